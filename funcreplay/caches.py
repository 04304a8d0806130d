"""Dropping the compiled programs funcreplay caches.

funcreplay keeps the jitted operations of a ``Table`` per spec and
implementation (the last 64 pairs) and a checkpoint migration's rebuild per
spec (the last 16), so a new ``Table`` of a known spec compiles nothing.
Each compiled XLA:CPU program holds a few memory mappings, and a process
may have at most
``vm.max_map_count`` (65530 by default) of them: a long-lived process that
compiles many thousands of programs (a test suite, a sweep building tables
of many specs and batch sizes) can run out, and XLA then fails inside a
later compilation (a segfault or an abort). ``clear_caches()`` drops
funcreplay's caches; ``jax.clear_caches()`` drops JAX's (every jitted
function's compiled programs). Existing tables keep working and compile
again on their next call.
"""

from __future__ import annotations

import jax


def clear_caches(include_jax: bool = True) -> None:
  """Forget funcreplay's cached jitted programs (and JAX's, with ``include_jax``)."""
  from funcreplay import table  # noqa: PLC0415 (table imports this package's modules)
  from funcreplay.checkpoint import migrate  # noqa: PLC0415

  table._cached_ops.cache_clear()  # noqa: SLF001
  migrate._rebuild.cache_clear()  # noqa: SLF001
  if include_jax:
    jax.clear_caches()
