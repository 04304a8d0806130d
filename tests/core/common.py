"""What the core contract tests (tests/core/test_core_*.py) share."""

from __future__ import annotations

import numpy as np

from tests.helpers import items_from_ids, jitted


def fill(spec, n, version=0):
  """A fresh table of ``spec`` holding items ``0 .. n-1`` inserted at ``version``."""
  f = jitted(spec)
  state = f["table"].init()
  return f["insert"](state, items_from_ids(np.arange(n)), version=version)
