"""Keeping donated updates in place: order reads of a column before its writes.

XLA updates a donated buffer in place only when every read of the old
contents is known to happen first, and on CPU it decides this from data
dependencies alone. A gather whose result does not feed a later scatter
(``info.priority = priority[slots]`` in ``sample``, then ``update_priorities``
scattering into ``priority``) leaves the two unordered, and XLA resolves that
by copying the whole ``[C]`` column: an O(C) cost per call that grows with
capacity. ``lax.optimization_barrier`` does not help here (the CPU pipeline
expands it before copy insertion), so ``settle`` / ``tie`` add a real but
O(1) data dependency instead: each capacity-sized leaf gets two rows
rewritten (to themselves) at positions computed from the reads (``never``).
The predicate is never true, but XLA cannot prove it, so every later writer
of that leaf is ordered after the reads and updates in place.

Fusion makes this subtler: XLA re-fuses cheap producers (a slice such as
``tree[1]``, elementwise ops, a dynamic-update-slice) into *every* consumer,
so one read in the program becomes several reads of the buffer, and the tie
orders only some of them. Hence ``never`` funnels scalar reads through a sort
and arrays through reductions (neither is duplicated), ``once`` does the same
for scalars that are used later, and ``tie`` writes with a two-index scatter,
which XLA neither fuses into later gathers nor turns into a slice update.

The same holds across calls: a ``sample`` then an ``insert`` on the state it
returns (in one jit, or a scan body) must order the sample's gathers before
the insert's writes of the same columns. The lean sample does it with
``witness`` (one element of each of its materialized outputs) feeding the
returned ``write_pos``, which every write of the insert depends on
(``uniform_lean.finish``; tests/core/test_hlo.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def never(reads) -> jnp.ndarray:
  """bool[]: always False, computed from every leaf of ``reads`` (cost O(size of reads))."""
  by_shape, scalars = {}, [jnp.uint32(0)]
  for x in jax.tree_util.tree_leaves(reads):
    x = jnp.asarray(x)
    if x.size == 0:
      continue
    if x.dtype == jnp.bool_ or jax.dtypes.itemsize_bits(x.dtype) < 8:
      # bool, and sub-byte types (int4, float4...), which cannot be bitcast to
      # a whole-byte type elementwise: a value conversion reads them as well.
      x = x.astype(jnp.uint8)
    bits = x.dtype.itemsize * 8
    if bits == 64:
      x = lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    else:
      x = lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}"))
    if x.size > 1:
      x = x.astype(jnp.uint32)
      by_shape[x.shape] = x if x.shape not in by_shape else by_shape[x.shape] + x
    else:
      scalars.append(x.reshape(()).astype(jnp.uint32))
  # A reduction (XLA does not duplicate one into its consumers) per shape, of the leaves
  # of that shape added elementwise: a reduction per leaf was an operation each, two for
  # more than 32 elements on XLA:CPU (BUILD.md finding 20), and a reduction of their
  # concatenation XLA splits back into one per leaf.
  sums = [jnp.uint32(0)] + [jnp.sum(x, dtype=jnp.uint32) for x in by_shape.values()]
  # A scalar read (say ``tree[1]``) is a slice, which XLA re-fuses into every
  # consumer: each copy is a read of the buffer that the tie does not order.
  # Passing the scalars through a sort (never duplicated, never simplified
  # away) leaves a single read.
  total = sum(sums) + jnp.sum(lax.sort(jnp.stack(scalars)), dtype=jnp.uint32)
  # A uint32 has at most 32 bits set; XLA does not reason about popcount ranges.
  return lax.population_count(total) > 32


def witness(arrays) -> jnp.ndarray:
  """uint32[]: a value computed from the *buffers* of ``arrays`` (a pytree), O(leaves).

  For ``after``: a write made dependent on it is ordered after whatever produced
  those buffers (say the fusion that gathered a sample's rows from a column), at
  the cost of reading one element of each, not a reduction of each (a reduction
  costs XLA:CPU ~3 fusions). Sound only for arrays XLA materializes (a gather of
  many rows, the sample's outputs), not for a cheap producer that XLA re-fuses
  into its consumers (a slice, elementwise ops): use ``never`` / ``once`` there.
  Pass each materialized array as a leaf of its own (a ``jnp.stack`` of several would
  be simplified to the first one's element).
  The elements are summed elementwise (XLA fuses that into the consumer): duplicates of
  this sum read the materialized arrays again, never the columns behind them.
  """
  firsts = [jnp.uint32(0)]
  for x in jax.tree_util.tree_leaves(arrays):
    x = jnp.asarray(x)
    if x.size == 0:
      continue
    x = x.reshape(-1)[0]
    if x.dtype == jnp.bool_ or jax.dtypes.itemsize_bits(x.dtype) < 32:
      x = x.astype(jnp.uint32)  # a value conversion: reads the element as well
    elif jax.dtypes.itemsize_bits(x.dtype) == 64:
      x = lax.bitcast_convert_type(x, jnp.uint32)[0]
    firsts.append(lax.bitcast_convert_type(x, jnp.uint32))
  return sum(firsts)


def once(values):
  """``values`` (a pytree of arrays read from big buffers: scalars, or a few rows), each
  read exactly once.

  The result comes out of a sort of two copies (along a new leading axis), which XLA
  neither duplicates into consumers nor simplifies away; a later ``tie`` on any value
  computed from the result then orders every use of the reads.
  """
  leaves, treedef = jax.tree_util.tree_flatten(values)
  leaves = [jnp.asarray(x) for x in leaves]
  if not leaves:
    return values
  if len({x.shape for x in leaves}) > 1:
    raise ValueError(f"once: the values must have one shape, got {[x.shape for x in leaves]}")
  key = lax.broadcasted_iota(jnp.int32, (2,) + leaves[0].shape, 0)
  out = lax.sort((key, *[jnp.stack([x, x]) for x in leaves]), dimension=0, num_keys=1)
  return jax.tree_util.tree_unflatten(treedef, [y[0] for y in out[1:]])


def once_on_cpu(values):
  """``once(values)`` on CPU; ``values`` themselves elsewhere.

  For the lean samples' reads of the count tree's root (the size) and node 0: on XLA:GPU
  the programs keep the trees in place without ``once`` (insert then sample, sample then
  insert, a sample alone, a prioritized sample then ``update_priorities``: no big copy,
  experiments/accel_hlo.py), where its stacks and sort are 2-3 kernels a sample (BUILD.md
  finding 27). The same values either way."""
  return lax.platform_dependent(values, cpu=once, default=lambda v: v)


def once_off_cpu(values):
  """``once(values)`` on every backend but the CPU; ``values`` themselves there.

  For reads that XLA:GPU recomputes inside a consumer that is not ordered before the next
  write of the buffer read (a victim's count inside the occupancy tree's scatter), so that
  it copies the buffer, where the CPU program keeps it in place without the sort's
  operation (experiments/accel_copies.py). The same values either way."""
  return lax.platform_dependent(values, cpu=lambda v: v, default=once)


def tie(leaf: jnp.ndarray, flag: jnp.ndarray) -> jnp.ndarray:
  """``leaf`` unchanged, but data-dependent on ``flag`` (an O(1) in-place update).

  Rows 0 and 1 are scattered back onto themselves. A two-index scatter, not a
  dynamic-update-slice (nor a one-index scatter, which XLA rewrites into
  one): XLA fuses a dynamic-update-slice into a later gather of the leaf,
  and that gather then reads the buffer the update writes in place (a copy).
  """
  if leaf.ndim == 0 or leaf.shape[0] < 2:
    return leaf
  rows = jnp.where(flag, jnp.array([1, 0]), jnp.array([0, 1]))  # always [0, 1]
  return leaf.at[rows].set(leaf[:2], unique_indices=True)


def settle(state, reads, capacity: int):
  """``state`` with every leaf of leading axis >= ``capacity`` ordered after ``reads``.

  Args:
    state: a ``TableState`` (any pytree of arrays).
    reads: pytree of arrays read from ``state`` that later writes must not overtake.
    capacity: C; leaves with a leading axis >= C (columns, data, trees) are tied.
  """
  flag = never(reads)
  return jax.tree_util.tree_map(
      lambda x: tie(x, flag) if x.ndim >= 1 and x.shape[0] >= capacity else x, state)


def after(x, read):
  """``x`` unchanged, but computed from ``read`` (a scalar, or ``x``'s shape).

  XLA updates a donated column in place only if every read of it is ordered
  before the write, and it orders by data dependencies only: the victims'
  ``occupied`` / ``times_sampled`` values read here do not feed the writes of
  those columns, so XLA would copy the whole column. A uint32 never has more
  than 32 bits set, which XLA cannot prove, so this select always keeps
  ``x`` and costs B elementwise operations fused into the write. Pass a
  reduction of the reads (XLA re-fuses a gather into each consumer, and
  each copy is a read of its own; a reduction is never duplicated).
  """
  bits = lax.population_count(read.astype(jnp.uint32))
  # The never-taken value is derived from the reads too (a constant equal to
  # ``x`` would let XLA fold the select away).
  return jnp.where(bits > 32, bits.astype(x.dtype), x)


def materialize(x):
  """``x`` (a 1-D integer array), computed once.

  XLA:CPU fuses a cheap-looking producer into each consumer, once per
  *element* of the consumer: the tree descent (and the random words behind
  it) were recomputed for every float of every gathered row, which inside
  ``lax.scan`` cost ~1 ms per B = 256 sample (measured). A reduction is never
  fused into its consumers, so passing ``x`` through one (the max of ``x`` and
  the dtype's minimum, elementwise over a stacked axis of 2) materializes it
  in one thunk with ``x``'s producer fused in (``lax.optimization_barrier``
  does not: XLA:CPU removes it first). A scatter of ``x`` into zeros also
  works but costs three thunks (zeros, copy, iota; measured: the lean uniform
  sample 53 -> 40 fusions, ~5-10% of the in-scan step).

  One element is not materialized: XLA's simplifier turns the reduction into a max with
  the minimum, and that into ``x``. Harmless where the one value is cheap to recompute (a
  sample of one row); where a write must wait for its reads, use ``once`` (a sort).
  """
  if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"materialize: expected a 1-D integer array, got {x.dtype}{list(x.shape)}")
  low = jnp.full_like(x, jnp.iinfo(x.dtype).min)
  return jnp.max(jnp.stack([x, low]), axis=0)


def materialize_on_cpu(x):
  """``materialize(x)`` on CPU; ``x`` itself elsewhere.

  For a value whose consumers read it more than once per element (``bits.words``' random
  words, a pointer-jumping gather chain): XLA:CPU evaluates a fused producer once per
  read, serially, and one materialization (~1 us) costs less. On a GPU the re-evaluation
  runs in parallel inside one kernel, and a materialization is one more kernel launch."""
  return lax.platform_dependent(x, cpu=materialize, default=lambda v: v)
