"""Config for ``experiments/dqn_torch.py``: a PyTorch double DQN fed by a funcreplay table.

Variants (the part after ``:`` in ``--config``):

* ``configs/dqn_torch.py`` (or ``:tiny``): the CI smoke size: a few seconds,
  exercises every part (actor threads, prioritized replay, write-back,
  staleness, outputs) but does not learn much.
* ``configs/dqn_torch.py:full``: the learning run, sized for a 2-core CPU (a
  few minutes): stops as soon as the mean return over the last 20 episodes
  reaches ``target_return`` (400), at the latest after ``total_env_steps``.

Override any field: ``--config.seed=3 --config.replay.max_staleness=5000``.

Replay semantics (versions are *learner* versions = gradient steps):

* ``replay.samples_per_insert``: the table's ``SampleToInsertRatio`` rate
  limiter pins the number of sampled rows per inserted transition, so the
  update-to-data ratio does not depend on how fast the actor threads run
  (``samples_per_insert / batch_size`` learner updates per env step).
* ``replay.max_staleness``: transitions produced by a policy more than this
  many learner updates old are not sampled.
* actors act with a copy of the online network refreshed every
  ``actor_sync_period`` learner updates; each transition carries the version
  of the weights that chose its action.
"""

import ml_collections


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """The CI-sized default, or ``"full"`` (see the module docstring)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.env_id = "CartPole-v1"
  c.num_actors = 2                  # actor threads, one gymnasium env each
  c.insert_batch = 4                # transitions an actor groups per insert
  c.total_env_steps = 3_000         # budget (all actors together)
  c.batch_size = 64
  c.hidden = (64, 64)
  c.learning_rate = 1e-3
  c.max_grad_norm = 10.0
  c.gamma = 0.99
  c.target_update_period = 250      # learner updates between hard target copies
  c.actor_sync_period = 50          # learner updates between actor weight refreshes
  c.eps_start = 1.0
  c.eps_end = 0.02
  c.eps_decay_steps = 2_000         # env steps
  c.return_window = 20              # episodes in the reported mean return
  c.target_return = 400.0
  c.stop_at_return = False          # stop once the mean return reaches target_return
  c.log_every = 500                 # learner updates between progress lines
  c.prefetch = 1                    # TorchSampler batches sampled ahead
  c.torch_threads = 1               # torch intra-op threads (small MLP: 1 is fastest)
  c.use_ingestor = True             # actors feed the table through Table.ingestor() if present

  c.replay = ml_collections.ConfigDict()
  c.replay.capacity = 4_096
  c.replay.learning_starts = 500    # min_size_to_sample of the rate limiter
  c.replay.samples_per_insert = 32.0  # rows sampled per inserted transition (0.5 updates/step)
  c.replay.error_buffer = 4_096.0   # rate-limiter slack, in sampled rows
  c.replay.priority_exponent = 0.6  # PER alpha
  c.replay.beta_start = 0.4         # importance-weight exponent, annealed linearly to 1
  c.replay.beta_end = 1.0
  c.replay.beta_decay_steps = 2_000  # learner updates
  c.replay.priority_eps = 1e-3      # priority = |td| + eps
  c.replay.max_staleness = 2_000    # learner versions

  if variant == "full":
    c.total_env_steps = 120_000
    c.stop_at_return = True
    c.batch_size = 128
    c.hidden = (128, 128)
    c.learning_rate = 1e-3
    c.target_update_period = 200
    c.actor_sync_period = 20
    c.eps_decay_steps = 10_000
    c.eps_end = 0.01
    c.log_every = 2_000
    c.replay.capacity = 50_000
    c.replay.learning_starts = 1_000
    c.replay.samples_per_insert = 64.0    # one update of 128 rows per 2 env steps
    c.replay.error_buffer = 16_384.0
    c.replay.beta_decay_steps = 30_000
    c.replay.max_staleness = 30_000
  elif variant not in ("", "tiny"):
    raise ValueError(f"configs/dqn_torch.py: unknown variant {variant!r}; use '', 'tiny' or "
                     "'full'.")
  return c
