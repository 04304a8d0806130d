"""Item signatures and host-boundary validation of items.

A signature is the pytree structure plus one ``jax.ShapeDtypeStruct`` per
leaf, *without* the batch axis. It is hashable so it can live in the static
``TableSpec``.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np


def _leaf_names(tree) -> Tuple[str, ...]:
  paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  return tuple(jax.tree_util.keystr(p) or "<root>" for p, _ in paths)


class Signature:
  """Hashable description of one item: pytree structure + leaf shapes/dtypes."""

  __slots__ = ("treedef", "leaves", "names", "_cached_key", "_cached_hash")

  def __init__(self, tree: Any):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
      raise ValueError("signature: the item pytree has no array leaves.")
    names = _leaf_names(tree)
    specs = []
    for name, leaf in zip(names, leaves):
      if isinstance(leaf, jax.ShapeDtypeStruct):
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
      elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
      else:
        raise TypeError(
            f"signature leaf {name}: expected an array or jax.ShapeDtypeStruct, "
            f"got {type(leaf).__name__}. Wrap Python scalars with np.asarray(x, dtype).")
      if dtype != jax.dtypes.canonicalize_dtype(dtype):
        raise TypeError(
            f"signature leaf {name}: dtype {dtype} is not supported while "
            f"jax_enable_x64 is off (it would silently become "
            f"{jax.dtypes.canonicalize_dtype(dtype)}); cast it explicitly.")
      specs.append(jax.ShapeDtypeStruct(shape, dtype))
    object.__setattr__(self, "treedef", treedef)
    object.__setattr__(self, "leaves", tuple(specs))
    object.__setattr__(self, "names", names)
    # Computed once: signatures key lru caches (packing.layout, ...) on hot paths.
    key = (treedef, tuple((s.shape, np.dtype(s.dtype).str) for s in specs))
    object.__setattr__(self, "_cached_key", key)
    object.__setattr__(self, "_cached_hash", hash(key))

  def __setattr__(self, *_):
    raise AttributeError("Signature is immutable")

  def __reduce__(self):
    # Pickled as the tree it was built from (the default would set the slots, which the
    # immutability above refuses): a TableSpec crosses process boundaries (Ray, spawn).
    return (Signature, (self.tree,))

  @property
  def tree(self):
    """The signature as a pytree of ``jax.ShapeDtypeStruct``."""
    return jax.tree_util.tree_unflatten(self.treedef, self.leaves)

  @property
  def item_bytes(self) -> int:
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in self.leaves)

  def _key(self):
    return self._cached_key

  def __eq__(self, other):
    return other is self or (isinstance(other, Signature) and self._key() == other._key())

  def __hash__(self):
    return self._cached_hash

  def __repr__(self):
    parts = ", ".join(f"{n}: {np.dtype(s.dtype).name}{list(s.shape)}"
                      for n, s in zip(self.names, self.leaves))
    return f"Signature({parts})"

  def to_json(self):
    """JSON-able description (structure as a pytree of leaf indices)."""
    index_tree = jax.tree_util.tree_unflatten(self.treedef, list(range(len(self.leaves))))
    return {"structure": _to_jsonable(index_tree),
            "leaves": [{"name": n, "shape": list(s.shape), "dtype": np.dtype(s.dtype).name}
                       for n, s in zip(self.names, self.leaves)]}

  @classmethod
  def from_json(cls, obj) -> "Signature":
    specs = [jax.ShapeDtypeStruct(tuple(d["shape"]), np.dtype(d["dtype"])) for d in obj["leaves"]]
    tree = _from_jsonable(obj["structure"], specs)
    return cls(tree)


def _to_jsonable(tree):
  if isinstance(tree, dict):
    return {"__dict__": {str(k): _to_jsonable(v) for k, v in tree.items()}}
  if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
    return {"__list__" if isinstance(tree, list) else "__tuple__": [_to_jsonable(v) for v in tree]}
  if isinstance(tree, int):
    return tree
  raise TypeError(
      f"signature structure {type(tree).__name__} cannot be written as JSON; "
      "use dicts, lists and tuples for checkpointable signatures.")


def _from_jsonable(obj, specs):
  if isinstance(obj, int):
    return specs[obj]
  if "__dict__" in obj:
    return {k: _from_jsonable(v, specs) for k, v in obj["__dict__"].items()}
  if "__list__" in obj:
    return [_from_jsonable(v, specs) for v in obj["__list__"]]
  return tuple(_from_jsonable(v, specs) for v in obj["__tuple__"])


def as_signature(sig_or_example) -> Signature:
  """A ``Signature`` from a Signature, a pytree of ShapeDtypeStruct or an example item."""
  if isinstance(sig_or_example, Signature):
    return sig_or_example
  return Signature(sig_or_example)


def dtype_error(name: str, want, got: str, cast: str = "x.astype(np.{})") -> TypeError:
  """The dtype-mismatch error of the host boundary (one wording for every entry point)."""
  want = np.dtype(want).name
  return TypeError(f"item leaf {name}: expected dtype {want}, got {got}. Cast it (e.g. "
                   f"{cast.format(want)}).")


def float_overflow_bound(dtype) -> float:
  """The smallest magnitude a Python float rounds to infinity in the float ``dtype``
  (round to nearest even: ``max`` plus half an ulp). Finite values below it stay finite."""
  fi = jnp.finfo(dtype)
  return 2.0 ** int(fi.maxexp) - 2.0 ** (int(fi.maxexp) - int(fi.nmant) - 2)


def exact_int_bound(dtype) -> int:
  """Every Python int of magnitude <= this is exact in the float ``dtype`` (2**(mantissa+1))."""
  return 2 ** (int(jnp.finfo(dtype).nmant) + 1)


# Python scalar kinds each leaf kind takes (numpy dtype.kind -> type names).
_SCALAR_KINDS = {"b": ("bool",), "i": ("int",), "u": ("int",), "f": ("int", "float"),
                 "c": ("int", "float")}


def scalar_leaf(x, dtype, name: str) -> np.ndarray:
  """A Python ``bool`` / ``int`` / ``float`` as a 0-d array of ``dtype``, only if lossless.

  The rules, by kind, so that no value is truncated or changed silently:
  bool leaves take ``bool``; integer leaves take ``int`` in range; float leaves
  take ``float`` (rounded to the leaf's precision, but never a finite value
  to infinity) and ``int`` exactly representable. Anything else (a ``float``
  or ``bool`` for an integer leaf, an ``int`` for a bool leaf, ...) is the
  dtype mismatch ``Table.insert`` reports for arrays (``TypeError``); a value
  out of range is a ``ValueError``.
  """
  d = np.dtype(dtype)
  kind = "bool" if isinstance(x, bool) else ("int" if isinstance(x, int) else "float")
  if kind not in _SCALAR_KINDS.get(d.kind, ()):
    raise dtype_error(name, d, f"a Python {kind} ({x!r})", cast="np.{}(x)")
  if kind == "int" and d.kind in "iu":
    info = np.iinfo(d)
    if not info.min <= x <= info.max:
      raise ValueError(f"item leaf {name}: the Python int {x} does not fit {d.name} "
                       f"([{info.min}, {info.max}]).")
  elif kind == "int" and d.kind == "f" and abs(x) > exact_int_bound(d):
    with np.errstate(over="ignore"):
      f = d.type(float(x)) if abs(x) < 2.0**1023 else d.type("inf")
    if not np.isfinite(f) or int(f) != x:
      raise ValueError(f"item leaf {name}: the Python int {x} is not exact in {d.name} (it "
                       f"would become {f!r}); pass a float, or store it in an integer leaf.")
  elif kind == "float" and d.kind == "f" and math.isfinite(x) \
      and abs(x) >= float_overflow_bound(d):
    raise ValueError(f"item leaf {name}: the Python float {x!r} does not fit {d.name} (it "
                     "would become inf).")
  return np.asarray(x, dtype=d)


def _nested_to_array(leaf, name: str, spec, batched: bool) -> np.ndarray:
  """A leaf given as (nested) Python lists or scalars, as a numpy array: a ragged list or
  one holding what is no number is an error naming the leaf and the shape it needs."""
  kind = type(leaf).__name__
  rows = f"[B, {', '.join(map(str, spec.shape))}]" if batched else list(spec.shape)
  try:
    a = np.asarray(leaf)
  except ValueError as e:  # numpy >= 1.24: "inhomogeneous shape"
    raise ValueError(f"item leaf {name}: a ragged {kind} (its rows differ in length; "
                     f"numpy: {e}). The leaf needs shape {rows}.") from None
  if a.dtype == object:
    raise TypeError(f"item leaf {name}: a {kind} numpy holds as Python objects (an element "
                    f"such as None, mixed types, or an int beyond int64) is not an array of "
                    f"{np.dtype(spec.dtype).name}.")
  return a


# What numpy makes of Python ints and floats: a list of them arrives with these dtypes.
_PYTHON_NUMBER_DTYPES = (np.dtype(np.int64), np.dtype(np.float64))


def check_items(signature: Signature, items: Any, *, batched: bool = True,
                batch_size: Optional[int] = None) -> Tuple[Any, int]:
  """Validate ``items`` against ``signature`` at the host boundary.

  Args:
    signature: the table's signature.
    items: a pytree with the signature's structure; with ``batched=True`` each
      leaf has a leading batch axis ``[B, *leaf_shape]``.
    batched: whether ``items`` carries a leading batch axis.
    batch_size: if given, the required ``B``.

  Returns:
    ``(leaves, B)``: the flat list of leaves as numpy/JAX arrays (unbatched
    Python scalars converted to the leaf dtype when lossless, ``scalar_leaf``)
    and the batch size (1 if unbatched).

  Raises:
    ValueError / TypeError naming the leaf, the expected and the got
    structure, shape or dtype.
  """
  try:
    leaves = signature.treedef.flatten_up_to(items)
  except (ValueError, TypeError) as e:
    got = jax.tree_util.tree_structure(items)
    raise ValueError(
        f"item structure does not match the table signature.\n  expected: "
        f"{signature.treedef}\n  got:      {got}\n  ({e})") from None
  out, sizes = [], []
  for name, spec, given in zip(signature.names, signature.leaves, leaves):
    leaf = given
    if isinstance(leaf, (bool, int, float)) and not batched:
      leaf = scalar_leaf(leaf, spec.dtype, name)
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      leaf = _nested_to_array(leaf, name, spec, batched)
    want_shape = tuple(spec.shape)
    got_shape = tuple(leaf.shape)
    if batched:
      if len(got_shape) != len(want_shape) + 1 or got_shape[1:] != want_shape:
        raise ValueError(
            f"item leaf {name}: expected shape [B, {', '.join(map(str, want_shape))}]"
            f" (B = batch), got {list(got_shape)}.")
      sizes.append(got_shape[0])
    elif got_shape != want_shape:
      raise ValueError(f"item leaf {name}: expected shape {list(want_shape)}, "
                       f"got {list(got_shape)}.")
    try:
      got_dtype = np.dtype(leaf.dtype)
    except TypeError:  # e.g. a torch tensor: torch.int32 is no numpy dtype
      raise TypeError(
          f"item leaf {name}: a {type(leaf).__module__}.{type(leaf).__name__} of dtype "
          f"{leaf.dtype} is not a numpy / JAX array; convert it first (torch tensors: "
          "funcreplay.torch.from_torch(items), zero copy, or tensor.numpy()).") from None
    if got_dtype != np.dtype(spec.dtype):
      if isinstance(given, (list, tuple)) and got_dtype in _PYTHON_NUMBER_DTYPES:
        # A list of Python numbers has no ``astype``: say how to build the right array.
        raise dtype_error(name, spec.dtype, f"{got_dtype.name} (numpy's default for Python "
                          "numbers in a list)", cast="np.asarray(x, np.{})")
      raise dtype_error(name, spec.dtype, got_dtype.name)
    out.append(leaf)
  if batched:
    if len(set(sizes)) != 1:
      detail = ", ".join(f"{n}: {s}" for n, s in zip(signature.names, sizes))
      raise ValueError(f"item leaves disagree on the batch size: {detail}.")
    b = sizes[0]
    if batch_size is not None and b != batch_size:
      raise ValueError(f"expected a batch of {batch_size} items, got {b}.")
    return out, b
  return out, 1


def batch_axis_tree(signature: Signature, batch: int):
  """ShapeDtypeStructs of a batch of ``batch`` items."""
  return jax.tree_util.tree_unflatten(
      signature.treedef,
      [jax.ShapeDtypeStruct((batch, *s.shape), s.dtype) for s in signature.leaves])


def zeros(signature: Signature, leading: Sequence[int]):
  """A pytree of zeros shaped ``[*leading, *leaf_shape]``."""
  return jax.tree_util.tree_unflatten(
      signature.treedef,
      [jnp.zeros((*leading, *s.shape), s.dtype) for s in signature.leaves])
