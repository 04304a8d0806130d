"""pytest plugin: tests/core/test_inplace.py's copy checks, compiled for an H200 that is
not there.

``test_inplace`` compiles each program for XLA:CPU and looks for whole-column copies
(``_capacity_copies``). Which reads XLA re-fuses into which consumers differs by backend,
so a program clean on the CPU may copy on a GPU: the second GPU session found 16 such
failures in that file (BUILD.md "On XLA:GPU (second measurements)" item 5, finding 31).
With this plugin each check compiles its program deviceless for an H200
(``accel_hlo.Target``, as ``accel_hlo.py`` and ``accel_copies.py`` do) and applies the
same test to that HLO, so those failures reproduce, and their fixes are checked,
without a GPU. Checks of a program compiled by the test itself (``compiled=``: the host
``Table``'s) are skipped: they were not retargeted. Needs the accelerator venv with
pytest (``make accel-inplace``):

  .venv-accel-hlo/bin/python -m pytest -p experiments.accel_pytest tests/core/test_inplace.py

XLA:GPU's fusion decisions change between jax versions: run it with the version a GPU
user runs (the GPU image's jax 0.11.2 passed every portable check after finding 31;
jax 0.10.2, the pinned version, still copies in three programs that 0.11.2 compiles
without copies).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # as accel_hlo: see there
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

_TARGET = []  # the Target, made once (its topology takes a second)


class _Compiled:
  """What ``_capacity_copies`` reads of a compiled program: its text."""

  def __init__(self, text: str):
    self._text = text

  def as_text(self) -> str:
    return self._text


def _shape(a, sharding):
  x = a if hasattr(a, "shape") and hasattr(a, "dtype") else jnp.asarray(a)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding,
                              weak_type=getattr(x, "weak_type", False))


@pytest.fixture(autouse=True)
def _compile_for_an_h200(monkeypatch, request):
  module = request.module
  if not hasattr(module, "_capacity_copies"):
    return
  if not _TARGET:
    from experiments.accel_hlo import Target
    _TARGET.append(Target("h200"))
  target, on_cpu = _TARGET[0], module._capacity_copies

  def on_h200(fn, *args, compiled=None):
    if compiled is not None:
      pytest.skip("a program the test compiled itself (for the CPU): not retargeted")
    shapes = [jax.tree_util.tree_map(lambda a: _shape(a, target.sharding), x) for x in args]
    text = jax.jit(fn, donate_argnums=0).lower(*shapes).compile().as_text()
    return on_cpu(None, compiled=_Compiled(text))

  monkeypatch.setattr(module, "_capacity_copies", on_h200)
