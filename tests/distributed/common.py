"""What the sharded-table tests (tests/distributed/test_sharding_*.py) share: the item,
tagged per-shard batches, jitted global queries, and global-sample draw counts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

N = 4  # shards used by most tests (of the 8 devices)

ITEM = {"x": jnp.zeros((2,), jnp.float32), "tag": jnp.zeros((), jnp.int32)}
SAMPLE_ARGS = ("batch_size", "replace", "max_per_shard")


def tagged_items(n, b, start):
  tag = (start + np.arange(n * b, dtype=np.int32)).reshape(n, b)
  return {"x": np.stack([tag, -tag], -1).astype(np.float32), "tag": tag}


@functools.lru_cache(maxsize=None)
def _jitted(fn):
  # Eager calls would compile each small op separately: jit whole queries.
  return jax.jit(fn)


def stats_of(t, st):
  return _jitted(t.stats)(st).to_dict()


def count_of(t, st, version=None):
  return int(_jitted(t.count)(st, version=version))


def leaf_equal(a, b):
  fa, fb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert len(fa) == len(fb)
  for x, y in zip(fa, fb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def unequal_state(t, prios):
  """Fill shard s with len(prios[s]) items of the given priorities (unequal fill)."""
  b = max(len(p) for p in prios)
  pr = np.zeros((N, b), np.float32)
  mask = np.zeros((N, b), bool)
  for s, p in enumerate(prios):
    pr[s, :len(p)], mask[s, :len(p)] = p, True
  st = jax.jit(t.init)()
  return jax.jit(t.insert)(st, tagged_items(N, b, 0), priority=pr, mask=mask), pr, mask


_RUNS = {}


def draw_counts(t, st, trials, batch_size, replace, b):
  """Item (shard * b + slot) counts over ``trials`` global samples, in one scan."""
  cache_key = (id(t), trials, batch_size, replace, b)
  if cache_key not in _RUNS:
    @jax.jit
    def run(st, key):
      def step(st, k):
        st, out = t.sample_global(st, k, batch_size=batch_size, replace=replace)
        ids = jnp.where(out.valid, jnp.arange(N)[:, None] * b + out.info.slot, N * b)
        return st, (jnp.bincount(ids.reshape(-1), length=N * b + 1)[:-1],
                    jnp.sum(out.valid), out)
      st, (counts, nvalid, outs) = jax.lax.scan(step, st, jax.random.split(key, trials))
      return jnp.sum(counts, 0), nvalid, jax.tree_util.tree_map(lambda x: x[0], outs)
    _RUNS[cache_key] = (t, run)  # keep t alive so its id is not reused
  return _RUNS[cache_key][1](st, jax.random.PRNGKey(11))


PRIOS = [[1.0, 2.0, 3.0, 4.0, 0.5, 6.0, 1.0], [5.0], [], [2.0, 0.25, 1.0]]  # unequal fill
