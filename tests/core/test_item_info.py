"""``TableState.item_info``: each slot's key, version, times sampled and priority in one row.

Reads go through the properties ``state.key`` / ``version`` / ``times_sampled`` /
``priority``; operations write rows through ``core.item_info``; checkpoints store the
four columns (``StateRecord``), so the format does not depend on the packing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import funcreplay as fr
from funcreplay.checkpoint import record
from funcreplay.core import item_info
from tests.helpers import ITEM, items_from_ids

U32 = st.integers(0, 2**32 - 1)
I32 = st.integers(-2**31, 2**31 - 1)
F32 = st.floats(width=32, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(U32, I32, I32, F32), min_size=1, max_size=9))
def test_rows_round_trip_bit_exactly_on_host_and_device(rows):
  key, version, times, prio = (np.array(c, dt) for c, dt in zip(
      zip(*rows), (np.uint32, np.int32, np.int32, np.float32)))
  host = item_info.pack(key=key, version=version, times_sampled=times, priority=prio)
  assert isinstance(host, np.ndarray) and host.shape == (len(rows), item_info.WIDTH)
  device = jax.jit(lambda k, v, t, p: item_info.pack(key=k, version=v, times_sampled=t,
                                                     priority=p))(key, version, times, prio)
  np.testing.assert_array_equal(np.asarray(device), host)
  for words in (host, device):
    got = item_info.unpack(words)
    for name, want in zip(item_info.FIELDS, (key, version, times, prio)):
      np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint32),
                                    want.view(np.uint32), err_msg=name)
      np.testing.assert_array_equal(np.asarray(item_info.column(words, name)).view(np.uint32),
                                    want.view(np.uint32), err_msg=name)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(U32, I32, I32, F32), min_size=1, max_size=9), st.data())
def test_at_reads_the_field_of_the_slots(rows, data):
  """``item_info.at(info, slots, name)`` (a gather from ``info`` itself, what the lean
  programs read) is ``column(info, name)[slots]``, bit for bit, on host and device, for
  one slot, several (repeats included) and a scalar index."""
  key, version, times, prio = (np.array(c, dt) for c, dt in zip(
      zip(*rows), (np.uint32, np.int32, np.int32, np.float32)))
  host = item_info.pack(key=key, version=version, times_sampled=times, priority=prio)
  n = len(rows)
  slots = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6)),
                   np.int32)
  for name in item_info.FIELDS:
    want = item_info.column(host, name)[slots].view(np.uint32)
    for info in (host, jnp.asarray(host)):
      got = np.asarray(item_info.at(info, slots, name))
      assert got.dtype == np.dtype(item_info.DTYPES[name]), name
      np.testing.assert_array_equal(got.view(np.uint32), want, err_msg=name)
    jitted = jax.jit(lambda i, s, name=name: item_info.at(i, s, name))(host, slots)
    np.testing.assert_array_equal(np.asarray(jitted).view(np.uint32), want, err_msg=name)
    scalar = np.asarray(item_info.at(jnp.asarray(host), jnp.int32(slots[0]), name))
    assert scalar.shape == () and scalar.view(np.uint32) == want[0], name


def test_pack_mixes_host_constants_and_traced_words():
  # Host words (insert's times_sampled=0, a constant version) go in as one literal.
  keys = jnp.arange(3, dtype=jnp.uint32) + 7
  got = jax.jit(lambda k: item_info.pack(key=k, version=np.int32(-2), times_sampled=0,
                                         priority=np.float32(1.5)))(keys)
  want = np.stack([np.arange(3, dtype=np.uint32) + 7, np.full(3, -2, np.int32).view(np.uint32),
                   np.zeros(3, np.uint32), np.full(3, 1.5, np.float32).view(np.uint32)], -1)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_writes_touch_only_their_rows_and_fields():
  info = item_info.pack(key=np.arange(6, dtype=np.uint32), version=np.full(6, 3, np.int32),
                        times_sampled=np.full(6, 2**31 - 1, np.int32),
                        priority=np.ones(6, np.float32))
  slots = jnp.array([1, 4, 6])  # 6 is out of range: dropped
  out = item_info.add_field(jnp.asarray(info), slots, "times_sampled", 1, mode="drop")
  times = np.asarray(item_info.column(out, "times_sampled"))
  np.testing.assert_array_equal(times, [2**31 - 1, -2**31, 2**31 - 1, 2**31 - 1, -2**31,
                                        2**31 - 1])  # wraps, as an int32 add
  out = item_info.put_field(out, slots, "priority", jnp.array([0.5, 2.5, 9.0]), mode="drop")
  np.testing.assert_array_equal(np.asarray(item_info.column(out, "priority")),
                                [1, 0.5, 1, 1, 2.5, 1])
  for name in ("key", "version"):  # untouched
    np.testing.assert_array_equal(np.asarray(item_info.column(out, name)),
                                  item_info.column(info, name))
  with pytest.raises(TypeError, match="float field"):
    item_info.add_field(out, slots, "priority", 1.0)
  with pytest.raises(KeyError, match="no field 'reward'"):
    item_info.column(info, "reward")
  with pytest.raises(ValueError, match="missing \\['priority'\\]"):
    item_info.pack(key=0, version=0, times_sampled=0)
  with pytest.raises(ValueError, match="4 uint32 words per slot"):
    item_info.column(np.zeros((5, 3), np.uint32), "key")


def test_state_properties_and_replace_read_and_write_the_columns():
  spec = fr.TableSpec(8, ITEM)
  t = fr.make_table(spec, native=False)
  s = t.insert(t.init(), items_from_ids(np.arange(5)), version=4, priority=2.0)
  assert s.item_info.shape == (8, item_info.WIDTH) and s.item_info.dtype == jnp.uint32
  np.testing.assert_array_equal(s.key[:5], np.arange(5))
  np.testing.assert_array_equal(s.version[:5], 4)
  np.testing.assert_array_equal(s.priority[:5], 2.0)
  s, smp = t.sample(s, jax.random.PRNGKey(0), batch_size=3)
  np.testing.assert_array_equal(s.times_sampled[np.asarray(smp.info.slot)], 1)
  np.testing.assert_array_equal(smp.info.times_sampled, 1)
  np.testing.assert_array_equal(smp.info.key, s.key[np.asarray(smp.info.slot)])
  # replace rewrites a whole column and nothing else.
  r = s.replace(version=jnp.full((8,), -1, jnp.int32))
  np.testing.assert_array_equal(r.version, -1)
  for name in ("key", "times_sampled", "priority"):
    np.testing.assert_array_equal(getattr(r, name), getattr(s, name))
  with pytest.raises(TypeError, match="either item_info or \\['key'\\]"):
    s.replace(item_info=s.item_info, key=s.key)


def test_record_stores_the_four_columns_by_name():
  spec = fr.TableSpec(8, ITEM)
  t = fr.make_table(spec, native=False)
  s = t.insert(t.init(), items_from_ids(np.arange(3)), version=2, priority=0.25)
  host = jax.tree_util.tree_map(np.asarray, s)
  rec = record.to_record(host, spec)
  for name in item_info.FIELDS:  # the checkpoint's leaf names (format unchanged)
    np.testing.assert_array_equal(getattr(rec, name), getattr(host, name))
  back = record.from_record(rec, spec)
  np.testing.assert_array_equal(back.item_info, host.item_info)
