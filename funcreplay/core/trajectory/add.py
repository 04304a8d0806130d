"""``add``: append ``t`` steps to every (unmasked) environment's time axis. Loop-free.

Program (E envs, t static steps, p period, L length, K = ceil(t / p)):

1. Every storage leaf (``rows``: the step's leaves, or one row of words): one
   scatter of the ``E * t`` rows at flat positions
   ``env * T + (head + i) mod T`` (masked envs drop theirs).
2. Window starts written in the block (at most ``K`` per env, ring positions
   ``= 0 mod p``) begin a new window in their id: ``version``,
   ``times_sampled`` and (``Prioritized``) ``priority`` reset. O(E K).
3. The windows whose last step is in the block (at most ``K`` per env)
   become sampleable unless (episodes tracked) an episode start lies in
   their steps 2..L (found from ``first``'s running last-start index and
   the carried ``since_first``), and the windows restarted in step 2 that do
   not also complete in the block stop being sampleable: ``index.update``
   of ``2 E K`` distinct windows (O(E K log(N / 32))) with episodes tracked,
   ``prioritized.refresh`` of the weight tree (O(E K log N)) under
   ``Prioritized``.
4. ``head``, ``filled``, ``written``, ``since_first`` and the ``steps`` counter.

Everything is elementwise or a gather / scatter of static size: no
``conditional`` or ``while``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from funcreplay.core import counters as ctr
from funcreplay.core import staleness
from funcreplay.core.trajectory import index, prioritized, rows
from funcreplay.core.trajectory.spec import TrajectorySpec
from funcreplay.core.trajectory.state import TrajectoryState


def check_steps(spec: TrajectorySpec, steps) -> int:
  """Validate ``steps`` (leaves ``[E, t, *leaf_shape]``, the signature's dtypes) at trace
  time; returns ``t``. Raises ValueError / TypeError naming the leaf."""
  sig = spec.signature
  try:
    leaves = sig.treedef.flatten_up_to(steps)
  except (ValueError, TypeError) as e:
    raise ValueError(f"add: steps do not match the step signature.\n  expected: {sig.treedef}"
                     f"\n  got:      {jax.tree_util.tree_structure(steps)}\n  ({e})") from None
  ts = []
  for name, want, leaf in zip(sig.names, sig.leaves, leaves):
    shape = tuple(np.shape(leaf))
    if len(shape) != len(want.shape) + 2 or shape[2:] != tuple(want.shape):
      raise ValueError(f"add: step leaf {name}: expected shape [num_envs={spec.num_envs}, t, "
                       f"{', '.join(map(str, want.shape))}], got {list(shape)}.")
    if shape[0] != spec.num_envs:
      raise ValueError(f"add: step leaf {name}: axis 0 must be the env axis of size "
                       f"num_envs={spec.num_envs}, got {shape[0]} (shape {list(shape)}).")
    if np.dtype(leaf.dtype) != np.dtype(want.dtype):
      raise TypeError(f"add: step leaf {name}: expected dtype {np.dtype(want.dtype).name}, "
                      f"got {np.dtype(leaf.dtype).name}.")
    ts.append(shape[1])
  if len(set(ts)) != 1:
    raise ValueError(f"add: step leaves disagree on t (axis 1): "
                     f"{dict(zip(sig.names, ts))}.")
  t = ts[0]
  if not 1 <= t <= spec.time_capacity:
    raise ValueError(f"add: t={t} steps per env (axis 1) must be in [1, time_capacity="
                     f"{spec.time_capacity}].")
  return t


def _vector(x, n: int, dtype, name: str):
  x = jnp.asarray(x)
  if x.shape != (n,) or x.dtype != dtype:
    raise ValueError(f"add: {name} must be {jnp.dtype(dtype).name}[{n}], got "
                     f"{x.dtype}{list(x.shape)}.")
  return x


def _first_flags(spec: TrajectorySpec, first, t: int):
  if first is None:
    return None
  first = jnp.asarray(first)
  if first.shape != (spec.num_envs, t) or first.dtype != jnp.bool_:
    raise ValueError(f"add: first must be bool[num_envs={spec.num_envs}, t={t}] (True on "
                     f"the steps that begin an episode), got {first.dtype}{list(first.shape)}.")
  return first


def add(spec: TrajectorySpec, state: TrajectoryState, steps, *, version=0, mask=None,
        first=None) -> TrajectoryState:
  """Append ``steps`` (leaves ``[E, t, ...]``, ``t`` static) to the envs in ``mask``.

  Args:
    spec, state: the table.
    steps: one block of ``t`` steps per env.
    version: int32[] policy version of the steps (the version of every window
      that starts in the block).
    mask: bool[E] (None: all): envs with False keep their time axis unchanged.
    first: bool[E, t] (``cross_episodes=False`` only; None: no episode starts
      in the block): True on the first step of an episode (the observation
      after a reset). No window contains such a step except as its first.

  Returns the new state. Errors (shapes, dtypes, ``t`` out of ``[1, T]``,
  ``first`` on a ``cross_episodes=True`` spec) are raised at trace time.
  """
  t = check_steps(spec, steps)
  e, cap, p, ln = spec.num_envs, spec.time_capacity, spec.period, spec.sequence_length
  if first is not None and not spec.tracks_episodes:
    raise ValueError("add: first= marks episode starts, but the spec has cross_episodes=True "
                     "(windows ignore episodes); build it with cross_episodes=False.")
  first = _first_flags(spec, first, t)
  mask = jnp.ones((e,), bool) if mask is None else _vector(mask, e, jnp.bool_, "mask")
  version = staleness.as_version(version, "add: version")
  if version.shape:
    raise ValueError(f"add: version must be a scalar int, got shape {list(version.shape)}.")
  head, filled = state.head, state.filled
  env = jnp.arange(e, dtype=jnp.int32)
  steps_i = jnp.arange(t, dtype=jnp.int32)

  # 1. Data: one scatter per leaf.
  pos = (head[:, None] + steps_i[None, :]) % cap                       # [E, t]
  flat = jnp.where(mask[:, None], env[:, None] * cap + pos, e * cap).reshape(-1)

  def write(buf, x):
    flat_buf = buf.reshape((e * cap,) + buf.shape[2:])
    flat_buf = flat_buf.at[flat].set(x.reshape((e * t,) + x.shape[2:]), mode="drop",
                                     unique_indices=True)
    return flat_buf.reshape(buf.shape)
  data = jax.tree_util.tree_map(write, state.data, rows.pack(spec, steps, 2))

  # 2. Window starts in the block: block index b = ((-head) mod p) + k p.
  k = (t + p - 1) // p
  ks = jnp.arange(k, dtype=jnp.int32)
  b_start = ((-head) % p)[:, None] + ks[None, :] * p                    # [E, K]
  ok_start = mask[:, None] & (b_start < t)
  w_start = env[:, None] * spec.windows_per_env + ((head[:, None] + b_start) % cap) // p
  w_start_flat = jnp.where(ok_start, w_start, spec.num_windows).reshape(-1)
  new = dict(
      version=state.version.at[w_start_flat].set(version, mode="drop"),
      times_sampled=state.times_sampled.at[w_start_flat].set(0, mode="drop"))
  if spec.prioritized:
    default = (state.max_priority if spec.default_priority is None
               else jnp.float32(spec.default_priority))
    new["priority"] = state.priority.at[w_start_flat].set(default, mode="drop")

  # 3. Windows whose last step is in the block: the episode index, the weight tree.
  if spec.tracks_episodes or spec.prioritized:
    b_end = ((ln - 1 - head) % p)[:, None] + ks[None, :] * p            # [E, K]
    b_end_c = jnp.minimum(b_end, t - 1)
    # Complete: its first step is stored (``filled + b_end + 1 >= L`` steps up to its
    # last) and not rewritten later in the block (possible only when t > T - L).
    complete = (mask[:, None] & (b_end < t) & (filled[:, None] + b_end_c + 1 >= ln)
                & (b_end_c - (ln - 1) + cap >= t))
    w_end = (env[:, None] * spec.windows_per_env
             + ((head[:, None] + b_end_c - (ln - 1)) % cap) // p)
    # A window restarted in the block leaves the indexes unless it completes in it too.
    leaving = ok_start & (b_start + ln - 1 >= t)
    slots = jnp.concatenate([w_start.reshape(-1), w_end.reshape(-1)])
    valid = jnp.concatenate([leaving.reshape(-1), complete.reshape(-1)])
    ok = jnp.ones((e * k,), bool)
  if spec.tracks_episodes:
    # Block index of the latest episode start at or before each step (-1: none).
    if first is None:
      last = jnp.full((e, t), -1, jnp.int32)
    else:
      last = jax.lax.cummax(jnp.where(first, steps_i[None, :], -1), axis=1)
    last_end = jnp.take_along_axis(last, b_end_c, axis=1)
    # Steps from the latest episode start to the window's last step.
    since = jnp.where(last_end >= 0, b_end_c - last_end, state.since_first[:, None] + b_end_c + 1)
    ok = (since >= ln - 1).reshape(-1)
    values = jnp.concatenate([jnp.zeros((e * k,), bool), ok])
    new["ok_bits"], new["ok_tree"] = index.update(state.ok_bits, state.ok_tree, slots, values,
                                                  valid)
    last_all = last[:, -1]
    since_new = jnp.where(last_all >= 0, t - 1 - last_all,
                          jnp.minimum(state.since_first + t, ln))
    new["since_first"] = jnp.where(mask, jnp.minimum(since_new, ln), state.since_first)
  if spec.prioritized:
    w_end_flat = w_end.reshape(-1)
    weight = jnp.where(ok, prioritized.window_weight(spec, new["priority"][w_end_flat]), 0.0)
    values = jnp.concatenate([jnp.zeros((e * k,), jnp.float32), weight])
    new["weight_tree"], new["positive"] = prioritized.refresh(
        state.weight_tree, state.positive, slots, values, valid)

  # 4. Cursors and counters.
  adv = jnp.where(mask, t, 0)
  counters = state.counters.at[0].set(
      ctr.add(state.counters[0], jnp.sum(adv, dtype=jnp.int32)))
  return state.replace(
      data=data, head=(head + adv) % cap, filled=jnp.minimum(filled + adv, cap),
      written=state.written + adv.astype(jnp.uint32), counters=counters, **new)
