"""``Ingestor``: many producer threads -> one background thread -> ``Table.insert``.

Environment workers put items one at a time; the table wants batches. The
``Ingestor`` decouples the two: ``put`` validates one item and appends it to
a bounded in-memory queue (a ``collections.deque``: appending is atomic under
the GIL, so the common path takes no lock), and one background thread pops up
to ``batch_size`` items, stacks every leaf into a fresh ``[n, ...]`` numpy
array and calls ``table.insert`` (which pads to a power-of-two bucket, so the
jitted insert compiles at most ``log2(batch_size) + 1`` times).

Guarantees:

* **Back-pressure:** the queue holds at most ``max_queue`` items (plus at most
  one item per producer thread racing past the check); a full queue blocks
  ``put`` (``on_full="block"``, with ``put_timeout``) or raises
  ``IngestorFullError`` (``on_full="raise"``). A table whose rate limiter
  blocks inserts therefore blocks the producers instead of growing memory.
* **Order:** items reach the table in the order they were accepted (one FIFO
  queue, one inserting thread), so each producer's order is preserved.
* **Nothing accepted is dropped silently:** ``flush()`` waits until every
  item accepted before it is in the table; an exception in the insert thread
  is re-raised (as ``IngestorError``, chained) by the next ``put`` /
  ``put_batch`` / ``flush`` and by ``close()``, and every accepted item that
  could not be inserted is counted in ``stats().failed``. Only an explicit
  ``close(discard_pending=True)`` discards items, and counts them.
* **Latency:** a partial batch is inserted once its first item has waited
  about ``max_wait_s`` (0: insert whatever is queued as soon as the thread is
  free; larger values give fewer, fuller inserts).

Items are *not* copied by ``put`` (``copy=False``): the queue keeps references
until the insert thread stacks them, so a producer must not modify an array
in place after putting it (pass ``copy=True`` if it reuses buffers).

Cost (``experiments/bench_host.py``; a 524-byte transition, 2-core CPU): a
``put`` is ~0.5 us of CPU in isolation, and the whole pipeline (puts,
stacking, ``Table.insert``) ~2 us of process CPU per item with 1-8 producer
threads, against ~19 us for cpprb's ``ReplayBuffer.add``. All producers and
the insert thread share the GIL, so throughput is bounded by the sum of their
Python work; only the table's XLA insert runs in parallel with it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any, Mapping, Optional

import jax
import numpy as np

from funcreplay.host import validation
from funcreplay.host.itemcheck import ItemChecker, stack_leaf

_NEVER = 1 << 62  # "no producer needs to wake the insert thread"
_F32_MAX = float(np.finfo(np.float32).max)


class IngestorError(RuntimeError):
  """The insert thread failed; ``__cause__`` holds the original exception."""


class IngestorClosedError(RuntimeError):
  """``put`` / ``put_batch`` / ``flush`` on a closed (or closing) ``Ingestor``."""


class IngestorFullError(RuntimeError):
  """``put`` on a full queue with ``on_full="raise"``."""


@dataclasses.dataclass(frozen=True)
class IngestorStats:
  """Counters of an ``Ingestor`` (exact once it is idle: after ``flush`` or ``close``).

  ``accepted == inserted + pending + failed + discarded`` at all times
  (up to the item being moved between counters while the stats are read).
  """

  accepted: int          # items put and accepted (put returned)
  inserted: int          # items inserted into the table
  pending: int           # accepted, not yet inserted (queued or being inserted)
  batches: int           # table.insert calls that succeeded
  failed: int            # accepted items not inserted because the insert thread failed
  discarded: int         # accepted items dropped by close(discard_pending=True)
  rejected: int          # items put after close/failure that were refused (put raised)
  queue_high_water: int  # largest queue length seen
  blocked_puts: int      # puts that had to wait for room in the queue
  error: Optional[str]   # repr of the insert thread's exception, if any


# --- the ingestor ------------------------------------------------------------------------

class _Marker:
  """A flush request travelling through the queue (FIFO: everything before it is done)."""

  __slots__ = ("event",)

  def __init__(self):
    self.event = threading.Event()


class Ingestor:
  """A background thread inserting items put by any number of producer threads.

  Args:
    table: the ``funcreplay.Table`` to insert into (anything with ``spec``,
      ``version`` and ``insert(items, *, version, priority, metadata, timeout)``).
    batch_size: most items per ``table.insert`` call (the insert thread takes
      whatever is queued up to this many; capped at the table's capacity).
      Each insert call has a fixed host cost (~0.5 ms on a CPU), so large
      batches pay off at high rates; partial batches (``max_wait_s``,
      ``flush``) are padded by the table to a power-of-two bucket.
    max_queue: most items waiting in the queue (default ``8 * batch_size``;
      at least ``batch_size``).
    on_full: ``"block"`` (wait for room, up to ``put_timeout`` seconds, then
      ``TimeoutError``) or ``"raise"`` (``IngestorFullError`` at once).
    put_timeout: seconds a blocked ``put`` waits (None: forever).
    max_wait_s: about how long a partial batch waits for more items before
      it is inserted (0: never wait).
    copy: copy every leaf in ``put`` (for producers that reuse their arrays).
    insert_poll_s: how often an insert blocked by the table's rate limiter
      re-checks for ``close(discard_pending=True)``.
    sync_every: wait for the device every this many batches, so that
      asynchronously dispatched inserts cannot pile up without bound.

  Use as a context manager (``with table.ingestor() as ing:``); leaving the
  block flushes and closes it (an ingestor never closed keeps its daemon
  thread, and the table, alive). Thread-safe: ``put`` / ``put_batch`` /
  ``flush`` / ``stats`` from any thread. Relies on the GIL (CPython's
  default build): the lock-free ``put`` path is not safe on free-threaded
  builds.

  Example::

    table = fr.Table(fr.TableSpec(1_000_000, example_transition))
    with table.ingestor(max_wait_s=0.01) as ing:
      def actor(env):                       # run in many threads
        obs = env.reset()
        while True:
          action = policy(obs)
          next_obs, reward, done = env.step(action)
          ing.put(dict(obs=obs, action=action, reward=reward, next_obs=next_obs),
                  version=policy_version)
          obs = env.reset() if done else next_obs
      ...                                   # the learner samples from ``table``
  """

  def __init__(self, table, *, batch_size: int = 4096, max_queue: Optional[int] = None,
               on_full: str = "block", put_timeout: Optional[float] = None,
               max_wait_s: float = 0.005, copy: bool = False, insert_poll_s: float = 0.1,
               sync_every: int = 16, name: str = "funcreplay-ingestor"):
    if not all(hasattr(table, a) for a in ("spec", "insert", "version")):
      raise TypeError(f"Ingestor expects a funcreplay Table, got {type(table).__name__}.")
    batch_size = validation.check_int(batch_size, "Ingestor batch_size", 1, 2**30)
    batch_size = min(batch_size, table.spec.capacity)  # Table.insert takes <= capacity rows
    if max_queue is None:
      max_queue = 8 * batch_size
    max_queue = validation.check_int(max_queue, "Ingestor max_queue", 1, 2**40)
    if max_queue < batch_size:
      raise ValueError(f"Ingestor: max_queue ({max_queue}) must be >= batch_size "
                       f"({batch_size}).")
    if on_full not in ("block", "raise"):
      raise ValueError(f"Ingestor: on_full must be 'block' or 'raise', got {on_full!r}.")
    self._put_timeout = validation.check_timeout(put_timeout)
    for what, v in (("max_wait_s", max_wait_s), ("insert_poll_s", insert_poll_s)):
      if validation.check_timeout(v) is None:
        raise ValueError(f"Ingestor: {what} must be a number of seconds >= 0, got None.")
    self._table = table
    self._spec = table.spec
    self._sig = table.spec.signature
    self._n_leaves = len(self._sig.leaves)
    self._checker = ItemChecker(self._sig, "Ingestor.put")
    self._fast = self._checker.fast
    self._batch_size = batch_size
    self._max_queue = max_queue
    self._raise_when_full = on_full == "raise"
    self._max_wait = float(max_wait_s)
    self._copy = bool(copy)
    self._poll = float(insert_poll_s)
    self._sync_every = validation.check_int(sync_every, "Ingestor sync_every", 0, 2**30)
    self._columns = tuple(self._spec.metadata)

    self._q: collections.deque = collections.deque()
    self._lock = threading.Lock()
    self._wake_cv = threading.Condition(self._lock)   # the insert thread sleeps here
    self._room_cv = threading.Condition(self._lock)   # blocked producers sleep here
    # The producers' lock-free path compares the queue length with two
    # thresholds, written only under the lock:
    #   _limit: before appending; max_queue, or 0 once stopped (-> _room_or_raise).
    #   _attention: after appending; min(_wake_at, high-water + 1), or 0 once
    #   stopped (-> _after_append: wake the thread, track the high-water mark).
    self._wake_at = _NEVER    # queue length at which a producer must wake the thread
    self._limit = max_queue
    self._attention = 1
    self._markers = 0         # flush markers in the queue (under the lock)
    self._blocked = 0         # producers waiting for room (under the lock)
    self._stop = False        # closing or failed: put refuses new items
    self._closing = False
    self._discard = False
    self._done = False        # the insert thread has exited (under the lock)
    self._joined = False
    self._error: Optional[BaseException] = None
    self._error_reported_by_close = False
    # Counters written by one thread each (the insert thread, or under the lock).
    self._inserted = self._batches = self._failed = self._discarded = self._rejected = 0
    self._inflight = 0        # items popped from the queue, not yet inserted
    self._cur: Optional[list] = None  # the batch being inserted (its markers, on failure)
    self._hw = 0
    self._blocked_puts = 0
    self._thread = threading.Thread(target=self._run, name=name, daemon=True)
    self._thread.start()

  # -- producers ----------------------------------------------------------------------
  def put(self, item: Any, *, version: Optional[int] = None, priority: Optional[float] = None,
          metadata: Optional[Mapping[str, int]] = None) -> None:
    """Queue one item (no batch axis) for insertion.

    Args:
      item: a pytree matching the table's signature, each leaf exactly the
        signature's shape and dtype (numpy / JAX arrays, numpy scalars;
        Python scalars are converted).
      version: policy version (int32; default: the table's version when the
        item is inserted).
      priority: finite float >= 0 (default: the table's default priority).
      metadata: dict column -> int over the spec's metadata columns.

    Raises:
      ValueError / TypeError for a bad item (nothing queued);
      IngestorFullError / TimeoutError when the queue is full;
      IngestorError if the insert thread failed; IngestorClosedError after close.
    """
    # The common path is ~0.5 us of CPU: a generated structure/shape/dtype
    # check, one deque append (atomic under the GIL), two integer comparisons.
    leaves = self._fast(item)
    if leaves is None:
      leaves = self._checker.slow(item)
    if self._copy:
      leaves = tuple(map(np.array, leaves))
    if version is not None or priority is not None or metadata is not None:
      # A queue entry is the tuple of leaves, followed by the extras only when
      # there are any (one small tuple less per put in the common case).
      leaves += self._check_extras(version, priority, metadata)
    q = self._q
    if len(q) >= self._limit:
      self._room_or_raise(1, "put")
    q.append(leaves)
    if len(q) >= self._attention:
      self._after_append("put")

  def put_batch(self, items: Any, *, version=None, priority=None,
                metadata: Optional[Mapping[str, Any]] = None) -> None:
    """Queue ``B`` items given with a leading ``[B]`` axis (in row order).

    ``version`` / ``priority``: scalar or ``[B]``; ``metadata``: column ->
    int or int[B]. A batch larger than ``max_queue`` is queued in chunks
    (blocking between them); on ``TimeoutError`` the error's ``accepted``
    attribute says how many leading rows were queued.
    """
    if self._stop:
      self._raise_stopped("put_batch")
    leaves, b = self._checker.batch(items)
    if b == 0:
      raise ValueError("Ingestor.put_batch: empty batch (B = 0); pass at least one item.")
    vers = [None] * b if version is None else \
        validation.int_rows(version, b, "Ingestor.put_batch version").tolist()
    prios = [None] * b if priority is None else validation.priority_rows(
        priority, b, "Ingestor.put_batch priority").tolist()
    metas = [None] * b
    extras = version is not None or priority is not None or metadata is not None
    if metadata is not None:
      cols = self._check_meta_keys(metadata, "Ingestor.put_batch")
      rows = {k: validation.int_rows(v, b, f"Ingestor.put_batch metadata[{k!r}]").tolist()
              for k, v in cols.items()}
      metas = [{k: rows[k][i] for k in rows} for i in range(b)]
    if self._copy:
      leaves = tuple(np.array(x) for x in leaves)
    entries = list(zip(*leaves, strict=True))
    if extras:
      entries = [e + x for e, x in zip(entries, zip(vers, prios, metas, strict=True),
                                       strict=True)]
    q = self._q
    done = 0
    while done < b:
      room = self._limit - len(q)
      if room <= 0:
        try:
          self._room_or_raise(min(b - done, self._max_queue), "put_batch")
        except (TimeoutError, IngestorFullError) as e:
          e.accepted = done
          raise
        continue
      chunk = entries[done:done + room]
      q.extend(chunk)
      done += len(chunk)
      if len(q) >= self._attention:
        self._after_append("put_batch")

  def flush(self, timeout: Optional[float] = None) -> None:
    """Wait until every item accepted before this call is in the table.

    Raises ``TimeoutError`` after ``timeout`` seconds (the items stay queued),
    ``IngestorError`` if the insert thread failed.
    """
    timeout = validation.check_timeout(timeout)
    if self._error is not None:
      raise self._wrapped_error("flush")
    marker = _Marker()
    with self._lock:
      if self._done:
        if self._error is not None:
          raise self._wrapped_error("flush")
        return  # closed: everything accepted has been inserted already
      self._markers += 1
      self._q.append(marker)
      self._wake_cv.notify()
    if not marker.event.wait(timeout):
      raise TimeoutError(f"Ingestor.flush timed out after {timeout} s with {self.pending} items "
                         "still pending (is the table's rate limiter blocking inserts?).")
    if self._error is not None:
      raise self._wrapped_error("flush")

  def warmup(self) -> int:
    """Compile the table's insert for every batch size this ingestor can use.

    Partial batches (``max_wait_s``, ``flush``) are padded by the table to a
    power-of-two bucket; each new bucket compiles once, which on a CPU can
    stall the insert thread for a second or more the first time it occurs.
    ``warmup`` compiles them all up front by inserting zeros into a scratch
    ``Table`` of the same spec (the compiled functions are shared per spec);
    this table is not touched. Costs one extra table allocation while it runs.

    Returns the number of buckets compiled.
    """
    scratch = type(self._table)(self._spec)  # a Table of the same class and spec
    try:
      sizes, k = [], 1
      while k < self._batch_size:
        sizes.append(k)
        k *= 2
      sizes.append(self._batch_size)
      for k in sizes:
        zeros = jax.tree_util.tree_unflatten(
            self._sig.treedef, [np.zeros((k, *s.shape), s.dtype) for s in self._sig.leaves])
        try:
          scratch.insert(zeros, timeout=0)
        except TimeoutError:
          pass  # a blocking rate limiter: compiled all the same
      len(scratch)  # wait for the compilations and runs to finish
    finally:
      scratch.close()
    return len(sizes)

  # -- lifecycle ------------------------------------------------------------------------
  def close(self, timeout: Optional[float] = None, *, discard_pending: bool = False) -> None:
    """Insert everything pending, stop the thread; idempotent.

    Args:
      timeout: seconds to wait for the pending items (None: forever). On
        ``TimeoutError`` the ingestor keeps closing: call ``close`` again to
        keep waiting, or with ``discard_pending=True``.
      discard_pending: drop the items not yet inserted (counted in
        ``stats().discarded``) instead of waiting for them.

    Raises ``IngestorError`` (once) if the insert thread failed.
    """
    timeout = validation.check_timeout(timeout)
    with self._lock:
      self._set_stopped()
      self._closing = True
      if discard_pending:
        self._discard = True
      self._wake_cv.notify_all()
      self._room_cv.notify_all()
    if not self._joined:
      self._thread.join(timeout)
      if self._thread.is_alive():
        raise TimeoutError(
            f"Ingestor.close timed out after {timeout} s with {self.pending} items not yet "
            "inserted (the table's rate limiter may be blocking inserts); call close() again to "
            "keep waiting, or close(discard_pending=True) to drop them.")
      self._joined = True
    if self._error is not None and not self._error_reported_by_close:
      self._error_reported_by_close = True
      raise self._wrapped_error("close")

  def __enter__(self) -> "Ingestor":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
      return
    # The body failed: still insert what was accepted, but never hang the
    # unwinding on a blocked table, and never mask the body's exception.
    try:
      try:
        self.close(timeout=10.0)
      except TimeoutError:
        self.close(discard_pending=True)
    except Exception as e:  # noqa: BLE001 (attached to the propagating exception)
      if exc is not None and hasattr(exc, "add_note"):
        exc.add_note(f"(while closing the Ingestor: {type(e).__name__}: {e})")
    if self._discarded and exc is not None and hasattr(exc, "add_note"):
      exc.add_note(f"(the Ingestor discarded {self._discarded} accepted items on exit)")

  @property
  def table(self):
    """The table this ingestor inserts into."""
    return self._table

  @property
  def closed(self) -> bool:
    return self._closing

  @property
  def pending(self) -> int:
    """Items accepted but not yet inserted (approximate while producers run)."""
    return max(0, len(self._q) - self._markers) + self._inflight

  def stats(self) -> IngestorStats:
    with self._lock:
      pending = self.pending
      return IngestorStats(
          accepted=self._inserted + pending + self._failed + self._discarded,
          inserted=self._inserted, pending=pending, batches=self._batches, failed=self._failed,
          discarded=self._discarded, rejected=self._rejected, queue_high_water=self._hw,
          blocked_puts=self._blocked_puts,
          error=None if self._error is None else repr(self._error))

  def __repr__(self) -> str:
    s = self.stats()
    state = "failed" if s.error else ("closed" if self._closing else "open")
    return (f"Ingestor({state}, batch_size={self._batch_size}, max_queue={self._max_queue}, "
            f"inserted={s.inserted}, pending={s.pending})")

  # -- producer helpers -------------------------------------------------------------------
  def _check_meta_keys(self, metadata, what) -> Mapping[str, Any]:
    return validation.check_metadata_columns(metadata, self._columns, what)

  def _check_extras(self, version, priority, metadata):
    if version is not None:
      version = validation.check_int(version, "Ingestor.put version")
    if priority is not None:
      try:
        p = float(priority)
      except (TypeError, ValueError):
        raise TypeError(f"Ingestor.put: priority must be a float, got "
                        f"{type(priority).__name__} {priority!r}.") from None
      if not 0.0 <= p <= _F32_MAX:  # also rejects NaN
        raise ValueError(f"Ingestor.put: priority must be finite and >= 0 (as float32), got "
                         f"{priority!r}.")
      priority = p
    if metadata is not None:
      metadata = {k: validation.check_int(v, f"Ingestor.put metadata[{k!r}]")
                  for k, v in self._check_meta_keys(metadata, "Ingestor.put").items()}
    return version, priority, metadata

  def _set_stopped(self) -> None:
    """Send every producer to the slow paths (lock held)."""
    self._stop = True
    self._limit = 0
    self._attention = 0

  def _set_wake_at(self, wake_at: int) -> None:
    """Lock held. Written *before* the thread re-checks the queue length, so a
    producer appending concurrently either is seen by that check or sees the
    new threshold (every step is atomic under the GIL)."""
    self._wake_at = wake_at
    if not self._stop:
      self._attention = min(wake_at, self._hw + 1)

  def _after_append(self, what: str) -> None:
    """The queue reached ``_attention``: wake the thread, raise the high-water mark."""
    with self._lock:
      n = len(self._q)
      if n > self._hw:
        self._hw = n
      if n >= self._wake_at:
        self._wake_cv.notify()
      if not self._stop:
        self._attention = min(self._wake_at, self._hw + 1)
        return
    self._after_stop_append(what)  # raced with close / failure

  def _room_or_raise(self, k: int, what: str) -> None:
    """Stopped -> raise; else block until ``k`` items fit (or raise if on_full='raise')."""
    if self._stop:
      self._raise_stopped(what)
    if len(self._q) + k <= self._max_queue:
      return
    if self._raise_when_full:
      raise IngestorFullError(
          f"Ingestor.{what}: the queue is full ({len(self._q)} >= max_queue={self._max_queue}); "
          "the table is not keeping up (or its rate limiter blocks inserts). Retry later, or "
          "use on_full='block'.")
    deadline = None if self._put_timeout is None else time.monotonic() + self._put_timeout
    with self._lock:
      self._blocked += 1
      self._blocked_puts += 1
      try:
        while len(self._q) + k > self._max_queue:
          if self._stop:
            break
          remaining = None if deadline is None else deadline - time.monotonic()
          if remaining is not None and remaining <= 0:
            raise TimeoutError(
                f"Ingestor.{what} timed out after {self._put_timeout} s waiting for room in the "
                f"queue (max_queue={self._max_queue}); the table is not keeping up or its rate "
                "limiter blocks inserts.")
          self._room_cv.wait(remaining)
      finally:
        self._blocked -= 1
    if self._stop:
      self._raise_stopped(what)

  def _raise_stopped(self, what: str):
    if self._error is not None:
      raise self._wrapped_error(what)
    raise IngestorClosedError(f"Ingestor.{what}: the ingestor is closed; create a new one "
                              "(table.ingestor()).")

  def _after_stop_append(self, what: str) -> None:
    """An item was appended while the ingestor stopped: refuse it if nobody will drain it."""
    with self._lock:
      if not self._done:
        return  # the insert thread is still running and will process (or count) it
      stranded = 0
      while self._q:
        stranded += self._q.popleft().__class__ is not _Marker
      self._rejected += stranded
    self._raise_stopped(what)

  def _wrapped_error(self, what: str) -> IngestorError:
    e = self._error
    err = IngestorError(
        f"Ingestor.{what}: the insert thread failed ({type(e).__name__}: {e}); "
        f"{self._inserted} items were inserted, {self._failed} accepted items were not. "
        "Create a new Ingestor after fixing the cause.")
    err.__cause__ = e
    return err

  # -- the insert thread ----------------------------------------------------------------
  def _run(self) -> None:
    try:
      self._loop()
    except BaseException as e:  # noqa: BLE001 (reported to producers and close())
      with self._lock:
        self._error = e
        self._set_stopped()
        self._failed += self._inflight
        self._inflight = 0
        self._room_cv.notify_all()
      self._release_markers(self._cur)
      self._drain_after_failure()

  def _sleep(self, wake_at: int, timeout: Optional[float]) -> None:
    with self._lock:
      if self._closing or self._markers:
        return
      self._set_wake_at(wake_at)
      if len(self._q) < wake_at:
        self._wake_cv.wait(timeout)
      self._set_wake_at(_NEVER)

  def _loop(self) -> None:
    q, pop, bsz = self._q, self._q.popleft, self._batch_size
    t_first = None
    since_sync = 0
    while True:
      if self._discard:
        self._drop_queued(failed=False)
      n = len(q)
      if n == 0:
        with self._lock:
          if self._closing and not self._q:
            self._done = True
            return
        t_first = None
        self._sleep(1, None)
        continue
      if n < bsz and self._max_wait > 0 and not self._markers and not self._closing:
        now = time.monotonic()
        if t_first is None:
          t_first = now
        if now - t_first < self._max_wait:
          self._sleep(bsz, t_first + self._max_wait - now)
          continue
      t_first = None
      batch = [pop() for _ in range(min(n, bsz))]
      try:
        self._process(batch)
      except _Discarding:
        with self._lock:
          self._discarded += self._inflight
          self._inflight = 0
        self._release_markers(self._cur)
      self._cur = None
      since_sync += 1
      if self._sync_every and since_sync >= self._sync_every:
        # Inserts are dispatched asynchronously; waiting for the device now and
        # then bounds the memory held by queued device work.
        since_sync = 0
        len(self._table)

  def _process(self, batch: list) -> None:
    """Insert the items of ``batch`` in order; release its flush markers as they come."""
    self._cur = batch
    markers = []
    if self._markers:
      markers = [i for i, e in enumerate(batch) if e.__class__ is _Marker]
    self._inflight = len(batch) - len(markers)
    if self._blocked:
      with self._lock:
        self._room_cv.notify_all()
    start = 0
    for i in markers + [len(batch)]:
      if i > start:
        self._insert_entries(batch[start:i])
      if i < len(batch):
        self._release_markers((batch[i],))
      start = i + 1

  def _release_markers(self, entries) -> None:
    with self._lock:
      for e in entries or ():
        if e.__class__ is _Marker and not e.event.is_set():
          self._markers -= 1
          e.event.set()

  def _drop_queued(self, failed: bool) -> None:
    """Pop everything queued; count the items as failed (or discarded); release markers."""
    dropped = []
    while True:
      try:
        dropped.append(self._q.popleft())
      except IndexError:
        break
    n = sum(1 for e in dropped if e.__class__ is not _Marker)
    with self._lock:
      if failed:
        self._failed += n
      else:
        self._discarded += n
      self._room_cv.notify_all()
    self._release_markers(dropped)

  def _drain_after_failure(self) -> None:
    """After a failure: count whatever racing producers still append, until close()."""
    while True:
      self._drop_queued(failed=True)
      with self._lock:
        if self._closing and not self._q:
          self._done = True
          return
        if not self._q:
          self._set_wake_at(1)
          self._wake_cv.wait()
          self._set_wake_at(_NEVER)

  def _insert_entries(self, entries: list) -> None:
    """Stack ``entries`` and insert them, in order.

    An entry is the tuple of an item's leaves, optionally followed by
    ``(version, priority, metadata)``.
    """
    n, n_leaves = len(entries), self._n_leaves
    cols = list(zip(*entries, strict=False))  # stops at the shortest entry: the leaves
    stacked = [stack_leaf(cols[i], n, s) for i, s in enumerate(self._sig.leaves)]
    if len(cols) == n_leaves and max(map(len, entries)) == n_leaves:
      self._insert(stacked, None, None, None, 0, n)  # the common case: no extras
      return
    none3 = (None, None, None)
    vers, prios, metas = zip(*[e[n_leaves:] if len(e) > n_leaves else none3 for e in entries],
                             strict=True)
    version = None
    if vers.count(None) != n:
      default = self._table.version
      version = np.array([default if v is None else v for v in vers], np.int32)
    meta = None
    if metas.count(None) != n:
      meta = {c: np.array([m.get(c, 0) if m else 0 for m in metas], np.int32)
              for c in self._columns}
    n_none = prios.count(None)
    if n_none in (0, n):
      self._insert(stacked, version, None if n_none else np.array(prios, np.float32), meta, 0, n)
      return
    # Items with and without explicit priorities: the table's default priority
    # applies per call, so insert each run separately (order preserved).
    start = 0
    for i in range(1, n + 1):
      if i == n or (prios[i] is None) != (prios[start] is None):
        prio = None if prios[start] is None else np.array(prios[start:i], np.float32)
        self._insert(stacked, version, prio, meta, start, i)
        start = i

  def _insert(self, stacked, version, prio, meta, a: int, b: int) -> None:
    """Insert rows ``[a, b)`` of the stacked leaves (``prio`` already covers exactly them)."""
    if (a, b) != (0, stacked[0].shape[0]):
      stacked = [x[a:b] for x in stacked]
      version = None if version is None else version[a:b]
      meta = None if meta is None else {k: v[a:b] for k, v in meta.items()}
    items = jax.tree_util.tree_unflatten(self._sig.treedef, stacked)
    rem = b - a
    while True:
      try:
        self._table.insert(items, version=version, priority=prio, metadata=meta,
                           timeout=self._poll)
        break
      except Exception as e:  # noqa: BLE001 (re-raised unless it is the limiter's timeout)
        k = getattr(e, "inserted", 0)  # Table errors say how many leading rows went in
        if k:
          items = jax.tree_util.tree_map(lambda x, k=k: x[k:], items)
          version = None if version is None else version[k:]
          prio = None if prio is None else prio[k:]
          meta = None if meta is None else {c: v[k:] for c, v in meta.items()}
          rem -= k
          self._inserted += k
          self._inflight -= k
        if not isinstance(e, TimeoutError):
          raise
        if self._discard:  # the rate limiter blocks and close() asked to give up
          raise _Discarding() from None
    self._inserted += rem
    self._inflight -= rem
    self._batches += 1


class _Discarding(Exception):
  """close(discard_pending=True) while an insert waits on the rate limiter."""
