"""A short demo: insert, sample and print table stats (placeholder main job)."""

import jax
import jax.numpy as jnp
from absl import app

import funcreplay as fr


def main(_):
  item = {"obs": jnp.zeros((4,), jnp.float32), "reward": jnp.zeros((), jnp.float32)}
  spec = fr.TableSpec(1000, item, max_times_sampled=4, max_staleness=8)
  table = fr.make_table(spec)
  insert = jax.jit(table.insert)
  sample = jax.jit(table.sample, static_argnames=("batch_size", "replace"))
  state = table.init()
  rng = jax.random.PRNGKey(0)
  for step in range(50):
    items = {"obs": jnp.full((32, 4), step, jnp.float32), "reward": jnp.ones((32,))}
    state = insert(state, items, version=step // 5)
    rng, k = jax.random.split(rng)
    state, batch = sample(state, k, batch_size=64, version=step // 5)
  print(table.stats(state).to_dict())


if __name__ == "__main__":
  app.run(main)
