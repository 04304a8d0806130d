"""Config for ``experiments/dqn_trajectory.py``: n-step double DQN from a trajectory table.

Variants: ``configs/dqn_trajectory.py`` (the default, a 2-core CPU run that
stops once the mean return of the last 20 episodes reaches 475, at most 150k
env steps) and ``:tiny`` (seconds, for CI smoke tests). The learner settings
are those of ``configs/dqn_anakin.py`` (128x128 MLP, Adam 2.3e-3 decayed to
1e-4, hard target copies every 128 updates, epsilon 1 -> 0.01 over 8k env
steps, 3-step targets); the replay is the trajectory table, uniform over
windows by default (``prioritized=True``: windows by |TD|, an O(N) sample).
"""

import ml_collections


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_envs = 8
  c.total_env_steps = 150_000
  c.chunk_iters = 500
  c.updates_per_iter = 2
  c.batch_size = 64
  c.hidden = (128, 128)
  c.learning_rate = 2.3e-3
  c.lr_end = 1e-4
  c.lr_decay_steps = 37_500
  c.max_grad_norm = 10.0
  c.gamma = 0.99
  c.n_step = 3                       # windows of n_step + 1 steps
  c.target_update_period = 128
  c.eps_start = 1.0
  c.eps_end = 0.01
  c.eps_decay_steps = 8_000
  c.learning_starts = 1_000
  c.return_window = 20
  c.target_return = 475.0
  c.stop_at_return = True
  c.time_capacity = 12_500           # steps per env: 8 envs -> 100k steps, as dqn_anakin's table
  c.prioritized = False
  c.priority_exponent = 0.6
  if variant == "tiny":
    c.num_envs = 4
    c.total_env_steps = 2_000
    c.chunk_iters = 100
    c.updates_per_iter = 1
    c.batch_size = 32
    c.hidden = (32, 32)
    c.learning_starts = 200
    c.eps_decay_steps = 1_000
    c.target_update_period = 100
    c.time_capacity = 512
  elif variant:
    raise ValueError(f"configs/dqn_trajectory.py: unknown variant {variant!r}; use '' or 'tiny'.")
  return c
