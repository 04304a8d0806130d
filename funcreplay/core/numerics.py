"""Numeric constants and checks shared by the core and the layers above."""

import numpy as np

# Floor for a probability, weight or total before a division, a log or a
# negative power. Rows it guards are masked out anyway (``valid`` False, a
# zero weight); the floor only keeps the arithmetic finite: with N >= 1
# eligible items and beta <= 1, ``(N * TINY) ** -beta <= 1e30`` (float32
# max ~3.4e38), and ``TINY ** alpha`` for alpha <= 1 is still a normal
# float32 (smallest normal ~1.2e-38). The C++ kernels use the same 1e-30f.
TINY = 1e-30

# Floor of a total weight before a division, where the total may be 0 (the smallest normal
# float32). Weights are normal or 0 (``powers``), so a positive total is at least this
# and the floor changes nothing but 0. TINY did: at a Prioritized exponent above 1 totals
# go below it (four priorities of 1e-16 at exponent 2: 4e-32), and each probability read
# 0.01 for 0.25 (found by a review). The C++ kernels' kMinTotal.
MIN_TOTAL = float(np.finfo(np.float32).tiny)


def beyond(x, dtype):
  """``(lo, hi)`` of the host integers ``x`` (Python or numpy) when one of them lies
  outside ``dtype``'s range (converting would wrap it onto another value), else None;
  None for device or traced arrays (checked by their dtype) and empty ones. The one range
  check of host integers: rows, keyed calls' keys and metadata, versions, group writers
  and sharded calls raise their own errors from it."""
  if hasattr(x, "aval"):
    return None
  a = np.asarray(x)
  if a.dtype.kind not in "iu" or not a.size:
    return None
  lo, hi, info = int(a.min()), int(a.max()), np.iinfo(dtype)
  return (lo, hi) if lo < info.min or hi > info.max else None
