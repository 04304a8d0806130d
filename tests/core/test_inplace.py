"""Donated updates stay in place: no O(C) copy of any column, insert cost O(B).

XLA silently copies a donated buffer when a read of it is not ordered before
an in-place write (see ``funcreplay.core.inplace``); these tests look for such
copies in the compiled HLO and check buffer pointers across donated calls.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr

# Every test here runs against both implementations (see conftest.py).
pytestmark = pytest.mark.usefixtures("both_implementations")

CAP = 4099  # odd size: no other array in these programs has this leading dim
ITEM = {"obs": jnp.zeros((8,), jnp.float32), "a": jnp.zeros((), jnp.int32)}


def _rows(b, start=0):
  return {"obs": jnp.arange(start, start + b * 8, dtype=jnp.float32).reshape(b, 8),
          "a": jnp.arange(start, start + b, dtype=jnp.int32)}


def _capacity_copies(fn, *args, compiled=None):
  """Lines of the optimised HLO that copy an array whose leading dim is C, C + 1 (a heap
  table's ``touched``: the stamps and the clock) or 2P.

  Copies made by ``sample``'s exact completion (``sampling.exact``, named scope
  ``exact_completion``: a rare branch that works on a copy of the weight tree) are not
  counted.
  """
  if compiled is None:
    compiled = jax.jit(fn, donate_argnums=0).lower(*args).compile()
  txt = compiled.as_text()
  p = fr.TableSpec(CAP, ITEM).tree_size
  sizes = {CAP, CAP + 1, 2 * p}
  # Computations of the completion: the while bodies it runs and any computation holding
  # one of its instructions (the cond branch that copies the tree into the loop).
  fallback = set(re.findall(r"while\(.*body=%([\w.\-]+).*op_name=\"[^\"]*exact_completion",
                            txt))
  comp = None
  for line in txt.splitlines():
    head = re.match(r"(?:ENTRY )?%([\w.\-]+) \(", line)
    if head:
      comp = head.group(1)
    elif "exact_completion" in line and comp is not None:
      fallback.add(comp)
  out, comp = [], None
  for line in txt.splitlines():
    head = re.match(r"(?:ENTRY )?%([\w.\-]+) \(", line)
    if head:
      comp = head.group(1)
    m = re.search(r"= \w+\[(\d+)[,\]].*\bcopy\(", line)
    if m and int(m.group(1)) in sizes and comp not in fallback:
      out.append(line.strip()[:120])
  return out


@pytest.mark.parametrize("sampler", [fr.Uniform(), fr.Prioritized(0.6)], ids=["uniform", "prio"])
def test_fifo_insert_delete_update_compile_without_column_copies(sampler):
  spec = fr.TableSpec(CAP, ITEM, sampler=sampler, max_times_sampled=3, max_staleness=5)
  t = fr.make_table(spec)
  s = t.init()
  slots, keys = jnp.arange(16, dtype=jnp.int32), jnp.arange(16, dtype=jnp.uint32)
  for b in (1, 2, 64):  # B = 1 lowers gathers to slices (see ops._gather)
    assert _capacity_copies(lambda s, x: t.insert(s, x, version=1), s, _rows(b)) == [], b
  assert _capacity_copies(lambda s: t.delete(s, slots, keys), s) == []
  assert _capacity_copies(lambda s: t.update_priorities(s, slots, keys, 2.0), s) == []


def test_donated_insert_keeps_every_column_buffer():
  spec = fr.TableSpec(CAP, ITEM, sampler=fr.Prioritized(0.6), max_times_sampled=3)
  t = fr.make_table(spec)
  insert = jax.jit(lambda s, x, v: t.insert(s, x, version=v), donate_argnums=0)
  s = insert(t.init(), _rows(64), 0)  # compile; the table wraps around below
  big = lambda st: {jax.tree_util.keystr(k): v.unsafe_buffer_pointer()
                    for k, v in jax.tree_util.tree_leaves_with_path(st)
                    if v.ndim and v.shape[0] >= CAP}
  before = big(s)
  assert len(before) >= 5  # data, occupied, item_info and both trees are all checked
  for i in range(1, 80):  # 80 * 64 > CAP: the FIFO ring evicts
    s = insert(s, _rows(64, i * 64), i)
  assert big(s) == before
  np.testing.assert_array_equal(fr.stored_items(spec, s)["a"][(79 * 64) % CAP], 79 * 64)


def _sample_cases():
  k = jax.random.PRNGKey
  uni = fr.make_table(fr.TableSpec(CAP, ITEM))
  masked = fr.make_table(fr.TableSpec(CAP, ITEM, max_staleness=5, max_times_sampled=2))
  prio = fr.make_table(fr.TableSpec(CAP, ITEM, sampler=fr.Prioritized(0.6), max_times_sampled=3))

  def prio_then_update(s, i):
    s, smp = prio.sample(s, k(i), batch_size=64)
    return prio.update_priorities(s, smp.info.slot, smp.info.key, smp.info.probability + 1), smp

  def sample_then_insert(s, i):
    s, smp = masked.sample(s, k(i), batch_size=64, version=i)
    return masked.insert(s, _rows(32), version=i), smp

  return {
      "uniform": (lambda s, i: uni.sample(s, k(i), batch_size=64), uni),
      "uniform_replace": (lambda s, i: uni.sample(s, k(i), batch_size=64, replace=True), uni),
      "uniform_stratified": (lambda s, i: uni.sample(s, k(i), batch_size=64, replace=True,
                                                     stratified=True), uni),
      "masked": (lambda s, i: masked.sample(s, k(i), batch_size=64, version=i), masked),
      "prio_then_update": (prio_then_update, prio),
      # With replacement the weight descent's last level was re-fused into the slots'
      # consumers, and the used-up items' tree writes copied the tree (sampling.sample).
      "prio_replace": (lambda s, i: prio.sample(s, k(i), batch_size=64, replace=True), prio),
      "sample_then_insert": (sample_then_insert, masked),
  }


@pytest.mark.parametrize("case", list(_sample_cases()))
def test_sample_compiles_without_column_copies(case):
  fn, t = _sample_cases()[case]
  assert _capacity_copies(fn, t.init(), 0) == []


@pytest.mark.parametrize("packed", [False, True], ids=["sample", "sample_packed"])
@pytest.mark.parametrize("replace", [False, True])
def test_table_sample_compiles_without_column_copies(replace, packed):
  from funcreplay.host import programs
  ops = programs.ops_for(fr.TableSpec(CAP, ITEM, max_staleness=5, max_times_sampled=2))
  compiled = ops.sample.lower(ops.init(), jax.random.PRNGKey(0), np.int32(0), None, {},
                              np.int32(1), batch_size=64, replace=replace,
                              packed=packed).compile()
  assert _capacity_copies(None, compiled=compiled) == []


@pytest.mark.parametrize("sampler", [fr.Uniform(), fr.Prioritized(0.6)], ids=["uniform", "prio"])
def test_batch_of_one_compiles_without_column_copies(sampler):
  # One-row gathers / scatters lower to slices that XLA re-fuses into several
  # reads (ops.take, indexes.refresh keep them real gathers / scatters).
  spec = fr.TableSpec(CAP, ITEM, sampler=sampler, max_times_sampled=3, max_staleness=5)
  t = fr.make_table(spec)
  s = t.init()

  def sample_update(s):
    s, smp = t.sample(s, jax.random.PRNGKey(0), batch_size=1, version=1)
    return t.update_priorities(s, smp.info.slot, smp.info.key, 1.0), smp

  assert _capacity_copies(sample_update, s) == []


@pytest.mark.parametrize("b", [8, 32])
def test_prioritized_step_in_a_scan_compiles_without_tree_copies(b):
  # A learner's loss reads info.probability but does not feed the next update_priorities'
  # writes. XLA re-fused the probability's division, with its reads of the weight tree,
  # into that consumer and copied the tree twice a step (B <= 32; prioritized_lean now
  # materializes the probability).
  t = fr.make_table(fr.TableSpec(CAP, ITEM, sampler=fr.Prioritized(0.6)))

  def step(c, i):
    s, acc = c
    s, smp = t.sample(s, jax.random.PRNGKey(i), batch_size=b)
    s = t.update_priorities(s, smp.info.slot, smp.info.key, smp.data["obs"][:, 0] ** 2 + 0.1)
    return (s, acc + jnp.sum(smp.info.probability) + jnp.sum(smp.data["obs"])), None

  def run(s, i0):
    return jax.lax.scan(step, (s, jnp.float32(0)), jnp.arange(4) + i0)[0]

  assert _capacity_copies(run, t.init(), 0) == []


def test_heap_remover_insert_in_a_scan_copies_no_data():
  # A full table with a heap remover inserts row by row (Reverb evicts per item). The rows
  # used to go through lax.cond on the whole state, and XLA copied the data and every
  # column each step (47 ms a step at C = 65,536); now masked writes in one loop. The
  # clock of ``touched`` is read once, and its writes are computed from that read
  # (ops.insert, keyed.update_priorities): before, ``touched`` and the int trees were
  # copied each step (BUILD.md findings 14, 16).
  t = fr.make_table(fr.TableSpec(CAP, ITEM, sampler=fr.Prioritized(0.6), remover=fr.MinHeap()))

  def run(s, i0):
    def step(s, i):
      s = t.insert(s, _rows(4, 0), priority=jnp.arange(4, dtype=jnp.float32) + i)
      s, smp = t.sample(s, jax.random.PRNGKey(i), batch_size=8)
      return t.update_priorities(s, smp.info.slot, smp.info.key, smp.data["obs"][:, 0] + 1), None
    return jax.lax.scan(step, s, jnp.arange(4) + i0)[0]

  assert _capacity_copies(run, t.init(), 0) == []


@pytest.mark.parametrize("in_scan", [False, True], ids=["call", "scan"])
def test_heap_remover_one_row_insert_copies_no_tree(in_scan):
  # A one-row insert into a table with room finds its free slot by the occupancy tree's
  # descent. Re-fused into each row write, that descent read the tree after its refresh
  # began writing it, and XLA copied the tree twice a call (now read once: ops.insert).
  t = fr.make_table(fr.TableSpec(CAP, ITEM, remover=fr.MinHeap()))

  def run(s, i0):
    if not in_scan:
      return t.insert(s, _rows(1, 0), priority=jnp.float32(1.0))
    step = lambda s, i: (t.insert(s, _rows(1, 0), priority=i.astype(jnp.float32)), None)  # noqa: E731
    return jax.lax.scan(step, s, jnp.arange(4) + i0)[0]

  assert _capacity_copies(run, t.init(), 0) == []


@pytest.mark.parametrize("remover", [fr.Lifo(), fr.Fifo(fill_holes=True), fr.Uniform()],
                         ids=["lifo", "fifo_fill_holes", "uniform"])
def test_non_ring_insert_then_sample_in_a_scan_copies_no_tree(remover):
  # The free-slot count read the size (occ_tree[1]) in consumers not ordered before the
  # tree writes: two copies of occ_tree a step (ops.insert reads it once now).
  t = fr.make_table(fr.TableSpec(CAP, ITEM, remover=remover))

  def run(s, i0):
    def step(c, i):
      s, acc = c
      s = t.insert(s, _rows(4, 0), rng=jax.random.PRNGKey(i))
      s, smp = t.sample(s, jax.random.PRNGKey(i), batch_size=8)
      return (s, acc + jnp.sum(smp.data["obs"]) + jnp.sum(smp.info.probability)), None
    return jax.lax.scan(step, (s, jnp.float32(0)), jnp.arange(4) + i0)[0]

  assert _capacity_copies(run, t.init(), 0) == []


@pytest.mark.parametrize("max_times", [0, 2], ids=["no_limit", "reuse_limit"])
@pytest.mark.parametrize("remover", [fr.Fifo(), fr.Fifo(fill_holes=True), fr.Lifo(),
                                     fr.MinHeap(), fr.Uniform()],
                         ids=["ring", "fifo_fill_holes", "lifo", "min_heap", "uniform"])
def test_uniform_sample_then_insert_in_a_scan_copies_no_column(remover, max_times):
  # The lean uniform sample ordered its reads before a following insert through
  # write_pos only, which a non-ring insert does not use: the data, occupied and
  # item_info were copied every step (it ties the occupancy tree too now); with a reuse
  # limit it frees used-up items (sampling.used_up) in place on every remover.
  t = fr.make_table(fr.TableSpec(CAP, ITEM, remover=remover, max_times_sampled=max_times))

  def run(s, i0):
    def step(c, i):
      s, acc = c
      s, smp = t.sample(s, jax.random.PRNGKey(i), batch_size=8)
      s = t.insert(s, _rows(4, 0), rng=jax.random.PRNGKey(i))
      return (s, acc + jnp.sum(smp.data["obs"]) + jnp.sum(smp.info.probability)), None
    return jax.lax.scan(step, (s, jnp.float32(0)), jnp.arange(4) + i0)[0]

  assert _capacity_copies(run, t.init(), 0) == []


@pytest.mark.parametrize("spec", [
    fr.queue(CAP, ITEM), fr.stack(CAP, ITEM),
    fr.TableSpec(CAP, ITEM, sampler=fr.MinHeap(), remover=fr.Fifo()),
    fr.TableSpec(CAP, ITEM, sampler=fr.Fifo(), remover=fr.Lifo(), max_times_sampled=2),
], ids=["queue", "stack", "minheap_fifo", "fifo_lifo"])
def test_ordered_sample_then_insert_in_a_scan_copies_no_column(spec):
  # The ordered samplers returned without ordering their reads (the rows, occupied)
  # before a following insert's writes: XLA copied the data and ``occupied`` every step.
  t = fr.make_table(spec)

  def run(s, i0):
    def step(c, i):
      s, acc = c
      s, smp = t.sample(s, jax.random.PRNGKey(i), batch_size=8)
      s = t.insert(s, _rows(4, 0))
      return (s, acc + jnp.sum(smp.data["obs"]) + jnp.sum(smp.info.probability)), None
    return jax.lax.scan(step, (s, jnp.float32(0)), jnp.arange(4) + i0)[0]

  assert _capacity_copies(run, t.init(), 0) == []


def test_once_and_materialize_keep_the_values_and_stay_in_the_program():
  """``inplace.once`` (scalars, or rows of one shape) and ``inplace.materialize`` give back
  their values, through an operation XLA keeps: a sort, a reduction (one element: none,
  the simplifier removes it; ``once`` is the tool there)."""
  from funcreplay.core import inplace
  x = jnp.arange(5, dtype=jnp.int32) * 3
  flags = jnp.array([True, False, True, True, False])
  got_x, got_f = jax.jit(inplace.once)((x, flags))
  np.testing.assert_array_equal(got_x, x)
  np.testing.assert_array_equal(got_f, flags)
  assert jax.jit(inplace.once)(jnp.float32(2.5)) == 2.5
  assert inplace.once(()) == ()
  with pytest.raises(ValueError, match="one shape"):
    inplace.once((x, jnp.int32(1)))
  one = jax.jit(lambda v: inplace.once(v) * 2).lower(jnp.arange(1)).compile().as_text()
  assert "sort" in one
  for n in (1, 2, 7):
    y = jnp.arange(n, dtype=jnp.int32) - 3
    text = jax.jit(lambda v: inplace.materialize(v) * 2).lower(y).compile().as_text()
    assert ("reduce" in text) == (n > 1), n
    np.testing.assert_array_equal(jax.jit(inplace.materialize)(y), y)
