"""The host layer: the thread-safe ``Table``, the ``Ingestor``, writers, validation."""
