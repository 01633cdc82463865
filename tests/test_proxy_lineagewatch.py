"""LineageWatch: what later requests may name a conversation by, recorded after its responses,
in batches that never queue a write each in front of a new conversation's pin."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from mitmproxy import http
from mitmproxy.test import tutils

from sessionpin import lineindex
from sessionpin.proxy import lineagewatch
from sessionpin.store import StoreUnavailable
from sessionpin.store.aio import Threaded
from sessionpin.store.memory import MemoryStore
from shellkit import CONFIG, SESSION, flow, start


@pytest.fixture
def cfg_path(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text(CONFIG)
    return p


@pytest.fixture
async def proxy(cfg_path):
    p = start(cfg_path)
    yield p
    p.close()


def answered(f, request_id: str, status: int = 200) -> None:
    f.response = tutils.tresp(status_code=status, headers=http.Headers(
        [(b"content-type", b"application/json"), (b"request-id", request_id.encode())]), content=b"{}")


async def flushed(watch: lineagewatch.LineageWatch) -> None:
    for _ in range(100):
        if watch._flusher is None or watch._flusher.done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the lineage records were not written")


async def test_a_claude_code_response_names_its_session_by_its_request_id(proxy):
    f = flow("opening")
    await proxy.send(f)
    watch = proxy.router.lineage
    answered(f, "req_011abc")
    watch.responseheaders(f)
    watch.response(f)
    await flushed(watch)
    assert await proxy.store.get(lineindex.anchor_key("claude-code", "req:req_011abc")) == SESSION
    assert (watch.recorded, watch.dropped) == (1, 0)


async def test_a_failed_response_names_nothing(proxy):
    f = flow("opening")
    await proxy.send(f)
    watch = proxy.router.lineage
    answered(f, "req_011bad", status=529)
    watch.responseheaders(f)
    watch.response(f)
    await flushed(watch)
    assert await proxy.store.get(lineindex.anchor_key("claude-code", "req:req_011bad")) is None


class Held(MemoryStore):
    """A store whose writes wait while ``hold`` is clear (another process holds its lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = threading.Event()
        self.applies = 0

    def apply(self, checks, writes, *, durable=False):
        self.applies += 1
        self.hold.wait(10)
        return super().apply(checks, writes, durable=durable)


class Runtime:
    def __init__(self, store) -> None:
        self.store = store
        self.errors = 0


def watched(n: int) -> list[lineagewatch._Watched]:
    out = []
    for i in range(n):
        w = lineagewatch._Watched("claude-code", f"s{i}", "anthropic-messages", None)
        w.anchors.append(f"req:r{i}")
        out.append(w)
    return out


async def test_records_that_come_while_a_write_waits_go_in_one_write():
    backend = Held()
    store = Threaded(backend)
    watch = lineagewatch.LineageWatch(Runtime(store))
    try:
        first, *rest = watched(200)
        watch._record(first, None)
        for _ in range(300):
            if backend.applies:
                break
            await asyncio.sleep(0.01)
        assert backend.applies == 1          # the first write waits for the store
        for w in rest:
            watch._record(w, None)
            await asyncio.sleep(0)
        backend.hold.set()
        await flushed(watch)
        assert backend.applies == 2          # the 199 that came meanwhile: one write
        assert (watch.recorded, watch.dropped) == (200, 0)
        assert await store.get(lineindex.anchor_key("claude-code", "req:r199")) == "s199"
    finally:
        backend.hold.set()
        await store.close()


async def test_records_close_together_go_in_one_write():
    backend = Held()
    backend.hold.set()
    store = Threaded(backend)
    watch = lineagewatch.LineageWatch(Runtime(store))
    try:
        for w in watched(20):
            watch._record(w, None)
        await flushed(watch)
        assert backend.applies == 1 and watch.recorded == 20
    finally:
        await store.close()


async def test_the_records_waiting_are_bounded(monkeypatch):
    monkeypatch.setattr(lineagewatch, "MAX_PENDING", 10)
    backend = Held()
    store = Threaded(backend)
    watch = lineagewatch.LineageWatch(Runtime(store))
    try:
        for w in watched(50):
            watch._record(w, None)
            await asyncio.sleep(0)
        assert watch._writes <= 10
        backend.hold.set()
        await flushed(watch)
        assert watch.recorded + watch.dropped == 50 and watch.dropped >= 39
        assert await store.get(lineindex.anchor_key("claude-code", "req:r49")) == "s49"   # the newest kept
    finally:
        backend.hold.set()
        await store.close()


class Failing(MemoryStore):
    def apply(self, checks, writes, *, durable=False):
        raise StoreUnavailable("store memory: locked by another process")


async def test_a_failing_store_drops_records_with_one_warning(caplog):
    store = Threaded(Failing())
    runtime = Runtime(store)
    watch = lineagewatch.LineageWatch(runtime)
    try:
        with caplog.at_level(logging.WARNING, logger="sessionpin"):
            for w in watched(5):
                watch._record(w, None)
                await flushed(watch)
        assert watch.dropped == 5 and watch.recorded == 0
        assert sum("lineage records not written" in r.getMessage() for r in caplog.records) == 1
        assert runtime.errors == 5
    finally:
        await store.close()


async def test_nothing_is_recorded_without_a_store():
    watch = lineagewatch.LineageWatch(Runtime(None))
    for w in watched(3):
        watch._record(w, None)
    assert watch._flusher is None and not watch._pending
