"""Typed metadata columns (``Column``) and variable-length leaves (``Ragged``).

Both are static, hashable declarations that live in a ``TableSpec``; neither
changes what the pure state stores:

* every metadata column is ``int32[C]`` in ``TableState.metadata`` (the native
  insert kernel, checkpoints, sharding and the torch bridge rely on that). A
  ``Column`` says how to read it: plain int32, an index into a vocabulary of
  strings (``vocab``), or the bit pattern of a float32 (``dtype="float32"``:
  stored with ``lax.bitcast_convert_type``, so the value comes back bit-exact
  and equality / membership ``where`` queries compare bits).
* a ``Ragged`` leaf is stored by the host ``Table`` in a token arena (one flat
  buffer per leaf, ``funcreplay.host.rollout.arena``); the pure state keeps the
  item's length (an ``int32`` scalar leaf at the same place in the pytree), so
  the core, the native kernels and checkpoints see a dense signature.
  BUILD.md "Ragged leaves live on the host" says why.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax.numpy as jnp
import numpy as np
from jax import lax

COLUMN_DTYPES = ("int32", "float32")
MAX_VOCAB = 2**31 - 1  # codes are int32


@dataclasses.dataclass(frozen=True, init=False)
class Column:
  """A metadata column: ``Column("task", vocab=("math", "code"))``, ``Column("difficulty",
  dtype="float32")`` or ``Column("seed")`` (the same as the plain name ``"seed"``).

  Attributes:
    name: an identifier (not a built-in column name).
    dtype: ``"int32"`` (default) or ``"float32"``.
    vocab: the allowed string values of an int32 column (stored as their index, so
      ``where={"task": "math"}`` and ``metadata={"task": "math"}`` work); None: plain
      ints / floats.
  """

  name: str
  dtype: str
  vocab: Optional[Tuple[str, ...]]

  def __init__(self, name: str, dtype: str = "int32", vocab=None):
    if not isinstance(name, str) or not name.isidentifier():
      raise ValueError(f"Column: the name must be an identifier, got {name!r}.")
    dtype = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if dtype not in COLUMN_DTYPES:
      raise ValueError(f"Column({name!r}): dtype must be one of {COLUMN_DTYPES}, got {dtype!r}.")
    if vocab is not None:
      if isinstance(vocab, str):
        raise TypeError(f"Column({name!r}): vocab must be a sequence of strings, got the string "
                        f"{vocab!r} (write vocab=({vocab!r},)).")
      vocab = tuple(vocab)
      if dtype != "int32":
        raise ValueError(f"Column({name!r}): a vocab needs dtype 'int32' (values are stored as "
                         f"their index), got {dtype!r}.")
      if not vocab or len(vocab) > MAX_VOCAB:
        raise ValueError(f"Column({name!r}): vocab must hold 1 to {MAX_VOCAB} strings.")
      bad = [v for v in vocab if not isinstance(v, str)]
      if bad:
        raise TypeError(f"Column({name!r}): vocab values must be strings, got {bad[0]!r}.")
      if len(set(vocab)) != len(vocab):
        dup = sorted({v for v in vocab if vocab.count(v) > 1})
        raise ValueError(f"Column({name!r}): vocab has duplicates {dup}.")
    object.__setattr__(self, "name", name)
    object.__setattr__(self, "dtype", dtype)
    object.__setattr__(self, "vocab", vocab)

  @property
  def is_float(self) -> bool:
    return self.dtype == "float32"

  @property
  def plain(self) -> bool:
    """True for a plain int32 column (what a bare name in ``metadata=`` declares)."""
    return self.dtype == "int32" and self.vocab is None

  def decode(self, stored):
    """The stored ``int32`` array as values: float32 for a float column, the codes
    otherwise (``vocab[code]`` names them). Works on numpy and inside jit."""
    if not self.is_float:
      return stored
    if isinstance(stored, np.ndarray):
      return np.array(stored, np.int32).view(np.float32)
    return lax.bitcast_convert_type(jnp.asarray(stored, jnp.int32), jnp.float32)

  def to_json(self):
    return {"name": self.name, "dtype": self.dtype,
            "vocab": None if self.vocab is None else list(self.vocab)}

  @classmethod
  def from_json(cls, obj) -> "Column":
    return cls(obj["name"], obj["dtype"], obj["vocab"])


@dataclasses.dataclass(frozen=True, init=False)
class Ragged:
  """A variable-length 1-D leaf of an item signature: up to ``max_len`` values of ``dtype``.

  ``TableSpec(capacity, {"tokens": fr.Ragged(512, jnp.int32), "reward": ...})``. The
  host ``Table`` stores such a leaf without per-item padding (a token arena) and
  hands it out as a ``RaggedBatch`` (padded ``[B, max_len]`` + lengths, or packed
  ``[sum_len]`` + offsets). A batch to insert gives the leaf as a list of 1-D
  arrays, or as ``(padded [B, L], lengths [B])``, or as a ``RaggedBatch``.
  """

  max_len: int
  dtype: np.dtype

  def __init__(self, max_len: int, dtype=jnp.int32):
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) \
        or not 1 <= max_len < 2**31:
      raise ValueError(f"Ragged: max_len must be an int in [1, 2**31), got {max_len!r}.")
    d = np.dtype(dtype)
    if d.kind not in "biuf" or d.itemsize > 4 and d.kind != "b":
      raise TypeError(f"Ragged: dtype must be a bool, int or float of at most 32 bits "
                      f"(x64 is off), got {d.name}.")
    object.__setattr__(self, "max_len", int(max_len))
    object.__setattr__(self, "dtype", d)

  def __hash__(self):
    return hash((self.max_len, self.dtype.str))

  def __eq__(self, other):
    return isinstance(other, Ragged) and (self.max_len, self.dtype) == (other.max_len,
                                                                        other.dtype)

  def __repr__(self):
    return f"Ragged(max_len={self.max_len}, dtype={self.dtype.name})"

  def to_json(self):
    return {"max_len": self.max_len, "dtype": self.dtype.name}

  @classmethod
  def from_json(cls, obj) -> "Ragged":
    return cls(obj["max_len"], np.dtype(obj["dtype"]))


LENGTH_DTYPE = np.dtype(np.int32)  # the dense stand-in of a Ragged leaf: its length
