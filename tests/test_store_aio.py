"""store/aio.py: the facade's lanes run a SyncStore's calls off the event loop."""

import asyncio
import threading

import pytest

from sessionpin.store import aio
from sessionpin.store.memory import MemoryStore


class Gate(MemoryStore):
    """A memory store whose writes can be held (as a file store's wait for another process's lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = threading.Event()
        self.hold.set()
        self.order: list[str] = []
        self.entered = threading.Event()

    def set(self, key, value, ttl=None, *, nx=False, durable=False):
        self.entered.set()
        self.hold.wait(10)
        self.order.append(key)
        return super().set(key, value, ttl, nx=nx, durable=durable)


async def test_calls_run_in_order_and_answer_on_the_loop():
    store = aio.Threaded(Gate())
    try:
        for i in range(20):
            await store.set(f"k{i}", str(i))
        assert store.backend.order == [f"k{i}" for i in range(20)]
        assert await store.mget([f"k{i}" for i in range(20)]) == [str(i) for i in range(20)]
    finally:
        await store.close()


async def test_a_durable_write_goes_before_background_writes_queued_behind_a_lock():
    # Another process holds the store's lock: every write waits. A new conversation's
    # durable pin write must not queue behind the background writes (lineage, activity)
    # that piled up meanwhile.
    backend = Gate()
    store = aio.Threaded(backend)
    try:
        backend.hold.clear()
        backend.entered.clear()
        first = asyncio.ensure_future(store.set("background-0", "x"))
        await asyncio.to_thread(backend.entered.wait, 5)         # the lane is stuck in it
        background = [asyncio.ensure_future(store.set(f"background-{i}", "x")) for i in range(1, 30)]
        await asyncio.sleep(0.05)
        pin = asyncio.ensure_future(store.set("pin", "glm", durable=True))
        await asyncio.sleep(0.05)
        backend.hold.set()
        await asyncio.gather(first, pin, *background)
        assert backend.order[:2] == ["background-0", "pin"]
        assert backend.order[2:] == [f"background-{i}" for i in range(1, 30)]
    finally:
        await store.close()


class Turnstile(MemoryStore):
    """A memory store whose writes each need a permit (``let(n)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.permits = threading.Semaphore(0)
        self.waiting = threading.Semaphore(0)

    def set(self, key, value, ttl=None, *, nx=False, durable=False):
        self.waiting.release()
        assert self.permits.acquire(timeout=10)
        return super().set(key, value, ttl, nx=nx, durable=durable)


async def test_a_write_is_answered_without_waiting_for_the_writes_after_it():
    backend = Turnstile()
    store = aio.Threaded(backend)
    try:
        zero = asyncio.ensure_future(store.set("zero", "x"))
        await asyncio.to_thread(backend.waiting.acquire, True, 5)     # the writer is in it
        first = asyncio.ensure_future(store.set("first", "x"))
        second = asyncio.ensure_future(store.set("second", "x"))
        await asyncio.sleep(0.05)           # both queued while the writer was busy
        backend.permits.release(2)          # "zero" and "first" pass; "second" waits at the turnstile
        await asyncio.wait_for(asyncio.gather(zero, first), 5)
        assert not second.done()
        backend.permits.release()
        await asyncio.wait_for(second, 5)
    finally:
        await store.close()


async def test_reads_do_not_wait_for_a_held_write():
    backend = Gate()
    store = aio.Threaded(backend)
    try:
        await store.set("a", "1")
        backend.hold.clear()
        write = asyncio.ensure_future(store.set("b", "2"))
        assert await asyncio.wait_for(store.get("a"), 2) == "1"
        backend.hold.set()
        await write
    finally:
        await store.close()


async def test_an_error_reaches_its_caller_and_the_lane_goes_on():
    store = aio.Threaded(MemoryStore())
    try:
        with pytest.raises(TypeError):
            await store.set("k")          # a wrong call, raised in the thread
        assert await store.set("k", "v") is True
        assert await store.get("k") == "v"
    finally:
        await store.close()
