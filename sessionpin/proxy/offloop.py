"""OffLoop: pure work on a request body (hashing a history) on threads of its own, so that a
large body never holds mitmproxy's event loop — every other client's bytes pass meanwhile.

Rules it keeps:
- ``run`` is for work a request waits for (its lineage, on the request path): it is never
  refused; the request waits, the event loop does not.
- ``submit`` is for work nothing waits for (a record made after a request left): bounded in
  jobs and in the bytes they hold (a body is kept alive until its job ran); over the bound the
  job is not run and counted in ``skipped`` (a lost record costs a later fork its parent link,
  nothing more).
- The work is pure (no store, no flow): it gets bytes, gives plain data.
- Threads are made on first use and let go at ``close``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

MAX_JOBS = 256
MAX_BYTES = 256 * 1024 * 1024


class OffLoop:
    def __init__(self, name: str, workers: int = 1, max_jobs: int = MAX_JOBS, max_bytes: int = MAX_BYTES) -> None:
        self.name, self.workers = name, workers
        self.max_jobs, self.max_bytes = max_jobs, max_bytes
        self.jobs = 0            # submitted, not finished
        self.bytes = 0           # the bodies they hold
        self.skipped = 0         # submitted over the bound: not run
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=f"sessionpin-{self.name}")
        return self._pool

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a thread; the caller waits, the event loop does not."""
        return await asyncio.get_running_loop().run_in_executor(self._executor(), fn, *args)

    def submit(self, size: int, fn: Callable[..., T], *args: Any) -> asyncio.Future[T] | None:
        """``fn(*args)`` on a thread, nobody waiting; None when over the bound (counted)."""
        if self.jobs >= self.max_jobs or (self.jobs and self.bytes + size > self.max_bytes):
            self.skipped += 1
            return None
        self.jobs += 1
        self.bytes += size
        fut = asyncio.get_running_loop().run_in_executor(self._executor(), fn, *args)

        def release(_: asyncio.Future) -> None:
            self.jobs -= 1
            self.bytes -= size

        fut.add_done_callback(release)
        return fut

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
