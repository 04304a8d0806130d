"""``sample``: windows of ``L`` steps, uniform or prioritized over the eligible windows.

Three programs, chosen statically:

* **Lean uniform, closed form** (``Uniform``, ``cross_episodes=True``, no
  ``where`` / staleness / reuse mask): the stored windows of env ``e`` lie
  at distances ``d0_e, d0_e + p, ...`` behind its head (``state.per_env_counts``),
  so position ``x`` of ``[0, N_valid)`` maps to (env, distance) through the
  ``[E]`` prefix sum of the per-env counts: O(B E), no index at all.
* **Lean uniform, index** (``Uniform``, episodes tracked, no mask): the
  ``x``-th set bit of the window bitmask (``index.kth``: a descent of the
  count tree over its words, then a popcount select), O(B log(N / 32)).
* **Lean prioritized** (``Prioritized``, no mask): ``prioritized.draw``, M
  descents of the weight tree ``add`` and ``update_priorities`` keep,
  O(M log N) (an O(N) exact completion only when the draws repeat too much).
* **General** (any mask): the eligibility mask
  over the ``N`` windows, then an exact draw: uniform by the ``x``-th
  eligible window of a count tree built over it, prioritized without
  replacement by exponential races ``-log2(u) / w`` (the smallest B: exactly successive
  sampling proportional to ``w = priority**alpha``; ``powers.race_keys``, the same keys on
  every backend), with replacement by i.i.d.
  descents of a weight tree built over it. O(N) per call.

The positions ``x`` are ``uniform_lean.positions``: without replacement the
first B entries of a uniformly random permutation (``bits.without_replacement``).
Every program ends in ``finish``: one gather of ``B * L`` rows per leaf,
``times_sampled`` and the ``samples`` counter. With an ``executor`` (the native one,
``funcreplay.native.trajectory``) the gather and the two lean uniform draws run as
CPU kernels that follow this recipe bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay.core import bits, fixedpoint, inplace, numerics, powers, staleness, trees
from funcreplay.core import counters as ctr
from funcreplay.core.inplace import materialize
from funcreplay.core.sampling import exact
from funcreplay.core.sampling.uniform_lean import kth_occupied, positions
from funcreplay.core.state import Sample, SampleInfo
from funcreplay.core.trajectory import index, prioritized, rows
from funcreplay.core.trajectory import state as st
from funcreplay.core.trajectory.spec import TrajectorySpec
from funcreplay.core.trajectory.state import TrajectoryState


def masked(spec: TrajectorySpec, *, version=None, where=None) -> bool:
  """True when a mask beyond stored/complete applies (static): the general program."""
  return (where is not None or spec.max_times_sampled > 0
          or (version is not None and spec.max_staleness is not None))


def eligible(spec: TrajectorySpec, state: TrajectoryState, *, version=None, where=None):
  """bool[N]: windows a ``sample`` with these arguments may return."""
  w = st.all_windows(spec)
  ok = st.valid_windows(spec, state, w)
  if version is not None and spec.max_staleness is not None:
    ok = ok & (state.version >= staleness.threshold(spec, version))
  if spec.max_times_sampled:
    ok = ok & (state.times_sampled < spec.max_times_sampled)
  if where is not None:
    where = jnp.asarray(where)
    if where.shape != (spec.num_windows,) or where.dtype != jnp.bool_:
      raise ValueError(f"sample: where must be bool[num_windows={spec.num_windows}] (window "
                       f"w = env * {spec.windows_per_env} + start // period), got "
                       f"{where.dtype}{list(where.shape)}.")
    ok = ok & where
  return ok


def weights(spec: TrajectorySpec, state: TrajectoryState, ok):
  """float32[N]: ``priority**alpha`` where ``ok`` and the priority is positive, else 0."""
  return jnp.where(ok, prioritized.window_weight(spec, state.priority), 0.0)


def _padded(x, size: int):
  return jnp.concatenate([x, jnp.zeros((size - x.shape[0],), x.dtype)])


def _closed_form(spec, state, rng, b, replace):
  d0, cnt = st.per_env_counts(spec, state)
  cs = jnp.cumsum(cnt)
  n = cs[-1]
  x, valid = positions(rng, n, b, replace, spec.num_windows)
  x = jnp.where(valid, x, 0)
  env = jnp.minimum(jnp.sum(cs[None, :] <= x[:, None], axis=1, dtype=jnp.int32),
                    spec.num_envs - 1)
  d = d0[env] + (x - (cs[env] - cnt[env])) * spec.period
  start = (state.head[env] - d) % spec.time_capacity
  w = env * spec.windows_per_env + start // spec.period
  return w, valid, n


def _kernels(spec, executor, rng=None) -> bool:
  """True when ``executor``'s CPU kernels apply (static): it supports ``spec``, its
  library is loaded (asked while tracing: it only reports) and, for a draw, ``rng`` is a
  threefry key (the kernels reproduce threefry bits only)."""
  return (executor is not None and executor.supports(spec)
          and (rng is None or exact.is_threefry(rng)) and executor.available())


def _index_draw(spec, state, rng, b, replace):
  n = index.count(state.ok_tree)
  x, valid = positions(rng, n, b, replace, spec.num_windows)
  w = jnp.minimum(index.kth(state.ok_bits, state.ok_tree, jnp.where(valid, x, 0)),
                  spec.num_windows - 1)
  return w, valid, n


def _uniform_masked(spec, state, rng, b, replace, ok):
  tree = trees.build_sum(_padded(ok.astype(jnp.int32), spec.tree_size))
  n = tree[1]
  x, valid = positions(rng, n, b, replace, spec.num_windows)
  return kth_occupied(tree, jnp.where(valid, x, 0)), valid, n


def _prioritized(spec, state, rng, b, replace, ok):
  w = weights(spec, state, ok)
  n = jnp.sum(w > 0, dtype=jnp.int32)
  if replace:
    tree = trees.build_sum(_padded(w, spec.tree_size))
    total = tree[1]
    # I.i.d. descents with the targets materialized (``exact.successive``): ``u * total``
    # fused into the descent's first subtraction may become one fused multiply-add on a
    # GPU, and the same key would descend elsewhere there.
    picked = exact.successive(tree, rng, b, True, spec.tree_size)
    slot = jnp.clip(picked, 0, spec.num_windows - 1)
    valid = picked >= 0
  else:
    total = jnp.sum(w)
    # Exponential races, the k smallest (the law of Gumbel-top-k over log w; the same
    # keys on every backend, powers.race_keys): weight 0 races at inf, never taken.
    race = powers.race_keys(jax.random.bits(rng, w.shape, jnp.uint32), w)
    k = min(b, spec.num_windows)
    vals, top = lax.top_k(-race, k)
    pad = b - k
    slot = jnp.concatenate([top, jnp.zeros((pad,), jnp.int32)])
    valid = jnp.concatenate([jnp.isfinite(vals), jnp.zeros((pad,), bool)])
  prob = fixedpoint.divide(w[slot], jnp.maximum(total, numerics.MIN_TOTAL))
  return slot, valid, n, prob


def sample(spec: TrajectorySpec, state: TrajectoryState, rng, *, batch_size: int, version=None,
           where=None, replace: bool = False, executor=None):
  """``(state, Sample)``: ``batch_size`` windows (distinct unless ``replace``).

  Args:
    rng: a PRNG key.
    batch_size: static ``B``; rows beyond the eligible windows are invalid.
    version: int32[] current policy version (staleness mask with ``max_staleness``).
    where: bool[N] window mask (window ``w = env * W + start // period``), or None.
    replace: draw with replacement.
    executor: None, or a ``functional.TrajectoryExecutor``: on CPU its kernels copy the
      windows and run the lean uniform draws (closed form, episode index; threefry
      keys), bit for bit this program's (same batch, same state).

  Returns ``Sample`` with ``data`` leaves ``[B, L, ...]`` (zero where not
  ``valid``), ``valid`` bool[B], ``info`` (``SampleInfo``: ``slot`` = window id,
  ``key``, exact single-draw ``probability``, ``priority`` (0 under
  ``Uniform``), ``times_sampled`` including this sample, ``version`` of the
  window's first step) and ``num_eligible``.
  """
  bits.check_key(rng, "sample")
  b = batch_size
  if isinstance(b, bool) or not isinstance(b, int) or b < 1:
    raise ValueError(f"sample: batch_size must be a static int >= 1, got {b!r}.")
  prob = None
  if spec.prioritized and not masked(spec, version=version, where=where):
    w, valid, n, prob = prioritized.draw(spec, state, rng, b, replace)
  elif spec.prioritized:
    ok = eligible(spec, state, version=version, where=where)
    w, valid, n, prob = _prioritized(spec, state, rng, b, replace, ok)
  elif masked(spec, version=version, where=where):
    ok = eligible(spec, state, version=version, where=where)
    w, valid, n = _uniform_masked(spec, state, rng, b, replace, ok)
  elif spec.tracks_episodes and _kernels(spec, executor, rng):
    w, valid, n = lax.platform_dependent(
        state, default=lambda s: _index_draw(spec, s, rng, b, replace),
        cpu=lambda s: executor.draw_index(spec, s.ok_bits, s.ok_tree, rng, b, replace))
  elif spec.tracks_episodes:
    w, valid, n = _index_draw(spec, state, rng, b, replace)
  elif _kernels(spec, executor, rng):
    w, valid, n = lax.platform_dependent(
        state, default=lambda s: _closed_form(spec, s, rng, b, replace),
        cpu=lambda s: executor.draw_closed_form(spec, s.head, s.filled, rng, b, replace))
  else:
    w, valid, n = _closed_form(spec, state, rng, b, replace)
  if prob is None:
    prob = jnp.broadcast_to(fixedpoint.divide(1.0, jnp.maximum(n, 1).astype(jnp.float32)), (b,))
  # Materialized: XLA:CPU would otherwise fuse the whole draw (random words, prefix sums,
  # descents) into the data gather and recompute it for every gathered element
  # (``inplace.materialize``; 1.3x the step time of the closed form here).
  state, out = finish(spec, state, materialize(jnp.where(valid, w, 0)), valid, prob, n,
                      executor)
  if spec.prioritized:
    # ``info.slot`` computed from every read of ``priority`` and the weight tree (through
    # the probabilities): a following ``update_priorities(info.slot, ...)`` in the same
    # program is then ordered after them and writes in place (XLA would copy both).
    flag = jnp.sum(lax.bitcast_convert_type(out.info.priority + out.info.probability,
                                            jnp.uint32), dtype=jnp.uint32)
    info = dataclasses.replace(out.info, slot=inplace.after(out.info.slot, flag))
    out = dataclasses.replace(out, info=info)
  return state, out


def gather_storage(spec: TrajectorySpec, data, w, valid):
  """The storage leaves' (``state.data``) ``[B, L, ...]`` rows of windows ``w`` (int32[B],
  in range), zero where not ``valid``: one gather of ``B * L`` rows per storage leaf."""
  env = w // spec.windows_per_env
  start = (w % spec.windows_per_env) * spec.period
  cap, ln = spec.time_capacity, spec.sequence_length
  flat = env[:, None] * cap + (start[:, None] + jnp.arange(ln, dtype=jnp.int32)[None, :]) % cap
  flat = materialize(flat.reshape(-1)).reshape(flat.shape)  # computed once, not per element

  def take(x):
    got = x.reshape((-1,) + x.shape[2:])[flat]
    v = valid.reshape((-1,) + (1,) * (got.ndim - 1))
    return jnp.where(v, got, jnp.zeros((), x.dtype))
  return jax.tree_util.tree_map(take, data)


def gather_windows(spec: TrajectorySpec, state: TrajectoryState, w, valid, executor=None):
  """Every data leaf's ``[B, L, ...]`` steps of windows ``w`` (int32[B], in range), zero
  where not ``valid``. ``executor`` (``functional.TrajectoryExecutor`` or None): on CPU its
  ``gather_windows`` copies the same rows (``lax.platform_dependent``; elsewhere the
  portable gather)."""
  if _kernels(spec, executor):
    got = lax.platform_dependent(
        state.data, w, valid, default=lambda d, w, v: gather_storage(spec, d, w, v),
        cpu=lambda d, w, v: executor.gather_windows(spec, d, w, v))
  else:
    got = gather_storage(spec, state.data, w, valid)
  return rows.unpack(spec, got, 2)


def finish(spec: TrajectorySpec, state: TrajectoryState, w, valid, prob, n, executor=None):
  """Gather, count and describe the windows ``w`` (int32[B] in range): ``(state, Sample)``."""
  data = gather_windows(spec, state, w, valid, executor)
  times = state.times_sampled.at[jnp.where(valid, w, spec.num_windows)].add(1, mode="drop")
  n_valid = jnp.sum(valid, dtype=jnp.int32)
  counters = state.counters.at[1].set(ctr.add(state.counters[1], n_valid))
  priority = state.priority[w] if spec.prioritized else jnp.zeros(w.shape, jnp.float32)
  info = SampleInfo(
      slot=jnp.where(valid, w, -1),
      key=jnp.where(valid, st.keys(spec, state, w), jnp.uint32(0)),
      probability=jnp.where(valid, prob, 0.0),
      priority=jnp.where(valid, priority, 0.0),
      times_sampled=jnp.where(valid, times[w], 0),
      version=jnp.where(valid, state.version[w], 0))
  state = state.replace(times_sampled=times, counters=counters)
  return state, Sample(data=data, valid=valid, info=info, num_eligible=n)
