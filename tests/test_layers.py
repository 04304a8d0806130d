"""The house's import rules, checked on the source (``ast``), plus lazy loading.

Layers, lowest first (README "Layout"): ``core`` (its base modules, then
``core.ops``, ``core.sampling``, ``core.functional``) <- ``native`` <- ``host``
<- ``distributed`` <- ``checkpoint`` <- ``interop`` <- the public names
(``funcreplay/__init__.py``, ``funcreplay.torch``). A module may import its
own layer or a lower one, never a higher one; every module belongs to a
layer; there is no import cycle between modules or between layers; and no
module imports (or reaches through a module into) another module's
``_private`` name. Imports inside functions
count: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "funcreplay")

# Longest matching prefix wins.
LAYERS = {
    "funcreplay.core.caches": 0,  # the registry every layer registers with: imports nothing
    "funcreplay.core": 1,
    "funcreplay.core.ops": 2,
    "funcreplay.core.sampling": 3,
    "funcreplay.core.functional": 4,
    "funcreplay.core.trajectory": 4,  # trajectory tables: the core's base modules + sampling
    "funcreplay.native": 5,
    "funcreplay.host": 6,
    "funcreplay.distributed": 7,
    "funcreplay.checkpoint": 8,
    "funcreplay.ray": 8.5,  # the replay service on Ray (issue 27): above checkpoint, below interop
    "funcreplay.interop": 9,
    "funcreplay.torch": 10,
    "funcreplay": 11,  # funcreplay/__init__.py: the public names
}


def layer_of(module: str):
  best = None
  for prefix in LAYERS:
    if module == prefix or module.startswith(prefix + "."):
      if best is None or len(prefix) > len(best):
        best = prefix
  if best == "funcreplay" and module != "funcreplay":
    return None  # a module outside every layer (e.g. a flat funcreplay/x.py)
  return best


def modules(root: str = ROOT):
  """{dotted module name: path} for every .py file under ``root``."""
  out = {}
  for d, _, files in os.walk(root):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(d, f), os.path.dirname(root))[:-3]
        name = rel.replace(os.sep, ".")
        out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = \
            os.path.join(d, f)
  return out


def private_uses(path: str, known):
  """``[(module, attribute, line)]``: ``mod._name`` on a funcreplay module imported here."""
  tree = ast.parse(open(path).read(), path)
  aliases = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("funcreplay"):
      for a in node.names:
        if f"{node.module}.{a.name}" in known:
          aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("funcreplay") and a.asname:
          aliases[a.asname] = a.name
  return [(aliases[n.value.id], n.attr, n.lineno) for n in ast.walk(tree)
          if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
          and n.value.id in aliases and n.attr.startswith("_") and not n.attr.startswith("__")]


def imports(name: str, path: str, known):
  """``[(imported module, imported names, line)]`` of funcreplay imports in one file."""
  tree = ast.parse(open(path).read(), path)
  is_pkg = path.endswith("__init__.py")
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split(".")[0] == "funcreplay":
          out.append((a.name, [], node.lineno))
    elif isinstance(node, ast.ImportFrom):
      mod = node.module or ""
      if node.level:  # relative import
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        mod = ".".join(base + ([mod] if mod else []))
      if mod.split(".")[0] != "funcreplay":
        continue
      for a in node.names:
        sub = f"{mod}.{a.name}"
        if sub in known:  # `from pkg import module`
          out.append((sub, [], node.lineno))
        else:
          out.append((mod, [a.name], node.lineno))
  return out


def graph(root: str = ROOT):
  mods = modules(root)
  return mods, {m: imports(m, p, mods) for m, p in mods.items()}


def violations(root: str = ROOT):
  """Every broken rule, as readable lines (empty: the house is in order)."""
  mods, g = graph(root)
  bad = []
  for m in sorted(mods):
    for target, attr, line in private_uses(mods[m], mods):
      bad.append(f"{m}:{line} uses the private name {target}.{attr}")
    lm = layer_of(m)
    if lm is None:
      bad.append(f"{m}: belongs to no layer")
      continue
    for target, names, line in g[m]:
      lt = layer_of(target)
      if lt is not None and LAYERS[lt] > LAYERS[lm]:
        bad.append(f"{m}:{line} imports {target} (layer {lt} is above {lm})")
      for n in names:
        if n.startswith("_") and not n.startswith("__"):
          bad.append(f"{m}:{line} imports the private name {target}.{n}")
  # Cycles between modules (a package's __init__ counts as its own module).
  edges = {m: {t for t, _, _ in g[m] if t in mods and t != m} for m in mods}
  bad += [f"import cycle: {' -> '.join(c)}" for c in cycles(edges)]
  # Cycles between layers.
  ledges = {}
  for m in mods:
    for t in edges[m]:
      a, b = layer_of(m), layer_of(t)
      if a and b and a != b:
        ledges.setdefault(a, set()).add(b)
        ledges.setdefault(b, set())
  bad += [f"layer cycle: {' -> '.join(c)}" for c in cycles(ledges)]
  return bad


def cycles(edges):
  """One representative cycle per strongly connected component with more than one node."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def strong(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        strong(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp) + [sorted(comp)[0]])

  for v in sorted(edges):
    if v not in index:
      strong(v)
  return out


def test_import_graph_follows_the_layers():
  bad = violations()
  assert not bad, "the house's import rules are broken:\n" + "\n".join(bad)


def test_the_check_can_fail(tmp_path):
  """A tree with an upward import, a cycle and a private import fails on each."""
  pkg = tmp_path / "funcreplay"
  for d in ("core", "host"):
    (pkg / d).mkdir(parents=True)
    (pkg / d / "__init__.py").write_text("")
  (pkg / "__init__.py").write_text("")
  (pkg / "core" / "a.py").write_text("from funcreplay.host import b\n")
  (pkg / "host" / "b.py").write_text("from funcreplay.core.a import _hidden\n"
                                     "from funcreplay.core import a\n"
                                     "a._reach_in()\n")
  (pkg / "flat.py").write_text("")
  bad = "\n".join(violations(str(pkg)))
  assert "funcreplay.core.a:1 imports funcreplay.host.b" in bad
  assert "imports the private name funcreplay.core.a._hidden" in bad
  assert "funcreplay.host.b:3 uses the private name funcreplay.core.a._reach_in" in bad
  assert "import cycle: funcreplay.core.a -> funcreplay.host.b" in bad
  assert "layer cycle" in bad
  assert "funcreplay.flat: belongs to no layer" in bad


def _loaded_after(code: str):
  env = dict(os.environ, PYTHONPATH=os.path.dirname(ROOT), JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code + "\nimport sys\n"
                        "print(' '.join(m for m in sys.modules if m.startswith('funcreplay')))"],
                       env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  return set(out.stdout.split())


UPPER = ("funcreplay.host", "funcreplay.checkpoint", "funcreplay.distributed",
         "funcreplay.interop", "funcreplay.torch")


def test_pure_use_loads_only_the_core():
  loaded = _loaded_after(
      "import funcreplay as fr, jax, jax.numpy as jnp\n"
      "spec = fr.TableSpec(capacity=8, signature=jax.ShapeDtypeStruct((2,), jnp.float32))\n"
      "t = fr.make_table(spec, native=False)\n"
      "s = t.insert(t.init(), jnp.ones((3, 2)))\n"
      "s, b = t.sample(s, jax.random.PRNGKey(0), batch_size=2)\n"
      "assert b.valid.all()\n")
  assert not {m for m in loaded if m.startswith(UPPER)}, sorted(loaded)
  plain = _loaded_after("import funcreplay")
  assert not {m for m in plain if m.startswith(UPPER + ("funcreplay.native",))}, sorted(plain)


@pytest.mark.parametrize("name", ["Table", "Ingestor", "make_sharded_table", "save", "native",
                                  "SequenceWriter"])
def test_upper_layers_load_on_first_use(name):
  loaded = _loaded_after(f"import funcreplay as fr\nfr.{name}\n")
  assert any(m.startswith(UPPER + ("funcreplay.native",)) for m in loaded)


def test_every_public_name_resolves():
  import funcreplay as fr
  import funcreplay.torch as frt
  missing = [n for n in fr.__all__ if not hasattr(fr, n)]
  assert not missing
  assert [n for n in frt.__all__ if not hasattr(frt, n)] == []
