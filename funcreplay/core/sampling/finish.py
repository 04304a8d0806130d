"""``finish``: the bookkeeping after a draw (rows, reuse counts, frees, counters)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from funcreplay.core import counters as ctr
from funcreplay.core import indexes, inplace, item_info, ops, staleness, storage
from funcreplay.core import rate_limiters as rl
from funcreplay.core.sampling import used_up
from funcreplay.core.state import Sample, SampleInfo


def finish(spec, state, picked, prob, num_eligible, ver, replace):
  """Gather the rows of ``picked`` (-1: invalid), count the sample, free items
  that reached ``max_times_sampled``. ``replace``: ``picked`` may repeat a slot."""
  valid = picked >= 0
  safe = jnp.maximum(picked, 0)
  cap = spec.capacity

  def rows(x):
    v = valid.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(v, ops.take(x, safe), jnp.zeros((), x.dtype))

  data = storage.unpack(spec.signature, spec.packed_rows,
                        jax.tree_util.tree_map(rows, state.data), 1)
  idx = jnp.where(valid, safe, cap)
  if idx.shape[0] == 1:  # keep it a scatter, not a slice update (see ops.take)
    idx = jnp.concatenate([idx, jnp.full((1,), cap, idx.dtype)])
  state = state.replace(item_info=item_info.add_field(state.item_info, idx, "times_sampled", 1,
                                                      mode="drop"))
  # One read of the rows' info words, after the increment; once off the CPU: XLA:GPU
  # re-fused a one-row gather into each of its consumers (the batch's info, the freeing,
  # the counters), some not ordered before a later write of item_info (a batch of one's
  # update_priorities: two copies of it; experiments/accel_pytest.py). On the CPU the
  # same program.
  got = item_info.unpack(inplace.once_off_cpu(ops.take(state.item_info, safe)))
  n_valid = jnp.sum(valid, dtype=jnp.int32)
  c = dict(state.counters)
  c["samples"] = ctr.add(c["samples"], n_valid)
  if ver is not None:
    c["sampled_staleness_sum"] = ctr.add_sum(c["sampled_staleness_sum"],
                                             staleness.behind(ver, got["version"]), valid)
  state = state.replace(counters=c, limiter_diff=rl.update_diff(
      spec.rate_limiter, state.limiter_diff, sampled=n_valid))
  info = SampleInfo(
      slot=jnp.where(valid, safe, -1),
      key=jnp.where(valid, got["key"], jnp.uint32(0)),
      probability=jnp.where(valid, prob, 0.0),
      priority=jnp.where(valid, got["priority"], 0.0),
      times_sampled=jnp.where(valid, got["times_sampled"], 0),
      version=jnp.where(valid, got["version"], 0))
  if spec.max_times_sampled > 0:
    exhausted = used_up.used_up(spec, safe, valid, got["times_sampled"], replace)
    # The rows read above (after the increment, as remove would read them): the caller
    # orders that read before later writes (``inplace.settle`` of the sample).
    state = ops.remove(spec, state, safe, exhausted, "evicted_reuse", rows=got)
    # Sampled items had a positive weight: the zero-weight count does not move
    # (and leaves the draw zeroed would read as zero). The refresh reads the new
    # ``occupied`` (a -1 added to the count tree without that read, as the lean uniform
    # sample does on the ring, made XLA copy ``occupied`` twice a step of a stack's scan).
    state = indexes.refresh(spec, state, safe, exhausted, count_zero=False)
  return state, Sample(data=data, valid=valid, info=info, num_eligible=num_eligible)
