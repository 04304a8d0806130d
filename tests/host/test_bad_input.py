"""Bad input at the host boundary: a clear error naming what was wrong, nothing stored.

Issue 23 items 9 (no silent truncation of Python scalars), 10 (``SequenceWriter``
validates each step at ``append``) and 13 (clear errors for torch tensors,
huge / traced batch sizes, ``TorchSampler`` arguments, versions ahead of the
table's). Every case also checks that the table is intact afterwards.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from funcreplay import Table
from funcreplay.host.itemcheck import ItemChecker
from funcreplay.host.writers import SequenceWriter, sequence_signature

SIG = {"a": jax.ShapeDtypeStruct((), jnp.int32), "f": jax.ShapeDtypeStruct((), jnp.float32),
       "b": jax.ShapeDtypeStruct((), jnp.bool_)}
STEP = {"id": jax.ShapeDtypeStruct((), jnp.int32)}


def good(i=1):
  return {"a": i, "f": 0.5, "b": True}


# -- item 9: no silent truncation ------------------------------------------------------------

LOSSY = [
    ({"a": 1.5}, TypeError, r"\['a'\].*int32.*float"),      # float -> int leaf
    ({"a": 2.0}, TypeError, r"\['a'\].*int32.*float"),      # even integral floats: the dtype
    ({"a": True}, TypeError, r"\['a'\].*int32.*bool"),      # bool -> int leaf
    ({"f": True}, TypeError, r"\['f'\].*float32.*bool"),    # bool -> float leaf
    ({"b": 1}, TypeError, r"\['b'\].*bool.*int"),           # int -> bool leaf
    ({"b": 0.0}, TypeError, r"\['b'\].*bool.*float"),
    ({"a": 2**40}, ValueError, r"\['a'\].*int32"),          # out of range
    ({"f": 1e40}, ValueError, r"\['f'\].*float32"),         # overflows to inf
    ({"f": 2**24 + 1}, ValueError, r"\['f'\].*float32"),    # int not exact in float32
]


@pytest.mark.parametrize("bad,exc,match", LOSSY)
def test_item_checker_refuses_lossy_python_scalars(bad, exc, match):
  chk = ItemChecker(fr.Signature(SIG), "Ingestor.put")
  item = {**good(), **bad}
  assert chk.fast(item) is None  # the fast path never converts lossily
  with pytest.raises(exc, match=match):
    chk(item)


def test_item_checker_keeps_lossless_conversions():
  chk = ItemChecker(fr.Signature(SIG))
  for item in ({"a": 3, "f": 0.1, "b": False}, {"a": -2**31, "f": 7, "b": True},
               {"a": 0, "f": float("nan"), "b": True}, {"a": 0, "f": -float("inf"), "b": True},
               {"a": 0, "f": 3.4e38, "b": True}, {"a": 0, "f": 2**24, "b": True}):
    fast = chk.fast(item)  # NaN / inf take the slow path, which keeps them
    assert fast is not None or not math.isfinite(item["f"])
    for leaves in (fast or chk(item), chk.slow(item)):
      a, b, f = leaves  # jax order: sorted keys
      assert int(a) == item["a"] and bool(b) == item["b"]
      assert np.float32(item["f"]) == f or (math.isnan(item["f"]) and np.isnan(f))


@pytest.mark.parametrize("bad,exc,match", LOSSY)
def test_ingestor_put_refuses_lossy_scalars_like_table_insert(bad, exc, match):
  t = Table(fr.TableSpec(8, SIG))
  with t.ingestor(batch_size=2) as ing:
    ing.put(good(1))
    with pytest.raises(exc, match="Ingestor.put: item leaf " + match):
      ing.put({**good(2), **bad})
    ing.flush()
    assert ing.stats().accepted == 1
  assert t.size == 1
  assert int(np.asarray(t.sample(1).data["a"])[0]) == 1


def test_put_batch_and_table_insert_give_the_same_dtype_error():
  t = Table(fr.TableSpec(8, SIG))
  bad = {"a": np.array([1.5, 2.5]), "f": np.zeros(2, np.float32), "b": np.ones(2, bool)}
  with pytest.raises(TypeError) as e_ins:
    t.insert(bad)
  with t.ingestor() as ing:
    with pytest.raises(TypeError) as e_put:
      ing.put_batch(bad)
  assert str(e_ins.value).replace("Table.insert", "X") == \
      str(e_put.value).replace("Ingestor.put_batch", "X")
  assert t.size == 0


NESTED = {"obs": jax.ShapeDtypeStruct((3,), jnp.float32), "a": jax.ShapeDtypeStruct((), jnp.int32)}
A2 = np.array([0, 1], np.int32)


@pytest.mark.parametrize("obs,exc,match", [
    ([[1, 2, 3], [1, 2]], ValueError, r"\['obs'\]: a ragged list .*needs shape \[B, 3\]"),
    ([[1, 2, 3], [1, 2, None]], TypeError, r"\['obs'\]: a list numpy holds as Python objects"),
    ([[1.0, 2.0, 3.0]] * 2, TypeError,
     r"\['obs'\]: expected dtype float32, got float64 .*np\.asarray\(x, np\.float32\)"),
    # The shape is checked first: a list of the wrong shape and dtype gets the shape's error.
    ([1.0, 2.0], ValueError, r"\['obs'\]: expected shape \[B, 3\]"),
])
def test_nested_lists_name_the_leaf(obs, exc, match):
  # Leaves given as Python lists: numpy's own messages ("inhomogeneous shape", "cannot
  # convert") named neither the leaf nor the shape it needs.
  t = Table(fr.TableSpec(8, NESTED))
  t.insert({"obs": np.ones((1, 3), np.float32), "a": A2[:1]})
  with pytest.raises(exc, match="Table.insert: item leaf " + match):
    t.insert({"obs": obs, "a": A2})
  with t.ingestor() as ing:
    with pytest.raises(exc, match="Ingestor.put_batch: item leaf " + match):
      ing.put_batch({"obs": obs, "a": A2})
  assert t.size == 1  # nothing of the bad batches stored
  t.insert({"obs": np.asarray([[1, 2, 3]] * 2, np.float32), "a": A2})  # the right array
  assert t.size == 3


@pytest.mark.parametrize("bad,exc,match", LOSSY[:3])
def test_sequence_writer_refuses_lossy_scalars(bad, exc, match):
  t = Table(fr.TableSpec(8, sequence_signature(SIG, 2)))
  w = SequenceWriter(t, 2)
  w.append(good(1))
  with pytest.raises(exc, match="SequenceWriter.append: item leaf " + match):
    w.append({**good(2), **bad})
  w.append(good(3))  # the partial window survived the bad step
  assert t.size == 1
  assert np.asarray(t.sample(1).data["a"]).tolist() == [[1, 3]]
  assert w.stats().steps == 2


def test_check_items_public_refuses_lossy_scalars():
  with pytest.raises(TypeError, match="int32"):
    fr.check_items(fr.Signature(SIG), {**good(), "a": 1.5}, batched=False)


# -- item 10: SequenceWriter validates each step at append ------------------------------------

@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(version=2**40), ValueError, "version"),
    (dict(version=1.5), TypeError, "version"),
    (dict(metadata={"task": 0.5}), TypeError, r"metadata\['task'\]"),
    (dict(metadata={"task": 2**40}), ValueError, r"metadata\['task'\]"),
    (dict(metadata={"nope": 1}), ValueError, "nope"),
    (dict(metadata=[1]), TypeError, "metadata"),
])
@pytest.mark.parametrize("via_ingestor", [False, True])
def test_sequence_writer_validates_at_append(kwargs, exc, match, via_ingestor):
  spec = fr.TableSpec(8, sequence_signature(STEP, 3), metadata=("task",))
  t = Table(spec)
  ing = t.ingestor(batch_size=1) if via_ingestor else None
  w = SequenceWriter(ing or t, 3)
  w.append({"id": np.int32(0)}, version=0)
  # The bad step is refused at its own append (not at the one completing the window)...
  with pytest.raises(exc, match="SequenceWriter.append.*" + match):
    w.append({"id": np.int32(1)}, **kwargs)
  # ... and the partial window is intact: two more good steps complete it.
  w.append({"id": np.int32(1)})
  w.append({"id": np.int32(2)})
  if ing is not None:
    ing.close()
  assert t.size == 1
  assert np.asarray(t.sample(1).data["id"]).tolist() == [[0, 1, 2]]
  s = w.stats()
  assert (s.steps, s.items, s.dropped_partials) == (3, 1, 0)


def test_sequence_writer_bad_priority_fn_keeps_the_window():
  t = Table(fr.TableSpec(8, sequence_signature(STEP, 2)))
  prios = iter([float("nan"), -1.0, 2.0])
  w = SequenceWriter(t, 2, priority_fn=lambda item: next(prios))
  w.append({"id": np.int32(0)})
  for bad in ("nan", "-1.0"):
    with pytest.raises(ValueError, match=f"priority_fn.*{bad}"):
      w.append({"id": np.int32(1)})
    assert t.size == 0 and w.stats().steps == 1 and w.stats().items == 0
  w.append({"id": np.int32(1)})  # retried: the window goes in with priority 2
  assert t.size == 1 and w.stats().items == 1
  smp = t.sample(1)
  assert np.asarray(smp.data["id"]).tolist() == [[0, 1]]
  assert float(np.asarray(smp.info.priority)[0]) == 2.0


def test_sequence_writer_sink_failure_keeps_the_window():
  class Flaky:
    """A sink whose first put fails (a full queue, a closed table, ...)."""

    def __init__(self):
      self.items, self.fail = [], True

    def put(self, item, *, version=None, priority=None, metadata=None):
      if self.fail:
        self.fail = False
        raise TimeoutError("queue full")
      self.items.append(np.asarray(item["id"]).tolist())

  sink = Flaky()
  w = SequenceWriter(sink, 2, stride=1, step_signature=STEP)
  w.append({"id": np.int32(5)})
  with pytest.raises(TimeoutError):
    w.append({"id": np.int32(6)})
  assert (w.stats().steps, w.stats().items) == (1, 0)
  w.append({"id": np.int32(6)})  # retried
  w.append({"id": np.int32(7)})
  assert sink.items == [[5, 6], [6, 7]]
  assert (w.stats().steps, w.stats().items) == (3, 2)


# -- item 13: clear errors, the table intact ---------------------------------------------------

def intact(t: Table):
  """(size, stats, rng key): what a refused call must not change."""
  s = t.stats().to_dict()
  return t.size, sorted(s.items()), s["samples"], np.asarray(t.rng_key()).tolist()


def filled(n=4, **spec_kwargs):
  t = Table(fr.TableSpec(8, SIG, **spec_kwargs))
  t.insert({"a": np.arange(n, dtype=np.int32), "f": np.zeros(n, np.float32),
            "b": np.ones(n, bool)})
  return t


def test_torch_tensors_to_table_insert_name_the_leaf_and_from_torch():
  torch = pytest.importorskip("torch")
  t = filled()
  before = intact(t)
  items = {"a": torch.arange(2, dtype=torch.int32), "f": np.zeros(2, np.float32),
           "b": np.ones(2, bool)}
  with pytest.raises(TypeError, match=r"Table.insert: item leaf \['a'\].*torch.*from_torch"):
    t.insert(items)
  with t.ingestor() as ing:
    with pytest.raises(TypeError, match=r"Ingestor.put_batch: item leaf \['a'\].*from_torch"):
      ing.put_batch(items)
  assert intact(t) == before
  import funcreplay.torch as frt
  t.insert(frt.from_torch(items, on_copy="ignore"))  # the way the message points to
  assert t.size == 6


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_huge_batch_size_names_batch_size(replace, packed):
  t = filled()
  before = intact(t)
  sample = t.sample_packed if packed else t.sample
  for bad in (2**40, 2**31):
    with pytest.raises(ValueError, match="batch_size"):
      sample(bad, replace=replace, timeout=0)
  assert intact(t) == before
  assert sample(2, replace=replace, timeout=0) is not None


def test_traced_batch_size_points_to_static_argnames():
  ft = fr.make_table(fr.TableSpec(8, SIG))
  state = ft.init()
  f = jax.jit(lambda s, k, b: ft.sample(s, k, batch_size=b))
  with pytest.raises(ValueError, match=r"batch_size.*traced.*static_argnames"):
    f(state, jax.random.PRNGKey(0), 4)
  g = jax.jit(lambda s, k, batch_size: ft.sample(s, k, batch_size=batch_size),
              static_argnames=("batch_size",))
  _, smp = g(state, jax.random.PRNGKey(0), batch_size=4)
  assert smp.valid.shape == (4,)
  with pytest.raises(ValueError, match="batch_size"):
    ft.sample(state, jax.random.PRNGKey(0), batch_size=True)


def test_torch_sampler_bogus_device():
  pytest.importorskip("torch")
  import funcreplay.torch as frt
  t = filled()
  with pytest.raises(ValueError, match=r"TorchSampler: device 'bogus'.*'cpu'"):
    frt.TorchSampler(t, 2, device="bogus")


@pytest.mark.parametrize("bad", [float("nan"), -0.5, "x", None])
def test_torch_sampler_beta_callable_checked_before_sampling(bad):
  pytest.importorskip("torch")
  import funcreplay.torch as frt
  t = filled()
  before = intact(t)
  betas = {0: 0.4, 1: bad}
  with frt.TorchSampler(t, 2, beta=lambda i: betas[i], prefetch=0, replace=True) as smp:
    batch = next(smp)
    assert batch.weights is not None
    after_one = intact(t)
    assert after_one[2] == before[2] + 2  # samples
    with pytest.raises(ValueError, match=r"TorchSampler: beta\(1\) returned"):
      next(smp)
    assert intact(t) == after_one  # nothing sampled for the refused batch


def test_version_ahead_of_the_table_warns_once_and_is_kept():
  t = Table(fr.TableSpec(8, SIG, max_staleness=2), version=5)
  item = {"a": np.zeros(1, np.int32), "f": np.zeros(1, np.float32), "b": np.ones(1, bool)}
  with pytest.warns(fr.VersionAheadWarning, match=r"version 9.*table's version 5.*set_version"):
    t.insert(item, version=9)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    t.insert(item, version=10)  # once per table
    t.insert(item, version=[3])
  assert t.size == 3
  smp = t.sample(3)  # items ahead count as fresh
  assert np.asarray(smp.valid).all()
