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
    """Counts what a facade sends to one of its threads (its reader's, or ``writer=True``)."""

    def __init__(self, store: aio.Threaded, writer: bool = False) -> None:
        self.names: list[str] = []
        lane = store._writer if writer else store._readers
        real = lane.call

        def call(fn, *args, **kw):
            self.names.append(getattr(fn, "__name__", "?"))
            return real(fn, *args, **kw)
        lane.call = call


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


async def test_a_write_that_met_the_disk_sends_the_writes_to_the_thread_not_the_reads(tmp_path, monkeypatch):
    """Issue 22, fourteenth round: a commit on the loop that grows the WAL may read the file
    system's blocks (ext4: 0 to 76 commits in 3,000). That cooled off the reads too, and under load
    11-88 % of the pin reads then went to the reader thread, a hop each (fails before: both
    reads went to the thread)."""
    from sessionpin.store.base import Set
    store = await opened(tmp_path)
    try:
        reads = iter(range(1000))
        monkeypatch.setattr(aio, "_disk_reads", lambda: next(reads))    # this write met the disk
        monkeypatch.setattr(aio, "SLOW_READ", -1.0)                      # and waited for it
        writer, wrote = WriterCalls(store), store.now_writes
        assert await store.apply([], [Set("seen:a", "1")]) is True
        monkeypatch.setattr(aio, "_disk_reads", lambda: 7)               # what follows does not
        lane, before = LaneCalls(store), store.now_reads
        assert await store.get("pin:s") == "glm" and await store.get("seen:a") == "1"
        assert (lane.names, store.now_reads, store.slow_reads) == ([], before + 2, 0)    # on the loop
        assert (store.now_writes, store.slow_writes, writer.names) == (wrote + 1, 1, [])
        assert await store.apply([], [Set("seen:b", "2")]) is True
        assert (store.now_writes, writer.names) == (wrote + 1, ["apply"])  # cooling off: on the thread
        store._writes_after = 0.0                                        # the cool-off is over
        assert await store.apply([], [Set("seen:c", "3")]) is True and store.now_writes == wrote + 2
    finally:
        await store.close()


async def test_a_write_that_read_from_the_disk_without_waiting_stays_on_the_loop(tmp_path, monkeypatch):
    """A block the disk gives at once (ext4's own, as a commit grows the WAL: their commits'
    median 1.68 ms against 1.45) is no stall: the writes stay on the loop. Under load, such a
    commit every few seconds had sent the ledger's and lineage's flushes to the writer thread
    nearly all the time (fails before: the second write went to the thread)."""
    from sessionpin.store.base import Set
    store = await opened(tmp_path)
    try:
        reads = iter(range(1000))
        monkeypatch.setattr(aio, "_disk_reads", lambda: next(reads))    # every write reads the disk
        monkeypatch.setattr(aio, "SLOW_READ", 60.0)                      # and waits for nothing
        writer, wrote = WriterCalls(store), store.now_writes
        for i in range(3):
            assert await store.apply([], [Set(f"seen:{i}", "1")]) is True
        assert (writer.names, store.now_writes, store.slow_writes) == ([], wrote + 3, 0)
        monkeypatch.setattr(aio, "_disk_reads", lambda: None)            # no getrusage: the time says
        assert await store.apply([], [Set("seen:x", "1")]) is True and store.slow_writes == 0
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


# -- an ordinary write on the caller's loop (file store: no thread hop, no GIL ping-pong) ----

def WriterCalls(store: aio.Threaded) -> LaneCalls:
    return LaneCalls(store, writer=True)


async def test_an_ordinary_write_is_made_on_the_loop_and_a_durable_one_on_the_thread(tmp_path):
    """Issue 22: the ledger's and lineage's batches went to the writer thread, whose SQLite
    calls each passed the GIL back and forth with a busy loop (~0.8 ms of CPU per request
    under load). Made on the loop they cost their SQLite time only (fails before: every write
    went to the thread)."""
    from sessionpin.store.base import Set
    store = await opened(tmp_path)
    try:
        lane, before = WriterCalls(store), store.now_writes
        assert await store.apply([], [Set("seen:a", "1"), Set("seen:b", "2")]) is True
        assert await store.hincr("h", "n", 2) == 2
        assert await store.set("pin:new", "glm", durable=True) is True     # fsyncs: the thread
        assert lane.names == ["set"] and store.now_writes == before + 2
        assert [await store.get(k) for k in ("seen:a", "seen:b", "pin:new")] == ["1", "2", "glm"]
    finally:
        await store.close()


async def test_a_write_behind_one_still_on_the_thread_goes_to_the_thread_in_order(tmp_path):
    """Writes keep their order: while the writer thread has a write not yet answered, the next
    ones queue behind it instead of passing it on the loop."""
    store = await opened(tmp_path)
    try:
        lane = WriterCalls(store)
        first = asyncio.ensure_future(store.set("k", "1", durable=True))
        await asyncio.sleep(0)                                  # queued on the thread
        assert store._writer.outstanding == 1
        second = asyncio.ensure_future(store.set("k", "2"))
        await asyncio.gather(first, second)
        assert lane.names == ["set", "set"] and await store.get("k") == "2"
        assert store._writer.outstanding == 0
        before = store.now_writes
        await store.set("k", "3")
        assert lane.names == ["set", "set"] and await store.get("k") == "3"   # the thread idle: on the loop
        assert store.now_writes == before + 1
    finally:
        await store.close()


LOCKER = r"""
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
c.execute("COMMIT")
"""


@pytest.mark.parametrize("held", ["sqlite", "lock file"])
async def test_a_write_that_would_wait_goes_to_the_thread_never_stalls_the_loop(tmp_path, held):
    """Another process holds the store's write lock (SQLite's, or the lock file): the write is
    not made on the loop (busy timeout 0, a lock file tried once) but on the thread, which
    waits; the loop goes on meanwhile."""
    import subprocess
    import sys
    import time
    store = await opened(tmp_path)
    path = tmp_path / "state.db"
    code = LOCKER if held == "sqlite" else (
        "import fcntl, sys, time\nfd = open(sys.argv[1], 'a')\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\ntime.sleep(float(sys.argv[2]))\n")
    target = str(path) if held == "sqlite" else f"{path}.lock"
    p = subprocess.Popen([sys.executable, "-c", code, target, "0.6"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "locked\n"
        lane = WriterCalls(store)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        t = asyncio.ensure_future(ticker())
        t0 = time.monotonic()
        assert await store.set("k", "v") is True
        waited = time.monotonic() - t0
        t.cancel()
        assert lane.names == ["set"]
        assert waited > 0.2 and ticks >= 10          # it waited on the thread; the loop ran meanwhile
        assert await store.get("k") == "v"
    finally:
        p.wait(timeout=10)
        await store.close()


async def test_a_write_on_the_loop_never_checkpoints_there(tmp_path):
    """A commit's autocheckpoint copies pages and fsyncs: off for the loop's commits, made by
    the background thread; a WAL grown past ``WAL_GUARD`` (checkpoints not keeping up) takes
    its writes on the thread again, whose commit checkpoints it."""
    import os
    from sessionpin.store import writer as W
    from sessionpin.store.base import Set
    store = await opened(tmp_path)
    k = store.backend._writer
    try:
        assert k.w.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == W.AUTOCHECKPOINT
        seen = []
        k.w.set_trace_callback(seen.append)
        await store.apply([], [Set(f"k{i:04d}", "x" * 3000) for i in range(200)])   # ~150 pages
        k.w.set_trace_callback(None)
        assert "PRAGMA wal_autocheckpoint = 0" in seen and any(x.startswith("COMMIT") for x in seen)
        assert k.w.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == W.AUTOCHECKPOINT   # restored
        import time
        k.loop_commits, k.checkpointed = max(k.loop_commits, 1), time.monotonic()
        k.checkpoint()                                    # not yet due: one commit, just now
        assert k.loop_commits >= 1
        k.loop_commits = W.CHECKPOINT_COMMITS             # due: as many commits as call for one
        k.checkpoint()                                    # what the background thread does
        assert k.loop_commits == 0
        busy, frames, done = k.w.execute("PRAGMA main.wal_checkpoint(PASSIVE)").fetchone()
        assert frames == done                             # everything copied already
        lane = WriterCalls(store)
        wal = f"{tmp_path / 'state.db'}-wal"
        os.truncate(wal, W.WAL_GUARD)                     # (a sparse tail: SQLite reads frames by header)
        await store.set("a", "1")
        assert lane.names == ["set"]
    finally:
        await store.close()


async def test_a_write_given_up_on_still_holds_back_the_writes_after_it(tmp_path):
    """A caller that stops waiting (cancelled) does not let later writes pass its write on the
    loop: the thread has not made it yet, and it could overwrite theirs."""
    store = await opened(tmp_path)
    release = threading.Event()
    try:
        held = store._writer.call(release.wait, 10)
        held.cancel()                                   # nobody waits for it any more
        lane = WriterCalls(store)
        second = asyncio.ensure_future(store.set("k", "after"))
        await asyncio.sleep(0.05)
        assert lane.names == ["set"] and not second.done()     # queued behind it, not made on the loop
        release.set()
        assert await second is True and await store.get("k") == "after"
        assert store._writer.outstanding == 0
    finally:
        release.set()
        await store.close()
