"""Building blocks of the Anakin DQN demo (``experiments/dqn_anakin.py``).

The Q-network, the replay functions the jitted step calls (the funcreplay table, or a
no-op ring buffer for profiling the replay's share of step time) and the n-step
transition built from each env's window of one-step transitions.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

import funcreplay as fr
from experiments import jax_cartpole as env


class QNetwork(nn.Module):
  """MLP: float32[..., 4] observations -> float32[..., A] action values."""

  hidden: Sequence[int]
  num_actions: int

  @nn.compact
  def __call__(self, x):
    for h in self.hidden:
      x = nn.relu(nn.Dense(h)(x))
    return nn.Dense(self.num_actions)(x)


# --- replay: the funcreplay table, or a no-op stand-in for profiling ----------------------

def _item_example():
  return {"obs": jnp.zeros((env.OBS_DIM,), jnp.float32), "action": jnp.zeros((), jnp.int32),
          "reward": jnp.zeros((), jnp.float32), "next_obs": jnp.zeros((env.OBS_DIM,), jnp.float32),
          "discount": jnp.zeros((), jnp.float32)}


class Replay(NamedTuple):
  """Pure replay functions used by the step (state is any pytree).

  ``sample(state, rng, version, beta) -> (state, data, weights float32[B], slots int32[B],
  keys uint32[B])``; ``update(state, slots, keys, td float32[B]) -> state``.
  """

  init: Any
  insert: Any
  sample: Any
  update: Any
  end_chunk: Any
  stats: Any


def make_replay(rc, batch_size: int) -> Replay:
  """Prioritized funcreplay table with staleness and reuse limits (``rc`` = config.replay)."""
  spec = fr.TableSpec(
      rc.capacity, _item_example(), sampler=fr.Prioritized(rc.priority_exponent),
      remover=fr.Fifo(), max_times_sampled=rc.max_times_sampled,
      max_staleness=rc.max_staleness if rc.max_staleness > 0 else None)
  table = fr.make_table(spec)

  def sample(state, rng, version, beta):
    state, smp = table.sample(state, rng, batch_size=batch_size, version=version)
    return state, smp.data, fr.importance_weights(smp, beta), smp.info.slot, smp.info.key

  def update(state, slots, keys, td):
    return table.update_priorities(state, slots, keys, jnp.abs(td) + rc.priority_eps)

  def end_chunk(state, version):
    return table.evict_stale(state, version) if spec.max_staleness is not None else state

  def stats(state, version):
    return {"stats": table.stats(state), "eligible": table.count(state, version=version)}

  def insert(state, items, version, td):
    # Ape-X style: new items get |TD| under the current networks as their priority, not the
    # largest priority ever seen (which only grows and makes every fresh item dominate).
    prio = None if td is None else jnp.abs(td) + rc.priority_eps
    return table.insert(state, items, version=version, priority=prio)

  return Replay(table.init, insert, sample, update, end_chunk, stats)


def make_noop_replay(rc, batch_size: int) -> Replay:
  """Shape-equivalent stand-in: a ring buffer sampled with uniform random indices."""
  cap = rc.capacity

  def init():
    data = jax.tree_util.tree_map(lambda x: jnp.zeros((cap,) + x.shape, x.dtype), _item_example())
    return {"data": data, "pos": jnp.int32(0), "size": jnp.int32(0)}

  def insert(s, items, version, td):
    del version, td
    n = jax.tree_util.tree_leaves(items)[0].shape[0]
    idx = (s["pos"] + jnp.arange(n)) % cap
    data = jax.tree_util.tree_map(lambda buf, x: buf.at[idx].set(x), s["data"], items)
    return {"data": data, "pos": (s["pos"] + n) % cap, "size": jnp.minimum(s["size"] + n, cap)}

  def sample(s, rng, version, beta):
    del version, beta
    idx = jax.random.randint(rng, (batch_size,), 0, jnp.maximum(s["size"], 1))
    data = jax.tree_util.tree_map(lambda buf: buf[idx], s["data"])
    return s, data, jnp.ones((batch_size,), jnp.float32), idx, jnp.zeros((batch_size,), jnp.uint32)

  def stats(s, version):
    del version
    return {"size": s["size"]}

  return Replay(init, insert, sample, lambda s, *a: s, lambda s, v: s, stats)


def n_step_transition(window, gamma: float):
  """The n-step transition starting at the oldest step of each env's window.

  Args:
    window: dict of one-step transitions, leaves ``[E, n, ...]`` oldest first:
      ``obs`` float32[E, n, 4], ``action`` int32[E, n], ``reward`` float32[E, n],
      ``next_obs`` float32[E, n, 4], ``terminated`` / ``done`` bool[E, n].
    gamma: the per-step discount.

  Returns:
    dict of float32/int32 leaves ``[E, ...]``: ``obs``, ``action``, ``reward`` (the
    discounted sum of up to n rewards, cut at the first episode end), ``next_obs`` (the
    observation after the last step used) and ``discount`` (gamma**m for the m steps
    used, 0 if the episode terminated within them; a truncated episode bootstraps).
  """
  n = window["reward"].shape[1]
  done = window["done"].astype(jnp.float32)
  # used[:, k] = 1 while no episode ended before step k of the window.
  used = jnp.concatenate([jnp.ones_like(done[:, :1]), jnp.cumprod(1.0 - done, axis=1)[:, :-1]],
                         axis=1)
  powers = gamma ** jnp.arange(n, dtype=jnp.float32)
  last = jnp.sum(used, axis=1).astype(jnp.int32) - 1   # index of the last step used
  pick = lambda x: jnp.take_along_axis(  # noqa: E731
      x, last.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]
  term = pick(window["terminated"]).astype(jnp.float32)
  return {"obs": window["obs"][:, 0], "action": window["action"][:, 0],
          "reward": jnp.sum(window["reward"] * used * powers, axis=1),
          "next_obs": pick(window["next_obs"]),
          "discount": gamma ** (last + 1).astype(jnp.float32) * (1.0 - term)}
