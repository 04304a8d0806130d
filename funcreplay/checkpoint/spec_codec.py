"""``TableSpec`` <-> JSON, and a field-by-field comparison of two specs.

The manifest stores the spec as plain JSON (no pickle, nothing executable):
selectors and rate limiters by class name plus their dataclass fields,
infinities as the strings ``"inf"`` / ``"-inf"`` (strict JSON has no
Infinity), floats with ``repr`` precision so they come back bit-exact.

Signatures whose pytree structure is made of dicts, lists and tuples are
stored completely. Other structures (namedtuples, registered dataclasses)
are stored *opaquely* (``treedef`` as text plus leaf shapes/dtypes): such a
checkpoint restores only when the caller passes ``spec=``, which is then
checked against the stored description.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from typing import Any, Dict, List

import jax
import numpy as np

from funcreplay.checkpoint.errors import CheckpointError
from funcreplay.core import rate_limiters as rl
from funcreplay.core import selectors as sel
from funcreplay.core import storage
from funcreplay.core.columns import Column, Ragged
from funcreplay.core.signature import Signature
from funcreplay.core.spec import TableSpec

_SELECTORS = {cls.__name__: cls for cls in sel.SAMPLERS}


def _num(x):
  """A float/int as JSON (infinities as strings, a ``Fraction`` as ``"p/q"``)."""
  if isinstance(x, float) and math.isinf(x):
    return "inf" if x > 0 else "-inf"
  if isinstance(x, fractions.Fraction):
    return f"{x.numerator}/{x.denominator}"
  return x


def _unnum(x):
  if x == "inf":
    return math.inf
  if x == "-inf":
    return -math.inf
  if isinstance(x, str) and "/" in x:
    try:
      return fractions.Fraction(x)
    except ValueError:
      raise CheckpointError(f"malformed fraction {x!r} in the checkpoint spec.") from None
  return x


def selector_to_json(s) -> Dict[str, Any]:
  fields = {f.name: _num(getattr(s, f.name)) for f in dataclasses.fields(s)}
  return {"type": type(s).__name__, **fields}


def selector_from_json(obj):
  obj = dict(obj)
  name = obj.pop("type")
  if name not in _SELECTORS:
    raise CheckpointError(f"unknown selector {name!r} in the checkpoint spec; known: "
                          f"{sorted(_SELECTORS)}.")
  return _SELECTORS[name](**{k: _unnum(v) for k, v in obj.items()})


def limiter_to_json(r: rl.RateLimiter) -> Dict[str, Any]:
  return {f.name: _num(getattr(r, f.name)) for f in dataclasses.fields(r)}


def limiter_from_json(obj) -> rl.RateLimiter:
  return rl.RateLimiter(**{k: _unnum(v) for k, v in obj.items()})


def signature_to_json(sig: Signature) -> Dict[str, Any]:
  """Full description if the structure is dicts/lists/tuples, else an opaque one."""
  leaves = [{"name": n, "shape": list(s.shape), "dtype": np.dtype(s.dtype).name}
            for n, s in zip(sig.names, sig.leaves, strict=True)]
  out = {"treedef": str(sig.treedef), "leaves": leaves, "structure": None}
  try:
    full = sig.to_json()
    if Signature.from_json(full) == sig:  # e.g. non-str dict keys would not survive
      out["structure"] = full["structure"]
  except (TypeError, ValueError, KeyError):
    pass
  return out


def signature_from_json(obj) -> Signature:
  if obj.get("structure") is None:
    raise CheckpointError(
        f"the checkpoint's item signature has a structure that JSON cannot describe "
        f"({obj['treedef']}); pass spec= (the TableSpec it was saved with) to restore it.")
  return Signature.from_json({"structure": obj["structure"], "leaves": obj["leaves"]})


def spec_to_json(spec: TableSpec) -> Dict[str, Any]:
  """JSON-able dict describing every field of ``spec`` (``columns`` / ``ragged`` only when
  a column is typed or a leaf ragged: older manifests stay what they were)."""
  out = {
      "capacity": spec.capacity,
      "signature": signature_to_json(spec.signature),
      "sampler": selector_to_json(spec.sampler),
      "remover": selector_to_json(spec.remover),
      "max_times_sampled": spec.max_times_sampled,
      "max_staleness": spec.max_staleness,
      "rate_limiter": limiter_to_json(spec.rate_limiter),
      "metadata": list(spec.metadata),
      "default_priority": spec.default_priority,
  }
  if not all(c.plain for c in spec.columns):
    out["columns"] = [c.to_json() for c in spec.columns]
  if spec.ragged:
    out["ragged"] = [{"leaf": i, **r.to_json()} for i, r in spec.ragged]
  if not spec.holes:  # a promise about later operations: restores check the state instead
    out["holes"] = False
  if spec.position_index:  # a layout: restores rebuild or drop it (checkpoint.positions)
    out["position_index"] = True
  if spec.storage != storage.resolve(spec.signature, None, bool(spec.ragged)):
    out["storage"] = spec.storage  # chosen, not picked (a layout only: restores ignore it)
  return out


def spec_from_json(obj) -> TableSpec:
  """Inverse of ``spec_to_json`` (raises ``CheckpointError`` on an opaque signature)."""
  try:
    signature = signature_from_json(obj["signature"])
    if obj.get("ragged"):  # put the Ragged leaves back in place of their lengths
      leaves = list(signature.leaves)
      for r in obj["ragged"]:
        leaves[r["leaf"]] = Ragged.from_json(r)
      signature = jax.tree_util.tree_unflatten(signature.treedef, leaves)
    metadata = (tuple(Column.from_json(c) for c in obj["columns"]) if obj.get("columns")
                else tuple(obj["metadata"]))
    return TableSpec(
        capacity=obj["capacity"],
        signature=signature,
        sampler=selector_from_json(obj["sampler"]),
        remover=selector_from_json(obj["remover"]),
        max_times_sampled=obj["max_times_sampled"],
        max_staleness=obj["max_staleness"],
        rate_limiter=limiter_from_json(obj["rate_limiter"]),
        metadata=metadata,
        default_priority=obj["default_priority"],
        storage=obj.get("storage"),
        holes=obj.get("holes", True),
        position_index=obj.get("position_index", False),
    )
  except CheckpointError:
    raise
  except (KeyError, TypeError, ValueError) as e:
    raise CheckpointError(f"the checkpoint's spec cannot be decoded ({type(e).__name__}: {e}); "
                          "the manifest is damaged or from an incompatible version.") from None


def _signature_diffs(saved: Dict[str, Any], want: Signature) -> List[str]:
  out = []
  if saved["treedef"] != str(want.treedef):
    out.append(f"signature structure: checkpoint {saved['treedef']}, spec {want.treedef}")
  got = {d["name"]: d for d in saved["leaves"]}
  for name, s in zip(want.names, want.leaves, strict=True):
    d = got.pop(name, None)
    if d is None:
      out.append(f"signature leaf {name}: missing from the checkpoint")
      continue
    ws, wd = list(s.shape), np.dtype(s.dtype).name
    if d["shape"] != ws or d["dtype"] != wd:
      out.append(f"signature leaf {name}: checkpoint {d['dtype']}{d['shape']}, spec {wd}{ws}")
  for name, d in got.items():
    out.append(f"signature leaf {name}: in the checkpoint ({d['dtype']}{d['shape']}) but not "
               "in the spec")
  return out


def spec_diffs(saved: Dict[str, Any], want: TableSpec, *, allow_capacity_growth: bool) -> List[str]:
  """Human-readable differences between a saved spec (JSON) and ``want``; [] if compatible.

  Capacity may grow when ``allow_capacity_growth``; every other field must
  match exactly (the state's layout or its meaning depends on it).
  """
  out = []
  c_saved, c_want = saved["capacity"], want.capacity
  if c_saved != c_want and not (allow_capacity_growth and c_want > c_saved):
    hint = (" (pass allow_capacity_growth=True to restore into a larger table)"
            if c_want > c_saved else " (shrinking would drop items: not supported)")
    out.append(f"capacity: checkpoint {c_saved}, spec {c_want}{hint}")
  out += _signature_diffs(saved["signature"], want.signature)
  mine = spec_to_json(want)
  saved = _with_current_fields(saved)
  for field in ("sampler", "remover", "max_times_sampled", "max_staleness", "rate_limiter",
                "metadata", "default_priority", "columns", "ragged"):
    if saved.get(field) != mine.get(field):
      out.append(f"{field}: checkpoint {saved.get(field)}, spec {mine.get(field)}")
  return out


def _with_current_fields(saved: Dict[str, Any]) -> Dict[str, Any]:
  """``saved`` with its selectors and rate limiter decoded and encoded again: a field
  added to them since the checkpoint was written (``Fifo(fill_holes)``) then has its
  default, as a restore without a spec gives it, instead of making every older
  checkpoint differ from a spec equal to its own (found by a review)."""
  out = dict(saved)
  try:
    for field in ("sampler", "remover"):
      out[field] = selector_to_json(selector_from_json(saved[field]))
    out["rate_limiter"] = limiter_to_json(limiter_from_json(saved["rate_limiter"]))
  except (KeyError, TypeError, ValueError):
    return saved  # undecodable: compared as written (and named in the differences)
  return out
