"""``Table.from_state`` checks consistency, not just shapes (issue 23, item 11).

Each invariant of ``funcreplay.host.consistency`` is broken in turn on a
real table's state; the error must name it, and ``check=False`` must accept it.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from funcreplay.core import counters as ctr
from funcreplay.host import consistency

CAP = 12


@functools.lru_cache(maxsize=None)
def _state(remover_name: str):
  """A host state after inserts, samples (reuse limit), deletes and priority updates."""
  remover = {"minheap": fr.MinHeap(), "fifo": fr.Fifo(), "uniform": fr.Uniform()}[remover_name]
  spec = fr.TableSpec(CAP, {"x": jnp.zeros((2,), jnp.float32)}, sampler=fr.Prioritized(0.7),
                      remover=remover, max_times_sampled=3, max_staleness=2,
                      rate_limiter=fr.MinSize(1))
  t = fr.Table(spec, seed=2)
  for k in range(5):
    t.set_version(k)
    t.insert({"x": np.full((4, 2), k, np.float32)}, priority=np.float32([0, 1.5, 2, 3 + k]))
    s = t.sample(3)
    t.update_priorities(s.info.slot, s.info.key, np.float32([0.5, 4, 1]))
  s = t.sample(2)
  t.delete(s.info.slot[:1], s.info.key[:1])
  t.evict_stale()
  return spec, jax.device_get(t.snapshot())


@pytest.mark.parametrize("remover", ["minheap", "fifo", "uniform"])
def test_real_states_pass(remover):
  spec, state = _state(remover)
  assert 0 < int(state.occupied.sum()) < CAP
  t = fr.Table.from_state(spec, state)
  assert t.size == int(state.occupied.sum())


def _set(field, fn):
  def edit(s):
    a = np.array(getattr(s, field), copy=True)
    fn(a, s)
    return s.replace(**{field: a})
  return edit


def _occ(s):
  return np.flatnonzero(np.asarray(s.occupied))


def _free(s):
  return np.flatnonzero(~np.asarray(s.occupied))


def _counter(name, delta):
  def edit(s):
    c = dict(s.counters)
    c[name] = np.asarray(ctr.from_int(ctr.to_int(np.asarray(c[name])) + delta))
    return s.replace(counters=c)
  return edit


def _take_worse_child(tree):
  """Point the first node whose children hold two different items at the one it did not
  pick: still one of its children (as the structural check asks), but the worse."""
  for n in range(1, P):
    l, r = tree[2 * n], tree[2 * n + 1]
    if l != -1 and r != -1 and l != r:
      tree[n] = r if tree[n] == l else l
      return
  raise AssertionError("no node with two items below it")


P = 16  # tree size of CAP 12
CORRUPTIONS = {
    "occupied free slot": (_set("occupied", lambda a, s: a.__setitem__(_free(s)[0], True)),
                           "occ_tree: leaf of slot"),
    "occ_tree inner node": (_set("occ_tree", lambda a, s: a.__setitem__(3, a[3] + 1)),
                            "occ_tree: node 1 holds"),  # the parent sees it first
    "weight_tree leaf": (_set("weight_tree", lambda a, s: a.__setitem__(P + _occ(s)[0], 9.0)),
                         "weight_tree: leaf of slot"),
    "priority vs weight": (_set("priority", lambda a, s: a.__setitem__(_occ(s)[1], 7.0)),
                           "weight_tree: leaf of slot"),
    "weight_tree root": (_set("weight_tree", lambda a, s: a.__setitem__(1, a[1] * 2)),
                         "weight_tree: node 1 holds"),
    "negative priority": (_set("priority", lambda a, s: a.__setitem__(_occ(s)[0], -1.0)),
                          "priority: slot"),
    "remover_tree leaf": (_set("remover_tree", lambda a, s: a.__setitem__(P + _free(s)[0], 0)),
                          "remover_tree: leaf of slot"),
    "remover_tree root": (_set("remover_tree", lambda a, s: a.__setitem__(1, _free(s)[0])),
                          "remover_tree: node 1 holds"),
    "zero-weight count": (_set("occ_tree", lambda a, s: a.__setitem__(0, a[0] + 1)),
                          "occ_tree: node 0 counts"),
    "remover_tree worse child": (_set("remover_tree", lambda a, s: _take_worse_child(a)),
                                 "remover_tree: node [0-9]+ holds slot .* is the better"),
    "inserts counter": (_counter("inserts", 1), "counters: size"),
    "deletes counter": (_counter("deletes", 1), "counters: size"),
    "next_key": (lambda s: s.replace(next_key=np.uint32(int(s.next_key) + 1)), "next_key: "),
    "duplicate key": (_set("key", lambda a, s: a.__setitem__(_occ(s)[0], a[_occ(s)[1]])),
                      "key: two occupied slots"),
    "future key": (_set("key", lambda a, s: a.__setitem__(_occ(s)[0], int(s.next_key) + 5)),
                   "key: slot"),
    "times_sampled at limit": (_set("times_sampled", lambda a, s: a.__setitem__(_occ(s)[0], 3)),
                               "times_sampled: slot"),
    "write_pos": (lambda s: s.replace(write_pos=np.int32(CAP)), "write_pos: 12 is outside"),
    "version_hist": (_set("version_hist", lambda a, s: a.__setitem__(0, a[0] + 1)),
                     "version_hist: holds"),
    "version newer than index": (_set("version", lambda a, s: a.__setitem__(_occ(s)[0], 99)),
                                 "version_bounds: an item has version 99"),
}


@pytest.mark.parametrize("remover", ["minheap", "fifo"])
@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_each_broken_invariant_is_named(remover, name):
  spec, state = _state(remover)
  edit, message = CORRUPTIONS[name]
  if remover == "fifo" and "remover_tree" in name:
    pytest.skip("Fifo has no remover tree")
  bad = edit(state)
  with pytest.raises(ValueError, match="inconsistent state: " + message):
    fr.Table.from_state(spec, bad)
  fr.Table.from_state(spec, bad, check=False).close()  # trusted: accepted as given


def test_check_cost_is_linear_host_numpy():
  """~numpy speed: a 2**16-slot state checks in well under a second, once the two jitted
  passes it runs (the weights, the remover tree built afresh) are compiled for the spec."""
  spec = fr.TableSpec(2**16, {"x": jnp.zeros((), jnp.float32)}, sampler=fr.Prioritized(0.6),
                      remover=fr.MinHeap())
  state = jax.device_get(fr.make_table(spec).init())
  consistency.check_state(spec, state)  # compiles them
  t0 = time.perf_counter()
  consistency.check_state(spec, state)
  assert time.perf_counter() - t0 < 1.0
