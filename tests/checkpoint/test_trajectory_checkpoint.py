"""Trajectory-table checkpoints: bit-exact round trip, same samples, clear errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from funcreplay.checkpoint import CheckpointError
from funcreplay.checkpoint.trajectory import restore_trajectory, save_trajectory

STEP = {"x": jnp.zeros((2,), jnp.float32), "a": jnp.zeros((), jnp.int32)}


def test_round_trip_is_bit_exact_and_samples_the_same(tmp_path):
  spec = fr.TrajectorySpec(3, 24, 4, 2, STEP, sampler=fr.Prioritized(0.5))
  t = fr.make_trajectory_table(spec)
  t = t._replace(sample=jax.jit(t.sample, static_argnames=("batch_size",)))
  s = t.add(t.init(), {"x": jnp.ones((3, 20, 2)), "a": jnp.arange(60).reshape(3, 20)},
            version=7, first=jnp.zeros((3, 20), bool).at[1, 5].set(True))
  s, b = t.sample(s, jax.random.key(0), batch_size=4)
  s = t.update_priorities(s, b.info.slot, b.info.key, jnp.arange(1.0, 5.0))
  path = save_trajectory(str(tmp_path / "ck"), s, spec)
  r = restore_trajectory(path, spec)
  for x, y in zip(jax.tree_util.tree_leaves(s), jax.tree_util.tree_leaves(r)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  _, b1 = t.sample(s, jax.random.key(1), batch_size=4)
  _, b2 = t.sample(r, jax.random.key(1), batch_size=4)
  np.testing.assert_array_equal(np.asarray(b1.info.slot), np.asarray(b2.info.slot))
  with pytest.raises(CheckpointError, match="different TrajectorySpec .*period"):
    restore_trajectory(path, spec.replace(period=4))
  with pytest.raises(FileExistsError):
    save_trajectory(path, s, spec)
  # A flipped byte is caught by the CRC.
  m = json.load(open(os.path.join(path, "manifest.json")))
  f = os.path.join(path, m["arrays"][0]["file"])
  raw = bytearray(open(f, "rb").read())
  raw[-1] ^= 1
  open(f, "wb").write(bytes(raw))
  with pytest.raises(CheckpointError, match="checksum mismatch"):
    restore_trajectory(path, spec)


def test_a_table_restore_of_a_trajectory_checkpoint_names_restore_trajectory(tmp_path):
  spec = fr.TrajectorySpec(3, 24, 4, 2, STEP)
  t = fr.make_trajectory_table(spec)
  path = save_trajectory(str(tmp_path / "ck"), t.init(), spec)
  for call in (lambda: fr.restore(path), lambda: fr.Table.restore(path)):
    with pytest.raises(CheckpointError, match="'trajectory' table.*restore_trajectory"):
      call()
