"""The async facade: a ``SyncStore`` (memory, file) as the ``Store`` every caller awaits.

Rules it keeps:
- The facade owns its executors: one writer thread (a process's writes to one file are
  serialised here rather than in SQLite's lock) and a few reader threads. Nothing runs
  on the caller's event loop, so a write that waits for a lock held by another process
  or for an fsync delays only the requests that need it.
- Reads go to reader threads, never behind a write: a pinned turn's pin read does not
  wait for a new conversation's durable pin write.
- ``Inline`` is the same surface without threads, for the memory store: its calls hold
  a lock for microseconds and touch no file, so a thread hop would cost more than them.
- ``close`` closes the backend on the writer thread (after the writes queued before it),
  then stops the threads.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .base import READS, WRITES, SyncStore

READER_THREADS = 2


class Threaded:
    """A SyncStore served from threads the facade owns."""

    def __init__(self, backend: SyncStore, *, readers: int = READER_THREADS) -> None:
        self.backend = backend
        self.url = backend.url
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sessionpin-store-w")
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="sessionpin-store-r")
        self._closed = False

    async def _call(self, pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, functools.partial(fn, *args, **kw))

    def describe(self) -> dict[str, Any]:
        return self.backend.describe()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._call(self._writer, self.backend.close)
        finally:
            self._writer.shutdown(wait=False)
            self._readers.shutdown(wait=False)

    def close_now(self) -> None:
        """Close from synchronous code (mitmproxy's ``done``, atexit): waits for queued writes."""
        if self._closed:
            return
        self._closed = True
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
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
    async def method(self: Threaded, *args: Any, **kw: Any) -> Any:
        return await self._call(self._readers if read else self._writer, getattr(self.backend, name), *args, **kw)
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
