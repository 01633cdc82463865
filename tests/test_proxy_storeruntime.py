"""StoreRuntime: heartbeat, activity flush, and what happens at exit."""

from __future__ import annotations

import asyncio
import os

import pytest

from sessionpin.records import pins
from sessionpin.records.documents import read_heartbeat
from shellkit import CONFIG, SESSION, flow, start


@pytest.fixture
def cfg_path(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text(CONFIG)
    return p


async def test_heartbeat_and_activity(cfg_path, monkeypatch):
    from sessionpin.proxy import storeruntime
    monkeypatch.setattr(storeruntime, "FLUSH_EVERY", 0.05)
    p = start(cfg_path)
    try:
        await p.send(flow())
        p.runtime.running()
        key = f"proxy:{p.runtime.host}:{os.getpid()}"
        for _ in range(200):
            await asyncio.sleep(0.02)
            if await p.store.get(key) and (await pins.seen(p.store, SESSION)).requests:
                break
        beat = read_heartbeat(await p.store.get(key))
        assert beat is not None and beat.store == "memory:" and beat.config == str(cfg_path)
        assert beat.pid == os.getpid() and beat.token == p.status.token
        assert 0 < await p.store.ttl(key) <= 30
        assert (await pins.seen(p.store, SESSION)).requests == 1
        counts = await pins.counts(p.store, 0, 0)
        assert counts[("claude-code", "glm")] == (1, 1)
        await p.send(flow("continuation"))
        store = p.store
    finally:
        p.close()
    # at exit: the last activity flushed, the heartbeat gone
    assert (await pins.seen(store, SESSION)).requests == 2
    assert await store.get(key) is None


def test_an_unopenable_store_is_refused_while_running(cfg_path):
    from mitmproxy import exceptions
    p = start(cfg_path)
    try:
        with pytest.raises(exceptions.OptionsError, match="sessionpin_store"):
            p.tctx.configure(p.runtime, sessionpin_store="nope:x")
        assert p.store is not None and p.runtime.url == "memory:"
    finally:
        p.close()


async def test_a_request_is_in_the_store_within_a_second_with_the_shipped_intervals(cfg_path):
    """A kill -9 loses at most a second of request counts (issue 19): no interval patched here."""
    import time
    p = start(cfg_path)
    try:
        p.runtime.running()
        key = f"proxy:{p.runtime.host}:{os.getpid()}"
        deadline = time.monotonic() + 5
        while not await p.store.get(key) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)        # the first round (its flush included) is over
        await asyncio.sleep(0.1)
        await p.send(flow())
        counted = time.monotonic()
        while not (await pins.seen(p.store, SESSION)).requests and time.monotonic() - counted < 3:
            await asyncio.sleep(0.02)
        took = time.monotonic() - counted
        assert (await pins.seen(p.store, SESSION)).requests == 1
        assert took <= 1.0, f"the count reached the store {took:.2f} s after the request"
    finally:
        p.close()
