"""One checked calling layout (issue 24): the native kernels refuse operands out of place.

The fixed operands (the rows) and the state results of the three FFI handlers (sample,
insert, update_priorities) are typed ``ffi::Buffer<dtype, rank>``, so a reordered operand or
one of the wrong dtype or rank is an error from XLA's binding (which names its position in
the binding, and the dtypes), never a misread buffer; a state operand is checked through the
typed result it aliases. Element counts and the variable-length tails (metadata columns,
item leaves) are checked by the handlers, which name the operand. Each test first runs the
real layout (built as ``funcreplay/native/*.py`` builds it), so a refusal is the layout's
doing, not a broken call. The direct path's ``ctypes.Structure`` layouts are checked too."""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from funcreplay import native
from funcreplay.core import indexes
from tests.helpers import require_native_kernels


@pytest.fixture(autouse=True)
def _need_kernels():
  require_native_kernels()


def _run(target, operands, out_like, aliases, **attrs):
  """``ffi_call(target)`` on ``operands``, results shaped as ``out_like``, jitted, waited."""
  out_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in out_like]
  f = jax.ffi.ffi_call(target, out_types, input_output_aliases=aliases)
  return jax.block_until_ready(jax.jit(lambda *a: f(*a, **attrs))(*operands))


def _state_columns(state):
  return [state.occupied, state.item_info, state.occ_tree, state.weight_tree, state.ledger,
          state.version_hist, state.version_bounds, state.position_index]


def test_sample_kernel_refuses_a_reordered_operand():
  """The key and the params swapped, and the state's first two columns swapped (XLA counts
  the thread-pool context as position 0)."""
  spec = fr.TableSpec(16, {"x": np.zeros(2, np.float32)})
  t = fr.make_table(spec)
  state = t.insert(t.init(), {"x": jnp.ones((4, 2))}, version=0)
  state_ops = _state_columns(state) + jax.tree_util.tree_leaves(state.data)
  key = jnp.asarray(jax.random.PRNGKey(0))
  params = jnp.zeros((2,), jnp.int32)
  attrs = dict(batch_size=2, capacity=16, replace=False, max_times_sampled=0,
               has_version=False, max_staleness=-1, split_key=False, ring=False,
               packed=np.array([-1], np.int64), ledger=native.ledger_attr(spec),
               fields=np.zeros((0,), np.int64))

  def call(operands, state_ops):
    outs = list(state_ops) + [jnp.zeros((2, 2), jnp.float32)]
    outs += [jnp.zeros((2,), d) for d in (jnp.bool_, jnp.int32, jnp.uint32, jnp.float32,
                                          jnp.float32, jnp.int32, jnp.int32)]
    outs += [jnp.zeros((), jnp.int32)] * 2 + [jnp.zeros((2,), jnp.uint32)]
    return _run("funcreplay_sample", [*operands, *state_ops], outs, {}, **attrs)

  where = jnp.zeros((0,), bool)
  call([key, params, where], state_ops)  # the real layout runs
  with pytest.raises(Exception, match=r"bad operands at: 1, 2\)[\s\S]*Wrong buffer dtype"):
    call([params, key, where], state_ops)
  swapped = [state_ops[1], state_ops[0], *state_ops[2:]]
  with pytest.raises(Exception, match=r"bad operands at: 5, 6\)[\s\S]*Wrong buffer"):
    call([key, params, where], swapped)


def test_kernels_name_a_position_index_of_the_wrong_shape():
  """position_index is int32[2, C + 1] or int32[2, 0] (typed: dtype and rank; the kernels
  its element count, naming it)."""
  rows, state, tail_rows, tail_state = _insert_layout()
  bad = jnp.full((2, 16), -1, jnp.int32)  # [2, C]: one column short (the count)
  with pytest.raises(Exception, match=r"funcreplay_fifo_insert: operand position_index has 32 "
                                      r"elements, expected 34"):
    _insert(rows, [*state[:7], bad], tail_rows, tail_state)


def test_kernels_name_an_item_info_of_the_wrong_shape():
  """item_info is uint32[C, 4]: the binding types its dtype and rank, the kernels its
  shape (element count 4 * C, four words a row), naming it."""
  rows, state, tail_rows, tail_state = _insert_layout()
  info = state[1]
  for bad in (info[:8], info.reshape(32, 2)):  # too few rows; the right count, 2 a row
    with pytest.raises(Exception, match=r"funcreplay_fifo_insert: operand item_info has "
                                        r"\d+ elements \(shape \[\d+,\d+\]\), expected "
                                        r"4 \* C = 64"):
      _insert(rows, [state[0], bad, *state[2:]], tail_rows, tail_state)
  urows, cols = _update_layout()
  with pytest.raises(Exception, match=r"funcreplay_update_priorities: operand item_info has 32 "
                                      r"elements"):
    _update(urows, [cols[0], cols[1][:8], *cols[2:]])
  with pytest.raises(Exception, match=r"bad operands at: 6\)[\s\S]*Wrong buffer rank"):
    _update(urows, [cols[0], cols[1].reshape(-1), *cols[2:]])  # flat: the old column rank


# The insert kernel's calling layout, as funcreplay/native/insert.py builds it.
INSERT_SPEC = fr.TableSpec(16, {"x": np.zeros(2, np.float32)}, sampler=fr.Prioritized(0.6),
                           metadata=("seed",))
B = 3


def _insert_layout():
  spec = INSERT_SPEC
  state = fr.make_table(spec).init()
  prios = jnp.asarray([1.0, 0.5, 2.0], jnp.float32)
  rows = [jnp.ones((B,), bool), jnp.zeros((B,), jnp.int32), prios,
          indexes.sample_weight(spec, jnp.ones((B,), bool), prios), jnp.zeros((), jnp.uint32)]
  tail_rows = [jnp.arange(B, dtype=jnp.int32), jnp.ones((B, 2), jnp.float32)]
  tail_state = [state.metadata["seed"], state.data["x"]]
  return rows, _state_columns(state), tail_rows, tail_state


def _insert(rows, state, tail_rows, tail_state):
  state_ops = state + tail_state
  state_at = len(rows) + len(tail_rows)
  return _run("funcreplay_fifo_insert", [*rows, *tail_rows, *state_ops], state_ops,
              {state_at + i: i for i in range(len(state_ops))}, capacity=16, n_meta=1, n_data=1,
              ledger=native.ledger_attr(INSERT_SPEC))


def test_insert_kernel_runs_the_real_layout():
  rows, state, tail_rows, tail_state = _insert_layout()
  out = _insert(rows, state, tail_rows, tail_state)
  np.testing.assert_array_equal(out[0][:B], True)  # occupied: the rows went in
  np.testing.assert_array_equal(out[1][:B, 0], np.arange(B))  # item_info: the keys
  np.testing.assert_array_equal(out[8][:B], np.arange(B))  # the metadata column
  np.testing.assert_array_equal(out[9][:B], 1.0)  # the item leaf


def test_insert_kernel_refuses_reordered_fixed_operands():
  rows, state, tail_rows, tail_state = _insert_layout()
  mask, version, *rest = rows
  with pytest.raises(Exception, match=r"bad operands at: 0, 1\)[\s\S]*"
                                      r"expected PRED but got S32"):
    _insert([version, mask, *rest], state, tail_rows, tail_state)
  # The state columns: occupied and key swapped, as operands and results alike (the
  # operands are checked through the typed results they alias).
  with pytest.raises(Exception, match=r"bad operands at: 6, 7\)[\s\S]*Wrong buffer"):
    _insert(rows, [state[1], state[0], *state[2:]], tail_rows, tail_state)


def test_insert_kernel_refuses_a_wrong_dtype_or_rank():
  rows, state, tail_rows, tail_state = _insert_layout()
  bad_prio = [*rows[:2], rows[2].astype(jnp.int32), *rows[3:]]
  with pytest.raises(Exception, match=r"bad operands at: 2\)[\s\S]*expected F32 but got S32"):
    _insert(bad_prio, state, tail_rows, tail_state)
  bad_n = [*rows[:4], jnp.zeros((1,), jnp.uint32)]  # n_bad is a scalar
  with pytest.raises(Exception, match=r"bad operands at: 4\)[\s\S]*Wrong buffer rank"):
    _insert(bad_n, state, tail_rows, tail_state)


def test_insert_kernel_names_a_tail_or_count_that_does_not_fit():
  rows, state, tail_rows, tail_state = _insert_layout()
  with pytest.raises(Exception, match=r"funcreplay_fifo_insert: metadata column 0: rows "
                                      r"F32\[3,2\] do not fit the table's S32\[16\]"):
    _insert(rows, state, tail_rows[::-1], tail_state)  # the metadata row and item leaf swapped
  with pytest.raises(Exception, match=r"item leaf 0: rows S32\[3,2\] do not fit the table's "
                                      r"F32\[16,2\]"):
    _insert(rows, state, [tail_rows[0], tail_rows[1].astype(jnp.int32)], tail_state)
  short = [rows[0], rows[1][:2], *rows[2:]]
  with pytest.raises(Exception, match="operand version has 2 elements, expected 3"):
    _insert(short, state, tail_rows, tail_state)
  with pytest.raises(Exception, match=r"expected n_meta \+ n_data = 2 rows, the eight state"):
    _insert(rows, state, tail_rows[:1], tail_state)


# The update_priorities kernel's calling layout, as funcreplay/native/priorities.py builds it.
def _update_layout():
  spec = INSERT_SPEC
  t = fr.make_table(spec)
  state = t.insert(t.init(), {"x": jnp.ones((4, 2))}, priority=jnp.ones((4,)), version=0,
                   metadata={"seed": jnp.zeros((4,), jnp.int32)})
  slots = jnp.arange(2, dtype=jnp.int32)
  prios = jnp.asarray([3.0, 0.25], jnp.float32)
  rows = [slots, state.key[slots], prios,
          indexes.sample_weight(spec, jnp.ones((2,), bool), prios)]
  cols = [state.occupied, state.item_info, state.weight_tree, state.ledger, state.occ_tree]
  return rows, cols


def _update(rows, cols):
  return _run("funcreplay_update_priorities", [*rows, *cols], cols,
              {len(rows) + i: i for i in range(len(cols))}, capacity=16,
              ledger=native.ledger_attr(INSERT_SPEC))


def test_update_kernel_runs_the_real_layout():
  rows, cols = _update_layout()
  info = np.asarray(_update(rows, cols)[1])
  np.testing.assert_array_equal(info[:2, 3].view(np.float32), [3.0, 0.25])  # the priorities


def test_update_kernel_refuses_reordered_or_wrong_dtype_operands():
  rows, cols = _update_layout()
  slots, keys, *rest = rows
  with pytest.raises(Exception, match=r"bad operands at: 0, 1\)[\s\S]*"
                                      r"expected S32 but got U32"):
    _update([keys, slots, *rest], cols)
  with pytest.raises(Exception, match=r"bad operands at: 2\)[\s\S]*expected F32 but got S32"):
    _update([slots, keys, rows[2].astype(jnp.int32), rows[3]], cols)
  swapped = [cols[0], cols[1], cols[2], cols[4], cols[3]]  # ledger <-> occ_tree
  with pytest.raises(Exception, match=r"bad operands at: 8, 9\)[\s\S]*Wrong buffer"):
    _update(rows, swapped)
  with pytest.raises(Exception, match="funcreplay_update_priorities: operand weights has 0 "
                                      "elements, expected 2"):
    _update([slots, keys, rows[2], jnp.zeros((0,), jnp.float32)], cols)


def test_direct_path_refuses_a_mismatched_layout():
  """The direct call's argument is one ctypes.Structure whose field names, offsets and
  sizes the library exports; a Python side that disagrees (fields reordered, one missing)
  is refused at load with the fields named."""
  from funcreplay.host import direct
  from funcreplay.native import build

  lib = build.library()
  direct.check_layout(lib, 0, direct.SampleArgs)  # the real layouts pass
  direct.check_layout(lib, 1, direct.UpdateArgs)
  fields = list(direct.SampleArgs._fields_)
  fields[1], fields[2] = fields[2], fields[1]  # batch <-> capacity

  class Reordered(ctypes.Structure):
    _fields_ = fields

  with pytest.raises(RuntimeError, match="calling layouts of Reordered differ.*batch"):
    direct.check_layout(lib, 0, Reordered)

  class Missing(ctypes.Structure):
    _fields_ = list(direct.UpdateArgs._fields_)[:-1]

  with pytest.raises(RuntimeError, match="ledger"):
    direct.check_layout(lib, 1, Missing)
