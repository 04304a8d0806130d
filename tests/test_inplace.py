"""Donated updates stay in place: no O(C) copy of any column, insert cost O(B).

XLA silently copies a donated buffer when a read of it is not ordered before
an in-place write (see ``funcreplay.inplace``); these tests look for such
copies in the compiled HLO and check buffer pointers across donated calls.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr

CAP = 4099  # odd size: no other array in these programs has this leading dim
ITEM = {"obs": jnp.zeros((8,), jnp.float32), "a": jnp.zeros((), jnp.int32)}


def _rows(b, start=0):
  return {"obs": jnp.arange(start, start + b * 8, dtype=jnp.float32).reshape(b, 8),
          "a": jnp.arange(start, start + b, dtype=jnp.int32)}


def _capacity_copies(fn, *args):
  """Lines of the optimised HLO that copy an array whose leading dim is C or 2P."""
  txt = jax.jit(fn, donate_argnums=0).lower(*args).compile().as_text()
  p = fr.TableSpec(CAP, ITEM).tree_size
  sizes = {CAP, 2 * p}
  out = []
  for line in txt.splitlines():
    m = re.search(r"= \w+\[(\d+)[,\]].*\bcopy\(", line)
    if m and int(m.group(1)) in sizes:
      out.append(line.strip()[:120])
  return out


@pytest.mark.parametrize("sampler", [fr.Uniform(), fr.Prioritized(0.6)], ids=["uniform", "prio"])
def test_fifo_insert_delete_update_compile_without_column_copies(sampler):
  spec = fr.TableSpec(CAP, ITEM, sampler=sampler, max_times_sampled=3, max_staleness=5)
  t = fr.make_table(spec)
  s = t.init()
  slots, keys = jnp.arange(16, dtype=jnp.int32), jnp.arange(16, dtype=jnp.uint32)
  assert _capacity_copies(lambda s, x: t.insert(s, x, version=1), s, _rows(64)) == []
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
  assert len(before) >= 8  # data leaves, columns and trees are all checked
  for i in range(1, 80):  # 80 * 64 > CAP: the FIFO ring evicts
    s = insert(s, _rows(64, i * 64), i)
  assert big(s) == before
  np.testing.assert_array_equal(np.asarray(s.data["a"])[(79 * 64) % CAP], 79 * 64)
