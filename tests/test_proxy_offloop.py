"""proxy/offloop.py: pure work on threads of its own, bounded; gathered work goes in one hop."""

import asyncio
import threading

import pytest

from sessionpin.proxy.offloop import OffLoop


def work(x: int) -> tuple[int, int]:
    if x < 0:
        raise ValueError("negative")
    return x * 2, threading.get_ident()


async def test_run_is_on_a_thread():
    off = OffLoop("t")
    try:
        doubled, thread = await off.run(work, 4)
        assert doubled == 8 and thread != threading.get_ident()
    finally:
        off.close()


async def test_gathered_jobs_go_to_the_thread_in_one_hop_and_fail_alone():
    """Records made after many requests: one trip to the thread for all of them (fails
    before: a hop per job)."""
    off = OffLoop("t", gather=0.02)
    try:
        futs = [off.submit(10, work, i) for i in (1, 2, -1, 3)]
        assert off.jobs == 4 and off.bytes == 40
        await asyncio.gather(*futs, return_exceptions=True)
        assert [f.result()[0] for f in (futs[0], futs[1], futs[3])] == [2, 4, 6]
        assert isinstance(futs[2].exception(), ValueError)
        assert off.hops == 1 and off.jobs == 0 and off.bytes == 0
        assert await off.submit(1, work, 5) == (10, futs[0].result()[1])      # a second batch: a second hop
        assert off.hops == 2
    finally:
        off.close()


async def test_gathered_jobs_keep_the_bounds_and_close_cancels_them():
    off = OffLoop("t", max_jobs=2, max_bytes=100, gather=10.0)
    a, b = off.submit(60, work, 1), off.submit(30, work, 2)
    assert off.submit(1, work, 3) is None and off.skipped == 1        # two jobs at most
    off.close()
    await asyncio.sleep(0)
    assert a.cancelled() and b.cancelled() and off.jobs == 0 and off.bytes == 0


async def test_without_gather_a_job_is_a_hop():
    off = OffLoop("t")
    try:
        assert (await off.submit(1, work, 1))[0] == 2 and off.hops == 1
        assert off.submit(300 * 1024 * 1024, work, 1) is not None       # the first job is never refused
    finally:
        off.close()
