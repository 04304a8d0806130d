"""n-step returns from sampled windows, inside ``jit`` (pure, static ``n``).

A window holds steps ``0 .. L-1`` of one trajectory (it crosses no episode
start unless ``cross_episodes=True``). With ``rewards[t]`` the reward after
the action of step ``t`` and ``discounts[t] = gamma * (1 - terminal[t])``
(0 after a terminal transition), the n-step target from step ``t`` is
``G_t = sum_{i<n} (prod_{j<i} discounts[t+j]) rewards[t+i]
+ (prod_{j<n} discounts[t+j]) * Q(obs[t+n])``: this module returns the
discounted sum, the bootstrap discount ``prod_{j<n} discounts[t+j]`` and
the bootstrap index ``t + n``.
"""

from __future__ import annotations

import jax.numpy as jnp


def n_step_returns(rewards, discounts, n: int):
  """n-step returns at every window position that has ``n`` steps after it.

  Args:
    rewards: float[B, L] (or [L]) rewards of the window's steps.
    discounts: float[B, L] per-step discounts (``gamma * (1 - terminal)``).
    n: static horizon, ``1 <= n < L``.

  Returns:
    ``(returns [B, L - n], bootstrap_discount [B, L - n], bootstrap_index
    int32[L - n])``: for position ``t``, the discounted sum of rewards ``t ..
    t+n-1``, the product of discounts ``t .. t+n-1`` (0 once a terminal step
    lies in them) and ``t + n``, the window position whose value bootstraps.
    O(B L n), no loop in the compiled program (``n`` is unrolled).
  """
  rewards = jnp.asarray(rewards)
  discounts = jnp.asarray(discounts, rewards.dtype)
  ln = rewards.shape[-1]
  if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < ln:
    raise ValueError(f"n_step_returns: n must be a static int in [1, L={ln}), got {n!r}.")
  if discounts.shape != rewards.shape:
    raise ValueError(f"n_step_returns: discounts shape {list(discounts.shape)} must equal "
                     f"rewards shape {list(rewards.shape)}.")
  m = ln - n
  ret = jnp.zeros(rewards.shape[:-1] + (m,), rewards.dtype)
  disc = jnp.ones_like(ret)
  for i in range(n):
    ret = ret + disc * rewards[..., i:i + m]
    disc = disc * discounts[..., i:i + m]
  return ret, disc, jnp.arange(n, n + m, dtype=jnp.int32)


def n_step_target(rewards, discounts, bootstrap_values, n: int):
  """float[B, L - n]: ``returns + bootstrap_discount * bootstrap_values[:, t + n]``.

  ``bootstrap_values``: float[B, L] (e.g. ``max_a Q_target(obs[t])`` for every
  window position); only positions ``n ..`` are read.
  """
  ret, disc, idx = n_step_returns(rewards, discounts, n)
  return ret + disc * jnp.asarray(bootstrap_values)[..., idx[0]:]
