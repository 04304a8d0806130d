"""Config for ``experiments/dqn_anakin.py``: double DQN + prioritized replay on JAX CartPole.

Variants (the part after ``:`` in ``--config``):

* ``configs/dqn_anakin.py``: the default, sized for a 2-core CPU (a few
  minutes; reaches a mean return >= 400 over the last 20 episodes);
* ``configs/dqn_anakin.py:tiny``: a few seconds, for CI smoke tests;
* ``configs/dqn_anakin.py:ci_learn``: the CI learning test (16k env steps);
* ``configs/dqn_anakin.py:full``: the full-size run (16 envs, 128x128 MLP,
  300k env steps, 200k-item table); meant for a bigger machine or an accelerator.

Override any field: ``--config.seed=3 --config.replay.max_times_sampled=0``.

Replay semantics used here (versions = learner update steps; with 8 envs and 2
updates per vector step one version is 4 env steps):

* ``replay.max_staleness`` = 20k versions (80k transitions, less than the
  100k capacity, so the window and not FIFO overwriting decides what is too
  old): older transitions are not sampled, and ``evict_stale`` frees them
  after every chunk (from ~80k env steps on). It bounds the policy lag of the
  data. We measured that a much tighter window hurts DQN here: at 6k-10k
  versions (24k-40k transitions) a good policy stops producing failures, the
  window drops the old ones, Q is overestimated and the return collapses
  (reproduce with ``--config.replay.max_staleness=6000 --config.stop_at_return=0``).
* ``replay.max_times_sampled`` = 256: a transition is freed after 256 samples.
  On average one is sampled ``batch * updates_per_iter / num_envs`` = 32
  times; PER concentrates samples on high-TD items (terminal transitions
  above all), so the cap only removes those few outliers. At 64 it removes
  the terminal transitions the agent needs and learning collapses (measured
  with Adam 1e-3 and hard target copies: best mean return 88 with a cap of 64,
  461 without a cap), so keep it well above 32.
* Target network: Polyak averaging (``target_tau`` = 0.005) was the most
  stable of what we tried (hard copies every 100 or 500 updates diverged or
  plateaued more often with PER).
"""

import ml_collections


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """The default config, or ``"tiny"`` / ``"full"`` (see the module docstring)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_envs = 8
  c.total_env_steps = 150_000       # upper bound, rounded up to whole chunks
  c.chunk_iters = 500               # vector steps per jitted lax.scan call (one progress line)
  c.updates_per_iter = 2            # learner updates per vector step
  c.batch_size = 128
  c.hidden = (64, 64)
  c.learning_rate = 5e-4
  c.lr_end = 5e-4                   # linear decay to lr_end ...
  c.lr_decay_steps = 30_000         # ... over this many learner steps
  c.max_grad_norm = 10.0
  c.gamma = 0.99
  c.target_update_period = 100      # learner steps between hard target-network copies ...
  c.target_tau = 0.005              # ... or, if < 1, Polyak averaging with this rate every step
  c.eps_start = 1.0
  c.eps_end = 0.05
  c.eps_decay_steps = 20_000        # env steps
  c.learning_starts = 2_000         # env steps before the first update
  c.return_window = 20              # episodes in the reported mean return
  c.target_return = 400.0           # reported: first env step where the mean return reaches it
  c.stop_at_return = 475.0          # stop once the mean return reaches it (0: never)
  c.replay_noop = False             # profiling: replace replay ops by a plain uniform ring buffer

  c.replay = ml_collections.ConfigDict()
  c.replay.capacity = 100_000
  c.replay.priority_exponent = 0.6  # PER alpha
  c.replay.beta_start = 0.4         # importance-weight exponent, annealed linearly to 1.0
  c.replay.beta_end = 1.0
  c.replay.beta_decay_steps = 100_000  # env steps
  c.replay.priority_eps = 1e-3      # priority = |td| + eps
  c.replay.initial_priority = "max" # new items: "td" = |TD| now (Ape-X), "max" = max seen (PER)
  c.replay.max_staleness = 20_000   # learner versions, 0 = no limit (see the module docstring)
  c.replay.max_times_sampled = 256  # 0 = unlimited

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
    c.replay.capacity = 2_048
    c.replay.max_staleness = 200
    c.replay.max_times_sampled = 8
  elif variant == "ci_learn":
    # The learning test: ~16k env steps, clearly better than a random policy (~22).
    c.total_env_steps = 16_000
    c.chunk_iters = 250
    c.updates_per_iter = 1
    c.batch_size = 64
    c.learning_starts = 1_000
    c.eps_decay_steps = 8_000
    c.replay.capacity = 16_384
    c.replay.max_staleness = 4_000
  elif variant == "full":
    c.num_envs = 16
    c.total_env_steps = 300_000
    c.hidden = (128, 128)
    c.learning_rate = 3e-4
    c.updates_per_iter = 2
    c.replay.capacity = 200_000
    c.replay.max_staleness = 50_000
  elif variant:
    raise ValueError(f"configs/dqn_anakin.py: unknown variant {variant!r}; use '', 'tiny', "
                     "'ci_learn' or 'full'.")
  return c
