"""The shell on a Redis store (a real redis-server with a password; the addons in a
taddons context, as in test_proxy_*.py): a pinned turn is one GET; the store is checked
as soon as the loop runs; a Redis that is down at start does not stop the proxy, its
in-scope requests get 503 naming the store and it routes again when Redis is back; at
exit the last activity is flushed and the clients are closed on the loop; the password
appears nowhere.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from redis_servers import DURABLE_ARGS, RedisServer, free_port, unique_prefix, wait_for
from sessionpin.records import pins
from sessionpin.records.documents import read_status
from shellkit import CONFIG, flow, internal, start

SECRET = f"pw-sentinel-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def server():
    s = RedisServer(password=SECRET).start()
    yield s
    s.cleanup()


@pytest.fixture
def cfg_path(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text(CONFIG)
    return p


def session() -> str:
    return str(uuid.uuid4())


def no_secret(*texts: object) -> None:
    for t in texts:
        assert SECRET not in str(t), f"the password shows in: {str(t)[:300]}"


def commandstats(client) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in client.info("commandstats").items()}


async def test_a_pinned_turn_sends_one_get(server, cfg_path, caplog):
    """Everything a pinned turn costs in Redis, counted by Redis itself (INFO commandstats):
    one GET of its pin. Renewals (once a day) and the activity flush (every 5 s, batched)
    are not on the request path; the pool is loaded as mitmdump loads it."""
    caplog.set_level(logging.DEBUG)
    p = start(cfg_path, pool=True, sessionpin_store=server.url(unique_prefix()))
    try:
        s = session()
        opening = flow("opening", session=s)
        await p.send(opening)
        assert opening.request.host == "api.z.ai" and opening.response is None
        await p.settle()
        look = server.client()            # one connection: its handshake is not counted
        look.config_resetstat()
        n = 7
        for _ in range(n):
            f = flow("continuation", session=s)
            await p.send(f)
            assert f.request.host == "api.z.ai" and f.response is None
        await p.settle()
        stats = commandstats(look)
        stats.pop("config|resetstat", None)
        stats.pop("info", None)           # this test's own INFO
        assert stats == {"get": n}, stats
    finally:
        await p.runtime.done()
    no_secret(*(r.getMessage() for r in caplog.records))


async def test_the_store_is_checked_as_soon_as_the_loop_runs(server, cfg_path, caplog):
    caplog.set_level(logging.INFO)
    p = start(cfg_path, sessionpin_store=server.url(unique_prefix(), wait=0))
    try:
        assert p.store.describe()["health"] == "not connected yet"
        p.runtime.running()
        await asyncio.wait_for(p.runtime._checking[1], 10)
        info = p.store.describe()
        assert info["health"] == "ok" and info["durable"] is True
        assert info["replication"] == {"role": "master", "replicas": 0} and info["version"].startswith("7.")
        f = internal("/__sessionpin/status")
        await p.send(f)
        status = read_status(f.response.content)
        assert status.store_info["durable"] is True and "appendfsync always" in status.store_info["durability"]["server"]
        assert status.store.startswith("redis://:***@127.0.0.1:")
        said = [r.getMessage() for r in caplog.records if "fsynced by Redis" in r.getMessage()]
        assert said and "appendfsync always" in said[0], [r.getMessage() for r in caplog.records]
        no_secret(f.response.text, *(r.getMessage() for r in caplog.records))
    finally:
        await p.runtime.done()


async def test_a_redis_that_does_not_fsync_is_named_at_start(cfg_path, caplog):
    caplog.set_level(logging.INFO)
    weak = RedisServer(args=("--appendonly", "yes", "--appendfsync", "everysec", "--save", "")).start()
    p = start(cfg_path, sessionpin_store=weak.url(unique_prefix()))
    try:
        p.runtime.running()
        await asyncio.wait_for(p.runtime._checking[1], 10)
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "durable writes are refused" in
                  r.getMessage()]
        assert warned and "appendfsync everysec" in warned[0].getMessage()
        f = flow("opening", session=session())       # moved to glm: needs a durable pin
        await p.send(f)
        assert f.response.status_code == 503 and "appendfsync everysec" in f.response.text
        assert f.response.headers["retry-after"] == "1" and f.request.host == "api.anthropic.com"
    finally:
        await p.runtime.done()
        weak.cleanup()


async def test_down_at_start_serves_503_naming_the_store_then_recovers(cfg_path, caplog):
    caplog.set_level(logging.DEBUG)
    late = RedisServer(password=SECRET, args=DURABLE_ARGS, port=free_port())   # not started yet
    p = start(cfg_path, sessionpin_store=late.url(unique_prefix()))
    try:
        p.runtime.running()
        await asyncio.wait_for(p.runtime._checking[1], 10)
        assert any(r.levelno == logging.ERROR and "cannot be reached" in r.getMessage() for r in caplog.records)
        s = session()
        refused = []
        for kind in ("opening", "continuation"):
            f = flow(kind, session=s)
            await p.send(f)
            assert f.response is not None and f.response.status_code == 424, kind   # no client retries it
            assert f.request.host == "api.anthropic.com"             # not sent anywhere
            assert "retry-after" not in f.response.headers and f.response.headers["x-should-retry"] == "false"
            refused.append(f.response.text)
        assert all(f"redis://:***@127.0.0.1:{late.port}/0" in t for t in refused), refused[0]
        f = internal("/__sessionpin/status")
        await p.send(f)
        status = read_status(f.response.content)
        assert status.pins is None and status.store_info["health"].startswith("unavailable: Error 111")
        f = internal("/__sessionpin/metrics")
        await p.send(f)
        assert "sessionpin_pins -1" in f.response.text
        metrics = f.response.text

        late.start()
        f = flow("opening", session=s)
        await p.send(f)
        assert f.response is None and f.request.host == "api.z.ai"
        assert (await pins.load(p.store, s)).pin.server == "glm"
        no_secret(*refused, metrics, *(r.getMessage() for r in caplog.records))
    finally:
        await p.runtime.done()
        late.cleanup()


async def test_done_flushes_and_closes_the_clients_on_the_loop(server, cfg_path):
    p = start(cfg_path, sessionpin_store=server.url(unique_prefix()))
    s = session()
    await p.send(flow("opening", session=s))
    await p.send(flow("continuation", session=s))
    store = p.store
    ours = lambda: [c for c in server.client().client_list() if c.get("name") == "sessionpin"]  # noqa: E731
    assert ours()
    task = p.runtime.done()
    assert isinstance(task, asyncio.Task)            # mitmproxy awaits what done returns
    await asyncio.wait_for(task, 10)
    assert p.runtime.store is None and store.describe()["health"] == "ok"
    await asyncio.to_thread(wait_for, lambda: not ours(), 5, "the store's connections to close")
    # the activity counted in memory was written before the close
    fresh = start(cfg_path, sessionpin_store=store.url.replace("***", SECRET))
    try:
        assert (await pins.seen(fresh.store, s)).requests == 2
    finally:
        await fresh.runtime.done()


async def test_a_server_the_store_will_not_use_is_named_and_refused(cfg_path, caplog):
    """A standalone URL that reaches a cluster node: the store refuses it (not "unreachable"),
    the proxy says so once and answers 503, sending nothing."""
    from redis_servers import shared_cluster
    node = next(n for n in shared_cluster().nodes if n.alive)
    caplog.set_level(logging.INFO)
    p = start(cfg_path, sessionpin_store=node.url(unique_prefix()))
    try:
        p.runtime.running()
        await asyncio.wait_for(p.runtime._checking[1], 10)
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("refuses this server" in m and "add ?cluster=1" in m for m in said), said
        f = flow("opening", session=session())
        await p.send(f)
        assert f.response.status_code == 424 and "cluster=1" in f.response.text
        assert f.request.host == "api.anthropic.com"
    finally:
        await p.runtime.done()
