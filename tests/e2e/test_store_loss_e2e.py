"""A store that lost what it acknowledged fails closed (issue 18): real mitmdump routers, real
redis-servers started here, a real file store, the real CLI.

Each fault is one an operator meets: FLUSHALL while the router runs, a cleanup script that
DELs pin keys, Redis restarted with its AOF gone (the same URL answers empty), the file
store's directory deleted while the router is stopped. Each time: no continuation reaches
another server (the fakes count every request), the refusal is a 424 (no retry signals) in Anthropic's format
naming the store and what was lost and the command that decides, status shows it, and the
command (``store accept-loss`` to start over, ``store copy BACKUP URL`` to restore) brings
routing back without restarting the router.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from redis_servers import RedisServer, unique_prefix, wait_for
from sessionpin.records import pins
from sessionpin.records.documents import HEARTBEAT_PREFIX
from sessionpin.store import open_store
from sessionpin.store.identity import LOSSES_KEY
from sessionpin.reader.ids import short
from sessionpin.decision.answers import NO_RETRY_STATUS as LOST      # a lost store: only the operator can decide
from sessionpin.decision.answers import NO_RETRY_UPGRADE_STATUS      # the same, to a WebSocket upgrade (Codex)

from .harness import Client, FakeServer, Mitmdump, Reply, TestCA, toml_config
from .test_cli_e2e import sessionpin_argv
from .test_router_e2e import GLM_ENV, GLM_KEY, SESSION_HEADER, cc


class Rig:
    """Fakes ``anthropic`` (what the client addresses) and ``glm`` (where new Claude Code
    conversations go); one router on ``store_url``."""

    def __init__(self, tmp: Path, store_url: str) -> None:
        self.tmp = tmp
        self.ca = TestCA(tmp / "ca")
        self.fakes = {n: FakeServer(n, self.ca) for n in ("anthropic", "glm")}
        for f in self.fakes.values():
            f.start()
        servers = {"anthropic": {"url": self.fakes["anthropic"].url},
                   "glm": {"url": self.fakes["glm"].url, "key_env": GLM_ENV}}
        self.url = store_url
        self.router = Mitmdump.router(tmp / "router", self.ca, toml_config(servers, {"claude-code": "glm"}),
                                      env={GLM_ENV: GLM_KEY},
                                      options={"sessionpin_store": store_url, "sessionpin_pool": False})

    def send(self, kind: str, session: str) -> Reply:
        req = cc(kind, session, stream=False)
        client = Client.via_proxy(self.router.port, self.router.mitm_ca, timeout=15)
        return client.request(req.method, self.fakes["anthropic"].origin + req.path, req.headers, req.body)

    def status(self) -> dict:
        client = Client.via_proxy(self.router.port, self.router.mitm_ca, timeout=10)
        return client.request("GET", self.fakes["anthropic"].origin + "/__sessionpin/status").json()

    def received(self, name: str, session: str) -> int:
        return sum(1 for r in self.fakes[name].received() if r.header(SESSION_HEADER) == session)

    def open(self, n: int) -> list[str]:
        """n conversations opened (each pinned to glm) and continued once."""
        sessions = [str(uuid.uuid4()) for _ in range(n)]
        for s in sessions:
            for kind in ("opening", "continuation"):
                r = self.send(kind, s)
                assert (r.status, r.header("x-fake-server")) == (200, "glm"), r.text[:300]
        return sessions

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*sessionpin_argv(), *args, "--store", self.url], capture_output=True, text=True,
                              timeout=60, cwd=self.tmp)

    def stop(self) -> None:
        self.router.stop(signal.SIGKILL)
        for f in self.fakes.values():
            f.stop()


def refused_as_lost(rig: Rig, sessions: list[str], loss: str) -> None:
    """Every continuation is a 424 naming the store and the loss; nothing reached a server."""
    before = {s: (rig.received("glm", s), rig.received("anthropic", s)) for s in sessions}
    for s in sessions:
        r = rig.send("continuation", s)
        assert r.status == LOST, (r.status, r.header("x-fake-server"), r.text[:300])
        body = r.json()
        assert body["type"] == "error", body                  # Anthropic's error format
        message = body["error"]["message"]
        assert f"store {rig.url}" in message and loss in message, message
        assert "sessionpin store accept-loss" in message and "sessionpin store copy BACKUP" in message, message
    after = {s: (rig.received("glm", s), rig.received("anthropic", s)) for s in sessions}
    assert after == before, "a continuation reached a server while the store was lost"


def routes_again(rig: Rig, sessions: list[str], where: str) -> None:
    """Within a few seconds of the operator's command, without restarting the router."""
    wait_for(lambda: rig.send("continuation", sessions[0]).status == 200, 10, "routing to resume")
    for s in sessions:
        r = rig.send("continuation", s)
        assert (r.status, r.header("x-fake-server")) == (200, where), r.text[:300]
    fresh = str(uuid.uuid4())
    r = rig.send("opening", fresh)
    assert (r.status, r.header("x-fake-server")) == (200, "glm"), r.text[:300]
    assert rig.status()["store_info"]["identity"]["lost"] is None


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.cleanup()


@pytest.fixture
def rig_on(tmp_path: Path):
    made: list[Rig] = []

    def make(url: str) -> Rig:
        rig = Rig(tmp_path, url)
        rig.router.start()
        made.append(rig)
        return rig
    yield make
    for rig in made:
        rig.stop()


def test_flushall_while_running_is_refused_until_the_operator_accepts_the_loss(redis, rig_on):
    rig = rig_on(redis.url(unique_prefix()))
    sessions = rig.open(5)
    redis.client().flushall()
    # the very next request meets it (no window where a pin reads as "never pinned")
    refused_as_lost(rig, sessions, "lost what it held: it answers empty")
    lost = rig.status()["store_info"]["identity"]
    assert lost["verdict"] == "lost" and "5 pins" in lost["lost"]
    assert "lost what it held" in rig.router.output
    done = rig.cli("store", "accept-loss")
    assert done.returncode == 0, done.stderr
    assert "Accepted the loss" in done.stdout
    # starting over: the lost conversations are decided afresh (left alone, to the server they address)
    routes_again(rig, sessions, "anthropic")


def test_pin_keys_deleted_by_another_client_are_refused_until_restored(redis, rig_on, tmp_path):
    prefix = unique_prefix()
    rig = rig_on(redis.url(prefix))
    sessions = rig.open(4)
    backup = f"file:{tmp_path}/backup/state.db"
    copied = subprocess.run([*sessionpin_argv(), "store", "copy", rig.url, backup], capture_output=True,
                            text=True, timeout=60)
    assert copied.returncode == 0, copied.stderr
    gone, kept = sessions[:2], sessions[2:]
    # a second router (another machine) that never served these conversations
    other = Mitmdump.router(tmp_path / "router-b", rig.ca, rig.router.config_path.read_text(),
                            env={GLM_ENV: GLM_KEY, "SESSIONPIN_STORE_MEMORY": str(tmp_path / "machine-b")},
                            options={"sessionpin_store": rig.url, "sessionpin_pool": False})
    other.start()
    raw = redis.client()
    assert raw.delete(*(prefix + pins.key(s) for s in gone)) == 2     # a key-pattern mistake
    try:
        req = cc("continuation", gone[1], stream=False)
        r = Client.via_proxy(other.port, other.mitm_ca, timeout=15).request(
            req.method, rig.fakes["anthropic"].origin + req.path, req.headers, req.body)
        assert r.status == LOST, (r.status, r.header("x-fake-server"), r.text[:300])
        assert "which its pin index still holds" in r.json()["error"]["message"]
    finally:
        other.stop(signal.SIGKILL)
    for s in gone:
        r = rig.send("continuation", s)
        assert r.status == LOST, (r.status, r.header("x-fake-server"), r.text[:300])
        message = r.json()["error"]["message"]
        # the agent's message names the session by its short id (docs/router.md: a long hex id
        # can read as a status code to pi's retry); the log line keeps the whole id
        assert f"store {rig.url} no longer has the pin of session {short(s)} (pinned to glm)" in message, message
        assert "sessionpin store accept-loss" in message and "sessionpin store copy BACKUP" in message
        assert rig.received("anthropic", s) == 0
    for s in kept:
        r = rig.send("continuation", s)
        assert (r.status, r.header("x-fake-server")) == (200, "glm")
    assert rig.send("continuation", gone[0]).status == LOST                 # refused again, said once:
    said = [ln for ln in rig.router.output.splitlines() if "no longer has the pin" in ln and f"refused {LOST}" not in ln]
    assert len(said) == 2, said                                             # one ERROR line per lost pin
    assert rig.status()["store_info"]["identity"]["partial_losses"] == 2
    # the operator restores: the proxy is running and refusing, so the copy needs no --force
    restored = subprocess.run([*sessionpin_argv(), "store", "copy", backup, rig.url], capture_output=True,
                              text=True, timeout=60)
    assert restored.returncode == 0, restored.stderr
    routes_again(rig, sessions, "glm")
    assert all(rig.received("anthropic", s) == 0 for s in sessions)


def test_redis_restarted_with_its_aof_gone_is_refused_until_restored(redis, rig_on, tmp_path):
    prefix = unique_prefix()
    rig = rig_on(redis.url(prefix))
    sessions = rig.open(4)
    backup = f"file:{tmp_path}/backup/state.db"
    copied = subprocess.run([*sessionpin_argv(), "store", "copy", rig.url, backup], capture_output=True,
                            text=True, timeout=60)
    assert copied.returncode == 0, copied.stderr
    redis.kill()
    for p in (tmp_path / "redis").iterdir():              # its AOF lost: the same URL answers empty
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    redis.start()
    # Nothing it held is there: no pin, no identity. The running router may already have
    # written its heartbeat (as soon as Redis is back) and, once it checked, its record of the
    # loss (``store:losses``) — neither is part of what the store held.
    left = list(redis.client().scan_iter())
    assert all(k.startswith(prefix + HEARTBEAT_PREFIX) or k == prefix + LOSSES_KEY for k in left), left
    refused_as_lost(rig, sessions, "lost what it held: it answers empty")
    # a router restarted meanwhile remembers the store too: still refused, not a new store
    rig.router.restart(signal.SIGKILL)
    refused_as_lost(rig, sessions[:1], "lost what it held")
    restored = subprocess.run([*sessionpin_argv(), "store", "copy", backup, rig.url], capture_output=True,
                              text=True, timeout=60)
    assert restored.returncode == 0, restored.stderr
    routes_again(rig, sessions, "glm")


def test_file_store_directory_deleted_while_stopped_is_refused_until_accepted(rig_on, tmp_path):
    where = tmp_path / "state"
    rig = rig_on(f"file:{where}/state.db")
    sessions = rig.open(4)
    rig.router.stop()
    shutil.rmtree(where)                                   # the store, its copy, its directory
    rig.router.start()
    refused_as_lost(rig, sessions, "lost what it held: it answers empty")
    assert "lost what it held" in rig.router.output
    listed = rig.cli("sessions")                           # the CLI remembers it too
    assert listed.returncode != 0 and "lost what it held" in listed.stderr
    shown = rig.cli("status", "--config", str(rig.router.config_path))
    assert "LOST: store" in shown.stdout, shown.stdout + shown.stderr
    doctor = rig.cli("doctor", "--config", str(rig.router.config_path))
    assert doctor.returncode != 0 and "lost what it held" in doctor.stdout, doctor.stdout + doctor.stderr
    done = rig.cli("store", "accept-loss")
    assert done.returncode == 0, done.stderr
    routes_again(rig, sessions, "anthropic")


def test_a_redis_that_can_forget_is_not_durable_within_seconds_of_a_config_set(redis, rig_on):
    rig = rig_on(redis.url(unique_prefix()))
    rig.open(1)
    assert rig.status()["store_info"]["durable"] is True
    redis.client().config_set("maxmemory-policy", "allkeys-lru")     # evictions may drop acknowledged pins
    started = time.monotonic()
    wait_for(lambda: rig.status()["store_info"]["durable"] is False, 6, "status to say not durable")
    assert time.monotonic() - started < 6
    assert "maxmemory-policy allkeys-lru" in rig.status()["store_info"]["durability"]["server"]
    r = rig.send("opening", str(uuid.uuid4()))                        # a pin it cannot keep: not moved
    assert r.status == 503 and "durable" in r.json()["error"]["message"], r.text[:300]
    redis.client().config_set("maxmemory-policy", "noeviction")
    wait_for(lambda: rig.send("opening", str(uuid.uuid4())).status == 200, 10, "durable pins again")


def test_two_routers_on_one_redis_the_one_that_never_saw_it_refuses_once_the_loss_is_recorded(redis, rig_on, tmp_path):
    """Router A has used the store; after a FLUSHALL it records the loss in the store itself
    (``store:losses``). Router B — another machine, which never saw the store — starts: it
    does not take the empty store for new (before, it did, made an identity and routed) but
    refuses, naming the loss A recorded, and makes nothing over it. `accept-loss` brings
    both back."""
    prefix = unique_prefix()
    rig = rig_on(redis.url(prefix))
    sessions = rig.open(3)
    raw = redis.client()
    raw.flushall()
    wait_for(lambda: raw.hlen(prefix + LOSSES_KEY) == 1, 5, "A to record the loss in the store")
    b = Mitmdump.router(tmp_path / "router-b", rig.ca, rig.router.config_path.read_text(),
                        env={GLM_ENV: GLM_KEY, "SESSIONPIN_STORE_MEMORY": str(tmp_path / "machine-b")},
                        options={"sessionpin_store": rig.url, "sessionpin_pool": False})
    b.start()
    try:
        opened = str(uuid.uuid4())

        def via_b(kind: str, session: str) -> Reply:
            req = cc(kind, session, stream=False)
            return Client.via_proxy(b.port, b.mitm_ca, timeout=15).request(
                req.method, rig.fakes["anthropic"].origin + req.path, req.headers, req.body)
        for kind, s in (("opening", opened), ("continuation", sessions[0])):
            r = via_b(kind, s)
            assert r.status == LOST, (kind, r.status, r.header("x-fake-server"), r.text[:300])
            message = r.json()["error"]["message"]
            assert f"store {rig.url} lost what it held, as " in message and "recorded in it" in message, message
            assert "it answered empty, without its identity" in message and "holding 3 pins" in message, message
            assert "sessionpin store accept-loss" in message and "sessionpin store copy BACKUP" in message
        assert f"store {rig.url} is new" not in b.output
        assert not raw.exists(prefix + "store:identity")              # nothing made over the loss
        refused_as_lost(rig, sessions, "lost what it held: it answers empty")
        done = rig.cli("store", "accept-loss")
        assert done.returncode == 0, done.stderr
        routes_again(rig, sessions, "anthropic")
        wait_for(lambda: via_b("opening", opened).status == 200, 10, "B to route again")
        r = rig.send("continuation", opened)                  # B's conversation, through A: on glm
        assert (r.status, r.header("x-fake-server")) == (200, "glm"), r.text[:300]
        assert rig.received("anthropic", opened) == 0
    finally:
        b.stop(signal.SIGKILL)


def test_store_copy_under_load_in_the_documented_order_loses_nothing(rig_on, tmp_path):
    """docs/cli.md's way to move a running proxy to another store: copy while it serves (the
    bulk), stop it, copy again (only what changed since: short), start it on the new store.
    Openings keep coming the whole time; every acknowledged conversation continues on its
    server afterwards."""
    old, new = f"file:{tmp_path}/old/state.db", f"file:{tmp_path}/new/state.db"
    rig = rig_on(old)
    acked: list[str] = []
    stop = threading.Event()

    def openings() -> None:
        while not stop.is_set():
            s = str(uuid.uuid4())
            try:
                r = rig.send("opening", s)
            except (OSError, http.client.HTTPException):
                time.sleep(0.05)            # the proxy is being restarted: the agent retries later
                continue
            if r.status == 200:
                assert r.header("x-fake-server") == "glm"
                acked.append(s)
    threads = [threading.Thread(target=openings) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(acked) >= 20, 30, "openings before the copy")
        first = subprocess.run([*sessionpin_argv(), "store", "copy", old, new], capture_output=True, text=True,
                               timeout=60)
        assert first.returncode == 0, first.stderr
        n = len(acked)
        wait_for(lambda: len(acked) >= n + 10, 30, "openings after the first copy")     # not in the copy
        rig.router.stop()
        second = subprocess.run([*sessionpin_argv(), "store", "copy", old, new], capture_output=True, text=True,
                                timeout=60)
        assert second.returncode == 0, second.stderr
        rig.router.options["sessionpin_store"] = new
        rig.router.start()
        n = len(acked)
        wait_for(lambda: len(acked) >= n + 5, 30, "openings on the new store")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert len(acked) >= 35
    for s in acked:
        r = rig.send("continuation", s)
        assert (r.status, r.header("x-fake-server")) == (200, "glm"), (s, r.status, r.text[:200])
    assert all(rig.received("anthropic", s) == 0 for s in acked)


def evict_cold_keys(raw, prefix: str, sessions: list[str]) -> list[str]:
    """Memory pressure under ``volatile-lru`` until Redis evicted the pin index and at least
    two pins, then the policy set back. Returns the sessions whose pins were evicted.

    Only keys with a TTL are candidates, and the identity has none, so it is never evicted
    (under ``allkeys-lru`` it was, now and then on a busy machine: Redis's LRU clock counts
    whole seconds, and the identity, read every second, could look older than the fillers).
    The index has no TTL of its own either: the test gives it one, so that it can go with its
    pins — the loss no index can witness."""
    index = prefix + pins.index_key("claude-code", "glm")
    assert raw.ttl(prefix + "store:identity") == -1          # (no TTL: not a candidate)
    raw.expire(index, 86_400)
    raw.config_set("maxmemory-samples", "10")
    raw.config_set("maxmemory-policy", "volatile-lru")
    raw.config_set("maxmemory", str(int(raw.info("memory")["used_memory"]) + 64 * 1024))
    n, deadline = 0, time.monotonic() + 20
    try:
        while raw.exists(index) or sum(not raw.exists(prefix + pins.key(s)) for s in sessions) < 2:
            raw.set(f"filler:{n}", "x" * 4096, ex=3600)
            n += 1
            assert time.monotonic() < deadline, "Redis did not evict the pins"
    finally:
        raw.config_set("maxmemory", "0")
        raw.config_set("maxmemory-policy", "noeviction")
        raw.delete(*(f"filler:{i}" for i in range(n))) if n else None
    return [s for s in sessions if not raw.exists(prefix + pins.key(s))]


def test_keys_redis_evicted_are_refused_also_by_a_router_started_after_until_accepted(redis, rig_on, tmp_path):
    """Redis evicts whole keys and says only how many (``evicted_keys``): a pin evicted with
    its index key reads, to a router that never served it, exactly as a conversation never
    seen begin. Before this, router B (started after the eviction, on the machine that
    remembers the store) sent it to the server its agent addresses (200 from anthropic)."""
    prefix = unique_prefix()
    rig = rig_on(redis.url(prefix))
    sessions = rig.open(8)
    time.sleep(2.5)                                 # the pins grow idle (the identity is read every second)
    raw = redis.client()
    gone = evict_cold_keys(raw, prefix, sessions)
    assert raw.exists(prefix + "store:identity"), "the identity was evicted: a whole-store loss, not this test"
    b = Mitmdump.router(tmp_path / "router-b", rig.ca, rig.router.config_path.read_text(), env={GLM_ENV: GLM_KEY},
                        options={"sessionpin_store": rig.url, "sessionpin_pool": False})
    b.start()
    try:
        req = cc("continuation", gone[0], stream=False)
        r = Client.via_proxy(b.port, b.mitm_ca, timeout=15).request(
            req.method, rig.fakes["anthropic"].origin + req.path, req.headers, req.body)
        assert r.status == LOST, (r.status, r.header("x-fake-server"), r.text[:300])
        message = r.json()["error"]["message"]
        assert f"store {rig.url} may have lost pins: Redis evicted" in message, message
        assert rig.received("anthropic", gone[0]) == 0
        status = Client.via_proxy(b.port, b.mitm_ca, timeout=10).request(
            "GET", rig.fakes["anthropic"].origin + "/__sessionpin/status").json()
        assert status["store_info"]["identity"]["verdict"] == "evicted"
        assert status["store_info"]["durability"]["evicted_keys"]
    finally:
        b.stop(signal.SIGKILL)
    # the router that served them refuses every routed request too (it cannot tell which were evicted)
    wait_for(lambda: rig.status()["store_info"]["identity"]["verdict"] == "evicted", 5, "A to see the count")
    refused_as_lost(rig, sessions, "Redis evicted")
    shown = rig.cli("status", "--config", str(rig.router.config_path))
    assert "LOST: store" in shown.stdout and "Redis evicted" in shown.stdout, shown.stdout + shown.stderr
    listed = rig.cli("sessions")
    assert listed.returncode != 0 and "Redis evicted" in listed.stderr
    done = rig.cli("store", "accept-loss")
    assert done.returncode == 0, done.stderr
    wait_for(lambda: rig.send("continuation", sessions[0]).status == 200, 10, "routing to resume")
    for s in sessions:          # kept: on their server; evicted: decided afresh (left alone, as addressed)
        r = rig.send("continuation", s)
        assert (r.status, r.header("x-fake-server")) == (200, "anthropic" if s in gone else "glm"), r.text[:300]
    assert rig.status()["store_info"]["identity"]["lost"] is None


# ---- a request without history meets a lost pin (the index still holds it) -------------------------

def test_a_subagent_request_of_a_conversation_whose_pin_was_deleted_is_refused_after_a_restart(redis, rig_on):
    """A cleanup script DELs pin keys (their index entries stay) and the router restarts (what
    it served is forgotten). Claude Code's subagent request (request class ``subagent``: no
    assistant message yet, so no history) of such a conversation is refused like its
    continuation. Before, it was sent to the server its agent addresses (200 from anthropic):
    the index was read only for requests that carry history."""
    prefix = unique_prefix()
    rig = rig_on(redis.url(prefix))
    a, b = rig.open(2)
    r = rig.send("subagent", a)                            # while the pin is there: it follows it
    assert (r.status, r.header("x-fake-server")) == (200, "glm"), r.text[:300]
    assert redis.client().delete(prefix + pins.key(a), prefix + pins.key(b)) == 2
    rig.router.restart(signal.SIGKILL)
    for kind, s in (("continuation", b), ("subagent", a)):
        r = rig.send(kind, s)
        assert r.status == LOST, (kind, r.status, r.header("x-fake-server"), r.text[:300])
        message = r.json()["error"]["message"]
        assert f"no longer has the pin of session {short(s)} (pinned to glm), which its pin index still holds" \
            in message, message
        assert "sessionpin store accept-loss" in message and "sessionpin store copy BACKUP" in message
    assert rig.received("anthropic", a) == 0 and rig.received("anthropic", b) == 0
    fresh = str(uuid.uuid4())                               # a new conversation is still new
    r = rig.send("opening", fresh)
    assert (r.status, r.header("x-fake-server")) == (200, "glm"), r.text[:300]
    r = rig.send("subagent", fresh)
    assert (r.status, r.header("x-fake-server")) == (200, "glm"), r.text[:300]


@pytest.fixture(scope="module")
def ws_rig(tmp_path_factory: pytest.TempPathFactory):
    from . import test_websocket_e2e as wse
    from .harness import running_rig

    with running_rig(tmp_path_factory.mktemp("e2e-store-loss-ws"),
                     lambda ca: {name: wse.WsFake(name, ca) for name in ("openai", "alt", "beta")}, wse.WsRig) as r:
        yield r


def test_a_codex_thread_whose_pin_was_deleted_is_refused_not_pinned_anew_after_a_restart(ws_rig):
    """Codex over WebSocket: a thread pinned to ``alt`` loses its pin row (the index entry
    stays), the router restarts, new threads go to ``beta`` now. Its subagent socket and its
    reconnect (whose upgrade says ``history_initialization: new``: it reads as an opening) are
    refused naming the loss (426: Codex goes to HTTPS, where its POST is refused too). Before, the subagent socket was left alone (to the origin it
    addresses) and the reconnect was pinned anew, to ``beta``, over the loss."""
    import asyncio

    from sessionpin.store import open_store
    from . import test_websocket_e2e as wse
    from .replay import Replay

    rig = ws_rig
    if not rig.mitm.alive:
        rig.mitm.start()
    rig.set_current("alt")
    r = Replay(wse.RUN)
    ws, landed, _ = rig.open(r.prepare(wse.upgrade(1)))
    with ws:
        wse.converse(ws, r, wse.client_messages(1)[:1])
    session = wse.session_of(r, wse.upgrade(1))
    assert landed == "alt" and rig.pin(session).server == "alt"

    async def delete_pin() -> None:
        store = open_store(f"file:{rig.store_path}")
        try:
            assert await store.delete(pins.key(session))            # a cleanup script's DELETE of pin rows
            assert await pins.index_entry(store, "codex", session, time.time()) is not None   # the witness stays
        finally:
            await store.close()
    asyncio.run(delete_pin())
    rig.mitm.restart(signal.SIGKILL)                # what it served goes with it
    rig.set_current("beta")                         # new threads go to beta from now on
    for what, p in (("subagent socket", wse.subagent_upgrade(r, wse.upgrade(1))),
                    ("reconnect", r.prepare(wse.upgrade(1)))):
        ws, landed, _ = rig.open(p)
        ws.close()
        assert landed is None and ws.status == NO_RETRY_UPGRADE_STATUS, (what, landed, ws.status, ws.reject_body[:300])
        assert b"which its pin index still holds" in ws.reject_body, (what, ws.reject_body[:300])
    assert rig.pin(session) is None                 # nothing pinned over the loss


# ---- a loss one router recorded in the store is refused by the others -------------------------------

def _router_on_machine_b(rig: Rig, tmp_path: Path) -> Mitmdump:
    """A second router on another machine (a memory of its own) that never served anything."""
    return Mitmdump.router(tmp_path / "router-b", rig.ca, rig.router.config_path.read_text(),
                           env={GLM_ENV: GLM_KEY, "SESSIONPIN_STORE_MEMORY": str(tmp_path / "machine-b")},
                           options={"sessionpin_store": rig.url, "sessionpin_pool": False})


def _send_via(rig: Rig, router: Mitmdump, kind: str, session: str) -> Reply:
    req = cc(kind, session, stream=False)
    return Client.via_proxy(router.port, router.mitm_ca, timeout=15).request(
        req.method, rig.fakes["anthropic"].origin + req.path, req.headers, req.body)


def test_a_pin_one_router_recorded_lost_is_refused_by_another_router(redis, rig_on, tmp_path):
    """A cleanup script deletes a pin *and* the pin index: only router A, which served it,
    knows it was pinned; it refuses and records the lost pin in the store. Router B (another
    machine) meets the conversation's next request and refuses it by that record — before, it
    sent it to the server its agent addresses. `accept-loss` clears the record."""
    prefix = unique_prefix()
    rig = rig_on(redis.url(prefix))
    s, = rig.open(1)
    raw = redis.client()
    assert raw.delete(prefix + pins.key(s), prefix + pins.index_key("claude-code", "glm")) == 2
    r = rig.send("continuation", s)
    assert r.status == LOST and "which this proxy served" in r.json()["error"]["message"], r.text[:300]
    b = _router_on_machine_b(rig, tmp_path)
    b.start()
    try:
        for kind in ("continuation", "subagent"):
            r = _send_via(rig, b, kind, s)
            assert r.status == LOST, (kind, r.status, r.header("x-fake-server"), r.text[:300])
            message = r.json()["error"]["message"]
            assert f"no longer has the pin of session {short(s)} (pinned to glm), which " in message, message
            assert "recorded lost in the store" in message and "sessionpin store accept-loss" in message, message
        assert rig.received("anthropic", s) == 0
        done = rig.cli("store", "accept-loss")
        assert done.returncode == 0, done.stderr
        wait_for(lambda: _send_via(rig, b, "continuation", s).status == 200, 10, "B to decide it afresh")
    finally:
        b.stop(signal.SIGKILL)


def test_an_eviction_one_router_recorded_is_refused_by_a_router_on_another_machine(redis, rig_on, tmp_path):
    """Redis evicts pins with their index key. Router A sees its count grow, refuses and
    records the loss in the store. Router B on another machine starts afterwards: it never
    saw the count, so its own judgement is "first sight" — before, it took the store as it
    was and sent an evicted conversation to the server its agent addresses; now it refuses
    by A's record until `accept-loss`."""
    prefix = unique_prefix()
    rig = rig_on(redis.url(prefix))
    sessions = rig.open(8)
    time.sleep(2.5)                                 # the pins grow idle (evict_cold_keys: LRU), not a verdict
    raw = redis.client()
    gone = evict_cold_keys(raw, prefix, sessions)
    wait_for(lambda: raw.hlen(prefix + LOSSES_KEY) >= 1, 5, "A to record the eviction in the store")
    b = _router_on_machine_b(rig, tmp_path)
    b.start()
    try:
        r = _send_via(rig, b, "continuation", gone[0])
        assert r.status == LOST, (r.status, r.header("x-fake-server"), r.text[:300])
        message = r.json()["error"]["message"]
        assert f"store {rig.url} lost what it held, as " in message and "Redis evicted keys of store" in message, \
            message
        assert rig.received("anthropic", gone[0]) == 0
        status = Client.via_proxy(b.port, b.mitm_ca, timeout=10).request(
            "GET", rig.fakes["anthropic"].origin + "/__sessionpin/status").json()
        assert status["store_info"]["identity"]["verdict"] == "evicted"
        done = rig.cli("store", "accept-loss")
        assert done.returncode == 0, done.stderr
        wait_for(lambda: _send_via(rig, b, "continuation", gone[0]).status == 200, 10, "B to route again")
    finally:
        b.stop(signal.SIGKILL)


# ---- a store rolled back to an older copy of itself ---------------------------------------------------

def _remembers_made(rig: Rig, n: int) -> None:
    """The router has counted ``n`` pins made in its memory (it looks every second)."""
    wait_for(lambda: rig.status()["store_info"]["identity"]["remembered_made"] == n, 10,
             f"the router to remember {n} pins made")


def test_a_file_store_restored_from_an_older_cold_backup_while_stopped_is_refused_until_accepted(rig_on, tmp_path):
    """The store's directory is copied while the router is stopped (a cold backup),
    conversations go on, the router is stopped again and the directory put back from that
    backup (a disk restore, a VM snapshot). The identity is the one remembered; before, the
    store was taken as whole and the conversations pinned after the backup went back to the
    server their agent addresses. Now the store counts fewer pins made than the router saw:
    rolled back, refused until `accept-loss` (or a copy at least that recent)."""
    where = tmp_path / "state"
    rig = rig_on(f"file:{where}/state.db")
    early = rig.open(2)
    rig.router.stop()
    shutil.copytree(where, tmp_path / "backup")
    rig.router.start()
    later = rig.open(2)                                     # pinned to glm after the backup
    _remembers_made(rig, 4)
    rig.router.stop()
    shutil.copytree(where, tmp_path / "newer")
    shutil.rmtree(where)
    shutil.copytree(tmp_path / "backup", where)
    rig.router.start()
    refused_as_lost(rig, later + early, "was rolled back: it is store")
    assert rig.status()["store_info"]["identity"]["verdict"] == "rolled-back"
    assert all(rig.received("anthropic", s) == 0 for s in later)
    restored = subprocess.run([*sessionpin_argv(), "store", "copy", f"file:{tmp_path}/newer/state.db", rig.url],
                              capture_output=True, text=True, timeout=60)       # the newer copy: all back
    assert restored.returncode == 0, restored.stderr
    routes_again(rig, later + early, "glm")


def test_a_redis_restarted_on_an_older_snapshot_is_refused_until_accepted(tmp_path, rig_on):
    """A Redis that persists by RDB snapshots only (``durability=accept-weaker``) restarts
    on its last snapshot: the identity, the pins and the index as they were then. Before, a
    router restarted afterwards took the pins made since the snapshot for never made (their
    conversations went to the server the agent addresses)."""
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis", args=("--appendonly", "no", "--save", "")).start()
    try:
        rig = rig_on(server.url(unique_prefix(), durability="accept-weaker"))
        early = rig.open(2)
        server.client().save()                              # the snapshot (as `save 3600 1` would make)
        later = rig.open(2)
        _remembers_made(rig, 4)
        server.kill()
        server.start()                                      # back on its snapshot
        rig.router.restart(signal.SIGKILL)
        refused_as_lost(rig, later + early, "was rolled back: it is store")
        assert all(rig.received("anthropic", s) == 0 for s in later)
        done = rig.cli("store", "accept-loss")
        assert done.returncode == 0, done.stderr
        wait_for(lambda: rig.send("continuation", early[0]).status == 200, 10, "routing to resume")
        for s in early + later:     # in the snapshot: on glm; made after it: decided afresh (as addressed)
            r = rig.send("continuation", s)
            assert (r.status, r.header("x-fake-server")) == (200, "glm" if s in early else "anthropic"), r.text[:300]
    finally:
        server.cleanup()


def fork_of(rig: Rig, parent: str, fork: str) -> Reply:
    """``claude --resume PARENT --fork-session``'s first request: a new session id, the parent's history."""
    import json as _json
    from .test_router_e2e import history
    req = cc("continuation", fork, stream=False)
    body = _json.loads(req.body)
    body["messages"] = history(parent)
    client = Client.via_proxy(rig.router.port, rig.router.mitm_ca, timeout=15)
    return client.request(req.method, rig.fakes["anthropic"].origin + req.path, req.headers,
                          _json.dumps(body).encode())


def test_a_fork_of_a_conversation_whose_pin_was_deleted_is_refused_not_left_alone(redis, rig_on):
    """A cleanup script DELs conversation A's pin (its index entry stays; its lineage entries
    too). Then ``--fork-session`` of A: its history's root names A, whose pin is missing — lost,
    not "never pinned". Before, the parent was skipped as one without a pin and the fork was left
    alone: sent to the server the agent addresses (anthropic), while A lives on glm. Now it is
    refused like A's own continuation, naming A's lost pin; nothing reaches a server."""
    prefix = unique_prefix()
    rig = rig_on(redis.url(prefix))
    a, = rig.open(1)
    raw = redis.client()
    wait_for(lambda: bool(raw.keys(prefix + "lin:claude-code:root:*")), 10, "A's root recorded")
    r = fork_of(rig, a, str(uuid.uuid4()))                  # while A's pin is there: A's server
    assert (r.status, r.header("x-fake-server")) == (200, "glm"), r.text[:300]
    assert raw.delete(prefix + pins.key(a)) == 1
    fork = str(uuid.uuid4())
    r = fork_of(rig, fork=fork, parent=a)
    assert r.status == LOST, (r.status, r.header("x-fake-server"), r.text[:300])
    message = r.json()["error"]["message"]
    assert f"no longer has the pin of session {short(a)} (pinned to glm)" in message, message
    assert "sessionpin store accept-loss" in message and "sessionpin store copy BACKUP" in message
    assert rig.received("anthropic", fork) == 0 and rig.received("glm", fork) == 0
    assert raw.get(prefix + pins.key(fork)) is None          # nothing pinned for it


def _decide_alone(rig: Rig, moved: str, forgotten: str, how: str) -> None:
    """The operator decides two lost conversations one by one, with the commands the refusal
    names: one moved back to glm (where it was), one forgotten (decided afresh: left alone).
    ``sessions`` lists both as lost before (``how``: what the CLI found them by), and neither
    after; nothing else changes."""
    for s in (moved, forgotten):
        r = rig.send("continuation", s)
        assert r.status == LOST, (r.status, r.header("x-fake-server"), r.text[:300])
        message = r.json()["error"]["message"]
        assert "which this proxy served" in message, message
        # the ways out for this conversation alone, by the id the agent's screen shows
        assert f"`sessionpin move {short(s)} glm`" in message and f"`sessionpin forget {short(s)}`" in message, message
    listed = rig.cli("sessions")
    assert listed.returncode == 0, listed.stderr
    for s in (moved, forgotten):
        said = [ln for ln in listed.stderr.splitlines() if short(s) in ln]
        assert said and "LOST" in said[0] and "glm" in said[0] and how in said[0], listed.stdout + listed.stderr
    doctor = rig.cli("doctor", "--config", str(rig.router.config_path))    # the proxy recorded both
    said = [ln for ln in doctor.stdout.splitlines() if ln.startswith("FAIL  lost pins")]
    assert said and short(moved) in said[0] and short(forgotten) in said[0], doctor.stdout + doctor.stderr
    # a prefix as the agent's screen shows it, as for any pinned conversation
    done = rig.cli("move", short(moved), "glm", "--yes", "--config", str(rig.router.config_path))
    assert done.returncode == 0 and "glm" in done.stdout, done.stdout + done.stderr
    done = rig.cli("forget", short(forgotten), "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    r = rig.send("continuation", moved)
    assert (r.status, r.header("x-fake-server")) == (200, "glm"), r.text[:300]
    r = rig.send("continuation", forgotten)
    assert (r.status, r.header("x-fake-server")) == (200, "anthropic"), r.text[:300]
    listed = rig.cli("sessions")
    assert listed.returncode == 0 and "LOST" not in listed.stderr, listed.stdout + listed.stderr
    assert short(moved) in listed.stdout, listed.stdout
    assert rig.received("anthropic", moved) == 0
    doctor = rig.cli("doctor", "--config", str(rig.router.config_path))
    assert "lost pins" not in doctor.stdout, doctor.stdout


def test_a_lost_pin_is_listed_and_moved_back_or_forgotten_alone_by_the_cli(redis, rig_on):
    """A cleanup script DELs two pin keys; their index entries stay. The proxy refuses both
    (424) — and the CLI said "no pinned conversation matches" to `move` and `forget` of them
    and listed neither in `sessions` (while `status` counted them): the only ways out were a
    restore or `accept-loss` of every loss at once. Now `sessions` lists them as lost, `move`
    puts one back where it was, `forget` lets one be decided afresh; the others are untouched."""
    prefix = unique_prefix()
    rig = rig_on(redis.url(prefix))
    moved, forgotten, kept = rig.open(3)
    assert redis.client().delete(*(prefix + pins.key(s) for s in (moved, forgotten))) == 2
    _decide_alone(rig, moved, forgotten, "its pin index still holds it")
    r = rig.send("continuation", kept)
    assert (r.status, r.header("x-fake-server")) == (200, "glm"), r.text[:300]


def test_a_lost_pin_only_a_record_knows_is_listed_and_decided_alone_by_the_cli(redis, rig_on, tmp_path):
    """The pins and their whole index are deleted: only the router that served them knows,
    and it records each lost pin in the store at its next request. The CLI (another machine)
    finds them by those records: listed as lost, moved back or forgotten one by one."""
    prefix = unique_prefix()
    rig = rig_on(redis.url(prefix))
    moved, forgotten = rig.open(2)
    assert redis.client().delete(prefix + pins.key(moved), prefix + pins.key(forgotten),
                                 prefix + pins.index_key("claude-code", "glm")) == 3
    _decide_alone(rig, moved, forgotten, "recorded it lost")


def test_a_forget_dated_before_the_proxys_last_serving_is_the_operators_not_a_loss(rig_on, tmp_path):
    """The operator forgets a running conversation from a machine whose wall clock is behind
    the proxy's (or after the clock stepped back: an NTP correction): the tombstone's time
    is before the proxy last served the pin. The proxy took the operator's decision for a
    loss — 424 store-lost for a conversation the operator had just released, recorded in the
    store so that every proxy refused it until `accept-loss`. Now a tombstone names the pin it
    forgot (its creation and expiry, as the store held them), and the proxy compares pins, not
    clocks: the next request is decided afresh (left alone, to the server its agent addresses)."""
    import asyncio

    rig = rig_on(f"file:{tmp_path}/state/state.db")
    s, kept = rig.open(2)

    async def forget_behind(seconds: float) -> None:
        store = open_store(rig.url)
        try:
            assert await pins.forget(store, s, await pins.load(store, s), now=time.time() - seconds)
        finally:
            await store.close()
    asyncio.run(forget_behind(600))
    r = rig.send("continuation", s)
    assert (r.status, r.header("x-fake-server")) == (200, "anthropic"), (r.status, r.text[:300])
    assert rig.status()["store_info"]["identity"]["partial_losses"] == 0
    assert "no longer has the pin" not in rig.router.output
    r = rig.send("continuation", kept)
    assert (r.status, r.header("x-fake-server")) == (200, "glm"), r.text[:300]


def test_a_new_store_while_the_machine_remembers_another_with_live_pins_is_said(redis, rig_on, tmp_path):
    """The router is restarted on another key prefix of the same Redis (a config edited by
    mistake; a wrong ``db`` or path, an environment without ``SESSIONPIN_STORE`` are alike):
    the store there is new, and every conversation pinned in the first reads as never
    pinned — left alone, sent where its agent addresses it. Nobody can tell a mistake from a
    second setup, so it routes on; but before it said only "store … is new" (INFO). Now one
    WARNING names the other store this machine remembers holding live pins, and status shows it."""
    machine = str(tmp_path / "machine")
    first = redis.url(unique_prefix())
    rig = rig_on(first)
    rig.router.stop()
    rig.router = Mitmdump.router(tmp_path / "router-a", rig.ca, rig.router.config_path.read_text(),
                                 env={GLM_ENV: GLM_KEY, "SESSIONPIN_STORE_MEMORY": machine},
                                 options={"sessionpin_store": first, "sessionpin_pool": False})
    rig.router.start()
    sessions = rig.open(2)
    # what this machine remembers of it, as any command that reads it counts it
    counted = subprocess.run([*sessionpin_argv(), "sessions", "--store", first], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "SESSIONPIN_STORE_MEMORY": machine})
    assert counted.returncode == 0, counted.stderr
    rig.router.stop()
    second = redis.url(unique_prefix())
    rig.router = Mitmdump.router(tmp_path / "router-b", rig.ca, rig.router.config_path.read_text(),
                                 env={GLM_ENV: GLM_KEY, "SESSIONPIN_STORE_MEMORY": machine},
                                 options={"sessionpin_store": second, "sessionpin_pool": False})
    rig.router.start()
    r = rig.send("continuation", sessions[0])                # routed on: nobody can tell
    assert r.status == 200, r.text[:300]
    shown = open_store(first).url
    said = [ln for ln in rig.router.output.splitlines() if "this machine last used another store" in ln]
    assert len(said) == 1 and shown in said[0] and "(2 pins" in said[0], rig.router.output[-2000:]
    assert "set sessionpin_store" in said[0]
    others = rig.status()["store_info"]["identity"]["other_stores"]
    assert [(o["store"], o["pins"]) for o in others] == [(shown, 2)], others
