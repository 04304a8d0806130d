"""Core contract tests, bad input: batches over capacity, wrong leaf shapes and dtypes,
``check_items`` messages, spec validation and hashing, ``where`` mask shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from tests.helpers import ITEM, items_from_ids

# Every test here runs against both implementations (see conftest.py).
pytestmark = pytest.mark.usefixtures("both_implementations")


def test_batch_larger_than_capacity_is_an_error():
  spec = fr.TableSpec(4, ITEM)
  with pytest.raises(ValueError, match="exceeds the table capacity 4"):
    fr.make_table(spec).insert(fr.make_table(spec).init(), items_from_ids(np.arange(5)))


def test_insert_wrong_shape_or_dtype_names_the_leaf():
  spec = fr.TableSpec(4, ITEM)
  table = fr.make_table(spec)
  bad = {"x": jnp.zeros((2,), jnp.int32), "y": jnp.zeros((2, 3), jnp.float32)}
  with pytest.raises(ValueError, match=r"\['y'\].*expected shape \[B, 2\]"):
    table.insert(table.init(), bad)
  bad = {"x": jnp.zeros((2,), jnp.float32), "y": jnp.zeros((2, 2), jnp.float32)}
  with pytest.raises(TypeError, match=r"\['x'\].*expected dtype int32"):
    table.insert(table.init(), bad)


def test_check_items_reports_leaf_expected_and_got():
  sig = fr.Signature(ITEM)
  with pytest.raises(ValueError, match="structure does not match"):
    fr.check_items(sig, {"x": np.zeros((2,), np.int32)})
  with pytest.raises(TypeError, match=r"\['y'\]: expected dtype float32, got float64"):
    fr.check_items(sig, {"x": np.zeros((2,), np.int32), "y": np.zeros((2, 2))})
  with pytest.raises(ValueError, match="disagree on the batch size"):
    fr.check_items(sig, {"x": np.zeros((2,), np.int32), "y": np.zeros((3, 2), np.float32)})
  leaves, b = fr.check_items(sig, {"x": 3, "y": np.zeros((2,), np.float32)}, batched=False)
  assert b == 1 and leaves[0].dtype == np.int32


@pytest.mark.parametrize("kwargs,match", [
    (dict(capacity=0), "capacity"),
    (dict(capacity=4, sampler="uniform"), "sampler must be one of"),
    (dict(capacity=4, remover=fr.Prioritized()), "remover must be one of"),
    (dict(capacity=4, max_times_sampled=-1), "max_times_sampled"),
    (dict(capacity=4, max_staleness=-2), "max_staleness"),
    (dict(capacity=4, metadata=("key",)), "built-in column"),
    (dict(capacity=4, metadata=("a", "a")), "duplicate"),
    (dict(capacity=4, default_priority=float("nan")), "default_priority"),
])
def test_spec_validation(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    fr.TableSpec(signature=ITEM, **kwargs)


def test_float64_signature_rejected_without_x64():
  with pytest.raises(TypeError, match="float64"):
    fr.TableSpec(4, {"x": np.zeros((2,), np.float64)})


def test_specs_are_hashable_and_compare_by_value():
  a = fr.TableSpec(4, ITEM, sampler=fr.Prioritized(0.5))
  b = fr.TableSpec(4, {"x": np.zeros((), np.int32), "y": np.zeros((2,), np.float32)},
                   sampler=fr.Prioritized(0.5))
  assert a == b and hash(a) == hash(b)
  assert a != a.replace(capacity=5)


def test_where_mask_shape_is_checked():
  spec = fr.TableSpec(4, ITEM)
  table = fr.make_table(spec)
  with pytest.raises(ValueError, match="bool mask of shape \\[4\\]"):
    table.sample(table.init(), jax.random.PRNGKey(0), batch_size=2, where=jnp.ones((3,), bool))


@pytest.mark.parametrize("storage", ["rows", "columns"])
def test_inserting_no_rows_leaves_the_state_as_it_was(storage):
  """B = 0: the state comes back unchanged on both executors (packed rows raised a
  ZeroDivisionError, and the portable columns program a zero-size max)."""
  spec = fr.TableSpec(4, ITEM, sampler=fr.Prioritized(0.6), storage=storage)
  t = fr.make_table(spec)
  state = t.insert(t.init(), items_from_ids([1, 2, 3]), priority=np.float32([1, 2, 3]))
  after = t.insert(state, items_from_ids([]))
  for x, y in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(after)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_keyed_calls_check_their_slots_keys_and_values():
  """Float slots were truncated to other slots; a scalar or 2-D slot array raised an
  IndexError or failed inside the kernel. Each is now an error naming the argument."""
  spec = fr.TableSpec(4, ITEM, sampler=fr.Prioritized(0.6), metadata=("task",))
  t = fr.make_table(spec)
  state = t.insert(t.init(), items_from_ids([1, 2]), priority=np.float32([1, 2]))
  keys = np.uint32([0, 1])
  calls = {
      "update_priorities": lambda s, k, v: t.update_priorities(state, s, k, v),
      "delete": lambda s, k, v: t.delete(state, s, k),
      "set_metadata": lambda s, k, v: t.set_metadata(state, s, k, "task", v.astype(np.int32)),
  }
  for what, call in calls.items():
    with pytest.raises(TypeError, match=f"{what}: slots must be integers"):
      call(np.array([0.5, 1.7]), keys, np.float32([5, 7]))
    for bad, shape in ((np.int32(0), r"\[\]"), (np.int32([[0], [1]]), r"\[2, 1\]")):
      with pytest.raises(ValueError, match=f"{what}: slots must be int32.K., got shape {shape}"):
        call(bad, keys if bad.ndim else np.uint32(0), np.float32([5, 7][:bad.size]))
    with pytest.raises(ValueError, match=f"{what}: keys must be a scalar or of the slots' shape"):
      call(np.int32([0, 1]), np.uint32([0, 1, 2]), np.float32([5, 7]))
    with pytest.raises(TypeError, match=f"{what}: keys must be integers"):
      call(np.int32([0, 1]), np.float32([0, 1]), np.float32([5, 7]))
  with pytest.raises(ValueError, match="update_priorities: priorities must be a scalar or"):
    t.update_priorities(state, np.int32([0, 1]), keys, np.float32([5, 7, 9]))
  with pytest.raises(TypeError, match="set_metadata: values must be integers"):
    t.set_metadata(state, np.int32([0, 1]), keys, "task", np.float32([5, 7]))
  # Host keys and values as Python ints go through numpy: a valid uint32 key above 2**31
  # was refused by JAX's int32 OverflowError, and one beyond uint32 or a metadata value
  # beyond int32 got JAX's error instead of these (found by a review).
  t.delete(state, [0], [3_000_000_000])
  t.update_priorities(state, [0], 3_000_000_000, 1.0)
  with pytest.raises(ValueError, match="delete: keys are uint32"):
    t.delete(state, [0], [2**32])
  with pytest.raises(ValueError, match="set_metadata: values must fit int32"):
    t.set_metadata(state, [0], [0], "task", 2**31)
  assert int(t.count(t.delete(state, [0, 1], keys.tolist()))) == 0


def test_host_lists_and_wide_slots_are_checked_as_host_values():
  """Lists were not host values: an int beyond int32 raised JAX's OverflowError naming
  nothing, a priority beyond float32 became inf and was stored as 0. A slot of 2**32 + 1
  (int64) wrapped onto slot 1 and deleted it. ``[]`` as keys was refused as floats.
  (Found by a review.)"""
  spec = fr.TableSpec(4, ITEM, sampler=fr.Prioritized(1.0), metadata=("task",))
  t = fr.make_table(spec)
  state = t.insert(t.init(), items_from_ids(np.arange(4)))
  key1 = int(state.key[1])
  for slots in (np.array([2**32 + 1], np.int64), [2**31]):
    with pytest.raises(ValueError, match="delete: slots must fit int32"):
      t.delete(state, slots, [key1])
    with pytest.raises(ValueError, match="update_priorities: slots must fit int32"):
      t.update_priorities(state, slots, [key1], 2.0)
  with pytest.raises(ValueError, match="update_priorities: priorities must fit float32"):
    t.update_priorities(state, [1], [key1], [1e39])
  items = items_from_ids([5, 6])
  with pytest.raises(ValueError, match="insert priority must fit float32"):
    t.insert(state, items, priority=[1e39, 1.0])
  with pytest.raises(ValueError, match="insert version must fit int32"):
    t.insert(state, items, version=[1, 2**31])
  with pytest.raises(ValueError, match=r"metadata\['task'\] must fit int32"):
    t.insert(state, items, metadata={"task": [1, 2**31]})
  assert int(t.count(t.delete(state, [], []))) == 4
  # None where a value is needed: ours, naming it (JAX's named nothing).
  with pytest.raises(TypeError, match="delete: keys must be given"):
    t.delete(state, [0], None)
  with pytest.raises(TypeError, match="update_priorities: priorities must be given"):
    t.update_priorities(state, [0], [key1], None)
  with pytest.raises(TypeError, match="insert version must be given"):
    t.insert(state, items, version=None)
  with pytest.raises(TypeError, match=r"metadata\['task'\] must be given"):
    t.insert(state, items, metadata={"task": None})
  with pytest.raises(ValueError, match=r"sample: version must be a scalar.*\[1\]"):
    t.sample(state, jax.random.PRNGKey(0), batch_size=1, version=[5])
  # In-range lists are taken as they are.
  up = t.update_priorities(state, [1, 2], [key1, int(state.key[2])], [2.0, 3.0])
  np.testing.assert_array_equal(np.asarray(up.priority), [1.0, 2.0, 3.0, 1.0])


def test_insert_refuses_numpy_items_of_a_wider_dtype():
  """A numpy float64 / int64 leaf for a 32-bit one is refused, as the host ``Table``
  refuses it: ``jnp.result_type`` read it as 32 bits without x64, and the rows storage
  then took twice its words (an error from inside the kernel or XLA) and the columns
  storage wrapped int64 values (found by a review)."""
  for storage in ("rows", "columns"):
    t = fr.make_table(fr.TableSpec(8, ITEM, storage=storage))
    x = items_from_ids([1, 2])
    for name in x:
      bad = dict(x, **{name: np.asarray(x[name]).astype(
          np.float64 if np.asarray(x[name]).dtype.kind == "f" else np.int64)})
      with pytest.raises(TypeError, match=f"item leaf .*{name}.*: expected dtype "
                                          f"{np.asarray(x[name]).dtype}, got"):
        t.insert(t.init(), bad)


BAD_KEYS = [np.float32([0.3, 0.7]), np.uint32([0, 0, 12345]), np.int32([0, 1]),
            jax.random.split(jax.random.PRNGKey(0), 2), 7]


@pytest.mark.parametrize("key", BAD_KEYS, ids=["float32[2]", "uint32[3]", "int32[2]",
                                               "uint32[2,2]", "int"])
def test_only_one_prng_key_is_taken(key):
  """The draws read a key's first two words, so anything else (a float array, int words,
  a batch of keys) became some other key silently (found by a review; ``jax.random``
  refuses them too). One key, raw ``uint32[2]`` or typed, is taken."""
  spec = fr.TableSpec(8, ITEM, remover=fr.Uniform())
  t = fr.make_table(spec)
  st = t.insert(t.init(), items_from_ids(np.arange(4)), rng=jax.random.PRNGKey(1))
  with pytest.raises(TypeError, match=r"sample: rng must be one PRNG key"):
    t.sample(st, key, batch_size=2)
  with pytest.raises(TypeError, match=r"insert: rng must be one PRNG key"):
    t.insert(st, items_from_ids([9]), rng=key)
  traj = fr.make_trajectory_table(fr.TrajectorySpec(
      num_envs=2, time_capacity=8, sequence_length=2, period=1,
      signature={"o": jnp.zeros((), jnp.float32)}))
  with pytest.raises(TypeError, match=r"sample: rng must be one PRNG key"):
    traj.sample(traj.init(), key, batch_size=1)
  for good in (jax.random.PRNGKey(3), jax.random.key(3)):
    assert t.sample(st, good, batch_size=2)[1].valid.all()


def test_insert_refuses_what_its_columns_would_truncate():
  """Versions and metadata are integers, a mask bools, priorities real numbers: a float
  version or metadata value was truncated and a host int64 beyond int32 wrapped (found
  by a review; ``set_metadata`` and the host ``Table`` refused them already)."""
  spec = fr.TableSpec(8, ITEM, metadata=("task",), sampler=fr.Prioritized(0.6))
  t = fr.make_table(spec)
  st = t.init()
  x = items_from_ids([1, 2])
  for kw, err, match in [
      (dict(version=2.9), TypeError, r"insert version must be integers, got float"),
      (dict(version=2**40), ValueError, r"insert version must fit int32"),
      (dict(metadata={"task": 1.7}), TypeError, r"metadata\['task'\] must be integers"),
      (dict(metadata={"task": np.int64(2**32 + 5)}), ValueError, r"must fit int32"),
      (dict(mask=np.array([1.0, 0.0])), TypeError, r"insert mask must be bools"),
      (dict(mask=2), TypeError, r"insert mask must be bools"),
      (dict(priority=True), TypeError, r"insert priority must be real numbers, got bool"),
      (dict(priority=np.array([1 + 2j, 1])), TypeError, r"must be real numbers, got complex"),
  ]:
    with pytest.raises(err, match=match):
      t.insert(st, x, **kw)
  st = t.insert(st, x, version=np.int64(3), priority=np.array([1, 2]),
                mask=np.array([True, False]), metadata={"task": np.uint8(3)})
  assert int(st.size) == 1  # integer priorities, numpy scalars in range: taken


def test_priorities_beyond_float32_are_refused_or_saturate():
  """A finite host priority beyond float32's range is refused: the cast made it inf,
  stored as 0 and counted invalid, so the most important item was never drawn (found by
  a review). A traced float64 one (x64) saturates at float32's largest value instead."""
  spec = fr.TableSpec(8, ITEM, sampler=fr.Prioritized(1.0))
  t = fr.make_table(spec)
  st = t.insert(t.init(), items_from_ids([1, 2]), priority=np.array([1.0, 2.0]))
  with pytest.raises(ValueError, match=r"insert priority must fit float32.*1e\+39"):
    t.insert(st, items_from_ids([3, 4]), priority=np.array([1.0, 1e39]))
  with pytest.raises(ValueError, match=r"update_priorities: priorities must fit float32"):
    t.update_priorities(st, np.array([0]), st.key[:1], np.array([-1e39]))
  big = float(np.finfo(np.float32).max)
  st = t.update_priorities(st, np.array([0]), st.key[:1], np.array([big]))
  assert float(st.priority[0]) == big and int(t.count(st)) == 2
  with jax.enable_x64(True):
    up = jax.jit(t.update_priorities)(st, np.array([1]), st.key[1:2],
                                      jnp.array([1e39], jnp.float64))
  assert float(up.priority[1]) == big and int(t.count(up)) == 2
  assert fr.counters.to_int(up.counters["invalid_priorities"]) == 0


def test_queries_refuse_float_versions_and_empty_counts():
  spec = fr.TableSpec(8, ITEM, max_staleness=2)
  t = fr.make_table(spec)
  st = t.insert(t.init(), items_from_ids([1, 2]), version=0)
  with pytest.raises(TypeError, match=r"sample: version must be an integer"):
    t.sample(st, jax.random.PRNGKey(0), batch_size=1, version=0.9)
  with pytest.raises(TypeError, match=r"version must be an integer"):
    t.evict_stale(st, 3.7)
  with pytest.raises(TypeError, match=r"version must be an integer"):
    t.count(st, version=1.5)
  with pytest.raises(ValueError, match=r"can_insert: num_items must be an integer >= 1"):
    t.can_insert(st, -3)
  with pytest.raises(ValueError, match=r"can_sample: batch_size must be an integer >= 1"):
    t.can_sample(st, 0, version=0)
  with pytest.raises(ValueError, match=r"keys are uint32"):
    t.delete(st, np.array([0]), np.array([2**33]))
  assert bool(jax.jit(lambda s, n: t.can_insert(s, n))(st, 2))  # traced counts: taken
