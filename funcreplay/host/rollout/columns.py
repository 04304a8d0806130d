"""Host encoding of typed metadata columns (``fr.Column``) to their stored int32 words.

Every column is stored as ``int32[C]`` (``funcreplay.core.columns``): a vocabulary
column as the index of its string, a float32 column as its bit pattern. These
functions turn what a user passes (strings, floats, ints) into those words, and back,
with the boundary's clear errors: an unknown vocabulary value, a float for an int
column, a value that does not fit. ``Table.insert`` encodes through ``rows``; the
queues in front of it (the ``Ingestor``, the Ray ``RemoteWriter``) encode each item at
``put`` time through ``item_words`` / ``batch_words`` (so a bad value is refused there,
with the same error) and hand the table ``insert_values``: values it stores as exactly
those words.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from funcreplay.core.columns import Column
from funcreplay.host import validation


def _codes(col: Column, x, what: str) -> np.ndarray:
  """int32 codes of vocabulary values ``x`` (strings; ints are taken as codes)."""
  a = np.asarray(x)
  flat = a.reshape(-1)
  if a.dtype.kind in "iu":
    if flat.size and (flat.min() < 0 or flat.max() >= len(col.vocab)):
      raise ValueError(f"{what}: codes must lie in [0, {len(col.vocab)}) (the vocab "
                       f"{list(col.vocab)}), got range [{flat.min()}, {flat.max()}].")
    return a.astype(np.int32)
  if a.dtype.kind not in "UOS":
    raise TypeError(f"{what}: column {col.name!r} takes strings of its vocab {list(col.vocab)}, "
                    f"got dtype {a.dtype.name}.")
  index = {v: i for i, v in enumerate(col.vocab)}
  out = np.empty(flat.shape, np.int32)
  for i, v in enumerate(flat):
    if isinstance(v, bytes):
      v = v.decode()
    if isinstance(v, np.str_):
      v = str(v)
    code = index.get(v) if isinstance(v, str) else None
    if code is None:
      raise ValueError(f"{what}: {v!r} is not in the vocab of column {col.name!r}: "
                       f"{list(col.vocab)}.")
    out[i] = code
  return out.reshape(a.shape)


def _float_bits(col: Column, x, what: str) -> np.ndarray:
  a = validation.as_array(x, what)
  if a.dtype.kind not in "fiu" or a.dtype.kind == "b":
    raise TypeError(f"{what}: column {col.name!r} is float32, got dtype {a.dtype.name}.")
  with np.errstate(over="ignore", invalid="ignore"):
    f = np.array(a, np.float64).astype(np.float32)
  if np.isnan(f).any():
    raise ValueError(f"{what}: NaN in float column {col.name!r} (it would never match a where).")
  if (np.isinf(f) & np.isfinite(np.asarray(a, np.float64))).any():
    raise ValueError(f"{what}: a value of column {col.name!r} overflows float32.")
  f = np.where(f == 0, np.float32(0.0), f).astype(np.float32)  # -0.0 -> 0.0: one bit
  return f.view(np.int32).reshape(a.shape)                      # pattern per where= value


def encode(col: Column, x, what: str) -> np.ndarray:
  """Stored int32 words of ``x`` (a scalar or an array) for column ``col``; the same shape.
  A plain column keeps the int checks of ``validation.int_rows``."""
  if col.vocab is not None:
    return _codes(col, x, what)
  if col.is_float:
    return _float_bits(col, x, what)
  a = validation.as_array(x, what)
  if a.dtype.kind not in "iu":
    raise TypeError(f"{what}: column {col.name!r} is int32, got dtype {a.dtype.name} "
                    "(cast it, or declare fr.Column(name, dtype='float32')).")
  lo, hi = validation.I32.min, validation.I32.max
  if a.size and (a.min() < lo or a.max() > hi):
    raise ValueError(f"{what}: values must lie in [{lo}, {hi}], got range [{a.min()}, "
                     f"{a.max()}].")
  return a.astype(np.int32)


def rows(col: Column, x, n: int, what: str) -> np.ndarray:
  """int32[n] stored words from a scalar or an ``[n]`` array of column values."""
  if col.plain:
    return validation.int_rows(x, n, what)
  a = encode(col, x, what)
  if a.ndim > 1 or (a.ndim == 1 and a.shape[0] != n):
    raise ValueError(f"{what}: expected a scalar or shape [{n}], got {list(a.shape)}.")
  return np.ascontiguousarray(np.broadcast_to(a, (n,)), np.int32)


def decode(col: Column, stored) -> np.ndarray:
  """Values of stored words: str (vocab), float32 or int32 numpy arrays."""
  s = np.array(stored, np.int32)
  if col.vocab is not None:
    return np.asarray(col.vocab, dtype=object)[s]
  return col.decode(s)


def value_key(col: Column, value: Any):
  """A hashable Python key for one requested value (the dict keys of ``take_batch``)."""
  if isinstance(value, np.generic):
    value = value.item()
  return value


def _by_name(columns: Sequence[Column], metadata, what: str) -> Dict[str, Column]:
  by_name = {c.name: c for c in columns}
  validation.check_metadata_columns(metadata, by_name, what)
  return by_name


def item_words(columns: Sequence[Column], metadata: Mapping[str, Any],
               what: str) -> Dict[str, int]:
  """ONE item's metadata (``Ingestor.put``, ``RemoteWriter.put``): ``{name: stored word}``
  over the given keys of ``metadata`` (a subset of ``columns``, the spec's). Each value is
  a scalar: a string of a vocabulary, a float of a float32 column, an int; checked and
  encoded by ``rows``, as in ``Table.insert`` (the same errors)."""
  by_name = _by_name(columns, metadata, what)
  out = {}
  for k, v in metadata.items():
    w = f"{what} metadata[{k!r}]"
    if np.ndim(v) != 0:
      raise TypeError(f"{w}: expected one value (a scalar) for one item, got shape "
                      f"{list(np.shape(v))}.")
    out[k] = int(rows(by_name[k], v, 1, w)[0])
  return out


def batch_words(columns: Sequence[Column], metadata: Mapping[str, Any], n: int,
                what: str) -> Dict[str, List[int]]:
  """``{name: n stored words}`` of a batch's metadata (each value a scalar or ``[n]``)."""
  by_name = _by_name(columns, metadata, what)
  return {k: rows(by_name[k], v, n, f"{what} metadata[{k!r}]").tolist()
          for k, v in metadata.items()}


def check_item_extras(version, priority, metadata: Optional[Mapping[str, Any]],
                      columns: Sequence[Column], what: str):
  """``(version, priority, metadata)`` of ONE item (``Ingestor.put``, the Ray
  ``RemoteWriter.put``), checked: ``validation.check_version_priority``, and the
  metadata as ``item_words`` (stored words of the spec's ``columns``). None stays None."""
  version, priority = validation.check_version_priority(version, priority, what)
  if metadata is not None:
    metadata = item_words(columns, metadata, what)
  return version, priority, metadata


def insert_values(columns: Sequence[Column],
                  words: Sequence[Optional[Mapping[str, int]]]) -> Dict[str, np.ndarray]:
  """``Table.insert``'s ``metadata=`` for items whose stored words are ``words`` (one dict
  per item from ``item_words`` / ``batch_words``, or None; a missing column is word 0, as
  in ``Table.insert``): int32 codes for int and vocabulary columns, float32 for a float
  column (its words' bits: ``encode`` gives them back unchanged, as -0.0 and NaN never
  reach a word)."""
  out = {}
  for c in columns:
    w = np.array([m.get(c.name, 0) if m else 0 for m in words], np.int32)
    out[c.name] = c.decode(w)
  return out


__all__ = ["batch_words", "check_item_extras", "decode", "encode", "insert_values", "item_words",
           "rows", "value_key"]
