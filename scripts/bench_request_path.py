#!/usr/bin/env python3
"""What the request path's store costs a turn: a write lock held by another process, and scrapers.

    .venv/bin/python scripts/bench_request_path.py [--old REV] [--pins 100000] [--turns 30]

Two measures of issue 9, for this checkout and (``--old``) for an earlier commit, in one run,
each through a real mitmdump with the router, a file store and a local TLS upstream:

lock    A pinned conversation's turn, timed unlocked, then while another process holds the
        store's write lock (``BEGIN IMMEDIATE``) for 5 s. Then, the lock held again, a new
        conversation is sent twice (its first try and the client's retry): was it forwarded
        before its pin was durable? The proxy is killed (-9) and restarted: does its next turn
        follow a pin?
scrape  With ``--pins`` pins in the store, new conversations' openings timed with no scraper,
        then while two threads fetch ``/__sessionpin/status`` and ``/__sessionpin/metrics``
        back to back.

Every figure is a median over ``--turns`` requests; the ratios (locked/unlocked, with/without
scrapers) are what to compare: this machine is shared and noisy. ``--old`` unpacks that commit
(``git archive``) into a temporary directory and runs its ``addons/route.py`` the same way.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from e2e.harness import Client, FakeServer, Mitmdump, StoreLock, TestCA, toml_config  # noqa: E402

KEY_ENV = "SESSIONPIN_BENCH_KEY"
UPSTREAM_KEY = "bench-upstream-key-" + uuid.uuid4().hex[:8]
CLIENT_KEY = "sk-ant-bench-client-" + uuid.uuid4().hex[:8]
LOCK_SECONDS = 5.0

# A router script that imports sessionpin from a given tree first (the old commit's).
SHIM = """import sys
sys.path.insert(0, {root!r})
try:
    from sessionpin.proxy import make_addons
except ImportError:             # before issue 9: one addon class
    from sessionpin.addon import make_addons
addons = make_addons()
"""

# Fill a store with pins using that tree's own API (the store formats differ).
FILL = """import sys, time, asyncio
sys.path.insert(0, sys.argv[1])
url, n = sys.argv[2], int(sys.argv[3])
from sessionpin.records import pins
from sessionpin.store import open_store
now = time.time()
def pin(i):
    return pins.Pin(agent="claude-code", server="up", since=now, renewed=now, rule="opening", turn="opening")
try:
    from sessionpin.store.base import Set
    async def main():
        store = open_store(url)
        for start in range(0, n, 1000):
            writes = []
            for i in range(start, min(n, start + 1000)):
                s = f"fill-{i:07d}"
                writes += [Set(pins.key(s), pins.encode(pin(i)), pins.PIN_TTL), *pins.index_writes(s, pin(i))]
            await store.apply([], writes)
        await store.close()
    asyncio.run(main())
except ImportError:                 # the old, synchronous store
    store = open_store(url)
    for i in range(n):
        pins.put(store, f"fill-{i:07d}", pin(i))
    store.close()
"""


def body(kind: str, session: str) -> bytes:
    messages: list[dict] = [{"role": "user", "content": "Fix the failing test. " + "x" * 8000}]
    if kind == "continuation":
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                                "input": {"command": "pytest"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]},
        ]
    tools = [{"name": "Bash", "description": "Run a command.",
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    return json.dumps({"model": "claude-opus-4-5", "messages": messages, "tools": tools, "max_tokens": 1024,
                       "metadata": {"user_id": json.dumps({"session_id": session})}}).encode()


def headers(session: str) -> list[tuple[str, str]]:
    return [("Content-Type", "application/json"), ("User-Agent", "claude-cli/2.1.332 (external, cli)"),
            ("anthropic-version", "2023-06-01"), ("x-api-key", CLIENT_KEY),
            ("X-Claude-Code-Session-Id", session), ("x-claude-code-request-class", "main")]


class Version:
    """One router (this checkout or an old tree) with its own store, upstream and origin."""

    def __init__(self, name: str, tree: Path, tmp: Path, ca: TestCA, upstream: FakeServer, origin: FakeServer) -> None:
        self.name, self.tree, self.upstream, self.origin = name, tree, upstream, origin
        config = toml_config(
            {"anthropic": {"url": origin.url},
             "up": {"url": upstream.url, "key_env": KEY_ENV, "models": {"claude-opus-*": "glm-4.6"}}},
            {"claude-code": "up"})
        self.mitm = Mitmdump.router(tmp / name, ca, config, env={KEY_ENV: UPSTREAM_KEY})
        if tree != ROOT:
            shim = tmp / f"{name}-route.py"
            shim.write_text(SHIM.format(root=str(tree)))
            self.mitm.script = shim
        self.db = Path(self.mitm.options["sessionpin_store"].removeprefix("file:"))

    def client(self) -> Client:
        return Client.via_proxy(self.mitm.port, self.mitm.mitm_ca, timeout=60)

    def send(self, kind: str, session: str) -> tuple[int, float]:
        t0 = time.perf_counter()
        r = self.client().request("POST", self.origin.origin + "/v1/messages?beta=true", headers(session),
                                  body(kind, session))
        return r.status, time.perf_counter() - t0

    def upstream_saw(self, session: str) -> int:
        return sum(1 for r in self.upstream.received() if r.header("x-claude-code-session-id") == session)

    def fill(self, n: int) -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", FILL, str(self.tree), f"file:{self.db}", str(n)], check=True)
        return time.perf_counter() - t0


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:.1f}"


def lock_bench(v: Version, turns: int) -> dict[str, object]:
    pinned = str(uuid.uuid4())
    status, _ = v.send("opening", pinned)
    assert status == 200, status
    unlocked = [v.send("continuation", pinned)[1] for _ in range(turns)]
    locked: list[float] = []
    with StoreLock(v.db, LOCK_SECONDS) as lock:
        while time.monotonic() < lock.until - 0.3:
            s, t = v.send("continuation", pinned)
            if s == 200:
                locked.append(t)
    fresh = str(uuid.uuid4())
    with StoreLock(v.db, 60.0):         # held until both tries are answered
        tries = [v.send("opening", fresh) for _ in range(2)]     # the first try and the client's retry
        statuses = [s for s, _ in tries]
        forwarded = v.upstream_saw(fresh)
    v.mitm.restart(sig=signal.SIGKILL)
    v.send("continuation", fresh)
    after = v.upstream_saw(fresh) - forwarded
    return {"unlocked_ms": ms(unlocked), "locked_ms": ms(locked) if locked else "-",
            "locked_max_ms": f"{max(locked) * 1000:.0f}" if locked else "-",
            "locked_turns": len(locked), "ratio": (statistics.median(locked) / statistics.median(unlocked))
            if locked else float("nan"),
            "opening_tries": statuses, "forwarded_unsaved": forwarded,
            "after_restart": "routed again (pin survived)" if after else "left alone (no pin)"}


def scrape_bench(v: Version, turns: int) -> dict[str, object]:
    quiet = [v.send("opening", str(uuid.uuid4()))[1] for _ in range(turns)]
    stop = threading.Event()
    scrapes: list[float] = []

    def scraper() -> None:
        # a scraper keeps its connection open, as Prometheus does
        with v.client().connect(v.origin.origin) as conn:
            while not stop.is_set():
                for path in ("/__sessionpin/status", "/__sessionpin/metrics"):
                    t0 = time.perf_counter()
                    conn.request("GET", path)
                    scrapes.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=scraper, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    busy = [v.send("opening", str(uuid.uuid4()))[1] for _ in range(turns)]
    stop.set()
    for t in threads:
        t.join(timeout=60)
    return {"quiet_ms": ms(quiet), "scraped_ms": ms(busy),
            "ratio": statistics.median(busy) / statistics.median(quiet),
            "scrape_ms": ms(scrapes) if scrapes else "-", "scrapes": len(scrapes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="also measure this git revision (e.g. c33fb11, before issue 9)")
    ap.add_argument("--pins", type=int, default=100_000, help="pins in the store for the scrape measure")
    ap.add_argument("--turns", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sessionpin-bench-path-") as tmp_:
        tmp = Path(tmp_)
        trees = [("new", ROOT)]
        if args.old:
            old = tmp / "old-tree"
            old.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.old], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
            trees.append((f"old {args.old}", old))
        ca = TestCA(tmp / "ca")
        results: dict[str, dict[str, dict[str, object]]] = {}
        for name, tree in trees:
            upstream = FakeServer("up", ca, prefix="/api/anthropic").start()
            origin = FakeServer("origin", ca).start()
            v = Version(name.split()[0], tree, tmp, ca, upstream, origin)
            try:
                v.mitm.start()
                results[name] = {"lock": lock_bench(v, args.turns)}
            except BaseException:
                print(v.mitm.output[-6000:], file=sys.stderr)
                raise
            try:
                v.mitm.stop()
                took = v.fill(args.pins)
                print(f"{name}: {args.pins} pins written in {took:.1f} s", flush=True)
                v.mitm.start()
                results[name]["scrape"] = scrape_bench(v, args.turns)
            finally:
                v.mitm.stop()
                upstream.stop()
                origin.stop()

        print(f"\nlock: a pinned turn, unlocked and while another process holds the write lock {LOCK_SECONDS:.0f} s")
        print("| code | unlocked ms | locked ms (max) | locked/unlocked | new conversation: tries | forwarded "
              "before durable | after kill -9 |")
        print("|---|---|---|---|---|---|---|")
        for name, r in results.items():
            x = r["lock"]
            print(f"| {name} | {x['unlocked_ms']} | {x['locked_ms']} ({x['locked_max_ms']}) | {x['ratio']:.2f} | "
                  f"{x['opening_tries']} | {x['forwarded_unsaved']} | {x['after_restart']} |")
        print(f"\nscrape: a new conversation's opening with {args.pins} pins, without and with two scrapers")
        print("| code | quiet ms | with scrapers ms | ratio | one scrape ms (n) |")
        print("|---|---|---|---|---|")
        for name, r in results.items():
            x = r["scrape"]
            print(f"| {name} | {x['quiet_ms']} | {x['scraped_ms']} | {x['ratio']:.2f} | {x['scrape_ms']} "
                  f"({x['scrapes']}) |")


if __name__ == "__main__":
    main()
