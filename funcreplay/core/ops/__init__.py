"""The table operations other than sampling: insert, remove, keyed updates, queries."""

from funcreplay.core.ops.insert import (
    Stats,
    can_insert,
    can_sample,
    count,
    delete,
    eligible_mask,
    evict_stale,
    insert,
    last_occurrence,
    masks_active,
    remove,
    set_metadata,
    stale_mask,
    stats,
    take,
    update_priorities,
)

__all__ = [
    "Stats", "can_insert", "can_sample", "count", "delete", "eligible_mask", "evict_stale",
    "insert", "last_occurrence", "masks_active", "remove", "set_metadata", "stale_mask", "stats", "take",
    "update_priorities",
]
