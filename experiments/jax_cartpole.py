"""CartPole-v1 as pure JAX functions (``reset`` / ``step``), vmappable and scannable.

Same dynamics, constants, termination test, reward and 500-step time limit as
gymnasium's ``CartPole-v1`` (``CartPoleEnv`` + ``TimeLimit``, Euler
integrator, reward +1 on every step including the terminating one, initial
state uniform in ``(-0.05, 0.05)``). The only numerical difference is that the
state is float32 here (gymnasium integrates in float64 and returns float32
observations); ``tests/experiments/test_experiments.py`` checks a few steps against
gymnasium.

Why an in-repo env rather than gymnax (the ecosystem's JAX env suite): gymnax
pins older jax/flax releases than this project uses, and pulling it (plus its
dependency tree) in for a single 60-line environment would be a heavy,
version-fragile dependency of the main demo.

``step`` auto-resets: when an episode ends (terminated or truncated) the
returned ``obs`` is the first observation of the next episode, and
``final_obs`` is the observation the episode ended on (what a replay
transition needs as ``next_obs``). Episode return and length are tracked in
the state so a vectorised runner can report them without host callbacks.

Example::

  keys = jax.random.split(key, num_envs)
  state, obs = jax.vmap(reset)(keys)
  out = jax.vmap(step)(state, actions, jax.random.split(key2, num_envs))
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

GRAVITY = 9.8
MASSCART = 1.0
MASSPOLE = 0.1
TOTAL_MASS = MASSPOLE + MASSCART
LENGTH = 0.5  # half the pole's length
POLEMASS_LENGTH = MASSPOLE * LENGTH
FORCE_MAG = 10.0
TAU = 0.02  # seconds between state updates
THETA_THRESHOLD = 12 * 2 * math.pi / 360
X_THRESHOLD = 2.4
MAX_STEPS = 500  # CartPole-v1 TimeLimit
OBS_DIM = 4
NUM_ACTIONS = 2


class EnvState(NamedTuple):
  """One environment's state (add a leading axis for a vector of envs).

  Attributes:
    physics: float32[4] ``(x, x_dot, theta, theta_dot)``.
    t: int32[] steps taken in the current episode.
    episode_return: float32[] return accumulated in the current episode.
  """

  physics: jax.Array
  t: jax.Array
  episode_return: jax.Array


class StepOut(NamedTuple):
  """What ``step`` returns.

  Attributes:
    state: the next ``EnvState`` (already reset if the episode ended).
    obs: float32[4] observation to act on next (first obs of a new episode
      if ``done``).
    reward: float32[].
    terminated: bool[] the pole fell or the cart left the track.
    truncated: bool[] the 500-step limit was reached (and not terminated).
    final_obs: float32[4] the observation this step produced, before any
      reset (the transition's ``next_obs``).
    done: bool[] ``terminated | truncated``.
    episode_return: float32[] the finished episode's return where ``done``
      (0 elsewhere).
    episode_length: int32[] the finished episode's length where ``done``.
  """

  state: EnvState
  obs: jax.Array
  reward: jax.Array
  terminated: jax.Array
  truncated: jax.Array
  final_obs: jax.Array
  done: jax.Array
  episode_return: jax.Array
  episode_length: jax.Array


def from_physics(physics) -> EnvState:
  """An ``EnvState`` at episode step 0 with the given float[4] physics state."""
  return EnvState(jnp.asarray(physics, jnp.float32), jnp.int32(0), jnp.float32(0.0))


def reset(key) -> tuple:
  """A new episode: ``(EnvState, obs float32[4])``, state uniform in (-0.05, 0.05)."""
  physics = jax.random.uniform(key, (OBS_DIM,), jnp.float32, -0.05, 0.05)
  state = from_physics(physics)
  return state, physics


def dynamics(physics, action):
  """One Euler step of the cart-pole ODE: float32[4], int[] action (1 pushes right)."""
  x, x_dot, theta, theta_dot = physics[0], physics[1], physics[2], physics[3]
  force = jnp.where(action == 1, FORCE_MAG, -FORCE_MAG)
  costheta, sintheta = jnp.cos(theta), jnp.sin(theta)
  temp = (force + POLEMASS_LENGTH * theta_dot**2 * sintheta) / TOTAL_MASS
  thetaacc = (GRAVITY * sintheta - costheta * temp) / (
      LENGTH * (4.0 / 3.0 - MASSPOLE * costheta**2 / TOTAL_MASS))
  xacc = temp - POLEMASS_LENGTH * thetaacc * costheta / TOTAL_MASS
  return jnp.stack([x + TAU * x_dot, x_dot + TAU * xacc,
                    theta + TAU * theta_dot, theta_dot + TAU * thetaacc]).astype(jnp.float32)


def step(state: EnvState, action, key) -> StepOut:
  """Advance one step with ``action`` (int {0, 1}); ``key`` seeds the auto-reset."""
  physics = dynamics(state.physics, action)
  x, theta = physics[0], physics[2]
  terminated = (x < -X_THRESHOLD) | (x > X_THRESHOLD) | (theta < -THETA_THRESHOLD) \
      | (theta > THETA_THRESHOLD)
  t = state.t + 1
  truncated = (t >= MAX_STEPS) & ~terminated
  done = terminated | truncated
  reward = jnp.float32(1.0)
  ep_return = state.episode_return + reward
  reset_state, reset_obs = reset(key)
  next_state = jax.tree_util.tree_map(
      lambda r, c: jnp.where(done, r, c), reset_state, EnvState(physics, t, ep_return))
  return StepOut(
      state=next_state, obs=jnp.where(done, reset_obs, physics), reward=reward,
      terminated=terminated, truncated=truncated, final_obs=physics, done=done,
      episode_return=jnp.where(done, ep_return, 0.0), episode_length=jnp.where(done, t, 0))
