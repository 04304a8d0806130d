"""Sharded tables: one ``TableState`` per device along a mesh axis (``shard_map``)."""

from funcreplay.distributed.mesh import global_counter_sum
from funcreplay.distributed.placement import gather_state, shard_items, shard_state
from funcreplay.distributed.sharded import ShardedTable, importance_weights, make_sharded_table

__all__ = ["ShardedTable", "gather_state", "global_counter_sum", "importance_weights",
           "make_sharded_table", "shard_items", "shard_state"]
