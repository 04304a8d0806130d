"""``StateRecord``: a ``TableState`` with the ledger unpacked and the items as columns, as
checkpoints store it."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from funcreplay.core import item_info, storage
from funcreplay.core.ledger import LEDGER_FIELDS, ledger_fields, pack_ledger
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState, register_dataclass


@register_dataclass
@dataclasses.dataclass(frozen=True)
class StateRecord:
  """A ``TableState`` with the ledger unpacked: every scalar and counter its own leaf.

  The checkpoint format stores this layout (one named array per leaf:
  ``.write_pos``, ``.counters['inserts']``, ...), so checkpoints do not
  depend on how the ledger packs its words; nor on ``item_info``'s packing:
  ``key``, ``version``, ``times_sampled`` and ``priority`` are stored as the
  columns ``TableState``'s properties of those names read. Fields as in ``TableState``;
  ``write_pos``, ``next_key``, ``max_priority``, ``limiter_diff`` and
  ``counters`` as its properties describe.
  """

  data: Any
  occupied: Any
  key: Any
  version: Any
  times_sampled: Any
  priority: Any
  metadata: Dict[str, Any]
  occ_tree: Any
  weight_tree: Any
  remover_tree: Any
  touched: Any
  version_hist: Any
  version_bounds: Any
  position_index: Any
  write_pos: Any
  next_key: Any
  max_priority: Any
  limiter_diff: Any
  counters: Dict[str, Any]


_COLUMN_FIELDS = tuple(f.name for f in dataclasses.fields(TableState)
                       if f.name not in ("ledger", "item_info"))


def to_record(state: TableState, spec: TableSpec, nlead: int = 1) -> StateRecord:
  """``state`` with its ledger unpacked and its items as one array per signature leaf
  (``storage.to_columns``: checkpoints do not depend on ``spec.storage`` either).
  ``nlead``: slot axes (2 for a sharded state). Numpy in, numpy out."""
  fields = {name: getattr(state, name) for name in _COLUMN_FIELDS}
  fields["data"] = storage.to_columns(spec, state.data, nlead)
  fields.update({name: item_info.column(state.item_info, name) for name in item_info.FIELDS})
  return StateRecord(**fields, **ledger_fields(state))


def from_record(record: StateRecord, spec: TableSpec, nlead: int = 1) -> TableState:
  """The ``TableState`` of a ``StateRecord`` for ``spec`` (the inverse of ``to_record``)."""
  fields = {name: getattr(record, name) for name in _COLUMN_FIELDS}
  fields["data"] = storage.from_columns(spec, record.data, nlead)
  fields["item_info"] = item_info.pack(**{name: getattr(record, name)
                                          for name in item_info.FIELDS})
  return TableState(**fields,
                    ledger=pack_ledger(**{name: getattr(record, name) for name in LEDGER_FIELDS}))
