"""The async facade: a ``SyncStore`` (memory, file) as the ``Store`` every caller awaits.

Rules it keeps:
- The facade owns its threads: a writer lane (a process's writes to one file are
  serialised here rather than in SQLite's lock) and a reader lane (a read takes
  microseconds: one thread keeps up, and a second would only fight the first for the GIL).
  Nothing that may wait runs on the caller's event loop, so a write that waits for a lock
  held by another process or for an fsync delays only the requests that need it.
- A lane is a queue and its threads that settle the caller's asyncio future directly
  (``call_soon_threadsafe``): a pin read is on every request's path, and the hop through
  ``concurrent.futures`` (its own future, a lock, a wrapped future) cost a third more.
- Reads go to reader threads, never behind a write: a pinned turn's pin read does not
  wait for a new conversation's durable pin write.
- A single key's read that the backend can answer without waiting (``read_now``: the
  file store's, through a connection that never waits for a lock) is answered on the
  caller's loop, with no hop at all: a pinned turn's pin read is ~10 µs of SQLite, its hop
  to the reader thread and back cost more than that, and the GIL twice. Where it would
  wait (``WouldBlock``) it goes to the reader thread, as every other read does. What a
  lock cannot say is whether a page is in the OS's cache: a read on the loop that read
  from the disk (the thread's block reads or major faults went up: ``getrusage``, Linux;
  elsewhere a read that took longer than ``SLOW_READ``) sends the reads back to the reader
  thread for ``COOL_OFF`` — a cold store costs the loop one disk read per ``COOL_OFF``,
  not one per request. (Not wall time on Linux: on a loaded machine a read preempted
  midway is slow without having waited for anything.) An ordinary write made on the loop
  (``write_now``) that waited for the disk (read from it and spent over ``SLOW_READ`` off the
  CPU) sends the writes to the writer thread for ``COOL_OFF``, not the reads: a commit that
  grows a file may read the file system's own blocks, which says nothing of the pages a pin
  read reads, and is seldom a wait.
- ``Inline`` is the same surface without threads, for the memory store: its calls hold
  a lock for microseconds and touch no file, so a thread hop would cost more than them.
- ``close`` closes the backend on the writer thread (after the writes queued before it),
  then stops the threads.
- ``share`` is another handle on the same backend and threads (the OpenCode id pool's, which
  must outlive the router's across a script reload): the backend closes with the last
  handle. A second ``open_store`` of the same file would run a second writer, a second
  background thread verifying both files and fsyncing their WALs, and two more lanes (issue
  22: ~0.1 ms of CPU per request under load, and a second file check every few seconds).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from typing import Any, Callable

from .base import READS, WRITES, StoreError, SyncStore, WouldBlock

SLOW_READ = 0.002     # seconds: without getrusage, a read on the loop this slow met the disk (a warm one: ~10 µs)
COOL_OFF = 10.0       # seconds of reads on the reader thread after one that met the disk

try:
    import resource
    _RUSAGE_THREAD: int | None = resource.RUSAGE_THREAD   # (Linux)
except (ImportError, AttributeError):
    _RUSAGE_THREAD = None


def _disk_reads() -> int | None:
    """Reads from the disk this thread has made (blocks read, major page faults); None: unknown."""
    if _RUSAGE_THREAD is None:
        return None
    r = resource.getrusage(_RUSAGE_THREAD)
    return r.ru_inblock + r.ru_majflt


def _waited(disk: int | None, t: float, cpu: float) -> bool:
    """Did a call on this thread, begun at ``t`` (``time.perf_counter``) with ``cpu`` of its
    thread's CPU time and ``disk`` of its disk reads (``_disk_reads``), wait for the disk: it
    read from it and spent over ``SLOW_READ`` off the CPU. (A preempted call reads nothing; a
    block the disk gives at once is no stall.) Without ``getrusage``: it took over ``SLOW_READ``."""
    wall = time.perf_counter() - t
    if disk is None:
        return wall > SLOW_READ
    return _disk_reads() != disk and wall - (time.thread_time() - cpu) > SLOW_READ


def _answer(answers: dict[asyncio.AbstractEventLoop, list], lane: "Lane") -> None:
    for loop, done in answers.items():
        try:
            loop.call_soon_threadsafe(_settle, done, lane)
        except RuntimeError:          # the caller's loop is closed: nobody waits
            pass


def _settle(done: list[tuple[asyncio.Future, Any, BaseException | None]], lane: "Lane") -> None:
    lane.outstanding -= len(done)     # answered (a caller that gave up waiting counts until now)
    for fut, result, error in done:
        if fut.cancelled():
            continue
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


class Lane:
    """A thread that runs calls and answers on the caller's loop.

    Calls run in the order they were queued, except that a durable write goes first: it
    is a new conversation's pin, on that request's path, while the other writes
    (activity, lineage, renewals) are background work that may pile up behind a store
    another process holds locked — each of them then waits out the busy timeout.

    ``batch``: calls queued while the lane worked are answered in one wakeup of the
    caller's loop (each wakeup is a syscall on both sides) — for reads, microseconds each,
    one on every request's path. Without it each call is answered when it is done — for
    writes, any of which may wait for another process's lock."""

    def __init__(self, name: str, batch: bool) -> None:
        self.batch = batch
        self.outstanding = 0      # calls queued or running, not yet answered on the loop
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.outstanding += 1
        self._queue.put((loop, fut, fn, args, kw))
        return fut

    def _drain(self, pending: deque) -> None:
        while True:
            try:
                pending.append(self._queue.get_nowait())
            except queue.Empty:
                return

    @staticmethod
    def _next(pending: deque) -> Any:
        for i, item in enumerate(pending):
            if item is not None and item[4].get("durable") is True:
                del pending[i]
                return item
        return pending.popleft()

    def _work(self) -> None:
        pending: deque = deque()
        answers: dict[asyncio.AbstractEventLoop, list] = {}
        while True:
            if not pending:
                pending.append(self._queue.get())
            self._drain(pending)
            item = self._next(pending)
            if item is None:
                _answer(answers, self)
                return
            loop, fut, fn, args, kw = item
            try:
                answers.setdefault(loop, []).append((fut, fn(*args, **kw), None))
            except BaseException as e:   # handed to the caller, whatever it is
                answers.setdefault(loop, []).append((fut, None, e))
            if not self.batch or (not pending and self._queue.empty()):
                _answer(answers, self)
                answers = {}

    def stop(self, wait: bool) -> None:
        self._queue.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()


class Threaded:
    """A SyncStore served from threads the facade owns."""

    def __init__(self, backend: SyncStore) -> None:
        self.backend = backend
        self.url = backend.url
        self._writer = Lane("sessionpin-store-w", batch=False)
        self._readers = Lane("sessionpin-store-r", batch=True)
        self._closed = False
        self._handles = [1]                  # open handles on this backend (``share``), one list for all
        self._now_reads: frozenset[str] = frozenset(getattr(backend, "now_reads", ()))
        self._now_writes: frozenset[str] = frozenset(getattr(backend, "now_writes", ()))
        self._now_after = 0.0                # monotonic: reads on the loop resume then (after a slow one)
        self._writes_after = 0.0             # and writes (after a slow write: its own, see ``_write``)
        self._opening: asyncio.Future | None = None
        self.now_reads = self.slow_reads = 0     # answered on the loop; of them, slow (tests, the bench)
        self.now_writes = self.slow_writes = 0   # writes made on the loop; of them, slow (tests, the bench)

    async def _read(self, name: str, *args: Any, **kw: Any) -> Any:
        if name in self._now_reads and not kw and time.monotonic() >= self._now_after:
            disk, t = _disk_reads(), time.perf_counter()
            try:
                result = self.backend.read_now(name, *args)    # type: ignore[attr-defined]
                self.now_reads += 1
                return result
            except WouldBlock:
                self._open_now()
            finally:
                if _disk_reads() != disk if disk is not None else time.perf_counter() - t > SLOW_READ:
                    self.slow_reads += 1
                    self._now_after = time.monotonic() + COOL_OFF
        return await self._call(self._readers, getattr(self.backend, name), *args, **kw)

    async def _write(self, name: str, *args: Any, **kw: Any) -> Any:
        # A write that waited for the disk cools off the writes only. What it read is not what a
        # pin read reads: a commit that grows the WAL may read the file system's own blocks
        # (ext4: 0 to 76 commits in 3,000, ``bench_batches.py --inblock``), and under load a
        # cool-off of the reads as well sent 11-88 % of the pin reads through the reader
        # thread, a hop each. Nor is such a read a stall (those commits' median 1.68 ms against
        # 1.45, the slowest 2.4): a write cools off when it read from the disk *and* spent over
        # ``SLOW_READ`` off the CPU (``_waited``), or the flushes go to the writer thread most of
        # the time under load, its SQLite calls passing the GIL to and from the loop (issue 22,
        # fourteenth round).
        if (name in self._now_writes and not kw.get("durable") and not self._writer.outstanding
                and time.monotonic() >= self._writes_after):
            disk, t, cpu = _disk_reads(), time.perf_counter(), time.thread_time()
            try:
                result = self.backend.write_now(name, *args, **kw)    # type: ignore[attr-defined]
                self.now_writes += 1
                return result
            except WouldBlock:
                pass
            finally:
                if _waited(disk, t, cpu):
                    self.slow_writes += 1
                    self._writes_after = time.monotonic() + COOL_OFF
        return await self._call(self._writer, getattr(self.backend, name), *args, **kw)

    def _open_now(self) -> None:
        """Have the reader thread open this thread's never-waiting connection (once at a time)."""
        if self._closed or (self._opening is not None and not self._opening.done()):
            return
        fut = self._opening = self._readers.call(self.backend.open_now, threading.get_ident())  # type: ignore
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())   # a failure: the next read says it

    async def _call(self, lane: Lane, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return await lane.call(fn, *args, **kw)

    def describe(self) -> dict[str, Any]:
        return self.backend.describe()

    def share(self) -> "Threaded":
        """Another handle on this backend and its threads; each is closed on its own, and
        the backend with the last of them."""
        if self._closed:
            raise StoreError(f"{self.url}: store is closed")
        other = object.__new__(Threaded)
        other.__dict__.update(self.__dict__)
        other._closed, other._opening = False, None
        other.now_reads = other.slow_reads = 0
        other.now_writes = other.slow_writes = 0
        self._handles[0] += 1
        return other

    def _last(self) -> bool:
        """This handle is closed; is it the last one open?"""
        self._closed = True
        self._handles[0] -= 1
        return self._handles[0] == 0

    async def close(self) -> None:
        if self._closed or not self._last():
            return
        try:
            await self._call(self._writer, self.backend.close)
        finally:
            self._writer.stop(wait=False)
            self._readers.stop(wait=False)

    def close_now(self) -> None:
        """Close from synchronous code (mitmproxy's ``done``, atexit): waits for queued writes."""
        if self._closed or not self._last():
            return
        self._writer.stop(wait=True)
        self._readers.stop(wait=True)
        self.backend.close()

    def __repr__(self) -> str:
        return f"<Threaded {self.backend!r}>"


class Inline:
    """A SyncStore whose calls are cheap and touch no file (memory): called directly."""

    def __init__(self, backend: SyncStore) -> None:
        self.backend = backend
        self.url = backend.url

    def describe(self) -> dict[str, Any]:
        return self.backend.describe()

    async def close(self) -> None:
        self.backend.close()

    def close_now(self) -> None:
        self.backend.close()

    def __repr__(self) -> str:
        return f"<Inline {self.backend!r}>"


def _threaded(name: str, read: bool):
    if read:
        async def method(self: Threaded, *args: Any, **kw: Any) -> Any:
            return await self._read(name, *args, **kw)
    else:
        async def method(self: Threaded, *args: Any, **kw: Any) -> Any:
            return await self._write(name, *args, **kw)
    method.__name__ = name
    return method


def _inline(name: str):
    async def method(self: Inline, *args: Any, **kw: Any) -> Any:
        return getattr(self.backend, name)(*args, **kw)
    method.__name__ = name
    return method


for _name in sorted(READS | WRITES):
    setattr(Threaded, _name, _threaded(_name, _name in READS))
    setattr(Inline, _name, _inline(_name))
