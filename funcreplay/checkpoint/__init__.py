"""Checkpoints: save and restore a whole replay table, crash-safe and bit-exact.

Two layers:

* pure: ``save(path, state, spec)`` / ``restore(path, spec=None)`` for a
  ``TableState`` (also a sharded one from ``funcreplay.distributed``);
* host: ``save_table(table, path)`` / ``restore_table(path)`` (what
  ``Table.save`` / ``Table.restore`` call) add the table's PRNG key and
  policy version; ``PeriodicCheckpointer`` saves from a background thread.
  The host table is *not* quiesced: the state is copied under the table's
  lock (``Table.snapshot``) and written without holding it, so inserts and
  samples continue during the write.

Everything comes back bit-exactly: item data of occupied slots, occupancy, keys, versions,
times_sampled, priorities, the sum / arg-best trees, metadata columns, the
two-word counters, the rate limiter's ``limiter_diff``, the Fifo ring
position, ``next_key`` and ``max_priority`` -- and for a host table its PRNG
key and version. The same calls after a restore give the same samples. Only
the occupied slots' item rows are stored (``rows.py``); free slots' item bytes
come back as zeros (nothing reads them). ``Table.load(path)`` restores into a
live table of the same spec (``host.read_into``).

Format (``format.py``): a directory with one ``.npy`` file per state leaf
and a ``manifest.json`` (format name, schema version, funcreplay version,
the spec as JSON, host state, user ``extra``, and per file: leaf, shape,
dtype, bytes, CRC-32), and a CRC-32 of the manifest itself (schema 2; schema-1
checkpoints, without it, still restore). No pickle anywhere (``allow_pickle=False`` both ways),
nothing executable. Written to a temporary directory, every file fsynced,
renamed atomically, parent fsynced: ``kill -9`` during a save leaves the
previous checkpoint intact (``fsync=False`` trades power-loss safety for
speed; ``restore(verify=False)`` skips the CRC pass on trusted storage).
``save(overwrite=True)`` swaps the new copy in with one atomic
``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere it takes two renames, and a
kill between them leaves the new copy beside the path, which ``restore`` finds
(``swap.py``). A restore racing a live overwrite reads again until it read one
whole checkpoint (``swap.read_stable``).
``directory/ckpt-<step>`` holds numbered
checkpoints with keep-last-N (``layout.py``); ``restore(directory)`` picks the
newest complete one.

Why plain ``.npy`` and not orbax-checkpoint: no extra dependency (orbax pulls
in tensorstore, etc., and is not installed here), the bytes on disk are
exactly the array bytes (trivially byte-exact, readable with bare numpy), and
crash-safety is a few lines we can test (temp dir + fsync + rename). Orbax
would be the right tool for multi-host states too big to gather on one host
(each process writing its own shards); here sharded states are gathered to
the host (``distributed.gather_state``) and re-laid out on restore with
``distributed.shard_state``.

Mismatches are errors: restoring into a spec that differs (capacity,
signature leaf shape/dtype/structure, sampler, remover, limits, rate
limiter, metadata columns, default priority) raises ``CheckpointError``
listing every difference. The one migration is growing the capacity
(``allow_capacity_growth=True``, see ``migrate.py``). Missing, truncated or
corrupted files raise ``CheckpointError`` naming the file; nothing is
returned until every array is read and verified. ``restore_table`` / ``Table.load``
also check the state's consistency (``funcreplay.host.consistency``, as ``Table.from_state``).
"""

from funcreplay.checkpoint.core import Restored, resolve, restore, save
from funcreplay.checkpoint.describe import CheckpointInfo, info
from funcreplay.checkpoint.errors import CheckpointError
from funcreplay.checkpoint.host import restore_table, save_table
from funcreplay.checkpoint.layout import latest, list_steps, prune, step_path
from funcreplay.checkpoint.periodic import PeriodicCheckpointer
from funcreplay.checkpoint.spec_codec import spec_from_json, spec_to_json

__all__ = [
    "CheckpointError", "CheckpointInfo", "PeriodicCheckpointer", "Restored", "info", "latest",
    "list_steps", "prune", "resolve", "restore", "restore_table", "save", "save_table",
    "spec_from_json", "spec_to_json", "step_path",
]
