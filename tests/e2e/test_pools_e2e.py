"""Server pools end to end: three real ``mitmdump -s addons/route.py`` on one file store and
one config file, fake TLS members that answer 429 and rate-limit headers, real kills.

- Concurrent openings through the three proxies are allocated exactly round-robin (no
  member skipped or doubled), each conversation gets one pin, and its next turn, through
  another proxy, goes to the same member.
- A pinned turn on an exhausted member is deferred with ``retry-after`` — by the member's
  own 429, then by the proxies themselves (which learned it from that answer, through the
  store) — and never moved; new conversations avoid the member, wait for a reset within
  ``sessionpin_pools_wait_ms``, and get 429 "pool exhausted" past it. An opening the
  member refused, asked again, is allocated afresh (nothing of it began there); so is one
  allocated to a hard member that is down.
- A member's claims are clamped (issue 20): a 429 with ``retry-after: 99999999`` or ``1e300``
  defers its pinned turns for at most an hour (``retry-after`` at most 3600), ``sessionpin
  pools`` shows it, and ``sessionpin pools reset MEMBER`` makes every proxy send them again;
  under ``policy = "quota"`` a member claiming ``remaining 1000000`` of a limit of 1 gets no
  more than a full member's share. A slow turn's 200, sent before another proxy's 429,
  does not clear the exhaustion that 429 taught every proxy.
- A soft pool's member killed and restarted: its conversations move to a fresh member
  when they next ask while it is down; one still pinned to it goes back to it once it
  is up. A soft member taken out of the pool's ``members`` (still a server, still up) is a
  miss too: its conversation moves at its next turn; so is a drained one that is out of
  quota (the miss comes before the deferral).
"""

from __future__ import annotations

import asyncio
import os
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from sessionpin.proxy import allocations
from sessionpin.serverpools import members
from sessionpin.records import pins
from sessionpin.store import open_store

from .harness import Client, FakeServer, Mitmdump, Reply, TestCA, toml_config
from .test_router_e2e import PROMPT, SESSION_HEADER, Req, cc, new_session

MEMBERS = ("glm-a", "glm-b", "glm-c")
REPLICAS = ("vllm-1", "vllm-2")
KEYS = {name: f"{name}-SENTINEL-{new_session()[:8]}" for name in MEMBERS + REPLICAS}
ENV = {f"SP_E2E_{name.upper().replace('-', '_')}_KEY": key for name, key in KEYS.items()}


class Pools:
    def __init__(self, tmp: Path, ca: TestCA, fakes: dict[str, FakeServer]) -> None:
        self.fakes = fakes
        self.shared = tmp / "shared"
        self.shared.mkdir()
        self.config_path = self.shared / "config.toml"
        self.store_url = f"file:{self.shared / 'state.db'}"
        self.config_path.write_text(self.config("glm"))
        opts = {"sessionpin_config": str(self.config_path), "sessionpin_store": self.store_url,
                "sessionpin_pools_wait_ms": 4000}
        self.proxies = [Mitmdump.router(tmp / f"proxy{i}", ca, "", env=ENV, options=opts) for i in range(3)]

    def config(self, current: str, replicas: tuple[str, ...] = REPLICAS) -> str:
        servers: dict[str, dict[str, Any]] = {"anthropic": {"url": self.fakes["anthropic"].url}}
        for name in MEMBERS + REPLICAS:
            servers[name] = {"url": self.fakes[name].url, "key_env": f"SP_E2E_{name.upper().replace('-', '_')}_KEY"}
        text = toml_config(servers, {"claude-code": current})
        return text + (f'[pools.glm]\nmembers = {list(MEMBERS)!r}\n\n'
                       f'[pools.local]\nmembers = {list(replicas)!r}\naffinity = "soft"\n\n'
                       f'[pools.quota]\nmembers = {list(MEMBERS)!r}\npolicy = "quota"\n').replace("'", '"')

    def use(self, current: str, replicas: tuple[str, ...] = REPLICAS) -> None:
        """Point claude-code at a pool (the soft pool ``local`` of ``replicas``) and wait until
        all three proxies show it."""
        self.config_path.write_text(self.config(current, replicas))
        deadline = time.monotonic() + 5
        for p in self.proxies:
            while time.monotonic() < deadline:
                r = Client.via_proxy(p.port, p.mitm_ca, 10).request(
                    "GET", self.fakes["anthropic"].origin + "/__sessionpin/status")
                if r.status == 200 and r.json()["agents"].get("claude-code") == current:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError(f"proxy did not take the config: {p.tail(20)}")

    def send(self, req: Req, proxy: int = 0) -> Reply:
        p = self.proxies[proxy]
        return Client.via_proxy(p.port, p.mitm_ca, 30).request(
            req.method, self.fakes["anthropic"].origin + req.path, req.headers, req.body)

    def where(self, session: str) -> dict[str, int]:
        out = {}
        for name, fake in self.fakes.items():
            n = sum(1 for r in fake.received() if r.header(SESSION_HEADER) == session)
            if n:
                out[name] = n
        return out

    def store(self, fn):
        async def go():
            s = open_store(self.store_url)
            try:
                return await fn(s)
            finally:
                await s.close()
        return asyncio.run(go())


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pools]:
    tmp = tmp_path_factory.mktemp("e2e-pools")
    ca = TestCA(tmp / "ca")
    fakes = {name: FakeServer(name, ca) for name in ("anthropic",) + MEMBERS + REPLICAS}
    for f in fakes.values():
        f.start()
    r = Pools(tmp, ca, fakes)
    try:
        for p in r.proxies:
            p.start()
        yield r
    finally:
        for p in r.proxies:
            p.stop()
        for f in fakes.values():
            f.stop()


@pytest.fixture(autouse=True)
def _fresh(rig: Pools) -> Iterator[None]:
    for f in rig.fakes.values():
        f.status, f.headers = None, []
        if not f.running:
            f.start()
    yield
    # no member's quota state outlives its test; no key reached another member
    rig.store(lambda s: _clear_quota(s))
    for name, fake in rig.fakes.items():
        for r in fake.received():
            raw = r.raw()
            for owner, key in KEYS.items():
                assert owner == name or key.encode() not in raw, f"{name} received {owner}'s key"


async def _clear_quota(store) -> None:
    for k in await store.keys(members.QUOTA_PREFIX):
        await store.delete(k)


def test_three_proxies_allocate_concurrent_openings_exactly_round_robin(rig: Pools) -> None:
    rig.use("glm")
    before = rig.store(lambda s: members.cursor(s, "glm")).n
    sessions = [new_session() for _ in range(30)]
    with ThreadPoolExecutor(max_workers=12) as pool:
        replies = list(pool.map(lambda i: rig.send(cc("opening", sessions[i]), proxy=i % 3), range(30)))
    assert [r.status for r in replies] == [200] * 30, [r.text[:200] for r in replies if r.status != 200]
    where = {s: rig.where(s) for s in sessions}
    assert all(len(w) == 1 and sum(w.values()) == 1 for w in where.values()), where
    assert Counter(next(iter(w)) for w in where.values()) == {m: 10 for m in MEMBERS}
    assert rig.store(lambda s: members.cursor(s, "glm")).n == before + 30
    records = [r for r in rig.store(lambda s: members.history(s, "glm", 0))
               if r.kind == "allocation" and r.session in where]
    assert sorted(r.n for r in records) == list(range(before, before + 30))
    in_turn = [r.member for r in sorted(records, key=lambda r: r.n)]
    assert in_turn == [MEMBERS[(before + i) % 3] for i in range(30)], "no member skipped or doubled"
    for r in records:
        assert where[r.session] == {r.member: 1}
    # the decision line says why (ids and names only)
    assert rig.proxies[0].wait_output(r"claude-code opening \w+ anthropic → glm-[abc] "
                                      r"\[opening: pool glm: round-robin → glm-[abc]\]")
    # one pin each, snapshotting the member; the next turn through another proxy stays on it
    for i, s in enumerate(sessions[:6]):
        pin = rig.store(lambda st: pins.load(st, s)).pin
        assert pin.pool == "glm" and pin.server in MEMBERS and pin.why == f"pool glm: round-robin → {pin.server}"
        assert rig.send(cc("continuation", s), proxy=(i + 1) % 3).status == 200
        assert rig.where(s) == {pin.server: 2}
    # each proxy counts what it allocated; the gauges count the pins (this is the module's first test)
    allocated, active = Counter(), {}
    for p in rig.proxies:
        r = Client.via_proxy(p.port, p.mitm_ca, 10).request("GET", rig.fakes["anthropic"].origin
                                                           + "/__sessionpin/metrics")
        for line in r.text.splitlines():
            for m in MEMBERS:
                if line.startswith(f'sessionpin_pool_allocations_total{{pool="glm",member="{m}"}} '):
                    allocated[m] += int(line.split()[-1])
                if line.startswith(f'sessionpin_pool_member_active{{member="{m}"}} '):
                    active[m] = int(line.split()[-1])
    assert allocated == {m: 10 for m in MEMBERS} and active == {m: 10 for m in MEMBERS}, (allocated, active)
    # nothing of a prompt reached the store
    for f in rig.shared.glob("state.db*"):
        assert PROMPT.encode() not in f.read_bytes()


def test_a_pinned_turn_on_an_exhausted_member_is_deferred_never_moved(rig: Pools) -> None:
    rig.use("glm")
    s = new_session()
    assert rig.send(cc("opening", s), proxy=0).status == 200
    [member] = rig.where(s)
    others = [m for m in MEMBERS if m != member]
    fake = rig.fakes[member]
    fake.status, fake.headers = 429, [("retry-after", "30")]
    # the member's own 429 reaches the agent, with its retry-after
    r = rig.send(cc("continuation", s), proxy=1)
    assert r.status == 429 and r.header("retry-after") == "30" and r.header("x-fake-server") == member
    fake.status, fake.headers = None, []   # were it asked again, it would answer (and nothing would be deferred)
    time.sleep(0.5)      # proxy 1 writes what it learned in the background
    # another proxy learned it through the store: it defers the turn itself, in the agent's format
    r = rig.send(cc("continuation", s), proxy=2)
    assert r.status == 429 and r.header("x-sessionpin-refused") == "member-exhausted"
    assert 25 <= int(r.header("retry-after")) <= 30 and r.header("x-should-retry") == "true"
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and member in err["message"] and s in err["message"]
    assert rig.where(s) == {member: 2}, "deferred, never moved"
    # new conversations avoid it
    fresh = [new_session() for _ in range(4)]
    for i, f in enumerate(fresh):
        assert rig.send(cc("opening", f), proxy=i % 3).status == 200
    assert Counter(next(iter(rig.where(f))) for f in fresh) == {others[0]: 2, others[1]: 2}


def test_a_success_sent_before_another_proxy_s_429_does_not_clear_the_exhaustion(rig: Pools) -> None:
    """Two conversations on one member, through two proxies. Proxy 0's turn is slow to be
    answered; meanwhile proxy 1's turn is answered 429 ``retry-after: 60`` and every proxy
    learns it through the store. Then the slow turn's 200 arrives at proxy 0, which never saw
    the 429: that answer says the member admitted a request sent *before* the 429, nothing
    of after it. It used to be written over the store's state as "not exhausted" (any success
    cleared exhaustion), so the other proxies sent new conversations and pinned turns to a
    member still refusing them for most of a minute."""
    rig.use("glm")
    started = time.monotonic()
    sessions = [new_session() for _ in range(len(MEMBERS) + 1)]
    for s in sessions:
        assert rig.send(cc("opening", s), proxy=2).status == 200
    member = next(iter(rig.where(sessions[0])))
    slow, limited = sessions[0], sessions[-1]
    assert rig.where(limited) == {member: 1}
    fake = rig.fakes[member]
    release = threading.Event()
    body = json.dumps({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}).encode()

    def canned(rec):
        if rec.header(SESSION_HEADER) == slow:     # its continuation: the opening came before
            release.wait(30)            # answered normally, once released
            return None
        if rec.header(SESSION_HEADER) == limited:
            return 429, [("content-type", "application/json"), ("retry-after", "60")], body
        return None

    fake.canned = canned
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(rig.send, cc("continuation", slow), 0)
            assert _until(lambda: rig.where(slow) == {member: 2})
            r = rig.send(cc("continuation", limited), proxy=1)
            assert r.status == 429 and r.header("x-fake-server") is None
            assert _until(lambda: _exhausted(rig, member))
            # a slow turn: past the 5 s in which proxy 0 would not write an unchanged state again
            # (it may have written this member's "fine" in an earlier test)
            time.sleep(max(0.0, started + allocations.WRITE_EVERY + 0.5 - time.monotonic()))
            release.set()
            assert pending.result(30).status == 200
        # proxy 0 has read the 200 (its quota write is in the background): wait for what it
        # would write, then look; the exhaustion stands
        time.sleep(1.0)
        assert _exhausted(rig, member), rig.store(lambda st: st.get(members.quota_key(member)))
        r = rig.send(cc("continuation", limited), proxy=2)
        assert r.status == 429 and r.header("x-sessionpin-refused") == "member-exhausted"
    finally:
        release.set()
        fake.canned = None


def _exhausted(rig: Pools, member: str) -> bool:
    q = rig.store(lambda st: members.read_quota(st, member, time.time()))
    return q is not None and q.exhausted_until > time.time() + 10


def test_an_opening_its_member_refused_429_is_allocated_afresh_when_asked_again(rig: Pools) -> None:
    """A member that refuses new conversations (429, retry-after 30) but serves the ones it
    has. The opening allocated to it is answered with its 429; when the agent asks the
    opening again (no history: it used no answer of it), nothing of the conversation began
    there, so it is allocated afresh among the other members (a recorded move), through any
    proxy. It used to stay pinned to the member: deferred by the proxies until the reset,
    then sent to the same member again and refused again, while the others had room.
    A conversation that began on the member is still deferred, never moved."""
    rig.use("glm")
    began = None
    for _ in range(len(MEMBERS)):
        s = new_session()
        assert rig.send(cc("opening", s), proxy=0).status == 200
        began = s
    member = next(iter(rig.where(began)))           # the last one: the next opening goes elsewhere…
    fake = rig.fakes[member]
    body = json.dumps({"type": "error", "error": {"type": "rate_limit_error", "message": "no new sessions"}}).encode()
    fake.canned = lambda rec: None if rec.header(SESSION_HEADER) == began else (
        429, [("content-type", "application/json"), ("retry-after", "30")], body)
    try:
        opening = None
        for _ in range(len(MEMBERS)):                # …until the member's turn comes round again
            s = new_session()
            r = rig.send(cc("opening", s), proxy=0)
            if member in rig.where(s):
                opening = s
                break
            assert r.status == 200
        assert opening is not None and r.status == 429 and r.header("retry-after") == "30"
        assert r.header("x-fake-server") is None             # the member's own answer
        assert _until(lambda: _exhausted(rig, member))
        mark = rig.proxies[1].line_count
        r = rig.send(cc("opening", opening), proxy=1)
        assert r.status == 200, r.body[:300]
        [moved_to] = [m for m in rig.where(opening) if m != member]
        assert rig.where(opening) == {member: 1, moved_to: 1}
        why = f"hard: {member} out of quota before the opening began → {moved_to}"
        assert rig.proxies[1].wait_output(why, since=mark)
        pin = rig.store(lambda st: pins.load(st, opening)).pin
        assert (pin.server, pin.pool, pin.rule, pin.why) == (moved_to, "glm", "opening", why)
        moves = [x for x in rig.store(lambda st: members.history(st, "glm", 0)) if x.kind == "move"]
        assert [(x.session, x.previous, x.member) for x in moves if x.session == opening] == [
            (opening, member, moved_to)]
        # its next turn stays where it began
        assert rig.send(cc("continuation", opening), proxy=2).status == 200
        assert rig.where(opening) == {member: 1, moved_to: 2}
        # a conversation that began on the member: deferred, never moved
        r = rig.send(cc("continuation", began), proxy=2)
        assert r.status == 429 and r.header("x-sessionpin-refused") == "member-exhausted"
        assert rig.where(began) == {member: 1}
    finally:
        fake.canned = None


def test_an_opening_allocated_to_a_member_that_is_down_is_allocated_afresh(rig: Pools) -> None:
    """A hard pool's member goes down. The new conversation whose turn it is used to be
    pinned to it and refused 424 "stays there" — for good: its retry, the same opening,
    went to the same dead member. Nothing of it began there: it is allocated afresh among
    the others before anything is sent. A conversation that began on the member is still
    refused, never moved."""
    rig.use("glm")
    began = None
    for _ in range(len(MEMBERS)):
        began = new_session()
        assert rig.send(cc("opening", began), proxy=0).status == 200
    member = next(iter(rig.where(began)))
    down = MEMBERS[(MEMBERS.index(member) + 1) % len(MEMBERS)]
    on_down = new_session()
    for _ in range(len(MEMBERS)):
        on_down = new_session()
        assert rig.send(cc("opening", on_down), proxy=0).status == 200
        if down in rig.where(on_down):
            break
    assert rig.where(on_down) == {down: 1}
    rig.fakes[down].stop()
    s = None
    for _ in range(len(MEMBERS)):                    # round-robin comes round to `down` again
        s = new_session()
        mark = rig.proxies[1].line_count
        r = rig.send(cc("opening", s), proxy=1)
        assert r.status == 200, r.body[:300]
        if rig.proxies[1].wait_output(f"hard: {down} unreachable before the opening began", since=mark,
                                      timeout=0.5):
            break
    else:
        raise AssertionError("no opening was allocated to the member that is down")
    [moved_to] = rig.where(s)
    assert moved_to != down
    pin = rig.store(lambda st: pins.load(st, s)).pin
    assert (pin.server, pin.rule) == (moved_to, "opening")
    assert pin.why == f"hard: {down} unreachable before the opening began → {moved_to}"
    # a conversation that began on it: refused, stays there
    r = rig.send(cc("continuation", on_down), proxy=2)
    assert r.status == 424 and down in r.json()["error"]["message"]
    assert rig.store(lambda st: pins.load(st, on_down)).pin.server == down


def _exhaust(rig: Pools, member: str, seconds: int) -> None:
    """Make ``member`` answer one pinned turn 429 with ``retry-after: seconds`` (a real answer)."""
    s = new_session()
    for _ in range(6):      # the pool sends the opening to whichever member's turn it is
        assert rig.send(cc("opening", s), proxy=0).status == 200
        if member in rig.where(s):
            break
        s = new_session()
    else:
        raise AssertionError(f"no opening reached {member}")
    fake = rig.fakes[member]
    fake.status, fake.headers = 429, [("retry-after", str(seconds))]
    try:
        assert rig.send(cc("continuation", s), proxy=0).status == 429
    finally:
        fake.status, fake.headers = None, []


def test_every_member_exhausted_waits_for_a_reset_then_429_pool_exhausted(rig: Pools) -> None:
    rig.use("glm")
    _exhaust(rig, "glm-a", 60)
    _exhaust(rig, "glm-b", 60)
    _exhaust(rig, "glm-c", 3)
    time.sleep(0.5)       # the quota writes are made in the background
    s = new_session()
    t0 = time.monotonic()
    r = rig.send(cc("opening", s), proxy=1)
    waited = time.monotonic() - t0
    assert r.status == 200 and rig.where(s) == {"glm-c": 1}
    assert 1.0 <= waited <= 4.5, waited          # it waited for glm-c's reset (within the 4 s limit)
    _exhaust(rig, "glm-c", 60)
    time.sleep(0.5)
    s = new_session()
    t0 = time.monotonic()
    r = rig.send(cc("opening", s), proxy=2)
    assert time.monotonic() - t0 < 2.0, "a reset beyond the limit is not waited for"
    assert r.status == 429 and r.header("x-sessionpin-refused") == "pool-exhausted"
    assert 50 <= int(r.header("retry-after")) <= 60
    assert "glm" in r.json()["error"]["message"] and rig.where(s) == {}


def test_a_soft_member_killed_and_restarted(rig: Pools) -> None:
    rig.use("local")
    cursor = rig.store(lambda s: members.cursor(s, "local")).n
    sessions = [new_session() for _ in range(4)]
    for s in sessions:
        assert rig.send(cc("opening", s), proxy=0).status == 200
    first = {s: next(iter(rig.where(s))) for s in sessions}
    assert list(first.values()) == [REPLICAS[(cursor + i) % 2] for i in range(4)]
    on_1 = [s for s in sessions if first[s] == "vllm-1"]
    moving, staying = on_1
    rig.fakes["vllm-1"].stop()
    mark = [p.line_count for p in rig.proxies]
    # while it is down: its conversation that asks moves to the fresh member (through any proxy)
    r = rig.send(cc("continuation", moving), proxy=1)
    assert r.status == 200 and rig.where(moving) == {"vllm-1": 1, "vllm-2": 1}
    assert rig.proxies[1].wait_output(r"soft: vllm-1 unreachable → vllm-2", since=mark[1])
    pin = rig.store(lambda st: pins.load(st, moving)).pin
    assert (pin.server, pin.rule, pin.why) == ("vllm-2", "soft-move", "soft: vllm-1 unreachable → vllm-2")
    # a new conversation goes to the member that is up
    fresh = new_session()
    assert rig.send(cc("opening", fresh), proxy=1).status == 200 and rig.where(fresh) == {"vllm-2": 1}
    # it comes back: the conversation still pinned to it goes back to it; the moved one stays moved
    rig.fakes["vllm-1"].start()
    r = rig.send(cc("continuation", staying), proxy=2)
    assert r.status == 200 and rig.where(staying) == {"vllm-1": 2}
    assert rig.send(cc("continuation", moving), proxy=0).status == 200
    assert rig.where(moving) == {"vllm-1": 1, "vllm-2": 2}
    moves = [r for r in rig.store(lambda s: members.history(s, "local", 0)) if r.kind == "move"]
    assert [(r.session, r.previous, r.member) for r in moves] == [(moving, "vllm-1", "vllm-2")]


def test_a_soft_member_taken_out_of_the_pool_is_a_miss_though_still_a_server(rig: Pools) -> None:
    """The operator takes vllm-1 out of the soft pool's members (its [servers.vllm-1] stays:
    ``servers remove`` refuses a member, so this is the first step of retiring it, or it is
    kept for direct use). A soft pin is a hint over the pool's current members (seed 004: a
    node no longer in the candidate set is a clean miss): the conversation pinned to vllm-1
    moves to a member at its next turn, through any proxy, although vllm-1 is up; a hard
    pin would stay."""
    rig.use("local")
    cursor = rig.store(lambda s: members.cursor(s, "local")).n
    sessions = [new_session() for _ in range(2)]
    for s in sessions:
        assert rig.send(cc("opening", s), proxy=0).status == 200
    on_1 = [s for s in sessions if rig.where(s) == {"vllm-1": 1}]
    assert len(on_1) == 1, (cursor, [rig.where(s) for s in sessions])
    pinned = on_1[0]
    try:
        rig.use("glm")
        rig.use("local", replicas=("vllm-2",))
        mark = rig.proxies[1].line_count
        r = rig.send(cc("continuation", pinned), proxy=1)
        assert r.status == 200 and rig.where(pinned) == {"vllm-1": 1, "vllm-2": 1}
        assert rig.proxies[1].wait_output(r"soft: vllm-1 left the pool → vllm-2", since=mark)
        pin = rig.store(lambda st: pins.load(st, pinned)).pin
        assert (pin.server, pin.rule, pin.why) == ("vllm-2", "soft-move", "soft: vllm-1 left the pool → vllm-2")
        # and it stays there
        assert rig.send(cc("continuation", pinned), proxy=2).status == 200
        assert rig.where(pinned) == {"vllm-1": 1, "vllm-2": 2}
    finally:
        rig.use("glm")
        rig.use("local")


def _cli(rig: Pools, *argv: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "sessionpin"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "sessionpin.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONPIN_")}
    return subprocess.run([*cmd, "--config", str(rig.config_path), "--store", rig.store_url, *argv],
                          capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=60)


def _until(what, deadline: float = 5.0):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    return what()


@pytest.mark.parametrize("claim", ["99999999", "1e300"])
def test_a_far_retry_after_defers_for_an_hour_at_most_and_pools_reset_clears_it(rig: Pools, claim: str) -> None:
    rig.use("glm")
    s = new_session()
    assert rig.send(cc("opening", s), proxy=0).status == 200
    [member] = rig.where(s)
    fake = rig.fakes[member]
    fake.status, fake.headers = 429, [("retry-after", claim)]
    try:
        assert rig.send(cc("continuation", s), proxy=1).status == 429
    finally:
        fake.status, fake.headers = None, []
    # another proxy learns it through the store, clamped: deferred for an hour at most
    stored = _until(lambda: rig.store(lambda st: members.quotas(st, [member])).get(member))
    assert stored is not None and stored.exhausted_until <= time.time() + 3600, stored
    r = rig.send(cc("continuation", s), proxy=2)
    assert r.status == 429 and r.header("x-sessionpin-refused") == "member-exhausted"
    assert 3500 <= int(r.header("retry-after")) <= 3600, r.header("retry-after")
    # the operator's view never dies, and says what was claimed
    p = _cli(rig, "pools")
    assert p.returncode == 0, p.stderr
    assert member in p.stdout and "taken as 3600s" in p.stdout
    p = _cli(rig, "pools", "reset", member)
    assert p.returncode == 0 and p.stdout.startswith(f"Forgot {member}'s quota state"), p.stdout + p.stderr
    # every proxy sends its pinned turns again
    for proxy in (0, 1, 2):
        assert rig.send(cc("continuation", s), proxy=proxy).status == 200
    assert rig.where(s) == {member: 5}


def test_a_lying_member_gets_no_more_than_a_full_member_s_share_under_quota(rig: Pools) -> None:
    rig.use("quota")
    liar, *honest = MEMBERS
    rig.fakes[liar].headers = [("anthropic-ratelimit-requests-limit", "1"),
                               ("anthropic-ratelimit-requests-remaining", "1000000")]
    for m in honest:
        rig.fakes[m].headers = [("anthropic-ratelimit-requests-limit", "10"),
                                ("anthropic-ratelimit-requests-remaining", "8")]
    # openings until every member has answered and the proxies have written what they read
    for _ in range(30):
        if len(rig.store(lambda st: members.quotas(st, list(MEMBERS)))) == 3:
            break
        assert rig.send(cc("opening", new_session()), proxy=0).status == 200
        time.sleep(0.05)
    heads = {m: q.headroom for m, q in rig.store(lambda st: members.quotas(st, list(MEMBERS))).items()}
    assert heads == {liar: 1.0, honest[0]: 0.8, honest[1]: 0.8}, heads
    got = Counter()
    for i in range(30):
        s = new_session()
        assert rig.send(cc("opening", s), proxy=i % 3).status == 200
        got[next(iter(rig.where(s)))] += 1
    # its share is a full member's: 1 / (1 + 0.8 + 0.8) of 30 = 11.5
    assert got[liar] <= 14 and all(got[m] >= 7 for m in honest), got


# ---- a missing answer is not a "no" (found in review, 2026-12-05) ------------------------------


def _lose_pin(rig: Pools, session: str, member: str) -> None:
    """A cleanup script deletes the pin and its index entry (the store's identity untouched)."""
    async def lose(store) -> None:
        assert await store.delete(pins.key(session))
        assert await store.zrem(pins.index_key("claude-code", member), session)
    rig.store(lose)


@pytest.mark.parametrize("pool", ["glm", "local"])
def test_a_pool_pin_lost_after_its_opening_is_refused_never_moved(rig: Pools, pool: str) -> None:
    """The pin a pool's allocation wrote is one the proxy served, as a plain server's pin is:
    lost, the next turn is refused 424 naming the loss. Before, it was taken for a
    conversation never seen begin and sent to the origin the agent addresses, pinned "not
    routed" over the loss."""
    rig.use(pool)
    s = new_session()
    assert rig.send(cc("opening", s)).status == 200
    [member] = rig.where(s)
    _lose_pin(rig, s, member)
    r = rig.send(cc("continuation", s))
    assert r.status == 424 and r.header("x-sessionpin-refused") == "store-lost", (r.status, r.text[:300])
    assert rig.where(s) == {member: 1}


def test_a_soft_member_drained_while_out_of_quota_is_a_miss_not_a_deferral(rig: Pools) -> None:
    """In a soft pool a drained member is a miss: its conversations move at their next turn.
    One that had also just answered 429 (retry-after 600) kept them instead: the deferral
    was decided before the miss, so draining it to move its conversations off did nothing
    for ten minutes. A miss (drained, gone, left the pool, unreachable) now comes first in a
    soft pool; exhaustion alone still defers."""
    rig.use("local")
    sessions = [new_session() for _ in range(2)]
    for s in sessions:
        assert rig.send(cc("opening", s), proxy=0).status == 200
    [pinned] = [s for s in sessions if rig.where(s) == {"vllm-1": 1}]
    fake = rig.fakes["vllm-1"]
    fake.status, fake.headers = 429, [("retry-after", "600")]
    try:
        assert rig.send(cc("continuation", pinned), proxy=0).status == 429
    finally:
        fake.status, fake.headers = None, []
    assert _until(lambda: _exhausted(rig, "vllm-1"))
    r = rig.send(cc("continuation", pinned), proxy=1)        # exhausted alone: deferred, not moved
    assert r.status == 429 and r.header("x-sessionpin-refused") == "member-exhausted"
    assert _cli(rig, "drain", "vllm-1").returncode == 0
    try:
        mark = rig.proxies[2].line_count
        r = rig.send(cc("continuation", pinned), proxy=2)
        assert r.status == 200, r.body[:300]
        assert rig.where(pinned) == {"vllm-1": 2, "vllm-2": 1}
        assert rig.proxies[2].wait_output(r"soft: vllm-1 drained → vllm-2", since=mark)
    finally:
        assert _cli(rig, "undrain", "vllm-1").returncode == 0


def _hang_up_mid_stream(rig: Pools, session: str) -> None:
    """An opening whose client reads the answer's headers and first bytes, then hangs up."""
    p = rig.proxies[0]
    req = cc("opening", session)
    c = Client.via_proxy(p.port, p.mitm_ca, 10).connect(rig.fakes["anthropic"].origin)._conn
    c.putrequest(req.method, req.path, skip_accept_encoding=True)
    for k, v in req.headers:
        c.putheader(k, v)
    c.putheader("Content-Length", str(len(req.body)))
    c.endheaders(req.body)
    resp = c.getresponse()
    assert resp.status == 200 and resp.read1(100)       # the member answered, and streams
    resp.close()
    c.close()


def test_a_client_hanging_up_mid_stream_leaves_its_soft_member_in_the_pool(rig: Pools) -> None:
    """A member that answered is reachable, whatever the client did then: before, a client
    that hung up mid-stream (Esc) took its soft member out of new allocations for 10 s, and
    with one such client on each replica every new conversation was refused 503."""
    rig.use("local")
    for name in REPLICAS:
        rig.fakes[name].pause_after_first_ms = 2500
    sessions = [new_session(), new_session()]
    try:
        for s in sessions:                              # round-robin: one on each replica
            _hang_up_mid_stream(rig, s)
        time.sleep(3.0)         # the members' streams end, and the proxy meets the clients gone
    finally:
        for name in REPLICAS:
            rig.fakes[name].pause_after_first_ms = 0
    assert sorted(m for s in sessions for m in rig.where(s)) == sorted(REPLICAS)
    r = rig.send(cc("opening", new_session()))
    assert r.status == 200, (r.status, r.header("x-sessionpin-refused"), r.text[:300])
