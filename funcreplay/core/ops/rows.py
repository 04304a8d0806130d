"""Row helpers shared by the operations: batch rows, key matches, gathers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from funcreplay.core import item_info, numerics
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def batch_size(spec: TableSpec, items) -> int:
  leaves = spec.signature.treedef.flatten_up_to(items)
  sizes = set()
  for name, s, leaf in zip(spec.signature.names, spec.signature.leaves, leaves, strict=True):
    shape = tuple(jnp.shape(leaf))
    if shape[1:] != tuple(s.shape) or len(shape) != len(s.shape) + 1:
      raise ValueError(f"insert: item leaf {name}: expected shape [B, "
                       f"{', '.join(map(str, s.shape))}], got {list(shape)}.")
    # An array's own dtype (numpy's included): ``jnp.result_type`` reads a numpy float64
    # or int64 as 32 bits without x64, and such a leaf then went in as twice its words or
    # wrapped (found by a review). Python scalars and lists: JAX's (weak) type.
    got = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)
    if got != s.dtype:
      raise TypeError(f"insert: item leaf {name}: expected dtype {s.dtype}, got {got}.")
    sizes.add(shape[0])
  if len(sizes) != 1:
    raise ValueError(f"insert: item leaves disagree on the batch size: {sorted(sizes)}.")
  return sizes.pop()


# Input dtype kinds a row of each target dtype takes (and their names for the error): a
# float version or metadata value would be truncated, a float mask or a bool priority read
# as something else.
_KINDS = {"b": ("b", "bools"), "i": ("iu", "integers"), "u": ("iu", "integers"),
          "f": ("iuf", "real numbers")}


def host_array(x):
  """``x`` as a numpy array when it is a host value (Python scalars, numpy, lists or tuples
  of them), else None (device or traced arrays, and lists holding tracers: JAX's own
  conversion). Lists count as host values: through ``jnp.asarray`` an int beyond int32
  raised JAX's ``OverflowError`` naming nothing, and a float beyond float32 became inf,
  stored as a zero priority (found by a review)."""
  if isinstance(x, (bool, int, float, np.ndarray, np.generic)):
    return np.asarray(x)
  if isinstance(x, (list, tuple)):
    try:
      a = np.asarray(x)
    except Exception:  # noqa: BLE001 - tracers, ragged lists: left to jnp's checks
      return None
    return a if a.dtype != object else None
  return None


def rows(x, b, dtype, name):
  """``x`` (a scalar or ``[b]``) as ``dtype[b]``. Host values (Python or numpy) stay
  numpy: constants to XLA, which ``item_info.pack`` leaves out of the row when zero and
  otherwise ORs in as a literal (a traced constant's pad is an operation XLA hoists out
  of a scan's loop, run on every call).

  Refused, naming ``name``: another dtype kind than ``dtype`` takes (``_KINDS``: integers
  for integer rows, bools for a mask, real numbers for priorities), and host integers
  beyond an integer ``dtype``'s range (they would wrap)."""
  if x is None:
    raise TypeError(f"{name} must be given (a scalar or [{b}]), got None.")
  given = host_array(x)
  host = given is not None
  if host:
    x = given
  else:
    given = jnp.asarray(x)
  target = np.dtype(dtype)
  kinds, names = _KINDS[target.kind]
  if given.dtype.kind not in kinds:
    raise TypeError(f"{name} must be {names}, got {given.dtype}.")
  bad = numerics.beyond(given, target) if host and target.kind in "iu" else None
  if bad:
    raise ValueError(f"{name} must fit {target.name}, got values in [{bad[0]}, {bad[1]}].")
  checked = jnp.asarray(x)  # the checks (shape) of any input
  if checked.ndim not in (0, 1) or (checked.ndim == 1 and checked.shape[0] != b):
    raise ValueError(f"{name} must be a scalar or have shape [{b}], got "
                     f"{list(checked.shape)}.")
  if target.kind == "f":
    x = fit_float(x, target, name)
    checked = jnp.asarray(x)
  if host:
    return np.broadcast_to(np.asarray(x).astype(checked.dtype).astype(dtype), (b,))
  return jnp.broadcast_to(checked, (b,)).astype(dtype)


def fit_float(x, dtype, name):
  """``x`` (real numbers) ready for a cast to the float ``dtype``: a host value of finite
  magnitude beyond ``dtype``'s range is refused, naming ``name`` (the cast would make it
  inf, which a priority row stores as 0: the most important item never drawn; found by
  a review); a traced wider float saturates at ``dtype``'s largest value instead."""
  fmax = np.finfo(dtype).max
  a = host_array(x)
  if a is not None:
    if a.dtype.kind == "f" and a.dtype.itemsize > np.dtype(dtype).itemsize and a.size:
      big = np.isfinite(a) & (np.abs(a) > fmax)
      if big.any():
        raise ValueError(f"{name} must fit {np.dtype(dtype).name}: a finite value beyond its "
                         f"range would become inf, got {float(np.abs(a[big]).max()):.3g}.")
    return a
  t = jnp.asarray(x)
  if t.dtype.kind == "f" and t.dtype.itemsize > np.dtype(dtype).itemsize:
    return jnp.where(jnp.isfinite(t), jnp.clip(t, -fmax, fmax), t)
  return x


def _typed_if_empty(x, dtype):
  """An empty host list as an empty ``dtype`` array (numpy reads ``[]`` as float64: a call
  on no slots, keys or values was refused as floats); anything else as it is."""
  return np.zeros((0,), dtype) if isinstance(x, (list, tuple)) and not len(x) else x


# ``keyed_args``' default: a call without values (``delete``); None is a missing value.
NO_VALUES = object()


def keyed_args(what: str, slots, keys, values=NO_VALUES, values_name: str = "values",
               values_kinds: str = "iuf"):
  """``(slots int32[K], keys, values)`` of a keyed call (``delete``, ``update_priorities``,
  ``set_metadata``), checked when tracing: ``slots`` integers of one axis (a float slot
  would be truncated to another slot), ``keys`` integers and ``values`` (of a dtype kind in
  ``values_kinds``) a scalar or of the same ``[K]`` shape. Raises naming the argument."""
  for name, x in (("slots", slots), ("keys", keys), (values_name, values)):
    if x is None:
      raise TypeError(f"{what}: {name} must be given, got None.")
  values = None if values is NO_VALUES else values
  slots, keys = _typed_if_empty(slots, np.int32), _typed_if_empty(keys, np.uint32)
  values = _typed_if_empty(values, np.int32 if values_kinds == "iu" else np.float32)
  host = host_array(slots)
  # A host slot beyond int32 would wrap onto another slot (2**32 + 1 onto slot 1).
  bad = numerics.beyond(host, np.int32) if host is not None else None
  if bad:
    raise ValueError(f"{what}: slots must fit int32 (Sample.info.slot), got values in "
                     f"[{bad[0]}, {bad[1]}].")
  slots_in = jnp.asarray(host if host is not None else slots)
  if slots_in.dtype.kind not in "iu":
    raise TypeError(f"{what}: slots must be integers (Sample.info.slot), got "
                    f"{slots_in.dtype}.")
  if slots_in.ndim != 1:
    raise ValueError(f"{what}: slots must be int32[K], got shape {list(slots_in.shape)}.")
  for name, x, kinds in (("keys", keys, "iu"), (values_name, values, values_kinds)):
    if x is None:
      continue
    # Host values (Python ints, lists) through numpy: ``jnp.asarray`` refused a valid
    # uint32 key above 2**31 as a Python int (OverflowError), before the range check.
    x = x if hasattr(x, "dtype") else np.asarray(x)
    if x.dtype.kind not in kinds:
      raise TypeError(f"{what}: {name} must be {'integers' if kinds == 'iu' else 'numbers'}, "
                      f"got {x.dtype}.")
    if x.ndim and x.shape != slots_in.shape:
      raise ValueError(f"{what}: {name} must be a scalar or of the slots' shape "
                       f"{list(slots_in.shape)}, got {list(x.shape)}.")
  # Keys are uint32: a host key outside [0, 2**32) would wrap onto another item's key.
  if keys is not None and not hasattr(keys, "aval"):
    bad = numerics.beyond(keys, np.uint32)
    if bad:
      raise ValueError(f"{what}: keys are uint32 (Sample.info.key), got values in "
                       f"[{bad[0]}, {bad[1]}].")
    keys = np.asarray(keys).astype(np.uint32)
  # Integer values are int32 (metadata): a host value beyond it would wrap.
  bad = numerics.beyond(values, np.int32) if values_kinds == "iu" else None
  if bad:
    raise ValueError(f"{what}: {values_name} must fit int32, got values in "
                     f"[{bad[0]}, {bad[1]}].")
  return slots_in.astype(jnp.int32), keys, values


def sanitize_priorities(p, counted):
  """Negative / NaN / inf -> 0 (documented); returns (clean, n_invalid)."""
  bad = ~jnp.isfinite(p) | (p < 0)
  return jnp.where(bad, 0.0, p).astype(jnp.float32), jnp.sum(bad & counted).astype(jnp.uint32)


def last_occurrence(slots, valid):
  """bool[K]: True at the last valid occurrence of each slot (O(K log K))."""
  k = slots.shape[0]
  sort_key = jnp.where(valid, slots, jnp.iinfo(jnp.int32).max)
  pos = jnp.arange(k, dtype=jnp.int32)
  s_key, s_pos = lax.sort((sort_key, pos), num_keys=1, is_stable=True)
  is_last_sorted = jnp.concatenate([s_key[1:] != s_key[:-1], jnp.ones((1,), bool)])
  is_last = jnp.zeros((k,), bool).at[s_pos].set(is_last_sorted)
  return is_last & valid


def key_matches(state: TableState, slots, keys):
  c = state.occupied.shape[0]
  slots = jnp.asarray(slots, jnp.int32)
  in_range = (slots >= 0) & (slots < c)
  safe = jnp.where(in_range, slots, 0)
  return safe, in_range & holds_key(state, safe, keys)


def holds_key(state: TableState, safe, keys):
  """bool[K]: slot ``safe[k]`` (in range) is occupied by the item of key ``keys[k]``.

  One slot: read inside a reduction (``count_read``): a one-index gather becomes a
  dynamic slice that XLA re-fuses into the later write of ``item_info``, which then
  reads what it overwrites (a copy of the array), and a two-index gather from it is one
  XLA:CPU splits across its threads."""
  keys = jnp.broadcast_to(jnp.asarray(keys, jnp.uint32), safe.shape)
  if safe.shape[0] == 1:
    return count_read(lambda s: item_info.at(state.item_info, s, "key"), safe,
                      take(state.occupied, safe), lambda k: k == keys[0])[None] > 0
  return state.occupied[safe] & (item_info.at(state.item_info, safe, "key") == keys)


def count_read(read, slots, where, pred):
  """int32[]: ``sum(where & pred(read(slots)))``, the gather inside the reduction.

  ``read(slots)``: the values at ``slots`` (say ``item_info.at(info, slots, "key")``).

  XLA:CPU splits a gather from a column over 256 KB across its threads, a hand-off
  each time it runs (it prices a gather by its operand; BUILD.md "Lean portable
  programs", finding 14), but not a reduction to a scalar, which it cannot split; so a
  read whose rows are only counted is done inside the count. One slot is read twice,
  the copy masked out (``take``: a one-index gather becomes a dynamic slice that XLA
  re-fuses into every consumer). ``pred`` must be elementwise.
  """
  if slots.shape[0] == 1:
    slots = jnp.concatenate([slots, slots])
    where = jnp.concatenate([where, jnp.zeros((1,), bool)])
  return jnp.sum(where & pred(read(slots)), dtype=jnp.int32)


def take(col, slots):
  """``col[slots]`` as a real gather even for one slot.

  A one-row gather lowers to a dynamic slice, which XLA re-fuses into every
  consumer; a consumer not ordered before a later in-place write of ``col``
  then costs a copy of the whole column. Two indices keep it a gather.
  """
  if slots.shape[0] == 1:
    return col[jnp.concatenate([slots, slots])][:1]
  return col[slots]
