#!/usr/bin/env python3
"""Fault soak (issue 10): real mitmdump routers on one store, under faults, for a bounded time.

    .venv/bin/python scripts/soak_faults.py [--seconds 120] [--proxies 1|2|3] [--store file|redis]
                                            [--clients 4] [--shapes cc,codex] [--faults KIND,...]
                                            [--seed N] [--keep] [--json FILE] [--set OPTION=VALUE]

Everything is on 127.0.0.1: a throwaway CA, fake TLS inference servers (tests/e2e/harness.py),
1-3 ``mitmdump -s addons/route.py`` processes sharing ONE store (a SQLite file store in a temp
directory, or with ``--store redis`` a redis-server of the soak's own on a free port,
``--appendonly yes --appendfsync always``), client threads, and a fault loop. It is a soak,
not a test: it runs for ``--seconds`` (then a final phase of ~10-60 s), prints figures, and
exits 1 if a conversation was misrouted, a pin lost or a key leaked.

The servers: ``anthropic`` (the origin Claude Code addresses; the agent's own key belongs
there), ``openai`` (the origin Codex addresses; Codex's own key belongs there), and ``glm``
(under a prefix, models renamed), ``alt`` (bearer) and ``kimi``, each with a sentinel key of its
own in the proxies' environment. Every proxy has its own config file; they start out sending
new conversations to different servers, so a proxy that decided a running conversation by
itself instead of following its pin would send it elsewhere.

The clients (``--clients`` threads) open conversations and send continuations through a random
running proxy: Claude Code ``POST /v1/messages`` (``cc``) and Codex ``POST /v1/responses`` over
HTTPS (``codex``), streamed or not. An opening is retried, as an agent retries, until a 200 (or
20 tries). **Ground truth**: the fake server that answered an opening's 200 (``x-fake-server``)
is the conversation's server. Then:

- a continuation answered 200 by another server is **misrouted**; one answered 503/502 with an
  error body in the agent's format is **refused** (allowed: counted per fault kind); a cut
  connection (its proxy killed) is **cut**; anything else is **other**;
- after the run, every request a fake received whose body carries history (a continuation), of
  an acknowledged conversation, at a server other than the conversation's: **misrouted
  (server side)** — also those whose answer the client never saw;
- after the run, all proxies are killed with SIGKILL and restarted, and every acknowledged
  conversation's pin is read from the store (the store API, as ``sessionpin sessions --json``
  reads it): missing, or naming another server, is **lost**. A conversation that began on the
  origin it addresses may have no pin or a "not routed" one: it goes there anyway (a pin that
  could not be saved does not stop such an opening, docs/router.md); counted as
  ``origin, unpinned``, not lost;
- then one more continuation of every acknowledged conversation (the **sweep**) through the
  restarted proxies: each must be answered by its server;
- a sentinel key seen by a fake server it does not belong to (anywhere in the request) is
  **leaked**; so is any key in the proxies' output.

Faults (``--faults``, default: all that apply to the store), one at a time: the fault, then
the loop waits until every running proxy's ``/__sessionpin/status`` reads its store again
(``settle``, at most 20 s), then 0.3-1.5 s, then the next. Refusals and cuts are counted
against the fault during whose window (from injection to 2 s after it settled) the answer
came (or the connection was cut); the latest fault begun wins.

    kill9             kill -9 of one random proxy, restarted at once
    delete-db         unlink state.db while the proxies run
    delete-wal        unlink state.db-wal
    delete-shm        unlink state.db-shm
    delete-dir        remove the whole store directory (db, copy, their -wal/-shm, lock file):
                      renamed away in one step, then deleted
    damage-pages      overwrite 3 random 4 KiB pages of state.db (page 1 in 1 of 4) in place
    damage-copy       overwrite 3 random 4 KiB pages of state.db.copy (page 1 in 1 of 4) in place
    delete-copy       unlink state.db.copy
    damage-at-start   kill -9 every proxy, truncate state.db to half or overwrite 3 pages, restart
    delete-wal+kill9  unlink state.db-wal, then at once kill -9 every proxy, restart (docs/store.md)
    delete-db+kill9   unlink state.db, then at once kill -9 every proxy, restart
    use               `sessionpin use`-like: one proxy's config sends an agent's new conversations elsewhere
    remove-server     one proxy's config loses a server (an origin too), restored 1.5-4 s later
    empty-config      one proxy's config file emptied, restored 1.5-4 s later
    redis-kill9       (--store redis) kill -9 of redis-server, restarted on its AOF 0.5-1.5 s later

Loss faults (issue 18: data that is simply not there any more). Before each, the soak backs
the store up under load (``sessionpin store copy URL BACKUP``, the documented way); after it,
it lets the clients meet the loss for 2-4 s (refusals are counted and expected, a misroute
is a failure), then plays the operator with the load paused: it restores the backup
(``sessionpin store copy BACKUP URL``) and accepts what is still missing (``sessionpin store
accept-loss``). Conversations whose pins are still missing then (opened after the backup)
were given up by the operator: they are counted as **abandoned**, and not continued — also
those on the server their agent addresses (a lost pin is decided afresh, and the soak's
conversations of a shape share one history, so the lineage may take one for a fork of
another).

    redis-flushdb              (--store redis) FLUSHDB while the proxies run
    redis-del                  (--store redis) DEL of a third of the pin keys
    redis-evict                (--store redis) maxmemory lowered under allkeys-random until Redis evicted
                               keys, then set back (noeviction)
    redis-restart-empty        (--store redis) kill -9 of redis-server, its AOF deleted, restarted empty
    file-emptied-while-stopped (--store file) every proxy stopped, the store's directory deleted, restarted

And the move of the running fleet to another store, in docs/cli.md's order, the load running
throughout (not paused: openings keep arriving; a misroute or a lost pin fails the run):

    store-copy-under-load      ``store copy FROM TO`` while the proxies serve (a new redis-server, or
                               a new file store), every proxy stopped (SIGTERM), ``store copy FROM TO``
                               again, every proxy started on TO; FROM (a redis-server) is then killed,
                               so nothing can still be read from it

``--keep`` keeps the temp directory (each proxy's output is written there as ``router<i>.log``;
it is also kept when the soak fails). ``--json FILE`` writes the summary as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import http.client
import json
import os
import random
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from e2e.harness import Client, FakeServer, Mitmdump, Reply, TestCA, free_port, toml_config  # noqa: E402

from sessionpin.reader import facts  # noqa: E402
from sessionpin.records import pins  # noqa: E402
from sessionpin.decision.answers import NO_RETRY_STATUS  # noqa: E402
from sessionpin.store import open_store  # noqa: E402

RUN = uuid.uuid4().hex[:8]
CC_KEY = f"sk-ant-api03-SOAK-CLIENT-{RUN}"          # Claude Code's own key: anthropic's
CX_KEY = f"sk-proj-SOAK-CODEX-CLIENT-{RUN}"         # Codex's own key: openai's
KEY_ENV = {"glm": "SOAK_GLM_KEY", "alt": "SOAK_ALT_KEY", "kimi": "SOAK_KIMI_KEY"}
KEYS = {"anthropic": CC_KEY, "openai": CX_KEY, **{n: f"{n}-SOAK-SENTINEL-{RUN}" for n in KEY_ENV}}
OWNER = {key: name for name, key in KEYS.items()}
PROMPT = f"SOAK-PROMPT-{RUN}"
CC_SESSION_HEADER = "x-claude-code-session-id"
CX_SESSION_HEADER = "session-id"
ORIGIN = {"cc": "anthropic", "codex": "openai"}
AGENT = {"cc": "claude-code", "codex": "codex"}
CHOICES = {"cc": ("glm", "alt", "anthropic", "kimi"), "codex": ("kimi", "openai", "glm", "alt")}
OPUS = "claude-opus-4-5-20251101"
FILE_FAULTS = ("kill9", "delete-db", "delete-wal", "delete-shm", "delete-dir", "damage-pages", "damage-copy",
               "delete-copy", "damage-at-start", "delete-wal+kill9", "delete-db+kill9",
               "file-emptied-while-stopped", "store-copy-under-load")
CONFIG_FAULTS = ("use", "remove-server", "empty-config")
REDIS_FAULTS = ("kill9", "redis-kill9", "redis-flushdb", "redis-del", "redis-evict", "redis-restart-empty",
                "store-copy-under-load")
LOSS_FAULTS = ("redis-flushdb", "redis-del", "redis-evict", "redis-restart-empty", "file-emptied-while-stopped")
SEND_ERRORS = (OSError, http.client.HTTPException, ssl.SSLError)
GRACE = 2.0          # a fault's window lasts until this long after it settled


# --------------------------------------------------------------------------- requests


@dataclass
class Req:
    path: str
    headers: list[tuple[str, str]]
    body: bytes


def cc_request(session: str, continuation: bool, stream: bool) -> Req:
    """Claude Code 2.1.332's main-loop turn (shape as in tests/e2e/test_router_e2e.py)."""
    headers = [("Accept", "application/json"), ("Content-Type", "application/json"),
               ("User-Agent", "claude-cli/2.1.332 (external, cli)"), ("anthropic-version", "2023-06-01"),
               ("anthropic-beta", "claude-code-20250219,interleaved-thinking-2025-05-14"), ("x-app", "cli"),
               ("x-claude-code-request-class", "main"), ("X-Claude-Code-Session-Id", session),
               ("x-api-key", CC_KEY)]
    user = {"role": "user", "content": [{"type": "text", "text": f"Fix the failing test. {PROMPT}"}]}
    messages = [user]
    if continuation:
        # the ids and the signature a real answer has, its own: conversations whose histories
        # were byte for byte the same would share their lineage root (each one another's fork)
        tool, sig = f"toolu_01{session.replace('-', '')[:22]}", "EqQBCkYIBxgCKkB0" + session.replace("-", "")
        messages += [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Look at the test first.", "signature": sig},
                {"type": "tool_use", "id": tool, "name": "Bash", "input": {"command": "pytest -x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool, "content": "1 failed"}]},
        ]
    else:
        headers.append(("x-claude-code-prompt-id", str(uuid.uuid4())))
    meta = {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": session})}
    body = {"model": OPUS, "messages": messages,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.e4b; cc_entrypoint=cli;"},
                       {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."}],
            "tools": [{"name": "Bash", "description": "Run a shell command.",
                       "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}],
            "metadata": meta, "max_tokens": 32000, "thinking": {"type": "enabled", "budget_tokens": 31999},
            "stream": stream}
    return Req("/v1/messages?beta=true", headers, json.dumps(body).encode())


def codex_request(session: str, continuation: bool, stream: bool) -> Req:
    """Codex CLI 0.171's HTTPS turn to /v1/responses (its fallback from the WebSocket)."""
    meta = {"session_id": session, "request_kind": "turn", "history_initialization": "new", "thread_source": "user"}
    headers = [("Content-Type", "application/json"), ("User-Agent", "codex_cli_rs/0.171.0 (Debian 12; x86_64)"),
               ("originator", "codex_cli_rs"), ("session-id", session), ("x-codex-turn-metadata", json.dumps(meta)),
               ("Authorization", f"Bearer {CX_KEY}")]
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "perms"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"hello {PROMPT}"}]},
    ]
    if continuation:
        call = f"call_{session.replace('-', '')[:24]}"      # its own, as a real answer's (see cc_request)
        items += [{"type": "reasoning", "summary": []},
                  {"type": "function_call", "name": "shell", "arguments": "{}", "call_id": call},
                  {"type": "function_call_output", "call_id": call, "output": "hi"}]
    body = {"model": "gpt-5-codex", "instructions": "You are Codex.", "input": items,
            "tools": [{"type": "function", "name": "shell"}], "stream": stream, "prompt_cache_key": session}
    return Req("/v1/responses", headers, json.dumps(body).encode())


BUILD = {"cc": cc_request, "codex": codex_request}


def check_shapes(shapes: list[str]) -> None:
    """The router's reader must take these requests for what the soak says they are."""
    for shape in shapes:
        s = str(uuid.uuid4())
        for continuation, turn in ((False, facts.OPENING), (True, facts.CONTINUATION)):
            r = BUILD[shape](s, continuation, True)
            f = facts.read("POST", "https://127.0.0.1:1" + r.path, r.headers, r.body)
            got = (f.agent, f.session, f.turn)
            assert got == (AGENT[shape], s, turn), f"{shape}: the reader says {got} ({f.reason})"


def is_error_body(body: bytes) -> bool:
    """An error in the Anthropic or OpenAI format, with a message."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and bool(err.get("message"))


def session_of(rec: Any) -> str | None:
    s = rec.header(CC_SESSION_HEADER) or rec.header(CX_SESSION_HEADER)
    if s:
        return s
    try:
        body = json.loads(rec.body)
        return body.get("prompt_cache_key") or json.loads(body["metadata"]["user_id"])["session_id"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def has_history(rec: Any) -> bool | None:
    try:
        body = json.loads(rec.body)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    if "messages" in body:
        return len(body["messages"]) > 1
    if "input" in body:
        return len(body["input"]) > 2
    return None


# --------------------------------------------------------------------------- the world


class RedisProc:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "yes"],
            stdout=open(self.dir / "redis.log", "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.5) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING within 20 s")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)


@dataclass
class Conv:
    shape: str
    server: str                      # who answered its opening's 200: the ground truth
    proxy: int
    at: float


@dataclass
class Fault:
    kind: str
    start: float
    detail: str = ""
    settled: float | None = None     # when every running proxy read its store again
    end: float | None = None         # window end (settled + GRACE)


class World:
    def __init__(self, tmp: Path, nproxies: int, store: str, shapes: list[str], rng: random.Random) -> None:
        self.tmp = tmp
        self.rng = rng
        self.shapes = shapes
        self.ca = TestCA(tmp / "ca")
        self.fakes: dict[str, FakeServer] = {}
        for name in ("anthropic", "openai", "glm", "alt", "kimi"):
            self.fakes[name] = FakeServer(name, self.ca, prefix="/api/anthropic" if name == "glm" else "")
            self.fakes[name].deltas = 1
            self.fakes[name].start()
        self.store_kind = store
        self.store_dir = tmp / "store"
        self.db = self.store_dir / "state.db"
        self.redis: RedisProc | None = None
        self.old_redis: list[RedisProc | None] = []     # those the fleet moved away from
        env = {KEY_ENV[n]: KEYS[n] for n in KEY_ENV}
        # what the proxies and the CLI remember of the store (issue 18): the soak's own, never the user's
        os.environ["SESSIONPIN_STORE_MEMORY"] = str(tmp / "memory")
        if store == "redis":
            self.redis = RedisProc(tmp / "redis")
            self.redis.start()
            self.store_url = self.redis.url
            env["SESSIONPIN_STORE"] = self.store_url
        else:
            self.store_url = f"file:{self.db}"
        self.current: list[dict[str, str]] = []
        self.proxies: list[Mitmdump] = []
        for i in range(nproxies):
            cur = {shape: CHOICES[shape][i % len(CHOICES[shape])] for shape in ("cc", "codex")}
            self.current.append(cur)
            m = Mitmdump.router(tmp / f"router{i}", self.ca, self.config(cur), env=env,
                                options={"sessionpin_pool": False})
            if store == "redis":
                m.options.pop("sessionpin_store")
            else:
                m.options["sessionpin_store"] = self.store_url
            self.proxies.append(m)
        self.lock = threading.Lock()
        self.ready: set[int] = set()

    def servers(self, drop: str | None = None) -> dict[str, dict[str, Any]]:
        f = self.fakes
        table: dict[str, dict[str, Any]] = {
            "anthropic": {"url": f["anthropic"].url},
            "openai": {"url": f["openai"].url},
            "glm": {"url": f["glm"].url, "key_env": KEY_ENV["glm"], "models": {"claude-opus-*": "glm-4.6"}},
            "alt": {"url": f["alt"].url, "key_env": KEY_ENV["alt"], "auth": "bearer"},
            "kimi": {"url": f["kimi"].url, "key_env": KEY_ENV["kimi"]},
        }
        return {n: t for n, t in table.items() if n != drop}

    def config(self, current: dict[str, str], drop: str | None = None) -> str:
        return toml_config(self.servers(drop), {AGENT[s]: current[s] for s in ("cc", "codex")})

    def use_store(self, url: str, redis_proc: "RedisProc | None") -> "RedisProc | None":
        """Every proxy uses ``url`` from its next start (they are stopped); returns the
        redis-server it replaces, if any."""
        old = self.redis
        self.store_url = url
        if redis_proc is not None:
            self.redis = redis_proc
            self.old_redis.append(old)
        else:
            self.db = Path(url[len("file:"):])
            self.store_dir = self.db.parent
        for m in self.proxies:
            if self.store_kind == "redis":
                m.env["SESSIONPIN_STORE"] = url
            else:
                m.options["sessionpin_store"] = url
        return old if redis_proc is not None else None

    # proxies
    def start(self, i: int) -> None:
        self.proxies[i].start(timeout=60)
        with self.lock:
            self.ready.add(i)

    def start_all(self, which: list[int] | None = None) -> None:
        which = list(range(len(self.proxies))) if which is None else which
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                self.start(i)
            except BaseException as e:      # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=one, args=(i,)) for i in which]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        if errors:
            raise errors[0]

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        with self.lock:
            self.ready.discard(i)
        self.proxies[i].stop(sig)

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        with self.lock:
            self.ready.clear()
        for m in self.proxies:          # all at once, then reap each
            if m.alive and m.proc is not None:
                m.proc.send_signal(sig)
        for m in self.proxies:
            m.stop(sig)

    def pick(self, rng: random.Random) -> int | None:
        with self.lock:
            ready = sorted(self.ready)
        return rng.choice(ready) if ready else None

    def send(self, i: int, req: Req, origin: str, timeout: float = 20.0) -> Reply:
        m = self.proxies[i]
        client = Client.via_proxy(m.port, m.mitm_ca, timeout=timeout)
        return client.request("POST", self.fakes[origin].origin + req.path, req.headers, req.body)

    def status(self, i: int) -> dict[str, Any] | None:
        m = self.proxies[i]
        try:
            r = Client.via_proxy(m.port, m.mitm_ca, timeout=5).request(
                "GET", self.fakes["anthropic"].origin + "/__sessionpin/status")
            return r.json() if r.status == 200 else None
        except (*SEND_ERRORS, ValueError):
            return None

    def settled(self) -> bool:
        """Every running proxy answers its status and can read its store."""
        with self.lock:
            ready = sorted(self.ready)
        for i in ready:
            st = self.status(i)
            if st is None or st.get("pins") is None:
                return False
            info = st.get("store_info") or {}
            if info.get("unsure"):
                return False
        return True


# --------------------------------------------------------------------------- load


@dataclass
class Outcome:
    t: float
    kind: str            # opening | continuation | sweep
    session: str
    proxy: int
    status: int | None   # None: cut
    server: str | None   # x-fake-server of a 200
    reason: str | None   # x-sessionpin-refused
    text: str = ""
    refusal: bool = False  # a 502/503/424 whose body is an error in the agent's format (424: the
                           # store lost what it held, only the operator can decide)
    took: float = 0.0
    error: str = ""       # why a cut request was cut


class Load:
    def __init__(self, world: World, clients: int, seed: int, new_share: float, pause: float) -> None:
        self.world = world
        self.convs: dict[str, Conv] = {}
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.new_share = new_share
        self.pause = pause
        self.running = threading.Event()            # cleared while the operator decides (loss faults)
        self.running.set()
        self.inflight = 0
        # session -> when the operator gave it up (wall clock, monotonic: the fakes' clock)
        self.abandoned: dict[str, tuple[float, float]] = {}
        self.threads = [threading.Thread(target=self.run, args=(random.Random(seed * 1000 + n),), daemon=True)
                        for n in range(clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def one(self, rng: random.Random, kind: str, session: str, shape: str, i: int | None = None) -> Outcome | None:
        if i is None:
            i = self.world.pick(rng)
        if i is None:
            time.sleep(0.05)
            return None
        req = BUILD[shape](session, kind != "opening", rng.random() < 0.5)
        while not self.running.wait(0.1):
            if self.stop.is_set():
                return None
        with self.lock:
            self.inflight += 1
            if session in self.abandoned:
                self.inflight -= 1
                return None
        t = time.time()
        try:
            r = self.world.send(i, req, ORIGIN[shape])
            o = Outcome(t, kind, session, i, r.status, r.header("x-fake-server") if r.status == 200 else None,
                        r.header("x-sessionpin-refused"), "" if r.status == 200 else r.text[:300],
                        refusal=r.status in (502, 503, NO_RETRY_STATUS) and is_error_body(r.body), took=time.time() - t)
        except SEND_ERRORS as e:
            o = Outcome(t, kind, session, i, None, None, None, took=time.time() - t,
                        error=f"{type(e).__name__}: {e}"[:120])
        finally:
            with self.lock:
                self.inflight -= 1
        with self.lock:
            self.outcomes.append(o)
        return o

    def paused(self, timeout: float = 60.0) -> bool:
        """Stop sending, and wait until no request is in flight (the operator decides)."""
        self.running.clear()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.inflight == 0:
                    return True
            time.sleep(0.02)
        return False

    def run(self, rng: random.Random) -> None:
        mine: list[str] = []
        while not self.stop.is_set():
            if self.pause:
                time.sleep(rng.uniform(0, 2 * self.pause))
            if not mine or rng.random() < self.new_share:
                shape = rng.choice(self.world.shapes)
                s = str(uuid.uuid4())
                for _ in range(20):                    # as an agent retries
                    o = self.one(rng, "opening", s, shape)
                    if o is not None and o.status == 200:
                        with self.lock:
                            self.convs[s] = Conv(shape, o.server or "?", o.proxy, o.t)
                        mine.append(s)
                        break
                    if self.stop.is_set():
                        break
                    time.sleep(0.1)
            else:
                s = rng.choice(mine)
                if s in self.abandoned:             # its loss was accepted: the agent gave it up
                    mine.remove(s)
                    continue
                self.one(rng, "continuation", s, self.convs[s].shape)


# --------------------------------------------------------------------------- faults


def overwrite_pages(path: Path, rng: random.Random, pages: int = 3, page_size: int = 4096) -> str:
    size = path.stat().st_size
    n = max(1, size // page_size)
    chosen = []
    with open(path, "r+b") as f:
        for _ in range(pages):
            p = 0 if (n == 1 or rng.random() < 0.25) else rng.randrange(1, n)
            chosen.append(p + 1)
            f.seek(p * page_size)
            f.write(rng.randbytes(page_size))
        f.flush()
        os.fsync(f.fileno())
    return f"pages {sorted(chosen)} of {n}"


class Faults:
    def __init__(self, world: World, kinds: list[str], rng: random.Random, load: "Load | None" = None) -> None:
        self.world = world
        self.load = load
        self.losses: list[dict[str, Any]] = []     # per loss fault: what was restored, accepted, abandoned
        self.kinds = kinds
        self.rng = rng
        self.log: list[Fault] = []
        self.skipped: collections.Counter[str] = collections.Counter()
        self.unsettled: list[Fault] = []
        self.config_unapplied: collections.Counter[str] = collections.Counter()
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        self.stop.set()
        self.thread.join(120)

    def run(self) -> None:
        time.sleep(2.0)
        while not self.stop.is_set():
            kind = self.rng.choice(self.kinds)
            fault = Fault(kind, time.time())
            try:
                done = self.inject(fault)
            except Exception as e:               # noqa: BLE001 - a fault that could not be made
                self.errors.append(f"{kind}: {type(e).__name__}: {e}")
                done = True
            if done is False:
                self.skipped[kind] += 1
                continue
            self.log.append(fault)
            deadline = time.monotonic() + 20
            while not self.world.settled():
                if time.monotonic() > deadline:
                    self.unsettled.append(fault)
                    break
                time.sleep(0.1)
            fault.settled = time.time()
            fault.end = fault.settled + GRACE
            self.stop.wait(self.rng.uniform(0.3, 1.5))

    def paths(self) -> dict[str, Path]:
        db = self.world.db
        return {"db": db, "wal": Path(f"{db}-wal"), "shm": Path(f"{db}-shm"), "copy": Path(f"{db}.copy")}

    def inject(self, fault: Fault) -> bool:
        w, rng, kind = self.world, self.rng, fault.kind
        p = self.paths()
        if kind == "kill9":
            i = w.pick(rng)
            if i is None:
                return False
            w.kill(i)
            w.start(i)
            fault.detail = f"proxy {i}"
        elif kind in ("delete-db", "delete-wal", "delete-shm", "delete-copy"):
            target = p[kind.removeprefix("delete-")]
            if not target.exists():
                return False
            target.unlink()
        elif kind == "delete-dir":
            if not w.store_dir.exists():
                return False
            # rm -rf races the proxies creating files in it: take it away from its path in
            # one step (the files are then nameless, as after a deletion), then delete it
            gone = w.tmp / f"deleted-store-{len(self.log)}"
            os.rename(w.store_dir, gone)
            shutil.rmtree(gone)
        elif kind == "damage-pages":
            if not p["db"].exists():
                return False
            fault.detail = overwrite_pages(p["db"], rng)
        elif kind == "damage-copy":
            if not p["copy"].exists():
                return False
            fault.detail = overwrite_pages(p["copy"], rng)
        elif kind == "damage-at-start":
            w.kill_all()
            if p["db"].exists():
                if rng.random() < 0.5:
                    size = p["db"].stat().st_size
                    os.truncate(p["db"], size // 2)
                    fault.detail = f"truncated {size} -> {size // 2}"
                else:
                    fault.detail = overwrite_pages(p["db"], rng)
            w.start_all()
        elif kind in ("delete-wal+kill9", "delete-db+kill9"):
            target = p["wal" if kind.startswith("delete-wal") else "db"]
            if not target.exists():
                return False
            target.unlink()
            w.kill_all()
            w.start_all()
        elif kind == "redis-kill9":
            assert w.redis is not None
            w.redis.kill()
            time.sleep(rng.uniform(0.5, 1.5))
            w.redis.start()
        elif kind in LOSS_FAULTS:
            self.loss(fault)
        elif kind == "store-copy-under-load":
            self.move(fault)
        elif kind == "use":
            i = rng.randrange(len(w.proxies))
            shape = rng.choice(("cc", "codex"))
            cur = dict(w.current[i])
            cur[shape] = rng.choice([c for c in CHOICES[shape] if c != cur[shape]])
            w.current[i] = cur
            self.write_config(i, w.config(cur), kind, want_agents=cur)
            fault.detail = f"proxy {i}: {AGENT[shape]} -> {cur[shape]}"
        elif kind in ("remove-server", "empty-config"):
            i = rng.randrange(len(w.proxies))
            cur = dict(w.current[i])
            if kind == "remove-server":
                drop = rng.choice(list(w.servers()))
                shown = {s: (c if c != drop else rng.choice([x for x in CHOICES[s] if x != drop])) for s, c in cur.items()}
                text = w.config(shown, drop=drop)
                fault.detail = f"proxy {i}: {drop} removed"
                self.write_config(i, text, kind, want_servers=set(w.servers(drop)))
            else:
                fault.detail = f"proxy {i}: emptied"
                self.write_config(i, "", kind, want_servers=set())
            self.stop.wait(rng.uniform(1.5, 4.0))
            self.write_config(i, w.config(cur), kind + " (restore)", want_servers=set(w.servers()))
        else:
            raise ValueError(kind)
        return True

    # ---- loss faults (issue 18) ------------------------------------------------------------
    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sessionpin.cli", *args], capture_output=True, text=True,
                              timeout=120, cwd=str(self.world.tmp),
                              env={**os.environ, "PYTHONPATH": str(ROOT)})

    def loss(self, fault: Fault) -> None:
        """Back up under load, make the loss, let clients meet it, then decide as an operator."""
        w, rng, kind = self.world, self.rng, fault.kind
        backup = f"file:{w.tmp / f'backup-{len(self.log)}' / 'state.db'}"
        copied = self.cli("store", "copy", w.store_url, backup)
        if copied.returncode != 0:
            raise RuntimeError(f"backup failed: {copied.stderr.strip()[:300]}")
        if kind == "redis-flushdb":
            w.redis.client().flushdb()
        elif kind == "redis-del":
            r = w.redis.client()
            keys = list(r.scan_iter(match=f"*{pins.PIN_PREFIX}*", count=1000))
            gone = rng.sample(keys, max(1, len(keys) // 3)) if keys else []
            if gone:
                r.delete(*gone)
            fault.detail = f"{len(gone)} of {len(keys)} pins"
        elif kind == "redis-evict":
            r = w.redis.client()
            before = r.dbsize()
            evicted = int(r.info("stats")["evicted_keys"])
            r.config_set("maxmemory-policy", "allkeys-random")
            r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) + 64 * 1024))
            deadline = time.monotonic() + 5
            # memory pressure until Redis evicted about a fifth of the store's keys (fillers count too)
            while int(r.info("stats")["evicted_keys"]) - evicted < max(2, before // 5) \
                    and time.monotonic() < deadline:
                r.set("soak:filler:" + uuid.uuid4().hex, "x" * 4096)
            r.config_set("maxmemory", "0")
            r.config_set("maxmemory-policy", "noeviction")
            fillers = list(r.scan_iter(match="soak:filler:*"))
            if fillers:
                r.delete(*fillers)
            fault.detail = f"{before} -> {r.dbsize()} keys"
        elif kind == "redis-restart-empty":
            w.redis.kill()
            for p in w.redis.dir.iterdir():
                if p.name != "redis.log":
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            w.redis.start()
        elif kind == "file-emptied-while-stopped":
            w.kill_all(signal.SIGTERM)
            if w.store_dir.exists():
                shutil.rmtree(w.store_dir)
            w.start_all()
        self.stop.wait(rng.uniform(2.0, 4.0))              # clients meet the loss: refusals, not misroutes
        load = self.load
        if load is not None and not load.paused():
            raise RuntimeError("requests still in flight after 60 s")
        try:
            restored = self.cli("store", "copy", backup, w.store_url)
            accepted = self.cli("store", "accept-loss", "--json", "--store", w.store_url)
            if restored.returncode != 0 or accepted.returncode != 0:
                raise RuntimeError(f"recovery failed: {restored.stderr.strip()[:200]} {accepted.stderr.strip()[:200]}")
            said = json.loads(accepted.stdout)
            abandoned = 0
            if load is not None:
                with load.lock:
                    convs = dict(load.convs)
                present = asyncio.run(read_pins(w.store_url, sorted(convs)))
                now = (time.time(), time.monotonic())
                for session, conv in convs.items():
                    # whatever server it was on: "decided afresh" includes the lineage, which may
                    # take it for a fork of another conversation of the same history (this soak's
                    # conversations of a shape share one prompt), and send it to that one's server
                    if present.get(session) is None and session not in load.abandoned:
                        load.abandoned[session] = now
                        abandoned += 1
            self.losses.append({"kind": kind, "accepted": len(said.get("accepted") or []),
                                "lost_pins_reported": said.get("lost_pins"), "abandoned": abandoned})
            fault.detail = (fault.detail + "; " if fault.detail else "") + f"abandoned {abandoned}"
        finally:
            if load is not None:
                load.running.set()

    def move(self, fault: Fault) -> None:
        """docs/cli.md's order for moving a running fleet to another store, under load."""
        w, n = self.world, len(self.log)
        new_redis = None
        if w.store_kind == "redis":
            new_redis = RedisProc(w.tmp / f"redis-moved-{n}")
            new_redis.start()
            to_url = new_redis.url
        else:
            to_url = f"file:{w.tmp / f'store-moved-{n}' / 'state.db'}"
        first = self.cli("store", "copy", "--json", w.store_url, to_url)     # 1. the bulk, proxies serving
        if first.returncode != 0:
            raise RuntimeError(f"first copy failed: {first.stderr.strip()[:300]}")
        w.kill_all(signal.SIGTERM)                                           # 2. the proxies stopped
        second = self.cli("store", "copy", "--json", w.store_url, to_url)    # 3. what changed since 1
        if second.returncode != 0:
            raise RuntimeError(f"second copy failed: {second.stderr.strip()[:300]}")
        old_redis = w.use_store(to_url, new_redis)
        w.start_all()                                                        # 4. the proxies on TO
        if old_redis is not None:
            old_redis.kill()                    # nothing may still be read from FROM
        fault.detail = (f"copied {json.loads(first.stdout)['copied']} keys under load, then "
                        f"{json.loads(second.stdout)['copied']} with the proxies stopped")

    def write_config(self, i: int, text: str, why: str, want_servers: set[str] | None = None,
                     want_agents: dict[str, str] | None = None) -> None:
        m = self.world.proxies[i]
        m.write_config(text)
        if not m.alive:
            return
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            st = self.world.status(i)
            if st is not None:
                ok = want_servers is None or set(st.get("servers") or {}) == want_servers
                if want_agents is not None:
                    ok = ok and all((st.get("agents") or {}).get(AGENT[s]) == c for s, c in want_agents.items())
                if ok:
                    return
            time.sleep(0.1)
        self.config_unapplied[why] += 1


# --------------------------------------------------------------------------- the run


async def read_pins(url: str, sessions: list[str]) -> dict[str, pins.Pin | None]:
    store = open_store(url)
    try:
        out: dict[str, pins.Pin | None] = {}
        for n in range(0, len(sessions), 500):
            batch = sessions[n:n + 500]
            for s, raw in zip(batch, await store.mget([pins.key(s) for s in batch])):
                out[s] = pins.decode(raw)
        return out
    finally:
        await store.close()


def utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%H:%M:%S.%f")[:12]


def fault_at(faults: list[Fault], t: float) -> str:
    best = "none"
    for f in faults:
        if f.start <= t and (f.end is None or t <= f.end):
            best = f.kind
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--proxies", type=int, choices=(1, 2, 3), default=1)
    ap.add_argument("--store", choices=("file", "redis"), default="file")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--shapes", default="cc,codex", help="cc, codex (comma-separated)")
    ap.add_argument("--faults", default="", help="fault kinds (comma-separated); default: all for the store")
    ap.add_argument("--new-share", type=float, default=0.3, help="share of a client's requests that open a conversation")
    ap.add_argument("--pause", type=float, default=0.05, help="mean pause between two requests of one client (s)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the temp directory (proxy logs, store)")
    ap.add_argument("--json", default=None, help="write the summary as JSON to this file")
    ap.add_argument("--set", dest="mitm_set", action="append", default=[], metavar="OPTION=VALUE",
                    help="a mitmdump option for every proxy (repeatable), e.g. termlog_verbosity=debug")
    args = ap.parse_args()

    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in BUILD:
            ap.error(f"unknown shape {s!r}")
    check_shapes(shapes)
    allowed = (REDIS_FAULTS if args.store == "redis" else FILE_FAULTS) + CONFIG_FAULTS
    kinds = [k for k in args.faults.split(",") if k] or list(allowed)
    for k in kinds:
        if k not in allowed:
            ap.error(f"fault {k!r} does not apply to --store {args.store} (choose from {', '.join(allowed)})")
    if args.store == "redis" and not shutil.which("redis-server"):
        ap.error("--store redis needs redis-server on PATH")

    tmp = Path(tempfile.mkdtemp(prefix="sessionpin-soak-"))
    print(f"soak: {args.seconds:.0f} s, {args.proxies} proxies, store {args.store}, {args.clients} clients, "
          f"shapes {','.join(shapes)}, seed {seed}, faults {','.join(kinds)}", flush=True)
    world = World(tmp, args.proxies, args.store, shapes, rng)
    for item in args.mitm_set:
        key, _, value = item.partition("=")
        for m in world.proxies:
            m.options[key] = value
    failed = True
    try:
        world.start_all()
        load = Load(world, args.clients, seed, args.new_share, args.pause)
        faults = Faults(world, kinds, random.Random(seed + 1), load)
        t0 = time.time()
        load.start()
        faults.start()
        next_note = time.monotonic() + 15
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            time.sleep(0.5)
            if time.monotonic() >= next_note:
                next_note += 15
                with load.lock:
                    n, c = len(load.outcomes), len(load.convs)
                print(f"  {time.time() - t0:5.0f} s: {n} requests, {c} conversations, {len(faults.log)} faults",
                      flush=True)
        faults.join()
        load.join()
        ran = time.time() - t0

        # config restored everywhere, then the final restart: kill -9 all, start all, settle
        for i in range(len(world.proxies)):
            world.proxies[i].write_config(world.config(world.current[i]))
        if world.redis is not None and (world.redis.proc is None or world.redis.proc.poll() is not None):
            world.redis.start()
        world.kill_all()
        world.start_all()
        deadline = time.monotonic() + 30
        while not world.settled() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.5)                      # the restored configs are taken within 1 s

        convs = {s: c for s, c in load.convs.items() if s not in load.abandoned}
        stored = asyncio.run(read_pins(world.store_url, sorted(convs)))

        # the sweep: one more continuation of every conversation, through the restarted proxies
        sweep: list[Outcome] = []
        todo = sorted(convs)
        sweep_lock = threading.Lock()

        def sweeper(n: int) -> None:
            r = random.Random(seed + 7 + n)
            for s in todo[n::4]:
                o = load.one(r, "sweep", s, convs[s].shape, i=n % len(world.proxies))
                if o is not None:
                    with sweep_lock:
                        sweep.append(o)
        threads = [threading.Thread(target=sweeper, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        world.kill_all(signal.SIGTERM)
        time.sleep(0.2)

        summary = summarize(args, seed, ran, world, load, faults, convs, stored, sweep)
        failed = summary["failed"]
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1, default=str) + "\n")
        return 1 if failed else 0
    finally:
        for i, m in enumerate(world.proxies):
            if m.alive:
                m.stop(signal.SIGKILL)
            with open(tmp / f"router{i}.log", "w") as fh:
                fh.write(m.output)
        for f in world.fakes.values():
            f.stop()
        for r in [world.redis, *world.old_redis]:
            if r is not None:
                r.kill()
        if args.keep or failed:
            print(f"kept: {tmp} (router<i>.log: each proxy's output; store/)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def summarize(args: argparse.Namespace, seed: int, ran: float, world: World, load: Load, faults: Faults,
              convs: dict[str, Conv], stored: dict[str, pins.Pin | None], sweep: list[Outcome]) -> dict[str, Any]:
    log = faults.log
    outs = list(load.outcomes)
    openings = [o for o in outs if o.kind == "opening"]
    conts = [o for o in outs if o.kind == "continuation"]

    given_up = dict(load.abandoned)
    kept = convs                                         # what the final checks are about
    convs = {**convs, **{s: load.convs[s] for s in given_up}}

    def classify(o: Outcome) -> str:
        conv = convs.get(o.session)
        if o.session in given_up and o.kind != "opening" and o.t >= given_up[o.session][0]:
            return "abandoned"          # sent after the operator gave it up (the load was paused then)
        if o.status is None:
            return "cut"
        if o.status == 200:
            if conv is None or o.server == conv.server:
                return "ok"
            return "misrouted"
        return "refused" if o.refusal else "other"

    cont_class = collections.Counter(classify(o) for o in conts)
    sweep_class = collections.Counter(classify(o) for o in sweep)
    open_class = collections.Counter("ok" if o.status == 200 else classify(o) for o in openings)
    misrouted = [o for o in conts + sweep if classify(o) == "misrouted"]
    others = [o for o in conts + sweep + openings if classify(o) == "other"]

    # refusals and cuts per fault kind (the fault whose window the request began in)
    per_fault: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    reasons: collections.Counter[str] = collections.Counter()
    for o in outs:
        c = classify(o) if o.kind != "opening" or o.status != 200 else "ok"
        if c in ("refused", "cut", "other"):
            per_fault[fault_at(log, o.t + o.took)][f"{o.kind} {c}"] += 1
        if c == "refused":
            reasons[f"{o.status} {o.reason or '?'}"] += 1

    # what the fakes received: continuations of a conversation at another server; keys
    server_side: list[tuple[str, str, str]] = []
    leaked: list[tuple[str, str, str]] = []
    received = 0
    for name, fake in world.fakes.items():
        for rec in fake.received():
            received += 1
            raw = rec.raw()
            for key, owner in OWNER.items():
                if owner != name and key.encode() in raw:
                    leaked.append((name, owner, rec.path))
            s = session_of(rec)
            conv = convs.get(s) if s else None
            if s in given_up and rec.at >= given_up[s][1]:
                continue                # after the operator gave it up: decided afresh
            if conv is not None and conv.server != name and has_history(rec):
                server_side.append((s, conv.server, name))
    in_output = [(i, owner) for i, m in enumerate(world.proxies) for key, owner in OWNER.items() if key in m.output]

    lost, origin_unpinned = [], 0
    for s, conv in kept.items():
        pin = stored.get(s)
        if pin is not None and pin.server == conv.server:
            continue
        if conv.server == ORIGIN[conv.shape] and (pin is None or pin.server is None):
            origin_unpinned += 1
            continue
        lost.append((s, conv.server, None if pin is None else (pin.server or "not routed"), conv.proxy,
                     f"opened {utc(conv.at)}", f"during {fault_at(log, conv.at)}"))

    by_kind = collections.Counter(f.kind for f in log)
    settle = collections.defaultdict(list)
    for f in log:
        if f.settled is not None:
            settle[f.kind].append(f.settled - f.start)
    print()
    print(f"fault soak: {ran:.0f} s, {args.proxies} prox{'y' if args.proxies == 1 else 'ies'}, store {args.store}, "
          f"{args.clients} clients, shapes {args.shapes}, seed {seed}")
    print(f"faults injected: {len(log)}  " + ", ".join(f"{k} {n}" for k, n in sorted(by_kind.items())))
    if faults.skipped:
        print("  skipped (nothing to act on): " + ", ".join(f"{k} {n}" for k, n in sorted(faults.skipped.items())))
    if faults.errors:
        print(f"  faults that failed to inject: {len(faults.errors)}: {faults.errors[:3]}")
    print("  settle s (median/max): " + ", ".join(
        f"{k} {statistics.median(v):.1f}/{max(v):.1f}" for k, v in sorted(settle.items())))
    if faults.unsettled:
        print(f"  not settled within 20 s: {len(faults.unsettled)}: "
              + ", ".join(f"{f.kind}@{f.start:.1f}" for f in faults.unsettled[:5]))
    if faults.config_unapplied:
        print(f"  config edits a proxy did not show within 3 s: {dict(faults.config_unapplied)}")
    print(f"requests: {len(outs) + len(sweep)} ({received} received by the fake servers)")
    print(f"openings: {len(openings)} sent, {len(convs)} acknowledged (pins written), "
          + ", ".join(f"{k} {n}" for k, n in sorted(open_class.items()) if k != "ok"))
    print("continuations: " + ", ".join(f"{k} {cont_class.get(k, 0)}" for k in ("ok", "refused", "misrouted", "cut", "other")))
    print("sweep after the final kill -9 and restart: "
          + ", ".join(f"{k} {sweep_class.get(k, 0)}" for k in ("ok", "refused", "misrouted", "cut", "other")))
    print(f"pins lost: {len(lost)}   (origin conversations without a routed pin, not lost: {origin_unpinned})")
    if faults.losses:
        print(f"loss faults: {len(faults.losses)}; refused meanwhile: "
              f"{sum(n for k, c in per_fault.items() if k in LOSS_FAULTS for x, n in c.items() if 'refused' in x)}; "
              f"conversations the operator gave up (opened after the backup): "
              f"{sum(x['abandoned'] for x in faults.losses)}; continuations sent after: {cont_class.get('abandoned', 0)}")
    print(f"misrouted (client saw another server): {len(misrouted)}; at the servers (continuations "
          f"received by another server): {len(server_side)}")
    print(f"keys leaked: {len(leaked)} to fake servers, {len(in_output)} in proxy output")
    print("refusals by reason: " + (", ".join(f"{k} {n}" for k, n in reasons.most_common()) or "none"))
    print("refused / cut / other per fault kind (answered during its window):")
    for k in sorted(per_fault, key=lambda k: (k == "none", k)):
        print(f"  {k:18s} " + ", ".join(f"{x} {n}" for x, n in sorted(per_fault[k].items())))
    killing = ("kill9", "damage-at-start", "delete-wal+kill9", "delete-db+kill9", "file-emptied-while-stopped",
               "store-copy-under-load")
    odd_cuts = [(o.session, o.kind, o.proxy, fault_at(log, o.t + o.took), utc(o.t), f"took {o.took:.1f} s", o.error)
                for o in outs if o.status is None and fault_at(log, o.t + o.took) not in killing]
    print(f"cut requests outside a kill's window: {len(odd_cuts)}")
    for title, rows in (("CUT OUTSIDE A KILL", odd_cuts), ("MISROUTED", [(o.session, convs[o.session].server, o.server, o.proxy, o.kind,
                                        fault_at(log, o.t + o.took), utc(o.t)) for o in misrouted]),
                        ("MISROUTED AT THE SERVERS", server_side), ("LOST", lost), ("LEAKED", leaked + in_output),
                        ("OTHER ANSWERS", [(o.session, o.kind, o.status, o.proxy, o.text[:160]) for o in others])):
        if rows:
            print(f"{title} (first 10 of {len(rows)}):")
            for row in rows[:10]:
                print("   ", row)
    if misrouted or lost or server_side:
        print("fault timeline (UTC start, kind, detail, settle s):")
        for f in log:
            print(f"   {utc(f.start)} {f.kind} {f.detail} {(f.settled or f.start) - f.start:.1f}")
    failed = bool(misrouted or server_side or lost or leaked or in_output)
    print("RESULT: " + ("FAIL" if failed else "ok: nothing misrouted, no pin lost, no key leaked"))
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "python": sys.version.split()[0],
        "seconds": round(ran), "proxies": args.proxies, "store": args.store, "clients": args.clients,
        "shapes": args.shapes, "seed": seed, "faults": dict(by_kind), "faults_total": len(log),
        "unsettled": len(faults.unsettled), "requests": len(outs) + len(sweep), "openings_sent": len(openings),
        "pins_written": len(convs), "continuations": dict(cont_class), "sweep": dict(sweep_class),
        "misrouted": len(misrouted), "misrouted_at_servers": len(server_side), "lost": len(lost),
        "origin_unpinned": origin_unpinned, "leaked": len(leaked) + len(in_output),
        "refusals_by_reason": dict(reasons), "per_fault": {k: dict(v) for k, v in per_fault.items()},
        "losses": faults.losses, "abandoned": len(given_up),
        "odd_cuts": odd_cuts[:50], "lost_rows": lost[:50], "misrouted_rows": [(o.session, o.server, o.proxy, o.kind, o.t, fault_at(log, o.t + o.took))
                           for o in misrouted][:50],
        "failed": failed,
    }


if __name__ == "__main__":
    sys.exit(main())
