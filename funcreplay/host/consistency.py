"""Is a ``TableState`` internally consistent? (``Table.from_state(check=True)``.)

The slot columns (``occupied``, ``key``, ``priority``, ``version``...) are the
truth; the trees, the version index and the counters are derived from them
and updated incrementally. A state whose parts disagree (built by hand,
edited, or from a buggy writer) does not fail loudly later: a sum tree that
disagrees with ``occupied`` samples free slots, a wrong counter breaks the
rate limiter silently. ``check_state`` re-derives every index on the host with
numpy, O(C) time and memory, and raises ``ValueError`` naming the first
invariant that does not hold:

* ``occ_tree``: leaves equal ``occupied`` (padding 0), every node the sum of
  its children (so the root is the size);
* ``weight_tree`` (prioritized sampler): leaves equal
  ``indexes.sample_weight`` (``priority**alpha`` of occupied slots, 0 for
  free ones or priority 0; within float32 rounding of the native kernels'
  ``pow``), every node exactly ``fl(left + right)``;
* ``occ_tree[0]`` (prioritized sampler): the number of occupied items of sampling
  weight 0 (not eligible; 0 without a prioritized sampler);
* ``remover_tree`` (Lifo / heap removers): leaves are the slot if occupied
  else -1, every node the better of its children by the remover's order (-1
  only if both are);
* ``priority``: finite and >= 0 on occupied slots;
* ``key``: occupied keys distinct, each among the ``inserts`` most recent
  keys below ``next_key`` (keys are insertion indices modulo 2**32);
* ``next_key``: equals ``counters['inserts']`` modulo 2**32;
* ``counters``: size == inserts - deletes - evicted_capacity -
  evicted_stale - evicted_reuse (modulo 2**64, as the counters wrap);
* ``times_sampled``: >= 0, and below ``max_times_sampled`` (when set) on
  occupied slots (an item reaching it is removed);
* ``write_pos``: in ``[0, capacity)``;
* ``occupied`` of a table without holes (``TableSpec.holes`` False): exactly the
  ``size`` slots written last before ``write_pos``, and with ``max_times_sampled``
  their reuse counts non-increasing from the oldest to the newest (``holes_error``);
* ``position_index`` (``TableSpec.position_index``): a valid index of ``occupied``
  (``core.position_index.check``);
* ``version_hist`` / ``version_bounds`` (``max_staleness``): the histogram
  of the occupied versions in the window ``(hi - V, hi]``, the count of the
  older ones, no item newer than ``hi``, ``old_min`` at most their minimum.

Not checked (no invariant ties them to the columns): the item data,
``max_priority``, ``limiter_diff`` and the metadata columns.

It lives in the host layer (it needs only the core and numpy), so
``Table.from_state`` calls it directly; the checkpoint layer above reaches it
through ``from_state`` (``restore_table``) and ``read_into`` (``Table.load``).
"""

from __future__ import annotations

import jax
import numpy as np

from funcreplay.core import counters as ctr
from funcreplay.core import indexes, position_index, staleness
from funcreplay.core.spec import TableSpec

_sample_weight = jax.jit(indexes.sample_weight, static_argnums=0)
_remover_tree = jax.jit(indexes.remover_tree, static_argnums=0)

# Leaves of the weight tree are ``core.powers.power`` (the same bits in XLA on every backend
# and in the native kernels); a state built before it (libm's or XLA's ``pow``) may differ
# in the last bits. Relative tolerance of a few ulp (2**-23 each).
_POW_RTOL = 8 * 2.0**-23
_REMOVED = ("deletes", "evicted_capacity", "evicted_stale", "evicted_reuse")


def _fail(what: str, detail: str) -> None:
  raise ValueError(f"Table.from_state: inconsistent state: {what}: {detail} (pass check=False "
                   "to skip these checks for a state you trust).")


def _levels(tree: np.ndarray):
  """``(parent nodes, left children, right children)`` index arrays of a ``[2P]`` tree."""
  p = tree.shape[0] // 2
  nodes = np.arange(1, p)
  return nodes, 2 * nodes, 2 * nodes + 1


def _first(bad: np.ndarray) -> int:
  return int(np.flatnonzero(bad)[0])


def _check_sum_tree(name: str, tree: np.ndarray, leaves: np.ndarray, exact: bool) -> None:
  p = tree.shape[0] // 2
  got = tree[p:]
  bad = (got != leaves) if exact else ~np.isclose(got, leaves, rtol=_POW_RTOL, atol=0.0)
  if bad.any():
    s = _first(bad)
    _fail(name, f"leaf of slot {s} holds {got[s]!r}, the columns give {leaves[s]!r}")
  nodes, left, right = _levels(tree)
  bad = tree[nodes] != tree[left] + tree[right]  # float32 + float32 rounds as the kernels do
  if bad.any():
    n = int(nodes[_first(bad)])
    _fail(name, f"node {n} holds {tree[n]!r}, not the sum of its children "
                f"{tree[2 * n]!r} + {tree[2 * n + 1]!r}")


def _check_best_tree(spec: TableSpec, state, tree: np.ndarray, occ: np.ndarray) -> None:
  p = tree.shape[0] // 2
  want = np.where(occ, np.arange(p, dtype=np.int32), -1)
  bad = tree[p:] != want
  if bad.any():
    s = _first(bad)
    _fail("remover_tree", f"leaf of slot {s} holds {tree[p + s]}, expected {want[s]} "
                          f"(slot {'occupied' if occ[s] else 'free'})")
  nodes, left, right = _levels(tree)
  t, l, r = tree[nodes], tree[left], tree[right]
  bad = ((t != l) & (t != r)) | ((t == -1) & ((l != -1) | (r != -1)))
  if bad.any():
    n = int(nodes[_first(bad)])
    _fail("remover_tree", f"node {n} holds {tree[n]}, which is neither child's slot "
                          f"({tree[2 * n]}, {tree[2 * n + 1]}) or -1 above a present leaf")
  # Each node one of its children: now the better one (the next victim is the root). The
  # tree built afresh by the table's own comparator (one jitted O(C) pass).
  want = np.asarray(_remover_tree(spec, state))
  bad = tree[1:] != want[1:]
  if bad.any():
    n = 1 + int(np.flatnonzero(bad)[-1])  # the deepest: its children are right
    _fail("remover_tree", f"node {n} holds slot {tree[n]}, but slot {want[n]} is the better "
                          f"of its children ({tree[2 * n]}, {tree[2 * n + 1]}) by the "
                          f"{type(spec.remover).__name__} remover's order")


def _check_versions(spec: TableSpec, state, occ: np.ndarray) -> None:
  v = staleness.window(spec)
  if not v:
    return
  hist, bounds = np.asarray(state.version_hist), np.asarray(state.version_bounds)
  hi, n_old, old_min = (int(x) for x in bounds)
  ver = np.asarray(state.version, np.int64)[occ]
  if ver.size and int(ver.max()) > hi:
    _fail("version_bounds", f"an item has version {int(ver.max())}, above the newest version "
                            f"{hi} the index holds")
  in_window = ver > hi - v
  want = np.bincount(ver[in_window] & (v - 1), minlength=v).astype(np.int64)
  if not np.array_equal(hist.astype(np.int64), want):
    _fail("version_hist", f"holds {hist.tolist()}, the occupied versions give {want.tolist()}")
  old = ver[~in_window]
  if n_old != old.size:
    _fail("version_bounds", f"counts {n_old} items older than the window, the columns "
                            f"{old.size}")
  if old.size and old_min > int(old.min()):
    _fail("version_bounds", f"old_min {old_min} is above the oldest item's version "
                            f"{int(old.min())}")


def _check_keys_and_counters(spec: TableSpec, state, occ: np.ndarray, size: int) -> None:
  counters = {k: ctr.to_int(np.asarray(c)) for k, c in state.counters.items()}
  inserts = counters["inserts"]
  removed = sum(counters[k] for k in _REMOVED)
  if (inserts - removed - size) % 2**64:
    _fail("counters", f"size {size} != inserts {inserts} - removed {removed} ("
                      + ", ".join(f"{k} {counters[k]}" for k in _REMOVED) + ")")
  next_key = int(state.next_key)
  if next_key != inserts % 2**32:
    _fail("next_key", f"{next_key}, but {inserts} items were inserted (keys are insertion "
                      "indices modulo 2**32)")
  keys = np.asarray(state.key, np.int64)[occ]
  if np.unique(keys).size != keys.size:
    _fail("key", "two occupied slots hold the same key")
  age = (next_key - keys) % 2**32  # 1 for the newest item
  bad = (age < 1) | (age > min(inserts, 2**32))
  if bad.any():
    s = int(np.flatnonzero(occ)[_first(bad)])
    _fail("key", f"slot {s} holds key {int(state.key[s])}, not one of the {inserts} keys "
                 f"issued below next_key {next_key}")


def holes_error(spec: TableSpec, state) -> str:
  """Why ``state`` (numpy leaves; ``[S, ...]`` for a sharded one) cannot be a state of
  ``spec`` when ``spec.holes`` is False, or "" if it can: its items must be exactly the
  ``size`` slots written last in each ring, ``(write_pos - size + i) mod C``
  (``TableSpec.holes``; the uniform and Fifo / Lifo samples map positions to those
  slots), and with ``max_times_sampled`` their reuse counts must not grow from the
  oldest item to the newest (a Fifo sample then uses items up oldest first)."""
  if spec.holes:
    return ""
  occupied = np.asarray(state.occupied)
  write_pos = np.asarray(state.write_pos)
  for s, (occ, wp) in enumerate(zip(occupied.reshape(-1, occupied.shape[-1]),
                                    write_pos.reshape(-1))):
    c, n = occ.shape[0], int(occ.sum())
    want = np.zeros(c, bool)
    want[(int(wp) - n + np.arange(n)) % c] = True
    where = f"shard {s}: " if occupied.ndim > 1 else ""
    if not np.array_equal(occ, want):
      return (f"{where}its {n} items are not the last {n} slots written before write_pos "
              f"{int(wp)} (a delete, eviction or reuse limit left holes), so it cannot "
              "restore into a TableSpec(holes=False); restore with holes=True")
    if spec.max_times_sampled:
      # A Fifo sample uses items up oldest first only while the reuse counts never grow
      # from the oldest item to the newest (TableSpec.holes); a masked sample in a table
      # with holes may have left a newer item with more uses than an older one.
      ring = (int(wp) - n + np.arange(n)) % c  # oldest first
      counts = np.asarray(state.times_sampled).reshape(-1, c)[s][ring]
      grew = np.flatnonzero(np.diff(counts) > 0)
      if grew.size:
        i = int(grew[0])
        return (f"{where}its item {i + 1} (0 = the oldest) has been sampled "
                f"{int(counts[i + 1])} time(s), more than item {i} before it "
                f"({int(counts[i])}), so a Fifo sample could use it up first and leave a "
                "hole: it cannot restore into a TableSpec(holes=False) with "
                "max_times_sampled; restore with holes=True")
  return ""


def check_state(spec: TableSpec, state) -> None:
  """Raise ``ValueError`` naming the first broken invariant of ``state`` (see module doc).

  Args:
    spec: the table's spec.
    state: an unsharded ``TableState`` of ``spec`` whose structure, shapes
      and dtypes were already checked (device or numpy arrays).
  """
  state = jax.device_get(state)
  c, p = spec.capacity, spec.tree_size
  occ = np.asarray(state.occupied, bool)
  occ_p = np.concatenate([occ, np.zeros(p - c, bool)])
  size = int(occ.sum())
  _check_sum_tree("occ_tree", np.asarray(state.occ_tree), occ_p.astype(np.int32), exact=True)
  prio = np.asarray(state.priority)
  bad = occ & ~(np.isfinite(prio) & (prio >= 0))
  if bad.any():
    _fail("priority", f"slot {_first(bad)} holds {prio[_first(bad)]!r}")
  if spec.prioritized:
    # The table's own rule for a slot's weight (one jitted O(C) pass: the integer
    # p**alpha is ~100 operations, slow eagerly), so the check follows it (e.g. how zero
    # priorities weigh).
    w = np.asarray(_sample_weight(spec, occ, prio), np.float32)
    _check_sum_tree("weight_tree", np.asarray(state.weight_tree),
                    np.concatenate([w, np.zeros(p - c, np.float32)]), exact=False)
    zero = int((occ & (w <= 0)).sum())
  else:
    zero = 0
  # Node 0 (outside the tree's sums): eligible = size - this count.
  if int(np.asarray(state.occ_tree)[0]) != zero:
    _fail("occ_tree", f"node 0 counts {int(np.asarray(state.occ_tree)[0])} occupied items of "
                      f"sampling weight 0; there are {zero}")
  if spec.needs_remover_tree:
    _check_best_tree(spec, state, np.asarray(state.remover_tree), occ_p)
  _check_keys_and_counters(spec, state, occ, size)
  ts = np.asarray(state.times_sampled)
  bad = occ & ((ts < 0) | ((ts >= spec.max_times_sampled) if spec.max_times_sampled else False))
  if bad.any():
    s = _first(bad)
    _fail("times_sampled", f"slot {s} holds {int(ts[s])} (max_times_sampled "
                           f"{spec.max_times_sampled}: an item reaching it is removed)")
  write_pos = int(state.write_pos)
  if not 0 <= write_pos < c:
    _fail("write_pos", f"{write_pos} is outside [0, {c})")
  _check_versions(spec, state, occ)
  why = holes_error(spec, state)
  if why:
    _fail("occupied", why)
  if spec.position_index:
    why = position_index.check(state.position_index, occ)
    if why:
      _fail("position_index", why)
