"""The kernels' item_info layout (csrc/item_info.h) is ``funcreplay.core.item_info``'s.

``TableState.item_info`` is ``uint32[C, 4]``; the kernels find each field by a column
constant of item_info.h. A drift between the two would make a kernel read or write the
wrong word without any error, so the layout is pinned here on the Python side, and
``native.build`` refuses (portable path, one warning) a library whose exported layout
(``funcreplay_item_info_layout``) differs from ``item_info.COLUMNS`` / ``WIDTH``.
"""

from __future__ import annotations

import types

import pytest

from funcreplay.core import item_info
from funcreplay.native import build
from tests.helpers import require_native_kernels


def test_item_info_columns_are_the_kernels():
  # Also in csrc/item_info.h (kInfoKey, kInfoVersion, kInfoTimesSampled, kInfoPriority,
  # kInfoWidth): change both together.
  assert item_info.COLUMNS == {"key": 0, "version": 1, "times_sampled": 2, "priority": 3}
  assert item_info.WIDTH == 4


def test_library_exports_the_same_layout():
  require_native_kernels()
  lib = build.library()
  build.check_item_info(lib)  # the real library passes
  assert build.item_info_layout() == "key:0;version:1;times_sampled:2;priority:3;width:4"


def test_a_drifted_layout_is_refused(monkeypatch):
  require_native_kernels()
  lib = build.library()
  swapped = dict(item_info.COLUMNS, version=2, times_sampled=1)
  monkeypatch.setattr(build, "item_info",
                      types.SimpleNamespace(COLUMNS=swapped, WIDTH=item_info.WIDTH))
  with pytest.raises(RuntimeError, match="item_info layout .* is not funcreplay.core.item_info"):
    build.check_item_info(lib)
