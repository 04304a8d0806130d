"""Config for ``experiments/async_grpo.py``: async GRPO with rollout groups (issue 28).

Variants (the part after ``:`` in ``--config``):

* ``configs/async_grpo.py``: the default (4 producer threads, 4 tasks, 120 learner steps,
  groups of 8 responses of 16-512 tokens; well under a minute on 2 cores);
* ``configs/async_grpo.py:tiny``: CI smoke test (12 learner steps, short responses).

Semantics (versions are learner steps):

* ``max_staleness`` (k): a group whose stalest response came from policy ``v`` is trained
  on up to learner version ``v + k``; ``evict_stale(receipt=True)`` then removes it and the
  learner re-queues its prompt (the receipt carries the prompt id).
* ``max_times_sampled`` (N): a group is trained on at most N times (``take_batch(...,
  consume=False)`` counts each use; the table frees it at the N-th).
* ``drop_prob``: a response that never arrives (a failed worker); its group is inserted
  at ``group_timeout_s`` with a mask and status "aborted", and not trained on.
"""

import ml_collections


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  """The default config, or ``"tiny"`` (see the module docstring)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_producers = 4
  c.tasks = ("math", "code", "chat", "tool")
  c.batch_groups = (4, 2, 1, 1)     # groups per task in one learner batch (is_ready sizes)
  c.group_size = 8                  # G responses per prompt (one table item)
  c.min_len = 16                    # response lengths ~ uniform[min_len, max_len]
  c.max_len = 512
  c.vocab = 16                      # the tiny policy: per-task logits over this vocabulary
  c.capacity = 256                  # groups
  c.max_staleness = 4               # k
  c.max_times_sampled = 2           # N
  c.sync_every = 3                  # a producer refreshes its weights every this many groups
  c.drop_prob = 0.01                # a response lost (partial, masked group)
  c.group_timeout_s = 0.5
  c.learner_steps = 120
  c.learning_rate = 8.0           # on the per-token mean of the clipped objective
  c.clip = 0.2                      # PPO ratio clip
  c.ready_timeout_s = 60.0
  if variant == "tiny":
    c.learner_steps = 12
    c.max_len = 64
    c.capacity = 64
    c.group_size = 4
    c.batch_groups = (2, 1, 1, 1)
  elif variant:
    raise ValueError(f"configs/async_grpo.py: unknown variant {variant!r}; use '' or 'tiny'.")
  return c
