"""OffLoop: pure work on a request body (hashing a history) on threads of its own, so that a
large body never holds mitmproxy's event loop — every other client's bytes pass meanwhile.

Rules it keeps:
- ``run`` is for work a request waits for (its lineage, on the request path): it is never
  refused; the request waits, the event loop does not.
- ``submit`` is for work nothing waits for (a record made after a request left): bounded in
  jobs and in the bytes they hold (a body is kept alive until its job ran); over the bound the
  job is not run and counted in ``skipped`` (a lost record costs a later fork its parent link,
  nothing more).
- ``gather``: work nothing waits for may be gathered for that many seconds and run in one
  hop to the thread, answered in one wakeup of the loop (a record made after every
  request with history: a hop each cost the loop more than the work — the queue, the
  thread's wakeup, its answer, the GIL passed twice). A job that fails fails alone.
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
    def __init__(self, name: str, workers: int = 1, max_jobs: int = MAX_JOBS, max_bytes: int = MAX_BYTES,
                 gather: float = 0.0) -> None:
        self.name, self.workers = name, workers
        self.max_jobs, self.max_bytes = max_jobs, max_bytes
        self.gather = gather     # seconds ``submit`` gathers jobs for one hop (0: a hop each)
        self.jobs = 0            # submitted, not finished
        self.bytes = 0           # the bodies they hold
        self.skipped = 0         # submitted over the bound: not run
        self.hops = 0            # trips to the thread made for submitted jobs
        self._pool: ThreadPoolExecutor | None = None
        self._gathered: list[tuple[asyncio.Future, Callable[..., Any], tuple]] = []
        self._gathering: asyncio.TimerHandle | None = None

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
        loop = asyncio.get_running_loop()
        if self.gather > 0:
            fut = loop.create_future()
            self._gathered.append((fut, fn, args))
            if self._gathering is None:
                self._gathering = loop.call_later(self.gather, self._run_gathered)
        else:
            self.hops += 1
            fut = loop.run_in_executor(self._executor(), fn, *args)

        def release(_: asyncio.Future) -> None:
            self.jobs -= 1
            self.bytes -= size

        fut.add_done_callback(release)
        return fut

    def _run_gathered(self) -> None:
        self._gathering = None
        batch, self._gathered = self._gathered, []
        if not batch:
            return
        self.hops += 1
        ran = asyncio.get_running_loop().run_in_executor(self._executor(), _run_all, [(fn, a) for _, fn, a in batch])

        def settle(ran: asyncio.Future) -> None:
            if ran.cancelled() or ran.exception() is not None:     # (closed meanwhile)
                for fut, _, _ in batch:
                    fut.cancel()
                return
            for (fut, _, _), (result, error) in zip(batch, ran.result()):
                if fut.done():
                    continue
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(result)
        ran.add_done_callback(settle)

    def close(self) -> None:
        if self._gathering is not None:
            self._gathering.cancel()
            self._gathering = None
        batch, self._gathered = self._gathered, []
        for fut, _, _ in batch:
            try:
                fut.cancel()
            except RuntimeError:        # its loop is closed: nobody waits
                pass
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _run_all(jobs: list[tuple[Callable[..., Any], tuple]]) -> list[tuple[Any, BaseException | None]]:
    """Gathered jobs, one after another on the thread; each one's answer or error."""
    out: list[tuple[Any, BaseException | None]] = []
    for fn, args in jobs:
        try:
            out.append((fn(*args), None))
        except Exception as e:
            out.append((None, e))
    return out
