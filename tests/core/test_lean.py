"""The lean portable programs (core/bits, core/ops/*_lean, core/sampling/*_lean): exactness,
invariants, leanness."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import funcreplay as fr
from funcreplay.core import bits as draws
from funcreplay.core import hlo, ops, trees
from funcreplay.core.ops import insert_lean as lean_insert
from funcreplay.core.ops import keyed
from funcreplay.core.ops import priorities_lean as lean_update
from funcreplay.core.sampling import prioritized_lean as lean_prio
from funcreplay.core.sampling import uniform_lean as lean_uniform

EXAMPLE = {"x": np.zeros((3,), np.float32), "a": np.int32(0)}


def _items(b, start=0):
  v = np.arange(start, start + b)
  return {"x": jnp.asarray(np.stack([v, v + 0.5, -v], 1).astype(np.float32)),
          "a": jnp.asarray(v.astype(np.int32))}


def _fisher_yates(j, n):
  a, out = list(range(n)), []
  for i, ji in enumerate(j):
    out.append(a[ji])
    a[i], a[ji] = a[ji], a[i]
  return out


# resolve's two executors, each called directly (resolve picks one per backend): the
# sorted one with its two-operand and its packed sort, and the all-pairs one.
_RESOLVERS = {"sorted": lambda j: draws.resolve_sorted(j, 1 << 31),
              "sorted-packed": lambda j: draws.resolve_sorted(j, 64),
              "pairs": draws.resolve_pairs,
              "resolve": draws.resolve}


@pytest.mark.parametrize("how", list(_RESOLVERS))
def test_resolve_is_fisher_yates(how):
  rng = np.random.default_rng(0)
  res = jax.jit(_RESOLVERS[how])
  for _ in range(60):
    b = 13
    n = int(rng.integers(b, 50))
    j = np.array([rng.integers(i, n) for i in range(b)], np.int32)
    assert np.asarray(res(jnp.asarray(j))).tolist() == _fisher_yates(j, n)


def test_resolve_pairs_equals_resolve_sorted():
  """The accelerators' all-pairs resolve gives the CPU's sorted one's values, row for row,
  for the batch sizes and table sizes of real draws: tables smaller than the batch (rows
  ``i >= n`` keep ``j_i = i``), many collisions (n near b) and few (n >> b)."""
  rng = np.random.default_rng(7)
  pairs = jax.jit(draws.resolve_pairs)
  for b in (1, 2, 5, 64, 256, draws._PAIRS_MAX_B):
    sorted_ = jax.jit(lambda j: draws.resolve_sorted(j, 1 << 18))
    for n in sorted({1, max(1, b // 2), b, b + 3, 4 * b, 1 << 18}):
      i = np.arange(b)
      j = np.where(i < n, i + (rng.random(b) * np.maximum(n - i, 1)).astype(np.int64), i)
      j = jnp.asarray(j.astype(np.int32))
      np.testing.assert_array_equal(np.asarray(pairs(j)), np.asarray(sorted_(j)))


@pytest.mark.parametrize("n", [1, 7, 256])
def test_words_are_jax_random_bits(n):
  for seed in (0, 1, 2**31 + 5):
    key = jax.random.PRNGKey(seed)
    hi, lo = draws.words(key, n)
    want = np.asarray(jax.random.bits(key, (2, n), jnp.uint32))
    np.testing.assert_array_equal(np.stack([hi, lo]), want)
  typed = jax.random.key(3)
  np.testing.assert_array_equal(np.stack(draws.words(typed, n)),
                                np.asarray(jax.random.bits(typed, (2, n), jnp.uint32)))


def test_kth_occupied_equals_the_binary_descent():
  rng = np.random.default_rng(4)
  for p in (1, 2, 8, 64, 1024, 1 << 13, 1 << 20):  # 2**20: levels below the copied top
    # Capacities below the tree size P too: the slots past C stay empty.
    # p - 64: a multiple of the 64-slot block below P (the CPU's block gathers, whose last
    # block ends at C).
    for cap in sorted({p, max(1, p - 3), p // 2 + 1} | ({p - 64} if p >= 128 else set())):
      occ = np.zeros(p, bool)
      occ[:cap] = rng.random(cap) < rng.random()
      occ[rng.integers(cap)] = True
      tree = trees.build_sum(jnp.asarray(occ.astype(np.int32)))
      k = jnp.asarray(rng.integers(0, occ.sum(), 40).astype(np.int32))
      want = np.flatnonzero(occ)[np.asarray(k)]
      np.testing.assert_array_equal(np.asarray(lean_uniform.kth_occupied(tree, k)), want)
      # The last levels counted from the occupied column (bool[C]) instead of the tree.
      got = lean_uniform.kth_occupied(tree, k, jnp.asarray(occ[:cap]))
      np.testing.assert_array_equal(np.asarray(got), want)
      # Both ways of counting them (on CPU, kth_occupied counts in blocks wherever the
      # capacity is a multiple of the block; off the CPU, byte by byte).
      leaf_levels = min(6, trees.depth(p))
      if cap % (1 << leaf_levels) == 0:
        first = (np.asarray(want) >> leaf_levels) << leaf_levels
        rank = np.asarray(k) - np.cumsum(np.concatenate([[0], occ]))[first]
        args = (jnp.asarray(occ[:cap]), jnp.asarray(first, jnp.int32),
                jnp.asarray(rank, jnp.int32))
        for got in (lean_uniform.kth_in_block(*args, leaf_levels=leaf_levels),
                    lean_uniform.kth_bytewise(*args, leaf_levels=leaf_levels, p=p)):
          np.testing.assert_array_equal(np.asarray(got), want)


def test_below_is_the_64_bit_fixed_point_product():
  rng = np.random.default_rng(1)
  hi, lo = (rng.integers(0, 2**32, 2000, dtype=np.uint64) for _ in range(2))
  r = rng.integers(1, 2**31, 2000, dtype=np.uint64)
  got = np.asarray(draws.below(*(jnp.asarray(a.astype(np.uint32)) for a in (hi, lo, r))))
  want = [((int(h) << 32 | int(lo_)) * int(r_)) >> 64 for h, lo_, r_ in zip(hi, lo, r)]
  assert got.astype(np.uint64).tolist() == want


def _table_with_hole():
  """Capacity 8, items in slots 0..5 with slot 2 deleted: N = 5 items."""
  spec = fr.TableSpec(8, EXAMPLE)
  t = fr.make_table(spec, native=False)
  st = t.insert(t.init(), _items(6))
  st = t.delete(st, jnp.asarray([2]), st.key[jnp.asarray([2])])
  return spec, t, st


def test_uniform_ordered_triples_are_exactly_uniform():
  spec, _, st = _table_with_hole()
  occupied = [0, 1, 3, 4, 5]
  n_keys = 24_000
  keys = jax.random.split(jax.random.PRNGKey(3), n_keys)
  slots = np.asarray(jax.jit(jax.vmap(lambda k: lean_uniform.sample(
      spec, st, k, batch_size=3)[1].info.slot))(keys))
  assert all(len(set(r)) == 3 and set(r) <= set(occupied) for r in slots[:500])
  triples = list(itertools.permutations(occupied, 3))  # 60 equally likely outcomes
  index = {t: i for i, t in enumerate(triples)}
  counts = np.bincount([index[tuple(r)] for r in slots], minlength=len(triples))
  assert stats.chisquare(counts).pvalue > 1e-3
  # Pairwise (row 0, row 2) frequencies: 20 ordered pairs, equally likely.
  pairs = np.bincount([occupied.index(a) * 5 + occupied.index(c) for a, _, c in slots],
                      minlength=25).reshape(5, 5)
  assert (np.diag(pairs) == 0).all()
  assert stats.chisquare(pairs[~np.eye(5, dtype=bool)]).pvalue > 1e-3


def test_uniform_valid_mask_probability_and_state():
  spec, t, st = _table_with_hole()
  st2, smp = jax.jit(lambda s, k: lean_uniform.sample(spec, s, k, batch_size=7, version=9))(
      st, jax.random.PRNGKey(0))
  valid = np.asarray(smp.valid)
  assert valid.tolist() == [True] * 5 + [False] * 2
  slot = np.asarray(smp.info.slot)
  assert sorted(slot[:5]) == [0, 1, 3, 4, 5] and (slot[5:] == -1).all()
  np.testing.assert_array_equal(np.asarray(smp.info.probability),
                                np.float32([0.2] * 5 + [0.0] * 2))
  np.testing.assert_array_equal(np.asarray(smp.data["a"])[:5], slot[:5])
  assert (np.asarray(smp.data["x"])[5:] == 0).all() and int(smp.num_eligible) == 5
  ts = np.asarray(st2.times_sampled)
  assert ts[[0, 1, 3, 4, 5]].tolist() == [1] * 5 and ts[[2, 6, 7]].tolist() == [0] * 3
  np.testing.assert_array_equal(np.asarray(smp.info.times_sampled), [1] * 5 + [0] * 2)
  s = t.stats(st2).to_dict()
  assert s["samples"] == 5 and s["sampled_staleness_sum"] == 5 * 9
  # Everything else is untouched: the trees and the other columns.
  for f in ("occupied", "key", "version", "priority", "occ_tree"):
    np.testing.assert_array_equal(np.asarray(getattr(st2, f)), np.asarray(getattr(st, f)))


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("remover", [fr.Fifo(), fr.Fifo(fill_holes=True), fr.Lifo()],
                         ids=["ring", "fifo_fill_holes", "lifo"])
def test_uniform_with_a_reuse_limit_frees_as_the_general_program(remover, replace):
  """With ``max_times_sampled`` the lean sample frees the items it used up
  (``sampling.used_up``): the state is the general program's bookkeeping
  (``sampling.finish``) for the same slots, leaf for leaf, over a few samples."""
  from funcreplay.core.sampling.finish import finish as general_finish
  spec = fr.TableSpec(8, EXAMPLE, remover=remover, max_times_sampled=2)
  t = fr.make_table(spec, native=False)
  st = t.insert(t.init(), _items(7))
  lean = jax.jit(lambda s, k: lean_uniform.sample(spec, s, k, batch_size=4, replace=replace))
  general = jax.jit(lambda s, slot, prob, n: general_finish(spec, s, slot, prob, n, None,
                                                            replace))
  freed = 0
  for i in range(5):
    new, smp = lean(st, jax.random.PRNGKey(i))
    want, want_smp = general(st, smp.info.slot, smp.info.probability, smp.num_eligible)
    got_leaves = jax.tree_util.tree_flatten_with_path(new)[0]
    for (path, a), b in zip(got_leaves, jax.tree_util.tree_leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                    err_msg=jax.tree_util.keystr(path))
    np.testing.assert_array_equal(np.asarray(smp.info.times_sampled),
                                  np.asarray(want_smp.info.times_sampled))
    freed = int(t.stats(new).to_dict()["evicted_reuse"])
    assert int(new.size) == 7 - freed and int(new.occ_tree[1]) == int(new.occupied.sum())
    assert (np.asarray(new.times_sampled)[np.asarray(new.occupied)] < 2).all()
    st = new
  assert freed > 0


def test_uniform_with_replacement_covers_the_items():
  spec, _, st = _table_with_hole()
  _, smp = lean_uniform.sample(spec, st, jax.random.PRNGKey(5), batch_size=64, replace=True)
  assert np.asarray(smp.valid).all()
  assert set(np.asarray(smp.info.slot).tolist()) == {0, 1, 3, 4, 5}


@pytest.mark.parametrize("sampler", [fr.Uniform(), fr.Prioritized(0.6)])
@pytest.mark.parametrize("staleness", [None, 3])
def test_lean_insert_equals_the_general_insert(sampler, staleness):
  spec = fr.TableSpec(7, EXAMPLE, sampler=sampler, max_staleness=staleness, metadata=("m",))
  t = fr.make_table(spec, native=False)
  general, lean = t.init(), t.init()
  ins = jax.jit(lambda s, x, v, p: lean_insert.insert(spec, s, x, version=v, priority=p,
                                                      metadata={"m": v}))
  # With a mask ops.insert runs the general program (without one, the lean one).
  gen = jax.jit(lambda s, x, v, p: ops.insert(spec, s, x, version=v, priority=p,
                                            mask=jnp.ones((x["a"].shape[0],), bool),
                                            metadata={"m": v}))
  rng = np.random.default_rng(2)
  start = 0
  for step, b in enumerate([1, 3, 2, 5, 1, 4, 3, 7, 2]):
    p = jnp.asarray(rng.choice([0.5, 2.0, -1.0, np.nan], b).astype(np.float32))
    general = gen(general, _items(b, start), step, p)
    lean = ins(lean, _items(b, start), step, p)
    start += b
    if step == 4:  # a hole and a sampled item: the victims' bookkeeping differs
      for st_name in ("general", "lean"):
        s = locals()[st_name]
        s = t.delete(s, jnp.asarray([1]), s.key[jnp.asarray([1])])
        s, _ = t.sample(s, jax.random.PRNGKey(0), batch_size=2, version=step)
        if st_name == "general":
          general = s
        else:
          lean = s
  for a, b_ in zip(jax.tree_util.tree_leaves(general), jax.tree_util.tree_leaves(lean)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


def test_lean_insert_without_priority_uses_the_default():
  spec = fr.TableSpec(4, EXAMPLE, sampler=fr.Prioritized(1.0))
  t = fr.make_table(spec, native=False)
  a = t.insert(t.init(), _items(2))
  b = lean_insert.insert(spec, t.init(), _items(2))
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _prio_table(priorities):
  spec = fr.TableSpec(8, EXAMPLE, sampler=fr.Prioritized(1.0))
  t = fr.make_table(spec, native=False)
  n = len(priorities)
  return spec, t, t.insert(t.init(), _items(n), priority=jnp.asarray(priorities, jnp.float32))


def test_prioritized_first_row_and_probability():
  prios = [1.0, 2.0, 3.0, 4.0, 0.0, 6.0]
  spec, _, st = _prio_table(prios)
  keys = jax.random.split(jax.random.PRNGKey(7), 20_000)
  smp = jax.jit(jax.vmap(lambda k: lean_prio.sample(spec, st, k, batch_size=3)[1]))(keys)
  slot = np.asarray(smp.info.slot)
  assert all(len(set(r)) == 3 and 4 not in r for r in slot[:500])
  w = np.asarray(prios) / sum(prios)
  np.testing.assert_allclose(np.asarray(smp.info.probability), w[slot], rtol=1e-6)
  counts = np.bincount(slot[:, 0], minlength=6)
  assert counts[4] == 0
  assert stats.chisquare(counts[[0, 1, 2, 3, 5]], w[[0, 1, 2, 3, 5]] * len(keys)).pvalue > 1e-3
  # Second row: exact successive sampling, P(s2 = j) = sum_i w_i w_j / (1 - w_i).
  p2 = np.array([sum(w[i] * w[j] / (1 - w[i]) for i in range(6) if i != j) for j in range(6)])
  c2 = np.bincount(slot[:, 1], minlength=6)
  assert stats.chisquare(c2[[0, 1, 2, 3, 5]], p2[[0, 1, 2, 3, 5]] * len(keys)).pvalue > 1e-3


def test_prioritized_completion_when_weight_is_concentrated():
  # One item holds nearly all the weight: the first round cannot find 4
  # distinct items, and the exact completion fills the batch.
  spec, _, st = _prio_table([1e6, 1e-3, 1e-3, 1e-3, 1e-3])
  _, smp = lean_prio.sample(spec, st, jax.random.PRNGKey(0), batch_size=5)
  assert np.asarray(smp.valid).all()
  assert sorted(np.asarray(smp.info.slot).tolist()) == [0, 1, 2, 3, 4]


def test_uniform_program_is_lean():
  spec = fr.TableSpec(1 << 12, EXAMPLE)
  st = fr.make_table(spec, native=False).init()
  c = hlo.counts(lambda s, k: lean_uniform.sample(spec, s, k, batch_size=256), st,
                 jax.random.PRNGKey(0), donate_argnums=0)
  assert c["conditional"] == 0 and c["while"] == 0 and c["big_copies"] == 0, c
  assert c["fusion"] <= 90, c  # flashbax's uniform sample: 45 fusions (and 4 whiles)


@pytest.mark.parametrize("b", [1, 16])
def test_insert_program_is_lean(b):
  spec = fr.TableSpec(1 << 17, EXAMPLE)
  st = fr.make_table(spec, native=False).init()
  c = hlo.counts(lambda s, x: lean_insert.insert(spec, s, x), st, _items(b), donate_argnums=0)
  assert c["conditional"] == 0 and c["while"] == 0 and c["sort"] == 0
  assert c["big_copies"] == 0, c  # every column updated in place
  if jax.default_backend() == "cpu":  # no victim read handed across XLA:CPU's threads
    assert c["split_gathers"] == 0, c


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's parallel task split")
@pytest.mark.parametrize("b", [1, 8])
def test_small_prioritized_writes_split_no_gather(b):
  # C = 2**18: every column (1 MB) and the trees (2 MB) are over XLA:CPU's 256 KB split
  # threshold; the weight tree's blocks (trees._blocks) and the victims' / winners' old
  # priorities (rows.count_read) are read without a gather it would split (finding 14).
  spec = fr.TableSpec(1 << 18, EXAMPLE, sampler=fr.Prioritized(0.6))
  t = fr.make_table(spec, native=False)
  st = t.init()
  ins = hlo.counts(lambda s, x: lean_insert.insert(spec, s, x, priority=1.5), st, _items(b),
                   donate_argnums=0)
  slots = jnp.arange(b, dtype=jnp.int32)
  upd = hlo.counts(lambda s: t.update_priorities(s, slots, slots.astype(jnp.uint32),
                                                 jnp.ones((b,), jnp.float32)), st,
                   donate_argnums=0)
  for c in (ins, upd):
    assert c["split_gathers"] == 0 and c["big_copies"] == 0, c


@pytest.mark.parametrize("sampler", [fr.Uniform(), fr.Prioritized(0.6)])
@pytest.mark.parametrize("k", [1, 6])
def test_lean_update_priorities_equals_the_general_one(sampler, k):
  spec = fr.TableSpec(8, EXAMPLE, sampler=sampler)
  t = fr.make_table(spec, native=False)
  st = t.insert(t.insert(t.init(), _items(8)), _items(2, 8))  # wrapped: slots 0, 1 newest
  rng = np.random.default_rng(k)
  for _ in range(5):
    slots = jnp.asarray(rng.integers(-1, 9, k).astype(np.int32))
    keys = st.key[jnp.clip(slots, 0, 7)] - jnp.asarray(rng.integers(0, 2, k), jnp.uint32)
    p = jnp.asarray(rng.choice([0.25, 3.0, -1.0, np.inf, 0.0], k).astype(np.float32))
    want = keyed.general_update_priorities(spec, st, slots, keys, p)
    got = jax.jit(lambda s, a, b, c: lean_update.update_priorities(spec, s, a, b, c))(
        st, slots, keys, p)
    for x, y in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    st = want


@pytest.mark.parametrize("replace", [False, True])
def test_a_table_without_holes_maps_positions_to_ring_slots(replace):
  spec = fr.TableSpec(8, EXAMPLE, holes=False)
  t = fr.make_table(spec, native=False)
  st = t.insert(t.insert(t.init(), _items(8)), _items(3, 8))  # full, wrapped, no holes
  # Positions map to slots in ring order: oldest (slot 3) first.
  x, _ = lean_uniform.positions(jax.random.PRNGKey(0), jnp.int32(8), 8, replace, 8)
  _, got = jax.jit(lambda s, k: t.sample(s, k, batch_size=8, replace=replace))(
      st, jax.random.PRNGKey(0))
  assert np.asarray(got.info.slot).tolist() == ((3 + np.asarray(x)) % 8).tolist()
  # The rows are those slots' items (payload = insertion index: 8, 9, 10 overwrote 0, 1, 2).
  slot = np.asarray(got.info.slot)
  assert np.asarray(got.data["a"]).tolist() == np.where(slot < 3, slot + 8, slot).tolist()
