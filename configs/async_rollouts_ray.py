"""Config for ``experiments/async_rollouts_ray.py``: the async-rollouts pattern on Ray.

Producers are Ray actors (processes) feeding one replay actor through
``RemoteWriter``s; the learner is another Ray actor. Same semantics and fields as
``configs/async_rollouts.py`` (free-running only: processes cannot take turns
cheaply), plus:

* ``namespace`` / ``table_name``: where the replay actor lives (a multi-machine run
  connects producers started elsewhere by these);
* ``writer_batch``: items per shipped batch (groups are big items; small batches keep
  the policy lag low);
* ``max_rounds``: an upper bound on each producer's rounds (they stop earlier, when
  the learner is done).

Variants: ``:tiny`` (CI smoke, 10 learner steps), ``:full`` (8 producers, 4 tasks).
"""

import ml_collections


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_producers = 3
  c.tasks = ("math", "code", "chat")
  c.task_probs = (0.5, 0.3, 0.2)
  c.batch_groups = (4, 2, 1)
  c.group_size = 8
  c.seq_len = 32
  c.groups_per_round = 2
  c.sync_every = 3
  c.failed_prob = 0.05
  c.truncated_prob = 0.15
  c.capacity = 256
  c.max_staleness = 4
  c.max_times_sampled = 2
  c.learner_steps = 100
  c.gen_time_s = 0.01                # simulated generation time per group
  c.sample_timeout_s = 60.0
  c.namespace = "funcreplay-async"
  c.table_name = "async_rollouts"
  c.writer_batch = 2
  c.max_rounds = 100_000
  c.num_cpus = 4                     # logical CPUs of a local cluster (ray.init)
  if variant == "tiny":
    c.learner_steps = 10
    c.seq_len = 8
    c.group_size = 4
    c.capacity = 64
    c.num_producers = 2
  elif variant == "full":
    c.num_producers = 8
    c.tasks = ("math", "code", "chat", "agent")
    c.task_probs = (0.4, 0.3, 0.2, 0.1)
    c.batch_groups = (8, 4, 2, 1)
    c.group_size = 16
    c.seq_len = 256
    c.capacity = 2048
    c.learner_steps = 1000
    c.gen_time_s = 0.002
  elif variant:
    raise ValueError(f"configs/async_rollouts_ray.py: unknown variant {variant!r}; use '', "
                     "'tiny' or 'full'.")
  return c
