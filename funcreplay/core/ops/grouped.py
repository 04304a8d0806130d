"""Grouped queries in one pass: ``count_by``, ``select_by`` (the rows of a multi-group
take or peek) and ``gather`` (rows by slot, without touching any counter).

xtuner's learner asks ``is_ready({task: n, ...})`` and then ``take_batch({task: n,
...})``; one ``count`` / ``sample(where=...)`` per task is one O(C) pass per task.
Here one program per call costs O(C) whatever K (the number of requested values) is
(O(C log K) for a plain column asked for more than 8 values), plus O(B log B) for the
B rows; no ``[K, C]`` array is built for K > 4:

* group ids (``group_ids``): a lookup by code for a vocabulary column (O(C + V)); for a
  plain or float column, K compares per slot up to 8 values, a binary search beyond;
* counts: one scatter-add;
* rows, up to 4 groups (``TOPK_MAX_GROUPS``; the host pads K to >= 4): two
  ``lax.top_k`` stages over ``[K, C]`` float32 scores (``_top_by_group``; O(C) as K <= 4)
  and a sort of the ``2 K min(B, C)`` candidates;
* rows, more groups, or order keys not exact in float32 (``first_by_group``): a radix
  select of each group's ``take[g]`` first items: per 8-bit digit of the order keys, one
  scatter-add of the C items into a ``[K + 1, 256]`` histogram picks each group's digit;
  digits above the span of the keys still in play are skipped (``StalestFirst``: one
  pass for a version span under 256, two or three for the ages within the threshold
  version). Then one ``lax.top_k`` of the C chosen flags and a sort of the B rows.

On XLA:CPU the top-k stages are faster up to K = 4 (a tuned kernel against scatter-adds
of ~1-3 ns per element), the radix select from K = 8 on (README "Rollout groups for LLM
RL" has the timings). On a GPU neither: XLA:GPU sorts the table for each ``lax.top_k``
and the host waits for the device at each of the select's conditions, so there the rows
come from one sort of the table (``sort_by_group``, chosen when the program is lowered;
compiled for an H200, K = 4: 109 -> 10 kernels, 9 -> 0 conditions, 5 -> 1 sorts).

The order within a group is the sampler's: the deterministic selectors sort by their
keys (``ordering.order_keys``); ``Uniform`` by random keys (a uniformly random subset,
in random order); ``Prioritized`` by exponential races ``-log2(u) / w`` (the k smallest
are a weighted draw without replacement, successive sampling: Efraimidis & Spirakis;
``powers.race_keys``, the same bits on every backend).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay.core import indexes, ordering, powers, storage
from funcreplay.core import selectors as sel
from funcreplay.core.ops.queries import eligible_mask
from funcreplay.core.ops.remove import delete
from funcreplay.core.ops.rows import take as _take_rows
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import Sample, SampleInfo, TableState

COMPARE_MAX_GROUPS = 8  # up to here K vectorized compares per slot beat a binary search


def group_ids(state: TableState, column, values, num_codes=None):
  """int32[C]: the index in ``values`` (int32[K]; a repeated value belongs to its first
  index) of each slot's ``column`` value, K if none. ``column`` None puts every slot in
  group 0 (K must be 1). ``num_codes``: the vocabulary size of a vocabulary column (its
  values are codes in ``[0, num_codes)``): a lookup table, O(C + num_codes); None: K
  compares per slot up to ``COMPARE_MAX_GROUPS`` values, else a binary search in the
  sorted values, O(C log K)."""
  c = state.occupied.shape[0]
  k = values.shape[0]
  if column is None:
    return jnp.zeros((c,), jnp.int32)
  col = state.metadata[column]
  index = jnp.arange(k, dtype=jnp.int32)
  if num_codes is not None:
    lut = jnp.full((num_codes,), k, jnp.int32).at[values].min(index, mode="drop")
    inside = (col >= 0) & (col < num_codes)
    return jnp.where(inside, lut[jnp.clip(col, 0, num_codes - 1)], k)
  if k <= COMPARE_MAX_GROUPS:
    eq = col[:, None] == values[None, :]
    return jnp.where(jnp.any(eq, axis=1), jnp.argmax(eq, axis=1).astype(jnp.int32), k)
  order = jnp.argsort(values, stable=True)  # equal values: the first index first
  sorted_values = values[order]
  pos = jnp.searchsorted(sorted_values, col, side="left", method="scan_unrolled")
  pos = jnp.clip(pos, 0, k - 1)
  return jnp.where(sorted_values[pos] == col, order[pos].astype(jnp.int32), k)


def _unique_keys(spec: TableSpec, rng) -> bool:
  """True when ``_order``'s keys end with the item's age (distinct for occupied slots)."""
  if not sel.is_ordered(spec.sampler):
    return rng is None  # Fifo order; random keys can tie
  return isinstance(spec.sampler, (sel.Fifo, sel.Lifo, sel.StalestFirst, sel.FreshestFirst))


def _num_codes(spec: TableSpec, column):
  if column is None:
    return None
  vocab = spec.column(column).vocab
  return None if vocab is None else len(vocab)


def count_by(spec: TableSpec, state: TableState, column, values, *, version=None,
             where=None):
  """int32[K]: eligible items (``eligible_mask``: occupied, fresh at ``version``, in
  ``where``) whose ``column`` equals each of ``values`` (int32[K], distinct). One pass."""
  k = values.shape[0]
  gid = group_ids(state, column, values, _num_codes(spec, column))
  ok = eligible_mask(spec, state, version, where)
  return jnp.zeros((k + 1,), jnp.int32).at[jnp.where(ok, gid, k)].add(1)[:k]


def _order(spec: TableSpec, state: TableState, rng):
  """Sort keys of the sampler's order (``rng`` None: oldest first for random samplers)."""
  if sel.is_ordered(spec.sampler):
    return ordering.order_keys(spec.sampler, state)
  if rng is None:
    return ordering.order_keys(sel.Fifo(), state)
  c = state.occupied.shape[0]
  if spec.prioritized:  # exponential races: the same keys on every backend (powers)
    w = indexes.sample_weight(spec, state.occupied, state.priority)
    return (powers.race_keys(jax.random.bits(rng, (c,), jnp.uint32), w),)  # w = 0: inf
  return (jax.random.bits(rng, (c,), jnp.uint32),)


# Up to this many groups (a take of up to 4 values: the host pads K to >= 4), two
# ``lax.top_k`` over ``[K, C]`` beat the radix passes on XLA:CPU (its top-k is a tuned
# kernel, its scatter-adds cost ~1-3 ns per element); from 8 on, the radix select wins
# (README "Rollout groups for LLM RL"). Either way O(C) per call: K <= 4 here.
TOPK_MAX_GROUPS = 4
FLOAT_EXACT = 2**24  # integers in [0, 2**24] are exact in float32


def _float_scores(keys, eligible):
  """``((primary, secondary) float32 [C], fits)``: scores with the order of ``keys``
  (ascending keys -> descending scores) when they are exact in float32 (``fits``).

  Integer keys count from their smallest eligible value (version, age, ... of the items
  in a table usually span far less than 2**24); float keys (the random samplers') are
  used as they are; a single key gets the slot as its tie-break."""
  c = eligible.shape[0]
  out, fits = [], jnp.bool_(True)
  for key in keys:
    if jnp.issubdtype(key.dtype, jnp.floating):
      out.append(-key.astype(jnp.float32))
      continue
    u = key.astype(jnp.uint32)
    if jnp.issubdtype(key.dtype, jnp.signedinteger):  # order-preserving into uint32
      u = lax.bitcast_convert_type(key.astype(jnp.int32), jnp.uint32) ^ jnp.uint32(1 << 31)
    rel = u - jnp.min(jnp.where(eligible, u, jnp.uint32(2**32 - 1)))
    fits = fits & (jnp.max(jnp.where(eligible, rel, 0)) < FLOAT_EXACT)
    out.append(-rel.astype(jnp.float32))
  if len(out) == 1:
    out.append(-jnp.arange(c, dtype=jnp.float32))
    fits = fits & (c < FLOAT_EXACT)
  return tuple(out), fits


def _top_by_group(gid, scores, take, kk):
  """Slots of the ``take[g]`` best items of each group, grouped and in order, without
  sorting the table: two ``lax.top_k`` over ``[K, C]`` (fast on XLA:CPU for float32,
  where a sort of C elements is not) and a sort of the ``2 K kk`` candidates.

  Stage 1 takes every item whose primary score beats the ``take[g]``-th best (``p*``);
  stage 2 fills the rest from the items tied at ``p*``, by the secondary score.
  Returns ``(ordered slots, start)`` laid out like ``first_by_group``'s, in ``2 K kk``
  positions."""
  k = take.shape[0]
  s1, s2 = scores
  member = gid[None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]
  v1, i1 = lax.top_k(jnp.where(member, s1[None, :], -jnp.inf), kk)
  pstar = jnp.take_along_axis(v1, jnp.maximum(take - 1, 0)[:, None], axis=1)
  n_gt = jnp.sum(v1 > pstar, axis=1)
  tied = member & (s1[None, :] == pstar)
  _, i2 = lax.top_k(jnp.where(tied, s2[None, :], -jnp.inf), kk)
  pos = jnp.arange(kk, dtype=jnp.int32)[None, :]
  valid = jnp.concatenate([pos < n_gt[:, None], pos < (take - n_gt)[:, None]], axis=1)
  slot = jnp.concatenate([i1, i2], axis=1).astype(jnp.int32)
  grp = jnp.where(valid, jnp.arange(k, dtype=jnp.int32)[:, None], k).reshape(-1)
  slot = slot.reshape(-1)
  ordered = lax.sort((grp, -s1[slot], -s2[slot], slot), num_keys=3)[-1]
  return ordered, jnp.cumsum(take) - take


RADIX_BITS = 8  # one digit per pass: a [K + 1, 256] histogram, one scatter-add of C items
UINT32_MAX = 2**32 - 1


def _digit_pass(shift, rel, row, k, carry):
  """One radix digit: every group keeps the items on the digit where its ``need``-th
  item lies, and takes those below it (``carry = (chosen, active, need)``)."""
  chosen, active, need = carry
  d = ((rel >> shift) & (2**RADIX_BITS - 1)).astype(jnp.int32)
  r = jnp.where(active, row, k)
  hist = jnp.zeros(((k + 1) << RADIX_BITS,), jnp.int32).at[(r << RADIX_BITS) + d].add(1)
  cum = jnp.cumsum(hist.reshape(k + 1, 2**RADIX_BITS)[:k], axis=1)  # items with digit <= d
  pick = jnp.sum(cum < need[:, None], axis=1, dtype=jnp.int32)  # first digit reaching need
  below = jnp.where(pick > 0, jnp.take_along_axis(cum, jnp.maximum(pick - 1, 0)[:, None],
                                                  axis=1)[:, 0], 0)
  dg = jnp.concatenate([pick, jnp.full((1,), -1, jnp.int32)])[row]  # row K: no group
  return chosen | (active & (d < dg)), active & (d == dg), need - below


def _select_key(u, row, k, carry):
  """The radix passes over one uint32 key, relative to the smallest key in play; a digit
  above the span of the keys in play is zero for all of them (a pass would keep them all
  and take none), so it is skipped."""
  active = carry[1]
  lo = jnp.min(jnp.where(active, u, jnp.uint32(UINT32_MAX)))
  rel = jnp.where(active, u - lo, jnp.uint32(0))
  top = jnp.max(rel)
  for shift in reversed(range(0, 32, RADIX_BITS)):
    carry = lax.cond((top >> shift) == 0, lambda c: c,
                     functools.partial(_digit_pass, shift, rel, row, k), carry)
  return carry


def first_by_group(gid, keys, take, kk: int, *, unique_keys: bool = False):
  """Slots of the ``take[g]`` first items of each group (ascending ``keys``, ties by slot),
  grouped and in order, in ``kk >= sum(take)`` positions (then ``C``: none), without a
  sort of the table or a ``[K, C]`` array: a radix select (module docstring).

  Args:
    gid: int32[C] group of each slot, K for none.
    keys: a tuple of ``[C]`` order keys (ints or floats; most significant first).
    take: int32[K] items per group, each <= the group's size.
    kk: static, ``sum(take) <= kk <= C``.
    unique_keys: static; True when no two slots have equal keys (an age among them),
      which skips the check for ties (a scatter-add of C).

  Returns ``(ordered slots int32[kk], start int32[K])``: group g's items at
  ``ordered[start[g]:start[g] + take[g]]``."""
  c = gid.shape[0]
  k = take.shape[0]
  row = jnp.minimum(gid, k)
  need = take
  active = (gid < k) & (jnp.concatenate([take, jnp.zeros((1,), jnp.int32)])[row] > 0)
  carry = (jnp.zeros((c,), bool), active, need)
  for key in keys:
    carry = _select_key(ordering.ascending_u32(key), row, k, carry)
  # Items still in play tie with their group's threshold on every key: more of them than
  # needed only on equal keys (e.g. equal random draws); the slot breaks those ties.
  if not unique_keys:
    slots = jnp.arange(c, dtype=jnp.uint32)
    in_play = jnp.zeros((k + 1,), jnp.int32).at[jnp.where(carry[1], row, k)].add(1)[:k]
    carry = lax.cond(jnp.any(in_play > carry[2]),
                     functools.partial(_select_key, slots, row, k), lambda c: c, carry)
  chosen = carry[0] | carry[1]
  _, cand = lax.top_k(chosen.astype(jnp.float32), kk)  # the sum(take) chosen slots first
  cand = cand.astype(jnp.int32)
  valid = chosen[cand]
  grp = jnp.where(valid, gid[cand], k)
  ukeys = [jnp.where(valid, ordering.ascending_u32(key)[cand], 0) for key in keys]
  ordered = lax.sort((grp, *ukeys, cand), num_keys=2 + len(keys))[-1]
  return jnp.where(jnp.arange(kk) < jnp.sum(take), ordered, c), jnp.cumsum(take) - take


def sort_by_group(gid, keys, take, kk: int):
  """``first_by_group``'s result by one sort of the table (O(C log C)): the slots by
  (group, ``ascending_u32`` keys, slot), then each group's first ``take[g]`` gathered into
  place. The executor off the CPU and the TPU (``select_by``): XLA:GPU lowers each
  ``lax.top_k`` over the table to a sort of it, and every ``lax.cond`` of the radix
  select (and the choice between the two) waits for the device to tell the host which
  branch to launch."""
  c = gid.shape[0]
  k = take.shape[0]
  slots = lax.sort((gid, *(ordering.ascending_u32(key) for key in keys),
                    jnp.arange(c, dtype=jnp.int32)), num_keys=1 + len(keys))[-1]
  size = jnp.zeros((k + 1,), jnp.int32).at[gid].add(1)[:k]
  start, first = jnp.cumsum(take) - take, jnp.cumsum(size) - size
  r = jnp.arange(kk, dtype=jnp.int32)
  # Unrolled (log2 K steps): a ``while`` on a GPU waits for the device at every trip.
  g = jnp.minimum(jnp.searchsorted(jnp.cumsum(take), r, side="right", method="scan_unrolled"),
                  k - 1).astype(jnp.int32)
  row = slots[jnp.clip(first[g] + r - start[g], 0, c - 1)]
  return jnp.where(r < jnp.sum(take), row, c), start


def select_by(spec: TableSpec, state: TableState, column, values, counts, *, batch_size: int,
              rng=None, version=None, where=None):
  """The rows of a grouped take / peek: up to ``counts[g]`` eligible items per group.

  Args:
    column, values: groups as in ``count_by`` (``column`` None: one group, all items).
    counts: int32[K] items wanted per group (>= 0).
    batch_size: static ``B >= sum(counts)``; rows are laid out group after group
      (``counts[0]`` rows of group 0, then group 1, ...), the rest invalid.
    rng: a key for the random samplers (None: oldest first).

  Returns:
    ``(slots int32[B] (-1 where invalid), group int32[B] (K past the requested rows),
    available int32[K])`` with ``available`` the ``count_by`` result.
  """
  c = state.occupied.shape[0]
  k = values.shape[0]
  eligible = eligible_mask(spec, state, version, where)
  gid = jnp.where(eligible, group_ids(state, column, values, _num_codes(spec, column)), k)
  available = jnp.zeros((k + 1,), jnp.int32).at[gid].add(1)[:k]
  keys = _order(spec, state, rng)
  counts = jnp.asarray(counts, jnp.int32)
  take = jnp.minimum(counts, available)
  kk = min(batch_size, c)
  radix = functools.partial(first_by_group, gid, keys, take, kk,
                            unique_keys=_unique_keys(spec, rng))

  def on_cpu():  # and the TPU: the top-k stages or the radix select
    if k > TOPK_MAX_GROUPS:
      return radix()
    scores, fits = _float_scores(keys, eligible)

    def top_k():
      ordered, start = _top_by_group(gid, scores, take, kk)
      return ordered[:kk], start  # the rows are the first sum(take) <= kk

    return lax.cond(fits, top_k, radix)

  by_sort = functools.partial(sort_by_group, gid, keys, take, kk)
  ordered, start = lax.platform_dependent(cuda=by_sort, rocm=by_sort, default=on_cpu)
  req_end = jnp.cumsum(counts)
  r = jnp.arange(batch_size, dtype=jnp.int32)
  group = jnp.searchsorted(req_end, r, side="right",  # K past the end; unrolled, as above
                           method="scan_unrolled").astype(jnp.int32)
  g = jnp.minimum(group, k - 1)
  j = r - (req_end[g] - counts[g])
  ok = (group < k) & (j < available[g])
  n = ordered.shape[0]
  picked = jnp.where(ok, _take_rows(ordered, jnp.clip(start[g] + j, 0, n - 1)), -1)
  return picked, group, available


def gather(spec: TableSpec, state: TableState, slots, num_eligible) -> Sample:
  """The items at ``slots`` (int32[B], -1: an invalid row of zeros) as a ``Sample``,
  read only: no counter, reuse count or key changes. ``probability`` is 1 (rows of a
  take or peek are chosen, not drawn)."""
  valid = slots >= 0
  safe = jnp.maximum(slots, 0)

  def rows(x):
    v = _take_rows(x, safe)
    return jnp.where(valid.reshape((-1,) + (1,) * (v.ndim - 1)), v, jnp.zeros((), v.dtype))

  info = SampleInfo(slot=jnp.where(valid, slots, -1), key=rows(state.key),
                    probability=valid.astype(jnp.float32), priority=rows(state.priority),
                    times_sampled=rows(state.times_sampled), version=rows(state.version))
  data = storage.unpack(spec.signature, spec.packed_rows,
                        jax.tree_util.tree_map(rows, state.data), 1)
  return Sample(data=data, valid=valid, info=info,
                num_eligible=jnp.asarray(num_eligible, jnp.int32))


def take_by(spec: TableSpec, state: TableState, column, values, counts, *, batch_size: int,
            rng=None, version=None, where=None):
  """``select_by`` + ``gather`` + ``delete`` (counted as deletes): xtuner's take.

  Returns ``(state, Sample, group int32[B], available int32[K])``; the sample's
  ``num_eligible`` is the total available over the requested groups.
  """
  slots, group, available = select_by(spec, state, column, values, counts,
                                      batch_size=batch_size, rng=rng, version=version,
                                      where=where)
  out = gather(spec, state, slots, jnp.sum(available))
  state = delete(spec, state, slots, out.info.key)
  return state, out, group, available


def metadata_rows(state: TableState, slots):
  """{column: int32[B]} stored metadata of ``slots`` (0 where the slot is -1)."""
  safe = jnp.maximum(slots, 0)
  return {name: jnp.where(slots >= 0, _take_rows(col, safe), 0)
          for name, col in state.metadata.items()}


__all__ = ["count_by", "first_by_group", "gather", "group_ids", "metadata_rows", "select_by",
           "take_by"]
