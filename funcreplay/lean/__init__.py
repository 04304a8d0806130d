"""Lean portable programs: the common cases of the table in few XLA operations.

Each module builds one pure program for one common case, specialised by the
static spec and call arguments so that a feature that is off costs nothing,
with no ``conditional`` or ``while`` in the compiled program:

* ``draws``: the random-bit recipe (reproducible in C++) and the loop-free
  exact uniform draw without replacement (a virtual partial Fisher-Yates).
* ``uniform``: ``Uniform`` sampling (any remover; holes allowed) without masks.
* ``insert``: insert into a ``Fifo`` ring (any weight sampler).
* ``prioritized``: ``Prioritized`` sampling without masks, and
  ``update_priorities`` for tables without an order tree.
* ``hlo``: operation counts of a compiled program (the leanness checks).

Every program reads and writes the ordinary ``TableState`` and keeps all its
invariants, so the rest of the table (delete, eviction, checkpoints, stats)
works on the result unchanged. ``applies`` in each module says statically
when the lean program may replace the general one.
"""
