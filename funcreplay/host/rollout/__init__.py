"""Rollout groups for LLM RL on the host ``Table`` (issue 28).

* ``columns``: typed metadata (``fr.Column``: vocabularies, float32) to stored words;
* ``arena`` / ``sidecar``: ``fr.Ragged`` values without padding, and payloads, per slot;
* ``batch``: ``RaggedBatch`` / ``HostSample``; ``inserts``: preparing an insert;
* ``programs`` / ``mixin``: ``count_by``, ``is_ready``, ``take_batch``, ``peek``,
  ``expire_stale`` and eviction receipts;
* ``group_writer``: ``GroupWriter``, groups assembled from responses of many producers.
"""
