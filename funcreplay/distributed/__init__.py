"""Sharded tables: one ``TableState`` per device along a mesh axis (``shard_map``)."""

from funcreplay.distributed.sharded import (
    ShardedTable,
    gather_state,
    global_counter_sum,
    importance_weights,
    make_sharded_table,
    shard_items,
    shard_state,
)

__all__ = ["ShardedTable", "gather_state", "global_counter_sum", "importance_weights",
           "make_sharded_table", "shard_items", "shard_state"]
