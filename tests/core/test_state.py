"""The ledger: the table's scalars and counters packed into one ``uint32`` leaf.

Reads go through properties (``state.write_pos``, ``state.counters``...),
writes through ``state.replace``; checkpoints store the unpacked
``StateRecord`` so the format does not depend on the packing.
"""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import funcreplay as fr
from funcreplay.checkpoint import record
from funcreplay.core import counters as ctr
from funcreplay.core import ledger as ledger_lib
from tests.helpers import ITEM, items_from_ids

U32 = st.integers(0, 2**32 - 1)
I32 = st.integers(-2**31, 2**31 - 1)


def _fields(write_pos, next_key, max_priority, limiter_diff, counter_words):
  counters = {name: np.array(counter_words[2 * i:2 * i + 2], np.uint32)
              for i, name in enumerate(ledger_lib.COUNTERS)}
  return dict(write_pos=np.int32(write_pos), next_key=np.uint32(next_key),
              max_priority=np.float32(max_priority), limiter_diff=np.int32(limiter_diff),
              counters=counters)


@settings(max_examples=40, deadline=None)
@given(write_pos=I32, next_key=U32, limiter_diff=I32,
       max_priority=st.floats(width=32, allow_nan=True, allow_infinity=True),
       counter_words=st.lists(U32, min_size=2 * len(ledger_lib.COUNTERS),
                              max_size=2 * len(ledger_lib.COUNTERS)),
       on_device=st.booleans())
def test_every_value_round_trips_bit_exactly(write_pos, next_key, limiter_diff, max_priority,
                                             counter_words, on_device):
  fields = _fields(write_pos, next_key, max_priority, limiter_diff, counter_words)
  if on_device:
    fields = jax.tree_util.tree_map(jnp.asarray, fields)
  ledger = ledger_lib.pack_ledger(**fields)
  assert ledger.shape == (ledger_lib.LEDGER_SIZE,) and ledger.dtype == np.uint32
  assert isinstance(ledger, np.ndarray) != on_device  # numpy in, numpy out
  spec = fr.TableSpec(4, ITEM)
  s = fr.make_table(spec).init().replace(ledger=jnp.asarray(ledger))
  back = ledger_lib.ledger_fields(s)
  for name in ("write_pos", "next_key", "max_priority", "limiter_diff"):
    got, want = np.asarray(back[name]), np.asarray(fields[name])
    assert got.dtype == want.dtype, name
    assert got.tobytes() == want.tobytes(), name  # NaN payloads and -0.0 included
  for name in ledger_lib.COUNTERS:
    np.testing.assert_array_equal(back["counters"][name], fields["counters"][name], name)


def test_replace_changes_only_what_it_is_given():
  t = fr.make_table(fr.TableSpec(8, ITEM))
  s = t.insert(t.init(), items_from_ids(np.arange(5)), version=0)
  before = ledger_lib.ledger_fields(jax.device_get(s))
  c = dict(s.counters)
  c["deletes"] = ctr.from_int(2**32 + 7)
  s2 = s.replace(counters=c, write_pos=jnp.int32(3))
  assert int(s2.write_pos) == 3 and ctr.to_int(s2.counters["deletes"]) == 2**32 + 7
  after = ledger_lib.ledger_fields(jax.device_get(s2))
  for name in ("next_key", "max_priority", "limiter_diff"):
    assert np.asarray(after[name]).tobytes() == np.asarray(before[name]).tobytes(), name
  for name in ledger_lib.COUNTERS:
    if name != "deletes":
      np.testing.assert_array_equal(after["counters"][name], before["counters"][name], name)
  # The same replace inside jit.
  s3 = jax.jit(lambda s: s.replace(counters=c, write_pos=jnp.int32(3)))(s)
  np.testing.assert_array_equal(s3.ledger, s2.ledger)


def test_bad_ledger_updates_are_refused_with_the_reason():
  s = fr.make_table(fr.TableSpec(4, ITEM)).init()
  c = dict(s.counters)
  del c["samples"]
  with pytest.raises(ValueError, match=r"missing \['samples'\]"):
    s.replace(counters=c)
  with pytest.raises(ValueError, match=r"unexpected \['typo'\]"):
    s.replace(counters={**s.counters, "typo": ctr.zero()})
  with pytest.raises(TypeError, match="either ledger or"):
    s.replace(ledger=s.ledger, write_pos=jnp.int32(1))


def test_the_ledger_is_one_leaf_and_vmaps_over_tables():
  spec = fr.TableSpec(8, ITEM)
  t = fr.make_table(spec)
  leaves = jax.tree_util.tree_leaves_with_path(t.init())
  names = [jax.tree_util.keystr(p) for p, _ in leaves]
  assert ".ledger" in names
  assert not any("counters" in n or "write_pos" in n for n in names)
  states = jax.vmap(lambda _: t.init())(jnp.arange(4))
  assert states.ledger.shape == (4, ledger_lib.LEDGER_SIZE)
  n = jnp.array([1, 2, 3, 4])

  def ins(s, k):
    return t.insert(s, items_from_ids(jnp.arange(4)), version=0,
                    mask=jnp.arange(4) < k)

  states = jax.vmap(ins)(states, n)
  np.testing.assert_array_equal(states.write_pos, [1, 2, 3, 4])
  assert states.counters["inserts"].shape == (4, 2)
  np.testing.assert_array_equal(states.counters["inserts"][:, 1], [1, 2, 3, 4])


def test_record_keeps_the_checkpoint_leaf_names():
  """The on-disk names of checkpoints written before the ledger existed."""
  spec = fr.TableSpec(8, ITEM, metadata=("task",))
  s = jax.device_get(fr.make_table(spec).init())
  rec = record.to_record(s, spec)
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(rec)]
  assert names[-13:] == [".write_pos", ".next_key", ".max_priority", ".limiter_diff"] + [
      f".counters['{k}']" for k in sorted(ledger_lib.COUNTERS)]
  assert ".metadata['task']" in names and ".occupied" in names
  back = record.from_record(rec, spec)
  assert isinstance(back.ledger, np.ndarray)  # host states stay on the host
  np.testing.assert_array_equal(back.ledger, s.ledger)
  for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(s)):
    np.testing.assert_array_equal(a, b)


def test_spec_and_signature_pickle_round_trip():
  """A TableSpec crosses process boundaries (Ray actors, spawned workers) by pickle."""

  item = {"obs": jnp.zeros((3, 2), jnp.uint8), "pair": (jnp.zeros((), jnp.int32),
                                                        jnp.zeros((4,), jnp.float32))}
  spec = fr.TableSpec(16, item, sampler=fr.Prioritized(0.6), remover=fr.MinHeap(),
                      max_times_sampled=2, max_staleness=3, metadata=("task",))
  back = pickle.loads(pickle.dumps(spec))
  assert back == spec and hash(back) == hash(spec)
  assert back.signature.names == spec.signature.names
  with pytest.raises(AttributeError, match="immutable"):
    back.signature.leaves = ()
