"""The native CPU kernels (``funcreplay.native``) against the portable path.

The sample kernel follows the portable programs' recipe bit for bit, so the
strongest check is equality (tests/native/test_native_identity.py: hypothesis over
specs and op sequences). Here (the insert / update kernels: test_native_insert.py):
* the bookkeeping alone: given the slots the kernel picked, the portable
  bookkeeping (``sampling.finish``: reuse counts, frees, counters, version
  index, the gathered rows and info) applied to the same state gives the
  same state and outputs (a narrower failure message when both drift);
* statistically: inclusion counts are uniform over exactly the eligible slots
  in every regime of the recipe (descents after holes, masked rounds, the
  O(C) completion under heavy masks, batches that take most of the eligible
  items, with replacement).
The calling layouts (typed operands, the direct path's checked struct) are
tests/test_native_layouts.py's.

The core suites (test_core_*, test_reference_model, test_staleness,
test_inplace, test_table) also run against both implementations.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats as sstats
from jax import lax

import funcreplay as fr
from funcreplay import native
from funcreplay.core import hlo, indexes, ledger, ops, packing, sampling
from funcreplay.native import sample as native_sample
from tests.helpers import (
  ITEM,
  assert_states_equal,
  assert_trees_consistent,
  items_from_ids,
  require_native_kernels,
)

P_MIN = 1e-3  # chi-square: fixed seeds, a correct sampler fails this 0.1% of the time


@pytest.fixture(autouse=True)
def _need_kernels():
  require_native_kernels()


def _table(spec, use_native=True):
  return fr.make_table(spec, native=use_native)


def _state(spec, n, version=0, holes=()):
  t = _table(spec, use_native=False)
  rng = jax.random.PRNGKey(0) if isinstance(spec.remover, fr.Uniform) else None
  st = jax.jit(t.insert)(t.init(), items_from_ids(np.arange(n)), version=version, rng=rng)
  if len(holes):
    slots = np.asarray(holes, np.int32)
    st = jax.jit(t.delete)(st, slots, st.key[slots])
  return st


def test_kernel_runs_only_where_it_applies():
  spec = fr.TableSpec(32, ITEM)
  st = _state(spec, 8)

  def hlo(s, use_native=True, **kw):
    t = _table(s, use_native)
    f = jax.jit(lambda st, k: t.sample(st, k, batch_size=4, **kw))
    return f.lower(st, jax.random.PRNGKey(0)).compile().as_text()

  assert "funcreplay_sample" in hlo(spec)
  assert "funcreplay_sample" in hlo(spec, replace=True)
  assert "funcreplay_sample" not in hlo(spec, use_native=False)
  assert "funcreplay_sample" not in hlo(spec, replace=True, stratified=True)

  def hlo_of(s):
    f = jax.jit(lambda st, k: _table(s).sample(st, k, batch_size=4))
    return f.lower(_state(s, 8), jax.random.PRNGKey(0)).compile().as_text()

  assert "funcreplay_sample" in hlo_of(spec.replace(sampler=fr.Prioritized(1.0)))
  assert "funcreplay_sample" in hlo_of(spec.replace(remover=fr.Uniform()))
  # Samplers by order, and removers that keep an order tree: portable only.
  assert "funcreplay_sample" not in hlo_of(spec.replace(sampler=fr.Fifo()))
  assert "funcreplay_sample" not in hlo_of(spec.replace(sampler=fr.Prioritized(1.0),
                                                        remover=fr.MinHeap()))


GRID = [
    # (capacity, filled, batch, replace, max_times_sampled, masks, holes[, alpha])
    (16, 16, 4, False, 0, "none", False),
    (16, 16, 4, True, 0, "none", False),
    (16, 12, 16, False, 0, "none", False),      # fewer items than the batch
    (16, 16, 6, False, 2, "version", False),    # reuse frees + staleness index
    (16, 16, 6, True, 1, "both", False),        # frees with repeats in a batch
    (32, 40, 8, False, 3, "where", True),       # wrapped ring with holes: descents
    (32, 32, 8, True, 0, "both", True),
    (64, 64, 30, False, 0, "heavy", False),     # heavy masks: enumeration
]
GRID += [g + (0.7,) for g in GRID[:2] + GRID[3:]]  # prioritized (alpha 0.7), same grid
GRID = [g if len(g) == 8 else g + (None,) for g in GRID]


@pytest.mark.parametrize("cap,filled,b,replace,mts,masks,holes,alpha", GRID)
def test_state_and_outputs_match_portable_bookkeeping(cap, filled, b, replace, mts, masks,
                                                      holes, alpha):
  sampler = fr.Uniform() if alpha is None else fr.Prioritized(alpha)
  # A samples-per-insert ratio of 5/2: the kernel keeps the limiter's diff too.
  # Cases without a version mask use a spec without max_staleness: a pure sample of a
  # spec with max_staleness needs a version (issue 25: no silent stale samples).
  staleness = None if masks in ("none", "where") else 2
  spec = fr.TableSpec(cap, ITEM, sampler=sampler, max_times_sampled=mts, max_staleness=staleness,
                      rate_limiter=fr.SampleToInsertRatio(2.5, 1, (-1e6, 1e6)))
  t = _table(spec, use_native=False)
  st = t.init()
  ins = jax.jit(t.insert)
  for start in range(0, filled, 8):  # versions 0, 1, 2, ... per chunk of 8
    n = min(8, filled - start)
    prio = jnp.asarray((np.arange(start, start + n) % 7) * 0.5, jnp.float32)  # some zero
    st = ins(st, items_from_ids(np.arange(start, start + n)), version=start // 8,
             priority=prio)
  if holes:
    slots = np.array([1, 5, 6], np.int32)
    st = jax.jit(t.delete)(st, slots, st.key[slots])
  version = None if masks in ("none", "where") else filled // 8
  where = None
  if masks in ("where", "both"):
    where = jnp.arange(cap) % 3 != 0
  if masks == "heavy":
    where = jnp.arange(cap) % 9 == 0  # 8 of 64 slots: rejection would be slow
  for seed in range(3):
    nat = jax.jit(lambda s, k: _table(spec).sample(s, k, batch_size=b, version=version,
                                                   where=where, replace=replace))
    new, out = nat(st, jax.random.PRNGKey(seed))
    picked = out.info.slot

    def expected(s, picked):
      # The probabilities and counts as the portable ``sample`` computes them.
      ver = None if version is None else jnp.int32(version)
      safe = jnp.maximum(picked, 0)
      if spec.prioritized:
        mask = ops.eligible_mask(spec, s, ver, where)
        if ops.masks_active(spec, ver, where):
          total = jnp.sum(jnp.where(mask, indexes.sample_weight(spec, s.occupied, s.priority),
                                    0.0))
          n_elig = jnp.sum(mask, dtype=jnp.int32)
        else:
          total, n_elig = s.weight_tree[1], ops.count(spec, s)  # zero weights not eligible
        w = indexes.sample_weight(spec, s.occupied[safe], s.priority[safe])
        prob = w / jnp.maximum(total, 1e-30)
      else:
        n_elig = ops.count(spec, s, where, ver)
        prob = jnp.full(picked.shape, 1.0, jnp.float32) / jnp.maximum(n_elig, 1).astype(
            jnp.float32)
      return sampling.finish(spec, s, picked, prob, n_elig, ver, replace)

    ref_state, ref_out = jax.jit(expected)(st, picked)
    assert_states_equal(spec, new, ref_state, "state")
    for path, a, e in zip(jax.tree_util.tree_leaves_with_path(out),
                          jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref_out)):
      name = f"sample{jax.tree_util.keystr(path[0])}"
      if spec.prioritized and name.endswith(".probability"):
        # The kernel divides the weight-tree leaf (p**alpha computed when the
        # priority was set); the portable path recomputes p**alpha, and XLA's
        # vectorized and scalar pow can differ in the last bit.
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=3e-7, err_msg=name)
      else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=name)
    # Picked rows are eligible, and distinct without replacement.
    ok = np.array(fr.make_table(spec).eligible(st, version=version, where=where))
    sl = np.asarray(picked)[np.asarray(out.valid)]
    assert ok[sl].all()
    if spec.prioritized:  # zero-priority items are never sampled
      ok &= np.asarray(st.priority) > 0
      assert (np.asarray(st.priority)[sl] > 0).all()
    n_elig = int(ok.sum())
    if not replace:
      assert len(set(sl.tolist())) == len(sl) == min(b, n_elig)
    else:
      assert len(sl) == (b if n_elig else 0)
    assert_trees_consistent(spec, new)
    st = new


def _inclusion(spec, state, n_draws, b, seed, **kw):
  t = _table(spec)

  @jax.jit
  def run(state, key):
    def body(s, k):
      s2, out = t.sample(s, k, batch_size=b, **kw)
      return s, (out.info.slot, out.valid)  # the same state every draw (no reuse limits)
    return lax.scan(body, state, jax.random.split(key, n_draws))[1]

  slots, valid = run(state, jax.random.PRNGKey(seed))
  return np.asarray(slots), np.asarray(valid)


@pytest.mark.parametrize("regime", ["ring", "holes", "heavy", "most", "replace", "replace_heavy"])
def test_inclusion_is_uniform_over_eligible(regime):
  cap = 48
  spec = fr.TableSpec(cap, ITEM, max_staleness=0)
  holes = (3, 4, 20) if regime == "holes" else ()
  st = _state(spec, cap, version=5, holes=holes)
  eligible = np.ones(cap, bool)
  eligible[list(holes)] = False
  where, b, replace = None, 6, False
  if regime in ("heavy", "replace_heavy"):
    where = np.arange(cap) % 8 == 1  # 6 of 48: heavy for the kernel
  elif regime == "most":
    where, b = np.arange(cap) % 2 == 0, 16  # a batch takes 2/3 of the 24 eligible
  if regime.startswith("replace"):
    replace = True
  if where is not None:
    eligible &= where
    where = jnp.asarray(where)
  slots, valid = _inclusion(spec, st, 3000, b, seed=11, version=5, where=where,
                            replace=replace)
  assert valid.all()
  if not replace:
    assert all(len(set(r.tolist())) == b for r in slots), "repeated slot within a batch"
  counts = np.bincount(slots.ravel(), minlength=cap)
  assert counts[~eligible].sum() == 0
  p = sstats.chisquare(counts[eligible]).pvalue
  assert p > P_MIN, f"{regime}: inclusion chi-square p={p}"
  # Without replacement the batch is in random order, not sorted by slot.
  if not replace:
    assert np.mean(np.all(np.diff(slots, axis=1) > 0, axis=1)) < 0.5


def test_same_key_same_batch_and_key_types():
  spec = fr.TableSpec(64, ITEM)
  st = _state(spec, 64)
  f = jax.jit(lambda s, k: _table(spec).sample(s, k, batch_size=8)[1].info.slot)
  a, b = f(st, jax.random.PRNGKey(1)), f(st, jax.random.PRNGKey(1))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, f(st, jax.random.PRNGKey(2)))
  for key in (jax.random.key(3), jax.random.key(3, impl="rbg")):
    slots = np.asarray(f(st, key))
    assert len(set(slots.tolist())) == 8 and slots.min() >= 0


def test_vmap_over_tables_matches_one_at_a_time():
  spec = fr.TableSpec(32, ITEM, max_times_sampled=2)
  t = _table(spec)
  states = [_state(spec, 20 + 3 * i) for i in range(4)]
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *states)
  f = functools.partial(t.sample, batch_size=5, replace=False)
  vs, vo = jax.jit(jax.vmap(f))(stacked, keys)
  for i in range(4):
    s, o = jax.jit(f)(states[i], keys[i])
    for a, e in zip(jax.tree_util.tree_leaves((vs, vo)), jax.tree_util.tree_leaves((s, o))):
      np.testing.assert_array_equal(np.asarray(a)[i], np.asarray(e))


def test_donated_sample_updates_in_place():
  spec = fr.TableSpec(4096, ITEM, max_times_sampled=3, max_staleness=4)
  st = _state(spec, 4096)
  f = jax.jit(lambda s, k: _table(spec).sample(s, k, batch_size=64, version=1),
              donate_argnums=0)
  leaves = jax.tree_util.tree_leaves(st)
  before = [x.unsafe_buffer_pointer() for x in leaves if x.shape and x.shape[0] >= 4096]
  for i in range(3):
    st, out = f(st, jax.random.PRNGKey(i))
  after = [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(st)
           if x.shape and x.shape[0] >= 4096]
  assert before == after
  assert int(out.valid.sum()) == 64


@pytest.mark.parametrize("path", ["rejection", "enumeration"])
def test_prioritized_without_replacement_is_successive_sampling(path):
  """Ordered pairs from 4 eligible items of weights 1, 2, 3, 6 follow the exact
  successive-sampling law, whether the kernel draws by rejection or (masks
  hiding most of the weight) from the enumerated eligible items."""
  import itertools
  prios = np.array([1.0, 2.0, 3.0, 6.0, 100.0, 100.0, 100.0, 100.0], np.float32)
  spec = fr.TableSpec(8, ITEM, sampler=fr.Prioritized(1.0))
  t = _table(spec)
  st = jax.jit(t.insert)(t.init(), items_from_ids(np.arange(8)), version=0,
                         priority=jnp.asarray(prios))
  where = jnp.arange(8) < (4 if path == "enumeration" else 8)
  n_items = 4 if path == "enumeration" else 8
  b = 2

  @jax.jit
  def run(state, key):
    def body(s, k):
      return s, t.sample(s, k, batch_size=b, where=where)[1].info.slot
    return lax.scan(body, state, jax.random.split(key, 8000))[1]

  slots = np.asarray(run(st, jax.random.PRNGKey(5)))
  w = prios[:n_items].astype(np.float64) / prios[:n_items].sum()
  pairs = list(itertools.permutations(range(n_items), 2))
  expected = np.array([w[i] * w[j] / (1 - w[i]) for i, j in pairs])
  index = {pair: k for k, pair in enumerate(pairs)}
  counts = np.zeros(len(pairs))
  for a, c in slots:
    counts[index[(int(a), int(c))]] += 1
  keep = expected * counts.sum() >= 5  # chi-square needs expected counts >= 5
  assert counts[~keep].sum() <= 0.01 * counts.sum()
  obs, exp = counts[keep], expected[keep] * counts.sum()
  p = sstats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
  assert p > P_MIN, f"{path}: successive sampling p={p}"


def test_sub_byte_items_use_the_portable_path():
  """XLA:CPU packs int4/uint4 two per byte; the kernels copy rows as bytes, so tables
  with such leaves stay on the portable path (found in review: rows were garbled
  and the last slots written past the buffer). A leaf of 3 uint4 also broke the
  portable path's in-place ordering (a bitcast to uint8), fixed with it."""
  spec = fr.TableSpec(8, {"a": jax.ShapeDtypeStruct((3,), jnp.uint4)})
  assert not native.supports_insert(spec) and not native.supports_sample(spec, False)
  t = _table(spec)
  x = {"a": jnp.asarray(np.arange(15).reshape(5, 3) % 16, jnp.uint4)}
  ins = jax.jit(t.insert)
  assert "funcreplay_fifo_insert" not in ins.lower(t.init(), x).compile().as_text()
  st = ins(ins(t.init(), x), x)  # wraps the ring
  rows = np.asarray(st.data["a"]).astype(np.int32)
  np.testing.assert_array_equal(rows[[2, 3, 4, 5, 6, 7, 0, 1]],
                                np.concatenate([np.arange(15).reshape(5, 3)[2:],
                                                np.arange(15).reshape(5, 3)]) % 16)
  _, out = jax.jit(lambda s, k: t.sample(s, k, batch_size=8))(st, jax.random.PRNGKey(0))
  np.testing.assert_array_equal(np.asarray(out.data["a"]).astype(np.int32),
                                rows[np.asarray(out.info.slot)])


def test_sample_kernel_refuses_a_packed_layout_that_does_not_match():
  spec = fr.TableSpec(16, {"x": np.zeros(2, np.float32)})
  t = fr.make_table(spec)
  state = t.insert(t.init(), {"x": jnp.ones((4, 2))}, version=0)
  lay = packing.layout(spec.signature, 4)
  bad = dataclasses.replace(lay, fields=lay.fields[1:])  # one offset missing
  with pytest.raises(Exception, match="packed layout does not match"):
    jax.block_until_ready(native_sample.sample(spec, state, jax.random.PRNGKey(0), 4, None, None,
                                               False, layout=bad))


def test_kernels_refuse_a_ledger_layout_that_does_not_fit(monkeypatch):
  spec = fr.TableSpec(16, {"x": np.zeros(2, np.float32)}, sampler=fr.Prioritized(0.6))
  t = fr.make_table(spec)
  state = t.insert(t.init(), {"x": jnp.ones((4, 2))}, version=0)
  calls = {
      "funcreplay_fifo_insert": lambda s: t.insert(s, {"x": jnp.ones((2, 2))}, version=0),
      "funcreplay_sample": lambda s: t.sample(s, jax.random.PRNGKey(0), batch_size=2)[0],
      "funcreplay_update_priorities": lambda s: t.update_priorities(
          s, jnp.array([0], jnp.int32), s.key[:1], jnp.ones((1,))),
  }
  good = native.ledger_attr(spec)
  bad = good.copy()
  bad[4] = ledger.LEDGER_SIZE - 1  # the inserts counter's second word off the end
  for kernel, call in calls.items():
    with monkeypatch.context() as m:
      m.setattr(native, "ledger_attr", lambda _: bad)
      with pytest.raises(Exception, match=f"{kernel}: the ledger layout does not fit"):
        jax.block_until_ready(jax.jit(lambda s, call=call: call(s))(state))
    jax.block_until_ready(jax.jit(lambda s, call=call: call(s))(state))  # the real layout runs


def test_a_ledger_of_the_wrong_size_is_named():
  t = fr.make_table(fr.TableSpec(4, ITEM))
  short = t.init().replace(ledger=jnp.zeros((5,), jnp.uint32))
  with pytest.raises(ValueError, match=r"state.ledger has shape \[5\]"):
    jax.jit(lambda s: t.insert(s, items_from_ids(np.arange(2)), version=0))(short)


@pytest.mark.parametrize("sampler", [fr.Uniform(), fr.Prioritized(0.6)])
def test_in_scan_kernels_copy_no_empty_column(sampler):
  """A column a spec leaves off (the weight tree of a uniform table, the version index
  without max_staleness) is empty; aliased to a kernel's result it was a copy of a
  constant each step (native.state_aliases): 16 -> 10 operations a uniform step."""
  spec = fr.TableSpec(64, {"obs": np.zeros(4, np.float32), "reward": np.float32(0)},
                      sampler=sampler)
  t = _table(spec)
  xs = {"obs": jnp.zeros((5, 16, 4)), "reward": jnp.ones((5, 16))}

  def step(s, x):
    s, smp = t.sample(t.insert(s, x), jax.random.PRNGKey(0), batch_size=8)
    if spec.prioritized:
      s = t.update_priorities(s, smp.info.slot, smp.info.key, smp.data["reward"] + 1)
    return s, smp.data["reward"].sum()

  text = jax.jit(lambda s, xs: lax.scan(step, s, xs), donate_argnums=0).lower(
      t.init(), xs).compile().as_text()
  (body,) = hlo.loop_body_ops(text)
  body_text = re.search(r"^%" + re.escape(body) + r" .*?^}", text, re.S | re.M).group(0)
  kernels = 3 if spec.prioritized else 2
  assert body_text.count("custom-call(") == kernels
  empty_copies = re.findall(r"= [a-z0-9]+\[(?:0|[0-9,]*,0|0,[0-9,]*)\]\S* copy\(", body_text)
  assert not empty_copies, body_text
  state, sums = jax.jit(lambda s, xs: lax.scan(step, s, xs))(t.init(), xs)
  np.testing.assert_array_equal(sums, 8.0)  # eight rows of reward 1 sampled every step
  assert int(state.size) == 64
