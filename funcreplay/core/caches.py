"""Dropping the compiled programs (and other per-spec objects) funcreplay caches.

Every module-level cache in funcreplay registers its ``clear`` function here
when its module is imported (``register``): the host ``Table``'s jitted
operations per (spec, implementation) (the last 64 pairs), a checkpoint
migration's jitted rebuild per spec (the last 16), the checkpoint's expected
leaf layout per spec, the packed-sample layouts and their torch views. So a
new ``Table`` of a known spec compiles nothing.

Each compiled XLA:CPU program holds a few memory mappings, and a process
may have at most ``vm.max_map_count`` (65530 by default) of them: a
long-lived process that compiles many thousands of programs (a test suite, a
sweep building tables of many specs and batch sizes) can run out, and XLA
then fails inside a later compilation (a segfault or an abort).
``clear_caches()`` drops every registered cache; ``jax.clear_caches()`` drops
JAX's (every jitted function's compiled programs). Existing tables keep
working and compile again on their next call.

This module is the bottom of the house: it imports nothing from funcreplay,
so any layer may register with it (a cache of a module never imported is
empty and needs no clearing).
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import jax

_REGISTRY: Dict[str, Callable[[], None]] = {}


def register(name: str, clear: Callable[[], None]) -> None:
  """Register ``clear`` (e.g. an ``lru_cache``'s ``cache_clear``) under a unique ``name``.

  Registering a name again replaces its function (a reloaded module).
  """
  if not callable(clear):
    raise TypeError(f"caches.register({name!r}): clear must be callable, got "
                    f"{type(clear).__name__}.")
  _REGISTRY[name] = clear


def registered() -> Tuple[str, ...]:
  """The names of the caches registered so far (sorted)."""
  return tuple(sorted(_REGISTRY))


def clear_caches(include_jax: bool = True) -> None:
  """Forget funcreplay's cached programs (every registered cache; JAX's with ``include_jax``)."""
  for clear in list(_REGISTRY.values()):
    clear()
  if include_jax:
    jax.clear_caches()
