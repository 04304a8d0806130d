"""Fast validation and stacking of single items on the host (used by the ``Ingestor``).

A producer thread puts one item per call, so checking it must cost well under
a microsecond: ``ItemChecker`` generates, once per signature, a small Python
function that walks the expected structure and compares shapes and dtypes
with constants (the slow, explaining path runs only on a mismatch), and
``stack_leaf`` joins the raw bytes of already-validated leaves into a batch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import jax
import numpy as np

from funcreplay.core import signature as sig_lib
from funcreplay.host import validation


class _Unsupported(Exception):
  """A container type the code generator does not specialise."""


def _gen_node(tree, var: str, lines: list, consts: dict, leaves: list) -> None:
  """Append the structure checks for ``tree`` (held in local ``var``) to ``lines``."""
  if isinstance(tree, jax.ShapeDtypeStruct):
    i = len(leaves)
    consts[f"S{i}"], consts[f"D{i}"] = tuple(tree.shape), np.dtype(tree.dtype)
    leaves.append(var)
  elif tree is None:
    lines.append(f"if {var} is not None: return None")
  elif type(tree) is dict:  # noqa: E721 (jax treats dict subclasses as other nodes)
    lines.append(f"if type({var}) is not dict or len({var}) != {len(tree)}: return None")
    for j, k in enumerate(sorted(tree)):  # jax flattens dicts in sorted key order
      kname = f"K{len(consts)}"
      consts[kname] = k
      lines.append(f"{var}_{j} = {var}[{kname}]")
      _gen_node(tree[k], f"{var}_{j}", lines, consts, leaves)
  elif type(tree) in (tuple, list) or (isinstance(tree, tuple) and hasattr(tree, "_fields")):
    tname = f"T{len(consts)}"
    consts[tname] = type(tree)
    lines.append(f"if type({var}) is not {tname} or len({var}) != {len(tree)}: return None")
    for j, sub in enumerate(tree):
      lines.append(f"{var}_{j} = {var}[{j}]")
      _gen_node(sub, f"{var}_{j}", lines, consts, leaves)
  else:
    raise _Unsupported(type(tree).__name__)


def _compile_fast_check(signature: sig_lib.Signature) -> Callable[[Any], Optional[tuple]]:
  """``fast(item) -> tuple of leaves``, or None when the item is not an exact match.

  Generated once per signature: walking the expected structure with
  ``type(x) is dict`` / ``x[key]`` and comparing ``shape`` / ``dtype`` (by
  identity: numpy's builtin dtypes are singletons) with constants costs a few
  hundred nanoseconds, where ``treedef.flatten_up_to`` plus a loop costs
  microseconds. Scalar leaves accept numpy scalars of the exact type and
  convert Python numbers only where the conversion is lossless (``float``
  below the leaf's overflow bound and ``int`` exactly representable for float
  leaves, ``int`` for integer leaves, ``bool`` for bool leaves: a subset of
  ``core.signature.scalar_leaf``). Dtypes that are equal but not identical,
  and every kind of mismatch, return None and take the slow path, which
  converts or explains.
  """
  lines: list = []
  consts: dict = {}
  leaves: list = []
  try:
    _gen_node(signature.tree, "x", lines, consts, leaves)
  except _Unsupported:  # custom pytree nodes: flatten with the (C++) treedef
    lines, consts = [], {"FLAT": signature.treedef.flatten_up_to}
    leaves = [f"x{i}" for i in range(len(signature.leaves))]
    for i, s in enumerate(signature.leaves):
      consts[f"S{i}"], consts[f"D{i}"] = tuple(s.shape), np.dtype(s.dtype)
    lines.append(f"{', '.join(leaves)}, = FLAT(x)")
  body = list(lines)
  for i, v in enumerate(leaves):
    d = consts[f"D{i}"]
    if consts[f"S{i}"] or d.kind not in "biuf":
      body.append(f"if {v}.shape != S{i} or {v}.dtype is not D{i}: return None")
      continue
    # Scalar leaves: a numpy scalar of the exact type passes with one check;
    # Python numbers of a compatible kind are converted (np.int32(2**40)
    # raises OverflowError -> the slow path explains it).
    consts[f"N{i}"] = d.type
    body += [f"t = type({v})", f"if t is not N{i}:"]
    if d.kind == "f":
      # Only lossless conversions (core.signature.scalar_leaf, the slow path,
      # explains the others): floats that stay finite, ints that are exact.
      consts[f"F{i}"] = sig_lib.float_overflow_bound(d)
      consts[f"I{i}"] = sig_lib.exact_int_bound(d)
      body += [f"  if t is float and -F{i} < {v} < F{i}: {v} = N{i}({v})",
               f"  elif t is int and -I{i} <= {v} <= I{i}: {v} = N{i}({v})"]
    else:
      body.append(f"  if t is {'bool' if d.kind == 'b' else 'int'}: {v} = N{i}({v})")
    body.append(f"  elif {v}.shape != () or {v}.dtype is not D{i}: return None")
  body.append(f"return ({', '.join(leaves)},)")
  src = "\n".join(["def fast(x):", "  try:"] + ["    " + ln for ln in body]
                  + ["  except Exception:", "    return None"])
  namespace = dict(consts)
  exec(compile(src, "<funcreplay.host.ingest item check>", "exec"), namespace)  # noqa: S102
  return namespace["fast"]


class ItemChecker:
  """Validates single items (no batch axis) against a ``Signature``.

  ``checker(item)`` returns the tuple of the item's leaves in the signature's
  (``jax.tree_util``) order: leaves of exactly the right shape and dtype as
  they are (no copy); Python ``bool`` / ``int`` / ``float`` leaves as 0-d numpy
  arrays of the leaf dtype where that is lossless (``1.5`` or ``True`` for an
  int32 leaf is refused). Anything else raises ``ValueError`` / ``TypeError``
  prefixed with ``what`` and naming the leaf (``validation.check_items``, the
  same check as ``Table.insert``).
  """

  __slots__ = ("signature", "what", "fast")

  def __init__(self, signature: sig_lib.Signature, what: str = "item"):
    self.signature = signature
    self.what = what
    self.fast = _compile_fast_check(signature)

  def __call__(self, item: Any) -> Tuple[Any, ...]:
    leaves = self.fast(item)
    return self.slow(item) if leaves is None else leaves

  def slow(self, item: Any) -> Tuple[Any, ...]:
    """The full check, with clear errors and Python-scalar conversion."""
    try:
      leaves, _ = validation.check_items(self.signature, item, batched=False, what=self.what)
    except OverflowError as e:
      raise ValueError(f"{self.what}: a Python number does not fit its leaf's dtype ({e}); "
                       f"the signature is {self.signature!r}.") from None
    return tuple(leaves)

  def batch(self, items: Any, what: Optional[str] = None) -> Tuple[Tuple[np.ndarray, ...], int]:
    """``(numpy leaves, B)`` of a batch with a leading [B] axis."""
    leaves, b = validation.check_items(self.signature, items, batched=True,
                                       what=what or self.what)
    return tuple(np.asarray(x) for x in leaves), b


def stack_leaf(col, n: int, spec: jax.ShapeDtypeStruct) -> np.ndarray:
  """Stack ``n`` validated leaves of one signature leaf into a fresh ``[n, *shape]`` array.

  The leaves were validated (shape and dtype) when they were put, so their
  raw bytes can be concatenated directly: ``b"".join`` over the buffers of
  C-contiguous arrays costs ~30 ns per leaf where ``np.array(col)`` (which
  re-discovers shapes and dtypes) costs ~110 ns. The result may be
  read-only; ``Table.insert`` copies it to the device anyway.
  """
  dtype = np.dtype(spec.dtype)
  try:
    if not spec.shape:
      out = np.fromiter(col, dtype, n)  # scalars: ~10 ns per item
    else:
      try:
        buf = b"".join(col)
      except (TypeError, BufferError, ValueError):  # non-contiguous, JAX, ...
        out = np.array(col)
      else:
        if len(buf) != n * dtype.itemsize * int(np.prod(spec.shape)):
          raise ValueError("leaf sizes changed after put")
        out = np.frombuffer(buf, dtype).reshape(n, *spec.shape)
    if out.dtype == dtype and out.shape == (n, *spec.shape):
      return out
  except (TypeError, ValueError):
    pass
  return np.stack([np.asarray(x, dtype) for x in col])  # JAX arrays, exotic dtypes


