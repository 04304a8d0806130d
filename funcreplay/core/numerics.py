"""Numeric constants shared by the core and the layers above."""

# Floor for a probability, weight or total before a division, a log or a
# negative power. Rows it guards are masked out anyway (``valid`` False, a
# zero weight); the floor only keeps the arithmetic finite: with N >= 1
# eligible items and beta <= 1, ``(N * TINY) ** -beta <= 1e30`` (float32
# max ~3.4e38), and ``TINY ** alpha`` for alpha <= 1 is still a normal
# float32 (smallest normal ~1.2e-38). The C++ kernels use the same 1e-30f.
TINY = 1e-30
