"""Several real mitmdump routers on one real Redis (or Redis Cluster), and the traffic that
tests them: the rig of test_redis_e2e.py.

- ``World``: fake TLS servers ``anthropic`` (the origin the client addresses), ``glm`` and
  ``alt`` (each with its own key); three routers whose configs send new Claude Code
  conversations to three *different* servers (glm, alt, anthropic), so a router that
  decided a pinned conversation by itself instead of following the pin sends it
  elsewhere, and the tests see it. ``ready`` is the set of routers listening now.
- ``Load``: client threads sending openings (retried through another router until one
  answers, as an agent retries) and continuations of acknowledged conversations through
  random ready routers; every answer is kept with the server that gave it
  (``x-fake-server``). An opening is **acknowledged** when it got a 200.
- ``check(world, load)``: what must hold after anything: every 200 of a conversation came
  from the server its opening's 200 came from; every request a fake received for a
  conversation went to that one server; each fake saw only its own key; Redis holds each
  acknowledged conversation's pin, naming that server.
"""

from __future__ import annotations

import http.client
import random
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Callable

from sessionpin.records import pins

from .harness import Client, FakeServer, Mitmdump, Reply, TestCA, toml_config
from .test_router_e2e import ALT_ENV, ALT_KEY, CLIENT_KEY, GLM_ENV, GLM_KEY, SESSION_HEADER, cc

CHOICES = ("glm", "alt", "anthropic")       # router i sends new conversations to CHOICES[i]
KEYS = {"anthropic": CLIENT_KEY, "glm": GLM_KEY, "alt": ALT_KEY}
ORIGIN = "anthropic"                        # the server every request is addressed to
SEND_ERRORS = (OSError, http.client.HTTPException)


class World:
    def __init__(self, tmp: Path, store_url: str, raw: Callable[[], object]) -> None:
        self.ca = TestCA(tmp / "ca")
        self.fakes = {name: FakeServer(name, self.ca) for name in ("anthropic", "glm", "alt")}
        for f in self.fakes.values():
            f.start()
        servers = {"anthropic": {"url": self.fakes["anthropic"].url},
                   "glm": {"url": self.fakes["glm"].url, "key_env": GLM_ENV},
                   "alt": {"url": self.fakes["alt"].url, "key_env": ALT_ENV}}
        # The store URL (with its password) goes in $SESSIONPIN_STORE, as `sessionpin run` hands
        # it over: a command line is readable by every user (ps), and the harness prints it.
        self.proxies = [Mitmdump.router(tmp / f"router{i}", self.ca, toml_config(servers, {"claude-code": choice}),
                                        env={GLM_ENV: GLM_KEY, ALT_ENV: ALT_KEY, "SESSIONPIN_STORE": store_url})
                        for i, choice in enumerate(CHOICES)]
        for m in self.proxies:
            m.options.pop("sessionpin_store")
            # The OpenCode id pool acts on none of these requests, and costs ~0.2 s of CPU per
            # start (the 30 kill -9s restart a router 30 times); the shell's Redis tests keep it.
            m.options["sessionpin_pool"] = False
        self.raw = raw                      # a synchronous redis-py client of the store's server
        self.prefix = ""
        self.lock = threading.Lock()
        self.ready: set[int] = set()

    # routers
    def use_store(self, url: str, prefix: str) -> None:
        for m in self.proxies:
            m.env["SESSIONPIN_STORE"] = url
        self.prefix = prefix

    def start(self, which: list[int] | None = None) -> None:
        """Start routers (all by default) at once, each on a thread of its own."""
        which = list(range(len(self.proxies))) if which is None else which
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                self.proxies[i].start()
            except BaseException as e:       # noqa: BLE001 - reported below
                errors.append(e)
                return
            with self.lock:
                self.ready.add(i)
        threads = [threading.Thread(target=one, args=(i,)) for i in which]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors

    def stop(self, i: int, sig: int) -> int | None:
        with self.lock:
            self.ready.discard(i)
        return self.proxies[i].stop(sig)

    def pick(self, rng: random.Random) -> int | None:
        with self.lock:
            ready = sorted(self.ready)
        return rng.choice(ready) if ready else None

    # traffic
    def send(self, i: int, kind: str, session: str, timeout: float = 15.0) -> Reply:
        m = self.proxies[i]
        req = cc(kind, session, stream=False)
        client = Client.via_proxy(m.port, m.mitm_ca, timeout=timeout)
        return client.request(req.method, self.fakes["anthropic"].origin + req.path, req.headers, req.body)

    def status(self, i: int) -> Reply:
        m = self.proxies[i]
        return Client.via_proxy(m.port, m.mitm_ca, timeout=10).request(
            "GET", self.fakes["anthropic"].origin + "/__sessionpin/status")

    # what the fakes and Redis hold
    def where(self, session: str) -> Counter[str]:
        return Counter({name: n for name, f in self.fakes.items()
                        if (n := sum(1 for r in f.received() if r.header(SESSION_HEADER) == session))})

    def pin(self, session: str) -> pins.Pin | None:
        return pins.decode(self.raw().get(self.prefix + pins.key(session)))


def served_by(reply: Reply) -> str | None:
    return reply.header("x-fake-server") if reply.status == 200 else None


class Load:
    """``threads`` clients sending openings and continuations through random ready routers."""

    def __init__(self, world: World, threads: int = 3, seed: int = 0, new_share: float = 0.4,
                 pause: float = 0.0) -> None:
        self.world = world
        self.acked: dict[str, str] = {}                 # session -> the server its opening's 200 came from
        self.answers: list[tuple[str, str | None, int]] = []   # (session, server, status) of every reply
        self.statuses: Counter[int] = Counter()
        self.lost = 0                                   # requests whose connection failed (router killed)
        self.new_share = new_share
        self.pause = pause                              # between two requests of one client
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(random.Random(seed * 100 + n),), daemon=True)
                         for n in range(threads)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def acks(self) -> int:
        with self._lock:
            return len(self.acked)

    def wait_acks(self, more: int, timeout: float = 30.0) -> None:
        want = self.acks() + more
        deadline = time.monotonic() + timeout
        while self.acks() < want:
            assert time.monotonic() < deadline, f"{self.acks()} of {want} openings acknowledged in {timeout} s " \
                                                f"(statuses {dict(self.statuses)}, {self.lost} lost)"
            time.sleep(0.05)

    def _one(self, rng: random.Random, kind: str, session: str) -> Reply | None:
        i = self.world.pick(rng)
        if i is None:
            time.sleep(0.05)
            return None
        if self.pause:
            time.sleep(self.pause)
        try:
            r = self.world.send(i, kind, session)
        except SEND_ERRORS:
            with self._lock:
                self.lost += 1
            return None
        with self._lock:
            self.statuses[r.status] += 1
            self.answers.append((session, served_by(r), r.status))
            if r.status == 200 and kind == "opening":
                self.acked.setdefault(session, served_by(r) or "?")
        if r.status != 200:
            time.sleep(0.05)
        return r

    def _run(self, rng: random.Random) -> None:
        mine: list[str] = []
        while not self._stop.is_set():
            if not mine or rng.random() < self.new_share:
                s = str(uuid.uuid4())
                for _ in range(20):                    # as an agent retries its request
                    r = self._one(rng, "opening", s)
                    if r is not None and r.status == 200:
                        mine.append(s)
                        break
                    if self._stop.is_set():
                        break
            else:
                self._one(rng, "continuation", rng.choice(mine))


def check(world: World, load: Load) -> None:
    """No acknowledged pin lost, no misroute, no key at a wrong server (see the module's doc)."""
    acked = dict(load.acked)
    assert acked, "no opening was acknowledged"
    wrong = [(s, got, acked[s]) for s, got, status in load.answers if status == 200 and s in acked and got != acked[s]]
    assert not wrong, f"answered by another server than the opening's: {wrong[:5]}"
    every = {s for s, _, _ in load.answers}
    split = {s: dict(c) for s in every if len(c := world.where(s)) > 1}
    assert not split, f"a conversation's requests reached several servers: {list(split.items())[:5]}"
    moved = {s: server for s in acked if (server := next(iter(world.where(s)), None)) != acked[s]}
    assert not moved, f"requests of acknowledged conversations reached another server: {list(moved.items())[:5]}"
    for name, fake in world.fakes.items():
        for r in fake.received():
            key = r.header("x-api-key")
            assert key == KEYS[name], f"{name} received the key meant for {next((n for n, k in KEYS.items() if k == key), '?')}"
            raw = r.raw()
            assert not any(k.encode() in raw for n, k in KEYS.items() if n != name), f"another key reached {name}"
    # A conversation that stays on the origin it addressed is forwarded even when its pin could
    # not be saved (docs/design.md): with no pin its next turn is left alone, to that origin,
    # and pinned "not routed" (server None: its requests go where they are addressed).
    lost = {s: (server, pin) for s, server in acked.items()
            if (pin := world.pin(s)) is None and server != ORIGIN
            or pin is not None and pin.server != server and not (server == ORIGIN and pin.server is None)}
    assert not lost, f"acknowledged pins lost or changed in Redis: {list(lost.items())[:5]}"


def continue_all(world: World, sessions: dict[str, str], via: list[int] | None = None) -> None:
    """One continuation of each conversation, the routers taking turns (one client thread per
    router): each must reach its conversation's server."""
    via = via or sorted(world.ready)
    todo = sorted(sessions.items())
    wrong: list[tuple] = []

    def run(n: int) -> None:
        for s, server in todo[n::len(via)]:
            r = world.send(via[n], "continuation", s)
            if (r.status, served_by(r)) != (200, server):
                wrong.append((s, server, via[n], r.status, served_by(r), r.text[:200]))
    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(via))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not wrong, wrong[:5]
