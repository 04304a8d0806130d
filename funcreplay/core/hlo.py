"""Operation counts of a compiled (optimized) XLA program: the leanness checks.

``counts(fn, *args)`` compiles ``jax.jit(fn)`` for ``args`` and counts, over
every computation of the optimized HLO text, the instructions by opcode:
``fusion`` (one kernel each on XLA:GPU), ``gather``, ``scatter``, ``sort``,
``conditional`` and ``while`` (each a device-to-host sync on XLA:GPU), plus
``big_copies``: ``copy`` instructions of at least ``big`` elements (a donated
buffer XLA could not update in place). ``entry`` cuts out the computation run once
per call.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Dict, List, Tuple

import jax
import numpy as np

OPS = ("fusion", "gather", "scatter", "sort", "conditional", "while", "custom-call")
_OPCODE = re.compile(r"=\s+(?:\([^=]*?\)|\S+)\s+([a-z][a-z0-9\-]*)\(")
_COMMENT = re.compile(r"/\*.*?\*/")  # tuple shapes carry /*index=5*/ markers
_SHAPE = re.compile(r"=\s+[a-z0-9]+\[([0-9,]*)\]")
# XLA:CPU's parallel task assignment marks an operation it splits across its threads
# with this backend config. A split gather (named after its fused ops, so "gather" is in
# the instruction's name) costs a thread hand-off each time it runs: microseconds, more
# than the gather of a few rows itself (core.ops.insert_lean._take).
_SPLIT = re.compile(r'"outer_dimension_partitions":\[')


def text_counts(hlo_text: str, big: int = 1 << 16) -> Dict[str, int]:
  """Opcode counts (``OPS``), ``big_copies`` (copies of >= ``big`` elements) and
  ``split_gathers`` (gathers XLA:CPU splits across its threads) of optimized HLO text."""
  ops: Counter = Counter()
  big_copies = split_gathers = 0
  for raw in hlo_text.splitlines():
    line = _COMMENT.sub("", raw.split(", metadata=")[0])
    m = _OPCODE.search(line)
    if not m:
      continue
    op = m.group(1)
    ops[op] += 1
    if op == "copy":
      s = _SHAPE.search(line)
      if s and s.group(1):
        n = 1
        for d in s.group(1).split(","):
          n *= int(d)
        big_copies += n >= big
    if _SPLIT.search(raw) and "gather" in line.split("=")[0]:
      split_gathers += 1
  out = {op: ops.get(op, 0) for op in OPS}
  out["big_copies"] = big_copies
  out["split_gathers"] = split_gathers
  return out


def entry(hlo_text: str) -> str:
  """The ENTRY computation of optimized HLO text: what runs once per call. Inside a
  ``lax.scan`` that is work XLA hoisted out of the loop (loop-invariant code motion), paid
  on every call, and on XLA:CPU as operations it hands to its threads."""
  m = re.search(r"^ENTRY .*?^}", hlo_text, re.S | re.M)
  return m.group(0) if m else ""


def counts(fn, *args, donate_argnums=(), big: int = 1 << 16, **kwargs) -> Dict[str, int]:
  """``text_counts`` of ``jax.jit(fn, donate_argnums=...)`` compiled for ``args``."""
  compiled = jax.jit(fn, donate_argnums=donate_argnums).lower(*args, **kwargs).compile()
  return text_counts(compiled.as_text(), big)


# What XLA:CPU runs as one operation of a loop body (a thunk): not these.
FREE = ("parameter", "get-tuple-element", "tuple", "constant", "bitcast")


def _computations(hlo_text: str) -> Dict[str, List[str]]:
  """``{computation name: its instruction lines}`` of HLO text."""
  comps, cur = {}, None
  for line in hlo_text.splitlines():
    m = re.match(r"^(?:ENTRY )?%(\S+) ", line)
    if m and line.rstrip().endswith("{"):
      cur = comps.setdefault(m.group(1), [])
    elif line.startswith("}"):
      cur = None
    elif cur is not None:
      cur.append(line)
  return comps


def loop_body_ops(hlo_text: str) -> Dict[str, int]:
  """``{while body name: number of operations}`` of optimized HLO text.

  XLA:CPU runs each iteration of a ``while`` (a ``lax.scan`` step) through its dataflow
  executor, which allocates a node per operation and counts down their dependencies every
  iteration, so a step of small operations costs in proportion to their number (BUILD.md
  "Lean portable programs", finding 15). On XLA:GPU each is a kernel launch."""
  comps = _computations(hlo_text)
  out = {}
  for body in re.findall(r"body=%([\w.\-]+)", hlo_text):
    n = 0
    for line in comps.get(body, []):
      op = _OPCODE.search(_COMMENT.sub("", line.split(", metadata=")[0]))
      n += bool(op) and op.group(1) not in FREE
    out[body] = n
  return out


def scan_step_ops(hlo_text: str) -> List[Tuple[str, str, str]]:
  """``(opcode, shape, op name)`` of each operation of the loop body of the entry's (first)
  ``while``: a step of the ``lax.scan`` a program is, as ``loop_body_ops`` counts them.
  A loop nested in a step (run by its own trips, e.g. inside a ``conditional``) is not
  listed. The op name is the last part of JAX's ``op_name`` ('' if none)."""
  head = re.search(r"while\(.*?body=%([\w.\-]+)", entry(hlo_text))
  if head is None:
    raise ValueError("scan_step_ops: the program's entry has no while loop (not a scan).")
  body = re.search(r"^%" + re.escape(head.group(1)) + r" .*?^}", hlo_text, re.S | re.M)
  out = []
  for line in body.group(0).splitlines()[1:-1]:
    op = _OPCODE.search(_COMMENT.sub("", line.split(", metadata=")[0]))
    if op and op.group(1) not in FREE:
      shape = re.search(r"=\s+(\([^=]*?\)|\S+)\s+[a-z]", line)
      name = re.search(r'op_name="([^"]*)"', line)
      out.append((op.group(1), shape.group(1) if shape else "",
                  name.group(1).split("/")[-1] if name else ""))
  return out


_CALLEE = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)"
                     r"=%([\w.\-]+)")
_BRANCH = re.compile(r"(?:true|false)_computation=%([\w.\-]+)")
_BRANCH_LIST = re.compile(r"branch_computations=\{([^}]*)\}")
_COPY = re.compile(r"=\s+(\w+\[([0-9,]*)\])\S*\s+copy\(")


def big_copy_sites(hlo_text: str, big: int = 1 << 16) -> List[Tuple[str, str, bool]]:
  """``(computation, shape, in_branch)`` of each ``copy`` of at least ``big`` elements in
  optimized HLO text: a donated buffer that XLA could not update in place. ``in_branch``:
  the copy is in a ``conditional``'s branch (or a computation a branch calls), which runs
  only when taken (say a rare completion), not on every call."""
  comps = _computations(hlo_text)
  calls, branches = {}, set()
  for name, lines in comps.items():
    text = "\n".join(lines)
    listed = {b.strip().lstrip("%") for group in _BRANCH_LIST.findall(text)
              for b in group.split(",")}
    calls[name] = set(_CALLEE.findall(text)) | listed
    branches |= set(_BRANCH.findall(text)) | listed
  todo = list(branches)  # and what the branches call, transitively
  while todo:
    for callee in calls.get(todo.pop(), ()):
      if callee not in branches:
        branches.add(callee)
        todo.append(callee)
  out = []
  for name, lines in comps.items():
    for line in lines:
      m = _COPY.search(_COMMENT.sub("", line.split(", metadata=")[0]))
      if m and m.group(2) and int(np.prod([int(d) for d in m.group(2).split(",")])) >= big:
        out.append((name, m.group(1), name in branches))
  return out
