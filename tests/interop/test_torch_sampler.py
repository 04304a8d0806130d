"""``funcreplay.torch.TorchSampler``: batches from a host table on a prefetch thread
(iteration, stopping, DataLoader, errors, close, concurrent inserts, staleness).
"""

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import funcreplay as fr  # noqa: E402
import funcreplay.torch as frt  # noqa: E402
from tests.interop.common import PRIO, rows, small_table  # noqa: E402

# --- TorchSampler ------------------------------------------------------------------------

def _threads():
  return {t for t in threading.enumerate() if t.name == "funcreplay-torch-prefetch"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_torch_sampler_yields_batches_and_stops(prefetch):
  table = small_table(16, sampler=PRIO)
  table.insert(rows(0, 16))
  seen = []
  with frt.TorchSampler(table, 4, prefetch=prefetch, num_batches=5, beta=lambda i: 0.4 + i / 10,
                        version_fn=lambda: 3) as sampler:
    for b in sampler:
      assert isinstance(b, frt.TorchBatch) and b.valid.all()
      a = b.data["a"].numpy()
      np.testing.assert_array_equal(b.data["obs"][:, 1].numpy(), a + 0.5)
      assert len(set(a.tolist())) == 4  # without replacement
      frt.update_priorities(table, b.info, torch.rand(4) + 0.1)
      seen.append(b)
  assert len(seen) == 5
  assert not _threads()
  assert table.stats().to_dict()["samples"] == 5 * 4  # the limit stops prefetching too
  table.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_torch_sampler_samples_no_batch_it_does_not_hand_out(prefetch):
  """``num_batches`` not a multiple of ``batches_per_call``: the last call samples only
  the batches still due. It sampled a whole call and dropped the rest, whose rows counted
  as sampled (here: used up and freed; found by a review)."""
  table = small_table(32, max_times_sampled=1)
  table.insert(rows(0, 32))
  with frt.TorchSampler(table, 4, prefetch=prefetch, batches_per_call=2,
                        num_batches=3) as sampler:
    batches = list(sampler)
  assert len(batches) == 3
  assert table.stats().to_dict()["samples"] == 12 and len(table) == 32 - 12
  table.close()


@pytest.mark.timeout(60)
def test_torch_sampler_batches_per_call_splits_one_sample():
  table = small_table(16, sampler=PRIO)
  table.insert(rows(0, 16), priority=np.linspace(0.5, 2.0, 16))
  with frt.TorchSampler(table, 4, prefetch=1, batches_per_call=2, num_batches=4,
                        beta=0.5) as sampler:
    batches = list(sampler)
  assert len(batches) == 4
  assert table.stats().to_dict()["samples"] == 16  # two calls of 8 rows
  for first, second in (batches[:2], batches[2:]):
    slots = torch.cat([first.info.slot, second.info.slot]).tolist()
    assert len(set(slots)) == 8  # one call: jointly without replacement
  for b in batches:
    assert len(b) == 4 and float(b.weights.max()) == pytest.approx(1.0)
    p = b.info.probability.double()
    ref = (p * b.num_eligible) ** -0.5
    np.testing.assert_allclose(b.weights.numpy(), (ref / ref.max()).numpy(), rtol=1e-5)
  table.close()


@pytest.mark.timeout(60)
def test_torch_sampler_with_a_concurrent_inserter_never_sees_torn_or_aliased_rows():
  table = small_table(16)
  table.insert(rows(0, 16))
  stop = threading.Event()
  errors = []

  def produce():
    k = 1
    try:
      while not stop.is_set():
        table.insert(rows(16 * k, 16))  # overwrites every slot (state donated each time)
        k += 1
    except fr.TableClosedError:
      pass
    except BaseException as e:  # noqa: BLE001
      errors.append(e)

  th = threading.Thread(target=produce)
  th.start()
  kept = []
  try:
    with frt.TorchSampler(table, 4, prefetch=2, num_batches=40) as sampler:
      for b in sampler:
        a = b.data["a"]
        assert torch.equal(b.data["obs"][:, 0], a.float()), "torn row"
        assert torch.equal(b.data["done"], a % 3 == 0)
        kept.append((b, {k: v.clone() for k, v in b.data.items()}))
  finally:
    stop.set()
    th.join()
  assert not errors
  for b, snap in kept:  # later inserts never wrote into an exported batch
    for k, v in snap.items():
      assert torch.equal(b.data[k], v)
  table.close()


@pytest.mark.timeout(60)
def test_torch_sampler_with_dataloader():
  table = small_table(16)
  table.insert(rows(0, 16))
  sampler = frt.TorchSampler(table, 4, num_batches=3)
  loader = torch.utils.data.DataLoader(sampler, batch_size=None, num_workers=0)
  batches = list(loader)
  assert len(batches) == 3 and all(isinstance(b, frt.TorchBatch) for b in batches)
  assert all(tuple(b.data["obs"].shape) == (4, 3) for b in batches)
  sampler.close()
  assert not _threads()
  table.close()


@pytest.mark.timeout(60)
def test_torch_sampler_reraises_errors_and_closes_cleanly():
  table = small_table(16)
  sampler = frt.TorchSampler(table, 4, prefetch=1, timeout=0.3)
  t0 = time.monotonic()
  # The caller's timeout, not the last 0.1 s slice the prefetch thread waited (found by
  # a review).
  with pytest.raises(TimeoutError, match=r"timed out after 0\.3 s: .*eligible"):
    next(iter(sampler))  # empty table
  assert time.monotonic() - t0 < 10
  # A closed table surfaces in the consumer, raised from the prefetch thread.
  table.insert(rows(0, 16))
  it = iter(frt.TorchSampler(table, 4, prefetch=2))
  next(it)
  table.close()
  with pytest.raises(fr.TableClosedError):
    for _ in range(10):
      next(it)
  deadline = time.monotonic() + 5
  while _threads() and time.monotonic() < deadline:
    time.sleep(0.01)
  assert not _threads()


@pytest.mark.timeout(60)
def test_torch_sampler_close_stops_a_blocked_prefetch_thread():
  table = small_table(16)
  sampler = frt.TorchSampler(table, 4, prefetch=1)  # waits forever on the empty table
  it = iter(sampler)
  time.sleep(0.2)
  assert _threads()
  sampler.close()
  assert not _threads()
  with pytest.raises(StopIteration):
    next(it)
  table.close()


@pytest.mark.timeout(60)
def test_an_abandoned_iterator_stops_its_prefetch_thread():
  """``zip(range(n), sampler)`` drops each pass's iterator without close(): its thread
  stops (each stayed blocked on its full queue, holding the batches, before)."""
  table = small_table(64)
  table.insert(rows(0, 64))
  sampler = frt.TorchSampler(table, 4, prefetch=2)
  for _ in range(3):
    for _, batch in zip(range(2), sampler):
      assert batch.valid.all()
  deadline = time.monotonic() + 10
  while _threads() and time.monotonic() < deadline:
    time.sleep(0.02)
  assert not _threads()
  sampler.close()
  table.close()


@pytest.mark.timeout(60)
def test_torch_sampler_staleness_by_version_fn():
  table = small_table(16, max_staleness=2)
  table.insert(rows(0, 8), version=5)
  version = {"v": 7}
  sampler = frt.TorchSampler(table, 4, prefetch=0, timeout=0.2, version_fn=lambda: version["v"])
  b = next(sampler)
  assert torch.all(b.info.version == 5)
  version["v"] = 8   # 8 - 5 > 2: every item is stale now
  with pytest.raises(TimeoutError, match="eligible"):
    next(frt.TorchSampler(table, 4, prefetch=0, timeout=0.2, version_fn=lambda: version["v"]))
  sampler.close()
  table.close()


def test_torch_sampler_bad_arguments():
  table = small_table(16)
  with pytest.raises(ValueError, match="batch_size"):
    frt.TorchSampler(table, 0)
  with pytest.raises(ValueError, match="prefetch"):
    frt.TorchSampler(table, 2, prefetch=-1)
  with pytest.raises(ValueError, match="beta"):
    frt.TorchSampler(table, 2, beta=-1.0)
  with pytest.raises(ValueError, match="batches_per_call"):
    frt.TorchSampler(table, 2, batches_per_call=0)
  with pytest.raises(TypeError, match="Table"):
    frt.TorchSampler(object(), 2)
  table.close()




def test_torch_sampler_over_payload_and_ragged_tables_takes_table_sample():
  """A table keeping payloads or ragged values refuses ``sample_packed``; the sampler
  chose the packed path by the signature alone and failed on the first batch (found by a
  review). It now samples with ``Table.sample``: payloads as a tuple, ragged leaves as
  ``fr.RaggedBatch``."""
  import jax
  import jax.numpy as jnp
  t = fr.Table(fr.TableSpec(8, {"obs": jax.ShapeDtypeStruct((3,), jnp.float32)}),
               payloads=True)
  t.insert({"obs": np.ones((4, 3), np.float32)}, payload=["a", "b", "c", "d"])
  b = next(iter(frt.TorchSampler(t, 2, prefetch=0)))
  assert tuple(b.data["obs"].shape) == (2, 3) and b.valid.all()
  r = fr.Table(fr.TableSpec(8, {"tok": fr.Ragged(8, jnp.int32),
                                "w": jax.ShapeDtypeStruct((), jnp.float32)}))
  r.insert({"tok": [np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int32)],
            "w": np.ones((2,), np.float32)})
  b = next(iter(frt.TorchSampler(r, 2, prefetch=0)))
  assert isinstance(b.data["tok"], fr.RaggedBatch)
  assert sorted(b.data["tok"].lengths.tolist()) == [3, 5] and tuple(b.data["w"].shape) == (2,)


def test_ragged_leaves_in_torch_give_masks_and_rows_as_tensors():
  """A ragged leaf crosses to torch as ``frt.TorchRaggedBatch``: its ``mask`` and
  ``rows()`` are tensors (the numpy ``RaggedBatch`` methods gave numpy arrays for torch
  values, and would fail for values on a GPU), padded and packed alike."""
  import jax
  import jax.numpy as jnp
  r = fr.Table(fr.TableSpec(8, {"tok": fr.Ragged(8, jnp.int32),
                                "w": jax.ShapeDtypeStruct((), jnp.float32)}))
  r.insert({"tok": [np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int32)],
            "w": np.ones((2,), np.float32)})
  b = next(iter(frt.TorchSampler(r, 2, prefetch=0)))
  tok = b.data["tok"]
  assert isinstance(tok, frt.TorchRaggedBatch) and isinstance(tok, fr.RaggedBatch)
  assert isinstance(tok.mask, torch.Tensor) and tok.mask.dtype == torch.bool
  assert tok.mask.sum(1).tolist() == tok.lengths.tolist()
  rows = tok.rows()
  assert all(isinstance(x, torch.Tensor) for x in rows)
  assert sorted(x.tolist() for x in rows) == [[0, 1, 2], [0, 1, 2, 3, 4]]
  assert isinstance(b.to("cpu").data["tok"], frt.TorchRaggedBatch)
  packed = frt.to_torch(r.sample(2, ragged="packed").data["tok"], on_copy="ignore")
  assert isinstance(packed, frt.TorchRaggedBatch) and packed.packed
  assert sorted(x.tolist() for x in packed.rows()) == [[0, 1, 2], [0, 1, 2, 3, 4]]
  with pytest.raises(ValueError, match="packed"):
    packed.mask  # noqa: B018
  r.close()
