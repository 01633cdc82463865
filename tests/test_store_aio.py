"""store/aio.py: the facade's lanes run a SyncStore's calls off the event loop."""

import asyncio
import threading

import pytest

from sessionpin.store import WrongType, aio
from sessionpin.store.base import WouldBlock
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


# -- a single key's read on the caller's loop (file store: no thread hop) ------------------

class LaneCalls:
    """Counts what a facade sends to its reader thread."""

    def __init__(self, store: aio.Threaded) -> None:
        self.names: list[str] = []
        real = store._readers.call

        def call(fn, *args, **kw):
            self.names.append(getattr(fn, "__name__", "?"))
            return real(fn, *args, **kw)
        store._readers.call = call


async def opened(tmp_path, name="state.db"):
    from sessionpin.store import open_store
    store = open_store(f"file:{tmp_path / name}")
    await store.set("pin:s", "glm")
    await store.hset("seen:s", "requests", "3")
    assert await store.get("pin:s") == "glm"      # the first read: on the thread, which opens the loop's connection
    for _ in range(100):
        if store.backend._now:
            break
        await asyncio.sleep(0.01)
    return store


async def test_a_file_store_answers_a_single_key_read_on_the_loop(tmp_path):
    """A pinned turn's pin read: answered on the loop, no hop to the reader thread (fails
    before: every read went to the thread)."""
    store = await opened(tmp_path)
    try:
        lane = LaneCalls(store)
        assert await store.get("pin:s") == "glm"
        assert await store.get("pin:other") is None
        assert await store.hgetall("seen:s") == {"requests": "3"}
        assert await store.hget("seen:s", "requests") == "3"
        with pytest.raises(WrongType):                  # a wrong type says so, as on the thread
            await store.zscore("seen:s", "m")
        assert store.now_reads == 4 and lane.names == []
        await store.set("pin:s", "anthropic")
        assert await store.get("pin:s") == "anthropic"  # it reads the file: the write just made
        assert await store.mget(["pin:s"]) == ["anthropic"] and lane.names == ["mget"]   # several keys: the thread
    finally:
        await store.close()


class Busy:
    """A connection SQLite answers "busy" on (another process rebuilding the WAL index)."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def execute(self, *a):
        import sqlite3
        e = sqlite3.OperationalError("database is locked")
        e.sqlite_errorcode = sqlite3.SQLITE_BUSY
        raise e

    def __getattr__(self, name):
        return getattr(self.conn, name)


async def test_a_read_that_would_wait_goes_to_the_thread_never_stalls_the_loop(tmp_path):
    """The loop's connection never waits for a lock (busy timeout 0); where SQLite says busy
    the read is asked again on the reader thread (which may wait): not a fault, not a stall."""
    import threading
    store = await opened(tmp_path)
    try:
        held = store.backend._now[threading.get_ident()]
        assert held[0].execute("PRAGMA busy_timeout").fetchone()[0] == 0
        store.backend._now[threading.get_ident()] = (Busy(held[0]), held[1])
        with pytest.raises(WouldBlock):
            store.backend.read_now("get", "pin:s")
        store.backend._now[threading.get_ident()] = (Busy(held[0]), held[1])
        lane = LaneCalls(store)
        assert await store.get("pin:s") == "glm"
        assert "get" in lane.names and store.backend._writer.rfaults.cause is None     # no fault said
    finally:
        await store.close()


async def test_a_pin_read_on_a_loaded_machine_stays_on_the_loop(tmp_path):
    """A read preempted midway (another process's turn on the CPU) is slow without having
    waited for the disk: it must not send the reads to the thread."""
    store = await opened(tmp_path)
    try:
        for _ in range(300):
            assert await store.get("pin:s") == "glm"
        assert aio._disk_reads() is None or store.slow_reads == 0
        assert store.now_reads == 300 or aio._disk_reads() is None
    finally:
        await store.close()


async def test_after_a_read_that_met_the_disk_reads_go_to_the_thread_for_a_while(tmp_path, monkeypatch):
    store = await opened(tmp_path)
    try:
        reads = iter(range(1000))
        monkeypatch.setattr(aio, "_disk_reads", lambda: next(reads))    # every read on the loop met the disk
        lane = LaneCalls(store)
        assert await store.get("pin:s") == "glm"
        assert (store.now_reads, store.slow_reads, lane.names) == (1, 1, [])
        assert await store.get("pin:s") == "glm"
        assert (store.now_reads, lane.names) == (1, ["get"])    # cooling off: on the thread
        store._now_after = 0.0                          # the cool-off is over
        monkeypatch.setattr(aio, "_disk_reads", lambda: 7)
        assert await store.get("pin:s") == "glm" and store.now_reads == 2
    finally:
        await store.close()


class Counted(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.closes = 0

    def close(self) -> None:
        self.closes += 1
        super().close()


async def test_a_shared_handle_outlives_the_first_and_the_backend_closes_with_the_last():
    """Issue 22: the OpenCode id pool shares the router's file store (one writer, one file
    check per process) instead of opening it again; the router closing its handle (a script
    reload's done) must not close the pool's."""
    first = aio.Threaded(Counted())
    second = first.share()
    assert second.backend is first.backend and second is not first
    await first.set("k", "1")
    await first.close()
    assert first.backend.closes == 0
    await second.set("k", "2")                 # the writer lane still runs
    assert await second.get("k") == "2"        # and the reader lane
    await first.close()                        # closing a closed handle twice counts once
    assert first.backend.closes == 0
    await second.close()
    assert first.backend.closes == 1
    with pytest.raises(Exception):
        first.share()


def test_close_now_of_shared_handles_closes_the_backend_once_with_the_last():
    first = aio.Threaded(Counted())
    second, third = first.share(), first.share()
    for h in (second, first):
        h.close_now()
        assert first.backend.closes == 0
    third.close_now()
    third.close_now()
    assert first.backend.closes == 1
