"""The pure API's signatures (issue 25 item 4): one argument order, staleness needs a
version, host-only switches stay in the host layer, no native build inside a trace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
import funcreplay.native as native_lib

EXAMPLE = {"x": np.zeros((2,), np.float32)}


def _filled(spec, native=False):
  t = fr.make_table(spec, native=native)
  return t, t.insert(t.init(), {"x": jnp.ones((6, 2))}, version=0)


def test_staleness_without_version_is_an_error():
  t, st = _filled(fr.TableSpec(8, EXAMPLE, max_staleness=2))
  with pytest.raises(ValueError, match="max_staleness=2.*version="):
    t.sample(st, jax.random.PRNGKey(0), batch_size=2)
  _, out = t.sample(st, jax.random.PRNGKey(0), batch_size=2, version=1)  # with one it works
  assert np.asarray(out.valid).all()
  _, out = t.sample(st, jax.random.PRNGKey(0), batch_size=2, version=3)  # all stale
  assert not np.asarray(out.valid).any()


def test_queries_without_version_have_the_staleness_mask_off():
  t, st = _filled(fr.TableSpec(8, EXAMPLE, max_staleness=2))
  assert int(t.count(st)) == 6 and int(t.count(st, version=3)) == 0
  assert int(t.eligible(st).sum()) == 6 and bool(t.can_sample(st, 6))
  assert not bool(t.can_sample(st, 1, version=3))


def test_without_max_staleness_version_is_optional():
  t, st = _filled(fr.TableSpec(8, EXAMPLE))
  assert int(t.count(st)) == 6 and bool(t.can_sample(st, 6)) and int(t.eligible(st).sum()) == 6
  _, out = t.sample(st, jax.random.PRNGKey(0), batch_size=3)
  assert np.asarray(out.valid).all()


def test_queries_share_one_keyword_order():
  t, st = _filled(fr.TableSpec(8, EXAMPLE, max_staleness=2, metadata=("m",)))
  where = jnp.arange(8) < 3
  assert int(t.count(st, version=1, where=where)) == 3
  assert int(t.eligible(st, version=1, where=where).sum()) == 3
  assert bool(t.can_sample(st, 3, version=1, where=where))
  assert not bool(t.can_sample(st, 4, version=1, where=where))
  _, out = t.sample(st, jax.random.PRNGKey(0), batch_size=4, version=1, where=where)
  assert int(out.num_eligible) == 3 and int(np.asarray(out.valid).sum()) == 3
  with pytest.raises(TypeError):
    t.count(st, 1)  # version and where are keyword-only


@pytest.mark.parametrize("switch", ["split_key", "packed", "enabled", "native"])
def test_host_only_switches_are_not_in_the_pure_sample(switch):
  t, st = _filled(fr.TableSpec(8, EXAMPLE))
  with pytest.raises(TypeError, match=switch):
    t.sample(st, jax.random.PRNGKey(0), batch_size=2, **{switch: True})


def test_native_kernels_are_built_with_the_table_never_in_a_trace(monkeypatch):
  calls = []
  real_build = native_lib.ensure_built
  monkeypatch.setattr(native_lib, "ensure_built", lambda: calls.append("build") or real_build())
  spec = fr.TableSpec(8, EXAMPLE, sampler=fr.Prioritized(1.0))
  t = fr.make_table(spec, native=True)
  assert calls == ["build"]  # when the programs are built

  def never(*_):
    raise AssertionError("the native library was built or loaded inside a trace")

  for name in ("ensure_built", "load", "available"):
    monkeypatch.setattr(native_lib, name, never)
  st = jax.jit(t.insert)(t.init(), {"x": jnp.ones((3, 2))})
  jax.jit(lambda s, k: t.sample(s, k, batch_size=2)).lower(st, jax.random.PRNGKey(0))
  jax.jit(lambda s: t.update_priorities(s, jnp.zeros((1,), jnp.int32), s.key[:1], 2.0)
          ).lower(st)
