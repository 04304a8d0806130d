"""``sample`` for a ``Uniform`` or ``Prioritized`` sampler in one CPU kernel.

Same contract as ``funcreplay.core.sampling.sample``, and the same program: the kernel
(``csrc/sample_core.h``, ``RunSample``) follows the portable programs' recipe bit for bit
(``uniform_lean``, ``prioritized_lean``, ``sampling.exact``), so for the same ``(state,
key)`` it returns the same batch and state. It computes the prologue itself (staleness
threshold, eligible count and weight, the key split) from the version and the ``where``
mask; the host direct path (``direct.cc``) runs the same code. Threefry keys only (the
caller, ``sampling.sample``, keeps other key implementations on the portable program).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from funcreplay import native
from funcreplay.core import ops
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import Sample, SampleInfo, TableState

_STATE_COLUMNS = 8  # occupied, item_info, occ_tree, weight_tree, ledger, version_hist/bounds,
#                    position_index


def _typed(rng) -> bool:
  return jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key)


def _key_words(rng) -> jnp.ndarray:
  if _typed(rng):
    rng = jax.random.key_data(rng)
  return jnp.asarray(rng).astype(jnp.uint32).reshape(-1)


def field_words(spec: TableSpec) -> np.ndarray:
  """The kernel's ``fields`` attribute: [] when every item leaf is its own state array,
  else the word offsets ``0 = f_0 < ... < f_n = R`` of the leaves in a packed row."""
  if not spec.packed_rows:
    return np.zeros((0,), np.int64)
  sizes = [math.prod(x.shape) for x in spec.signature.leaves]
  return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def sample(spec: TableSpec, state: TableState, rng, batch_size: int, ver, where,
           replace: bool, enabled=None, layout=None, split_key: bool = True):
  """``(state, Sample, next_key)``; arguments already validated by ``sampling.sample``.

  ``enabled`` False: no sample (state unchanged, every row invalid, the key kept).
  ``layout``: a ``packing.PackedLayout``: the kernel writes the batch straight
  into one uint8 buffer, returned in place of the ``Sample``.
  ``split_key``: sample with ``jax.random.split(rng)[1]`` and return ``[0]`` as the next
  key (``sampling.sample(split_key=True)``); else sample with ``rng`` itself.
  """
  b, c = batch_size, spec.capacity
  has_version = ver is not None
  if where is not None:
    ops.eligible_mask(spec, state, None, where)  # validates shape and dtype
    where = jnp.asarray(where)
  params = jnp.stack([jnp.asarray(ver if has_version else 0, jnp.int32),
                      jnp.int32(1) if enabled is None else jnp.asarray(enabled).astype(jnp.int32)])
  data_leaves, data_def = jax.tree_util.tree_flatten(state.data)
  # item_info whole (uint32[C, 4]): the kernel reads the sampled rows and counts
  # times_sampled in place (kStateColumns in csrc/ffi_binding.h: eight columns).
  state_ops = [state.occupied, state.item_info, state.occ_tree, state.weight_tree,
               state.ledger, state.version_hist, state.version_bounds, state.position_index,
               *data_leaves]
  key_words = _key_words(rng)
  operands = [key_words, params, where if where is not None else jnp.zeros((0,), bool),
              *state_ops]
  out_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state_ops]
  if layout is not None:
    out_types.append(jax.ShapeDtypeStruct((layout.nbytes,), jnp.uint8))
    offsets = np.array([f.offset for f in layout.fields] + [layout.nbytes], np.int64)
  else:
    out_types += [jax.ShapeDtypeStruct((b,) + x.shape, x.dtype) for x in spec.signature.leaves]
    out_types += [jax.ShapeDtypeStruct((b,), d) for d in
                  (jnp.bool_, jnp.int32, jnp.uint32, jnp.float32, jnp.float32, jnp.int32,
                   jnp.int32)]
    offsets = np.array([-1], np.int64)
  out_types += [jax.ShapeDtypeStruct((), jnp.int32)] * 2  # valid rows, num_eligible
  out_types.append(jax.ShapeDtypeStruct((2,), jnp.uint32))  # next key
  call = jax.ffi.ffi_call("funcreplay_sample", out_types, vmap_method="sequential",
                          input_output_aliases=native.state_aliases(state_ops, 3))
  res = native.keep_empty(call(*operands, batch_size=b, capacity=c, replace=bool(replace),
             max_times_sampled=int(spec.max_times_sampled), has_version=has_version,
             max_staleness=-1 if spec.max_staleness is None else int(spec.max_staleness),
             split_key=bool(split_key), ring=not spec.holes, packed=offsets,
             ledger=native.ledger_attr(spec),
             fields=field_words(spec)), state_ops)
  n_state = len(state_ops)
  occupied, item_info, occ_tree, weight_tree, ledger, hist, bounds, pindex = (
      res[:_STATE_COLUMNS])
  new_data = res[_STATE_COLUMNS:n_state]
  if layout is not None:
    out, n_valid, num_eligible, next_words = res[n_state:]
  else:
    n_fields = len(spec.signature.leaves)
    rows = res[n_state:n_state + n_fields]
    valid, slot, key_o, prob, prio, times_o, version_o, n_valid, num_eligible, next_words = (
        res[n_state + n_fields:])
    info = SampleInfo(slot=slot, key=key_o, probability=prob, priority=prio,
                      times_sampled=times_o, version=version_o)
    out = Sample(data=jax.tree_util.tree_unflatten(spec.signature.treedef, rows), valid=valid,
                 info=info, num_eligible=num_eligible)

  state = state.replace(
      data=jax.tree_util.tree_unflatten(data_def, new_data), occupied=occupied,
      item_info=item_info, occ_tree=occ_tree, weight_tree=weight_tree, ledger=ledger,
      version_hist=hist, version_bounds=bounds, position_index=pindex)
  next_key = next_words
  if _typed(rng):
    next_key = jax.random.wrap_key_data(next_key, impl=jax.random.key_impl(rng))
  return state, out, next_key
