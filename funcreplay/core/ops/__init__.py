"""The table operations other than sampling.

``insert`` (insert.py), removals (remove.py: ``remove``, ``delete``,
``evict_stale``), keyed updates (keyed.py: ``update_priorities``,
``set_metadata``), queries (queries.py: ``eligible_mask``, ``count``,
``can_*``, ``Stats``), and the row helpers they share (rows.py). Every
function takes the static ``TableSpec`` first and is meant to be closed over
by ``make_table``; all are jit-, scan- and vmap-compatible.
"""

from funcreplay.core.ops.insert import insert
from funcreplay.core.ops.keyed import set_metadata, update_priorities
from funcreplay.core.ops.queries import (
    Stats,
    can_insert,
    can_sample,
    count,
    eligible_mask,
    masks_active,
    stale_mask,
    stats,
    stats_from,
)
from funcreplay.core.ops.remove import delete, evict_stale, remove, require_holes
from funcreplay.core.ops.rows import last_occurrence, take

__all__ = [
    "Stats", "can_insert", "can_sample", "count", "delete", "eligible_mask", "evict_stale",
    "insert", "last_occurrence", "masks_active", "remove", "require_holes", "set_metadata",
    "stale_mask", "stats", "stats_from", "take", "update_priorities",
]
