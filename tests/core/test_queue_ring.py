"""Reverb's queue without holes (``fr.queue(..., holes=False)``, BUILD.md finding 30).

A Fifo sample uses items up oldest first (a reuse count never grows from the oldest item
to the newest), so a queue's unmasked samples keep its items the ring window before
``write_pos`` and its order is ring arithmetic (``ring_order``), no tree read. Checked
here: over random histories the table without holes gives the table with holes' batches
and states leaf for leaf (the descent is the oracle); what would leave a hole is refused
(spec, masked samples, delete, host); a state whose counts grow toward the newest item
does not restore into such a spec; the program reads no tree and copies nothing in a scan.
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import funcreplay as fr
from funcreplay import checkpoint
from funcreplay.core import hlo
from funcreplay.host import consistency

ITEM = {"x": np.zeros((), np.int32)}
CAP = 8


def _spec(holes: bool, lifo: bool = False, max_times: int = 1, cap: int = CAP):
  return fr.TableSpec(cap, ITEM, sampler=fr.Lifo() if lifo else fr.Fifo(), remover=fr.Fifo(),
                      max_times_sampled=max_times, holes=holes)


@functools.lru_cache(maxsize=None)
def _programs(lifo: bool, max_times: int, batch: int):
  """Jitted insert and sample of the tables with and without holes (compiled once)."""
  out = {}
  for holes in (True, False):
    t = fr.make_table(_spec(holes, lifo, max_times), native=False)
    out[holes] = (t.init, jax.jit(lambda s, x, m, t=t: t.insert(s, {"x": x}, mask=m)),
                  jax.jit(lambda s, t=t: t.sample(s, jax.random.PRNGKey(0), batch_size=batch)))
  return out


@pytest.mark.parametrize("lifo,max_times,batch", [
    (False, 1, 3), (False, 2, 4), (False, 3, CAP), (False, 0, 3), (True, 0, 3)],
    ids=["queue-b3", "fifo-reuse2-b4", "fifo-reuse3-bC", "fifo-b3", "lifo-b3"])
@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.one_of(st.lists(st.booleans(), min_size=1, max_size=5),
                              st.just("sample")), min_size=1, max_size=25))
def test_a_queue_without_holes_is_the_queue_with_holes(lifo, max_times, batch, ops):
  progs = _programs(lifo, max_times, batch)
  states = {holes: progs[holes][0]() for holes in progs}
  spec, n = _spec(False, lifo, max_times), 0
  for op in ops:
    if op == "sample":
      out = {holes: progs[holes][2](states[holes]) for holes in progs}
      for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(out[False])[0],
                              jax.tree_util.tree_leaves(out[True])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))
      states = {holes: out[holes][0] for holes in out}
    else:
      mask = np.zeros(5, bool)
      mask[:len(op)] = op
      x = jnp.arange(n, n + 5, dtype=jnp.int32)
      states = {holes: progs[holes][1](states[holes], x, jnp.asarray(mask)) for holes in progs}
      n += 5
    host = jax.tree_util.tree_map(np.asarray, states[False])
    assert consistency.holes_error(spec, host) == ""


def test_spec_refuses_a_reuse_limit_that_leaves_holes():
  for sampler in (fr.Lifo(), fr.Uniform(), fr.Prioritized(0.6)):  # used up out of age order
    with pytest.raises(ValueError, match="only with the Fifo"):
      fr.TableSpec(CAP, ITEM, sampler=sampler, max_times_sampled=1, holes=False)
  with pytest.raises(ValueError, match="no max_staleness"):
    fr.queue(CAP, ITEM, max_staleness=2, holes=False)
  assert fr.queue(CAP, ITEM, holes=False).holes is False


def test_what_would_leave_a_hole_is_refused_when_traced():
  t = fr.make_table(fr.queue(CAP, ITEM, holes=False), native=False)
  s = t.insert(t.init(), {"x": jnp.arange(5, dtype=jnp.int32)})
  where = jnp.arange(CAP) % 2 == 1  # would use up items 1 and 3, not the oldest
  with pytest.raises(ValueError, match=r"evicted_reuse.*holes=False"):
    t.sample(s, jax.random.PRNGKey(0), batch_size=2, where=where)
  with pytest.raises(ValueError, match=r"delete: .*holes=False"):
    t.delete(s, jnp.array([0]), s.key[:1])


def test_host_queue_without_holes():
  table = fr.Table(fr.queue(CAP, ITEM, holes=False), seed=0)
  table.insert({"x": np.arange(6, dtype=np.int32)})
  got = table.sample(4, timeout=0)
  assert np.asarray(got.data["x"]).tolist() == [0, 1, 2, 3]
  table.insert({"x": np.arange(6, 10, dtype=np.int32)})
  assert np.asarray(table.sample(6, timeout=0).data["x"]).tolist() == [4, 5, 6, 7, 8, 9]
  with pytest.raises(TimeoutError):  # Reverb's Queue limiter: nothing left to take
    table.sample(1, timeout=0)
  before = table.stats().to_dict()
  with pytest.raises(ValueError, match=r"Table.delete: .*holes=False"):
    table.delete([0], [0])
  assert table.stats().to_dict() == before
  table.insert({"x": np.arange(3, dtype=np.int32)})
  before = table.stats().to_dict()
  with pytest.raises(ValueError, match=r"Table.take_batch: .*holes=False"):  # a masked draw
    table.take_batch({0: 1}, consume=False)
  assert table.stats().to_dict() == before
  table.close()


def test_counts_that_grow_toward_the_newest_item_do_not_restore(tmp_path):
  """A masked sample of a table with holes may use a newer item more than an older one;
  such a state cannot promise that Fifo samples use items up oldest first."""
  loose = fr.TableSpec(CAP, ITEM, sampler=fr.Fifo(), max_times_sampled=3)
  t = fr.make_table(loose, native=False)
  s = t.insert(t.init(), {"x": jnp.arange(4, dtype=jnp.int32)})
  ring = loose.replace(holes=False)
  assert consistency.holes_error(ring, jax.device_get(s)) == ""
  s, _ = t.sample(s, jax.random.PRNGKey(0), batch_size=1, where=jnp.arange(CAP) == 2)
  why = consistency.holes_error(ring, jax.device_get(s))
  assert "item 2 (0 = the oldest) has been sampled 1 time(s), more than item 1 before" in why
  checkpoint.save(str(tmp_path / "c"), s, loose)
  with pytest.raises(checkpoint.CheckpointError, match="more than item 1 before it"):
    checkpoint.restore(str(tmp_path / "c"), ring)
  s, _ = t.sample(s, jax.random.PRNGKey(0), batch_size=2)  # items 0, 1 now used once too
  assert consistency.holes_error(ring, jax.device_get(s)) == ""
  checkpoint.save(str(tmp_path / "d"), s, loose)
  assert checkpoint.restore(str(tmp_path / "d"), ring).spec.holes is False


def test_the_program_reads_no_tree_and_a_scan_copies_nothing():
  cap = 4099  # odd: no other array of these programs has this leading dim
  got = {}
  for holes in (True, False):
    t = fr.make_table(fr.queue(cap, ITEM, holes=holes), native=False)

    def run(s, i0, t=t):
      def step(c, i):
        s, acc = c
        s, smp = t.sample(s, jax.random.PRNGKey(i), batch_size=16)
        s = t.insert(s, {"x": jnp.arange(16, dtype=jnp.int32) + i})
        return (s, acc + jnp.sum(smp.data["x"]) + jnp.sum(smp.info.key)), None
      return jax.lax.scan(step, (s, jnp.int32(0)), jnp.arange(4) + i0)[0]

    txt = jax.jit(run, donate_argnums=0).lower(t.init(), 0).compile().as_text()
    p = t.spec.tree_size
    big = [line for line in txt.splitlines() if (" copy(" in line or " sort(" in line)
           and any(f"[{n}]" in line or f"[{n}," in line for n in (cap, 2 * p))]
    assert big == [], big
    got[holes] = hlo.text_counts(txt, cap)
    assert got[holes]["conditional"] == 0 and got[holes]["while"] == 1  # the scan's own
  # The descent's and the count below write_pos's one-element reads of the tree.
  assert got[False]["gather"] < got[True]["gather"] - 8, got
