"""Per-producer sequence writers: steps in, fixed-length windows of consecutive steps out.

An actor produces one step at a time; a recurrent or n-step learner wants
items of ``length`` consecutive steps (Reverb's ``TrajectoryWriter``, Acme's
``SequenceAdder``, MineStudio's chunks of consecutive fragments).
``SequenceWriter`` keeps the last ``length`` steps of one producer and emits
a window every ``stride`` steps into a ``Table`` (``insert``) or an
``Ingestor`` (``put``):

* windows start at steps ``0, stride, 2 * stride, ...`` of a *segment* (a run
  of consecutive steps of one episode); ``stride < length`` overlaps windows,
  ``stride > length`` skips steps between them;
* a new ``episode_id``, ``end_episode()``, or a gap in ``step_id`` ends the
  segment. If some of its trailing steps are in no emitted window, the
  *partial* window (from the next window start to the segment's end) is
  dropped (``pad=False``) or padded with zeros and emitted with a ``mask``
  (``pad=True``); both are counted in ``stats()``;
* an item carries the policy ``version`` (and ``metadata``) of its first step
  (MineStudio semantics: staleness is judged by the oldest step).

Item layout: the step pytree with a leading ``[length]`` axis on every leaf;
with ``pad=True`` it is ``{"steps": <that>, "mask": bool[length]}`` (every
item has the mask, full windows all True). ``sequence_signature`` builds the
matching ``TableSpec`` signature. A writer belongs to one producer thread.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np

from funcreplay.core import signature as sig_lib
from funcreplay.host import validation
from funcreplay.host.itemcheck import ItemChecker

F32_MAX = float(np.finfo(np.float32).max)


def sequence_signature(step_signature: Any, length: int, *, pad: bool = False):
  """The item signature of ``length``-step windows of ``step_signature``.

  Args:
    step_signature: a ``Signature``, a pytree of ``jax.ShapeDtypeStruct`` or
      an example step.
    length: steps per item (>= 1).
    pad: whether items carry a ``mask`` (``SequenceWriter(pad=True)``).

  Returns:
    A pytree of ``jax.ShapeDtypeStruct``: every step leaf with a leading
    ``[length]`` axis; with ``pad`` wrapped as ``{"steps": ..., "mask":
    bool[length]}``. Pass it as ``TableSpec(signature=...)``.
  """
  length = _check_length(length)
  sig = sig_lib.as_signature(step_signature)
  steps = jax.tree_util.tree_unflatten(
      sig.treedef, [jax.ShapeDtypeStruct((length, *s.shape), s.dtype) for s in sig.leaves])
  if pad:
    return {"steps": steps, "mask": jax.ShapeDtypeStruct((length,), np.bool_)}
  return steps


def _check_length(length) -> int:
  if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
    raise ValueError(f"SequenceWriter: length must be an int >= 1, got {length!r}.")
  return int(length)


@dataclasses.dataclass(frozen=True)
class WriterStats:
  """Counters of one ``SequenceWriter``."""

  steps: int             # steps appended
  items: int             # items emitted (full + padded)
  padded_items: int      # partial windows emitted with padding
  dropped_partials: int  # partial windows dropped
  dropped_steps: int     # steps in no emitted item (in dropped partials)
  gaps: int              # step-id gaps that ended a segment
  episodes: int          # episodes ended (end_episode or a new episode_id)


class _Step:
  __slots__ = ("leaves", "version", "metadata")

  def __init__(self, leaves, version, metadata):
    self.leaves, self.version, self.metadata = leaves, version, metadata


class SequenceWriter:
  """Assembles one producer's steps into ``length``-step items (see the module doc).

  Args:
    sink: a ``funcreplay.Table`` (items go in with ``insert``, batch of 1) or
      an ``Ingestor`` / anything with ``put(item, *, version, priority,
      metadata)``.
    length: steps per item.
    stride: steps between the starts of consecutive items (default
      ``length``: no overlap).
    pad: emit the partial window at a segment end padded with zeros and a
      ``mask`` (True) or drop it (False).
    step_signature: signature of one step; default: derived from the sink's
      table signature (which must then be ``sequence_signature(step, length,
      pad=pad)``).
    priority_fn: optional ``item -> float`` priority of each emitted item.

  ``stats()`` returns ``WriterStats``. Use ``with`` (or ``close()``) to end
  the last episode.

  Example (R2D2-style overlapping sequences of 80 steps, every 40 steps)::

    spec = fr.TableSpec(100_000, sequence_signature(step_example, 80, pad=True))
    table = fr.Table(spec)
    with table.ingestor() as ing:              # shared by all actors
      writer = SequenceWriter(ing, 80, stride=40, pad=True)   # one per actor
      for t, step in enumerate(episode):
        writer.append(step, step_id=t, episode_id=episode_id, version=policy_version)
      writer.end_episode()
  """

  def __init__(self, sink, length: int, *, stride: Optional[int] = None, pad: bool = False,
               step_signature: Any = None,
               priority_fn: Optional[Callable[[Any], float]] = None):
    length = _check_length(length)
    stride = length if stride is None else stride
    if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or stride < 1:
      raise ValueError(f"SequenceWriter: stride must be an int >= 1, got {stride!r}.")
    if hasattr(sink, "put"):
      self._emit_fn = self._emit_put
    elif hasattr(sink, "insert"):
      self._emit_fn = self._emit_insert
    else:
      raise TypeError(f"SequenceWriter: the sink must have put() (an Ingestor) or insert() "
                      f"(a Table), got {type(sink).__name__}.")
    table = getattr(sink, "table", sink)  # an Ingestor's table, or the table itself
    spec = getattr(table, "spec", None)
    if step_signature is None:
      if spec is None:
        raise ValueError("SequenceWriter: pass step_signature= (the sink has no table spec).")
      step_signature = _step_signature_from(spec.signature, length, pad)
    self._step_sig = sig_lib.as_signature(step_signature)
    item_sig = sig_lib.Signature(sequence_signature(self._step_sig, length, pad=pad))
    if spec is not None and spec.signature != item_sig:
      raise ValueError(f"SequenceWriter: the table stores {spec.signature!r} but windows of "
                       f"{length} steps{' with a mask' if pad else ''} are {item_sig!r}; build "
                       "the TableSpec with funcreplay.sequence_signature(step, length, "
                       f"pad={pad}).")
    self._sink = sink
    self._columns = None if spec is None else tuple(spec.metadata)
    self._length, self._stride, self._pad = length, int(stride), bool(pad)
    self._priority_fn = priority_fn
    self._checker = ItemChecker(self._step_sig, "SequenceWriter.append")
    self._buf: collections.deque = collections.deque(maxlen=length)
    self._pos = 0            # index of the next step within the current segment
    self._last_step_id: Optional[int] = None
    self._episode_id: Any = None
    self._open_episode = False
    self._steps = self._items = self._padded = self._dropped = self._dropped_steps = 0
    self._gaps = self._episodes = 0

  # -- producer API ---------------------------------------------------------------------
  def append(self, step: Any, *, step_id: Optional[int] = None, episode_id: Any = None,
             version: Optional[int] = None, metadata: Optional[Mapping[str, int]] = None) -> None:
    """Add one step (a pytree matching the step signature, no batch axis).

    Args:
      step: the step.
      step_id: its index in the episode; a value other than the previous
        ``step_id + 1`` is a gap that ends the current segment (None: no
        gap detection).
      episode_id: any hashable; a value different from the previous step's
        ends the previous episode first (None: same episode as before).
      version: policy version that produced the step (an item gets its first
        step's); None: the table's version at insertion.
      metadata: dict column -> int (an item gets its first step's).

    Raises ``ValueError`` / ``TypeError`` for a bad step, version (int32),
    metadata (columns of the table, int32 values) or step_id, checked here
    (not when a later step completes the window) and before the writer
    changes: the partial window stays intact. If emitting the window this
    step completes fails (the sink raises, e.g. ``TimeoutError``, or
    ``priority_fn`` returns a NaN / negative priority), the step is not
    recorded either: the append can be retried.
    """
    # Everything the step's item will carry is checked now, before the writer
    # changes: a bad step raises here and the partial window stays intact.
    leaves = self._checker(step)
    if version is not None:
      version = validation.check_int(version, "SequenceWriter.append version")
    if metadata is not None:
      # Columns are checked against the table's when the writer knows them.
      cols = self._columns if self._columns is not None else getattr(metadata, "keys", tuple)()
      metadata = {k: validation.check_int(v, f"SequenceWriter.append metadata[{k!r}]")
                  for k, v in validation.check_metadata_columns(
                      metadata, cols, "SequenceWriter.append").items()}
    if step_id is not None:
      step_id = validation.check_int(step_id, "SequenceWriter.append step_id", -2**63,
                                     2**63 - 1)
    if episode_id is not None and self._open_episode and episode_id != self._episode_id:
      self.end_episode()
    if episode_id is not None:
      self._episode_id = episode_id
    if (step_id is not None and self._last_step_id is not None and self._pos > 0
        and step_id != self._last_step_id + 1):
      self._end_segment()
      self._gaps += 1  # after: a sink that raises leaves the writer as it was, for a retry
    new = _Step(leaves, version, metadata)
    first = self._pos - (self._length - 1)  # start of the window ending at this step
    if first >= 0 and first % self._stride == 0:
      # Emit before recording the step: if the sink (or priority_fn) fails,
      # the error propagates with the writer as it was, so the caller can
      # retry this append and no window is lost.
      self._emit(list(self._buf)[len(self._buf) - (self._length - 1):] + [new], self._length)
    self._last_step_id = step_id
    self._open_episode = True
    self._buf.append(new)
    self._steps += 1
    self._pos += 1

  def end_episode(self) -> None:
    """End the current episode: handle its partial window (drop or pad)."""
    self._end_segment()  # first: if the sink raises, nothing is counted (the caller retries)
    if self._open_episode:
      self._episodes += 1
    self._open_episode = False
    self._last_step_id = None
    self._episode_id = None

  def close(self) -> None:
    """End the last episode (idempotent)."""
    self.end_episode()

  def __enter__(self) -> "SequenceWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def stats(self) -> WriterStats:
    return WriterStats(steps=self._steps, items=self._items, padded_items=self._padded,
                       dropped_partials=self._dropped, dropped_steps=self._dropped_steps,
                       gaps=self._gaps, episodes=self._episodes)

  # -- internals ------------------------------------------------------------------------
  def _end_segment(self) -> None:
    n = self._pos
    if n:
      # The next window would start at the first multiple of stride not yet
      # emitted; the steps from there on are the partial window.
      emitted = 0 if n < self._length else (n - self._length) // self._stride + 1
      nxt = emitted * self._stride
      covered_to = 0 if emitted == 0 else (emitted - 1) * self._stride + self._length
      # Only a partial window holding a step no emitted item holds matters
      # (with overlap, the trailing steps are usually in earlier windows).
      uncovered = n - max(nxt, covered_to)
      if uncovered > 0:
        tail = list(self._buf)[-(n - nxt):]
        if self._pad:
          self._emit(tail, len(tail))
          self._padded += 1
        else:
          self._dropped += 1
          self._dropped_steps += uncovered
    self._buf.clear()
    self._pos = 0

  def _emit(self, steps: list, n_real: int) -> None:
    length = self._length
    cols = list(zip(*(s.leaves for s in steps), strict=True))
    stacked = []
    for col, spec in zip(cols, self._step_sig.leaves, strict=True):
      a = np.stack([np.asarray(x, spec.dtype) for x in col])
      if n_real < length:
        a = np.concatenate([a, np.zeros((length - n_real, *spec.shape), spec.dtype)])
      stacked.append(a)
    item = jax.tree_util.tree_unflatten(self._step_sig.treedef, stacked)
    if self._pad:
      item = {"steps": item, "mask": np.arange(length) < n_real}
    first = steps[0]
    priority = None
    if self._priority_fn is not None:
      p = self._priority_fn(item)
      try:
        priority = float(p)
      except (TypeError, ValueError):
        priority = None
      if priority is None or not 0.0 <= priority <= F32_MAX:  # also refuses NaN
        raise ValueError(f"SequenceWriter: priority_fn returned {p!r} for a window; priorities "
                         "must be finite floats >= 0 (as float32). Fix priority_fn; the step was "
                         "not recorded, so the append can be retried.")
    self._emit_fn(item, first.version, priority, first.metadata)
    self._items += 1

  def _emit_put(self, item, version, priority, metadata) -> None:
    self._sink.put(item, version=version, priority=priority, metadata=metadata)

  def _emit_insert(self, item, version, priority, metadata) -> None:
    batched = jax.tree_util.tree_map(lambda a: a[None], item)
    meta = None if metadata is None else {k: [v] for k, v in metadata.items()}
    self._sink.insert(batched, version=version, priority=priority, metadata=meta)


def _step_signature_from(item_signature: sig_lib.Signature, length: int, pad: bool):
  """Invert ``sequence_signature``: the step signature of a table's item signature."""
  tree = item_signature.tree
  if pad:
    if not (isinstance(tree, dict) and set(tree) == {"steps", "mask"}):
      raise ValueError(f"SequenceWriter(pad=True): the table's items must be {{'steps': ..., "
                       f"'mask': bool[{length}]}} (sequence_signature(step, {length}, "
                       f"pad=True)), got {item_signature!r}.")
    tree = tree["steps"]
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  for name, s in zip(sig_lib.Signature(tree).names, leaves, strict=True):
    if len(s.shape) < 1 or s.shape[0] != length:
      raise ValueError(f"SequenceWriter: table leaf {name} is {np.dtype(s.dtype).name}"
                       f"{list(s.shape)}, expected a leading [{length}] (steps) axis; build "
                       f"the TableSpec with sequence_signature(step, {length}).")
  return jax.tree_util.tree_unflatten(
      treedef, [jax.ShapeDtypeStruct(tuple(s.shape[1:]), s.dtype) for s in leaves])
