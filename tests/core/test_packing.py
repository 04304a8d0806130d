"""Packed samples (``funcreplay.core.packing``, ``Table.sample_packed``, ``sample(packed=True)``).

The packed buffer must hold exactly what the unpacked ``Sample`` holds: the
same items, info and counts from the same random stream, for every dtype a
signature can have, with the documented layout (64-byte aligned fields in
order, zero padding). Both implementations (native kernel, portable JAX).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import funcreplay as fr
from funcreplay.core import packing
from funcreplay.core import selectors as sel
from tests.helpers import host_sample

pytestmark = pytest.mark.usefixtures("both_implementations")

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.float16, ml_dtypes.bfloat16,
          np.int32, np.uint32, np.float32]


def _values(rng, dtype, shape):
  dt = np.dtype(dtype)
  if dt == np.bool_:
    return rng.random(shape) < 0.5
  if dt.kind in "iu":
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, shape, endpoint=True, dtype=np.int64).astype(dt)
  return rng.standard_normal(shape).astype(dt)


def _assert_same_sample(a: fr.Sample, b: fr.Sample):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    # Bitwise: NaN payloads and -0.0 must survive packing too.
    np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


def _assert_zero_padding(buf, lay: packing.PackedLayout):
  raw, used = np.asarray(buf), np.zeros(lay.nbytes, bool)
  for f in lay.fields:
    used[f.offset:f.offset + f.nbytes] = True
  assert not raw[~used].any()


def _check_layout(lay: packing.PackedLayout):
  end = 0
  for f in lay.fields:
    assert f.offset % packing.ALIGN == 0 and f.offset >= end
    end = f.offset + f.nbytes
  assert lay.nbytes % packing.ALIGN == 0 and lay.nbytes >= end


signatures = st.recursive(
    st.tuples(st.sampled_from(DTYPES),
              st.lists(st.integers(0, 3), max_size=2)).map(
        lambda t: jax.ShapeDtypeStruct(tuple(t[1]), np.dtype(t[0]))),
    lambda children: st.one_of(st.lists(children, min_size=1, max_size=3).map(tuple),
                               st.dictionaries(st.sampled_from("abcd"), children, min_size=1,
                                               max_size=3)),
    max_leaves=5)


@settings(max_examples=20)
@given(sig=signatures, batch=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip_is_bitwise_for_any_signature(sig, batch, seed):
  signature = fr.Signature(sig)
  lay = packing.layout(signature, batch)
  _check_layout(lay)
  rng = np.random.default_rng(seed)
  data = jax.tree_util.tree_map(lambda s: _values(rng, s.dtype, (batch,) + s.shape), sig)
  info = fr.SampleInfo(slot=_values(rng, np.int32, batch), key=_values(rng, np.uint32, batch),
                       probability=_values(rng, np.float32, batch),
                       priority=_values(rng, np.float32, batch),
                       times_sampled=_values(rng, np.int32, batch),
                       version=_values(rng, np.int32, batch))
  smp = fr.Sample(data=data, valid=rng.random(batch) < 0.5, info=info,
                  num_eligible=np.int32(rng.integers(0, 1000)))
  smp = jax.tree_util.tree_map(jnp.asarray, smp)
  buf = jax.jit(packing.pack, static_argnums=1)(smp, lay)
  assert buf.dtype == jnp.uint8 and buf.shape == (lay.nbytes,)
  packed = fr.PackedSample(buf, lay)
  _assert_same_sample(smp, packed.unpack())
  _assert_same_sample(smp, packed.numpy())
  _assert_zero_padding(buf, lay)  # between and after the fields


def test_sub_byte_items_cannot_be_packed_and_say_which_leaf():
  sig = fr.Signature({"w": jax.ShapeDtypeStruct((2,), jnp.int4),
                      "x": jax.ShapeDtypeStruct((), jnp.float32)})
  assert "['w']" in packing.packable(sig) and "int4" in packing.packable(sig)
  with pytest.raises(ValueError, match=r"\['w'\].*int4"):
    packing.layout(sig, 4)
  table = fr.Table(fr.TableSpec(8, sig.tree))
  table.insert({"w": jnp.zeros((2, 2), jnp.int4), "x": jnp.zeros((2,), jnp.float32)})
  with pytest.raises(ValueError, match=r"Table.sample_packed: cannot pack.*int4"):
    table.sample_packed(2)
  assert table.size == 2 and int(table.sample(2).valid.sum()) == 2  # table intact


def _filled_table(spec, seed):
  table = fr.Table(spec, seed=seed)
  rng = np.random.default_rng(0)
  for v in range(6):
    n = 7
    ids = np.arange(v * n, (v + 1) * n)
    table.insert({"obs": np.stack([ids, -ids], -1).astype(np.float32),
                  "act": (ids % 5).astype(np.int8), "done": ids % 3 == 0},
                 version=v, priority=rng.random(n) + 0.1,
                 metadata={"task": ids % 2})
  return table


SPEC_KW = [
    dict(sampler=fr.Uniform()),
    dict(sampler=fr.Prioritized(0.7), max_times_sampled=2),
    dict(sampler=fr.Uniform(), max_staleness=2),
    dict(sampler=fr.Fifo(), remover=fr.Fifo()),
    dict(sampler=fr.MaxHeap(), remover=fr.Lifo()),
]


@pytest.mark.parametrize("kw", SPEC_KW, ids=lambda kw: type(kw["sampler"]).__name__)
def test_table_sample_packed_equals_sample_on_a_twin_table(kw):
  example = {"obs": np.zeros(2, np.float32), "act": np.int8(0), "done": np.bool_(False)}
  spec = fr.TableSpec(32, example, metadata=("task",), **kw)
  plain, packed = _filled_table(spec, 7), _filled_table(spec, 7)
  calls = [dict(batch_size=5), dict(batch_size=8, where={"task": 1}),
           dict(batch_size=40 if not sel.is_ordered(spec.sampler) else 4,
                replace=not sel.is_ordered(spec.sampler), min_valid=1),
           dict(batch_size=6, version=6, min_valid=0)]
  for kwargs in calls:
    a = plain.sample(**kwargs)
    p = packed.sample_packed(**kwargs)
    assert isinstance(p, fr.PackedSample)
    _check_layout(p.layout)
    _assert_same_sample(a, p.unpack())
    _assert_same_sample(a, p.numpy())
    _assert_zero_padding(p.buffer, p.layout)  # the kernel zeroes the gaps it leaves
    assert plain.stats().to_dict() == packed.stats().to_dict()


def test_packed_rows_beyond_the_eligible_items_are_invalid_zeros():
  spec = fr.TableSpec(16, {"x": np.zeros(3, np.float32)})
  table = fr.Table(spec)
  table.insert({"x": np.ones((3, 3), np.float32)})
  s = table.sample_packed(8, min_valid=1).numpy()
  assert s.valid.tolist() == [True] * 3 + [False] * 5
  assert (s.info.slot[3:] == -1).all() and not s.data["x"][3:].any()
  assert s.data["x"][:3].tolist() == [[1.0] * 3] * 3 and int(s.num_eligible) == 3


def test_functional_sample_packed_under_jit_and_scan():
  spec = fr.TableSpec(64, {"x": np.zeros((), np.int32), "y": np.zeros(2, np.float16)},
                      sampler=fr.Prioritized(1.0))
  t = fr.make_table(spec)
  state = t.insert(t.init(), {"x": jnp.arange(40, dtype=jnp.int32),
                              "y": jnp.ones((40, 2), jnp.float16)}, version=0,
                   priority=jnp.arange(40, dtype=jnp.float32) + 1)

  def step(carry, _):
    st, key = carry
    st, p, key = host_sample(spec)(st, key, batch_size=8, split_key=True, packed=True)
    return (st, key), p.buffer

  (st_p, _), bufs = jax.jit(lambda s, k: jax.lax.scan(step, (s, k), None, length=3))(
      state, jax.random.PRNGKey(1))

  def step_plain(carry, _):
    st, key = carry
    st, s, key = host_sample(spec)(st, key, batch_size=8, split_key=True)
    return (st, key), s

  (st_s, _), smps = jax.jit(lambda s, k: jax.lax.scan(step_plain, (s, k), None, length=3))(
      state, jax.random.PRNGKey(1))
  lay = packing.layout(spec.signature, 8)
  for i in range(3):
    _assert_same_sample(jax.tree_util.tree_map(lambda a, i=i: a[i], smps),
                        fr.PackedSample(bufs[i], lay).unpack())
  for a, b in zip(jax.tree_util.tree_leaves(st_p), jax.tree_util.tree_leaves(st_s)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("replace", [False, True])
def test_disabled_packed_sample_is_all_invalid_and_changes_nothing(replace):
  spec = fr.TableSpec(32, {"x": np.zeros(3, np.float32), "e": np.zeros((0, 2), np.int16)},
                      max_times_sampled=1)
  t = fr.make_table(spec)
  state = t.insert(t.init(), {"x": jnp.ones((20, 3)), "e": jnp.zeros((20, 0, 2), jnp.int16)},
                   version=0)
  fn = jax.jit(lambda s, k, on: host_sample(spec)(s, k, batch_size=8, replace=replace,
                                                   enabled=on, split_key=True, packed=True))
  lay = packing.layout(spec.signature, 8)
  for on in (False, True):
    new, p, key = fn(state, jax.random.PRNGKey(3), on)
    _, ref, ref_key = jax.jit(lambda s, k, on: host_sample(spec)(
        s, k, batch_size=8, replace=replace, enabled=on, split_key=True))(
        state, jax.random.PRNGKey(3), on)
    _assert_same_sample(ref, p.unpack())
    _assert_zero_padding(p.buffer, lay)
    np.testing.assert_array_equal(key, ref_key)
    s = p.numpy()
    assert s.valid.all() == on and int(s.num_eligible) == 20
    if not on:
      assert (s.info.slot == -1).all() and not s.data["x"].any()
      np.testing.assert_array_equal(key, jax.random.PRNGKey(3))  # a disabled call keeps it
      for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_complex_items_cannot_be_packed():
  sig = fr.Signature({"z": jax.ShapeDtypeStruct((2,), jnp.complex64)})
  assert "complex" in packing.packable(sig)


def test_layout_rejects_wrong_buffers():
  lay = packing.layout(fr.Signature({"x": np.zeros(2, np.float32)}), 4)
  want = r"expected a uint8\[%d\] buffer for this layout, got uint8\[%d\]" % (
      lay.nbytes, lay.nbytes + 64)
  with pytest.raises(ValueError, match=want):
    packing.unpack(jnp.zeros((lay.nbytes + 64,), jnp.uint8), lay)
  stacked = fr.PackedSample(jnp.zeros((3, lay.nbytes), jnp.uint8), lay)  # e.g. from vmap
  with pytest.raises(ValueError, match=r"stack of 3 packed batches\? index one first"):
    stacked.numpy()
  with pytest.raises(KeyError, match="no field"):
    lay.field("nope")
  assert lay.field("data['x']").shape == (4, 2)

