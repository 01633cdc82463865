#!/usr/bin/env python3
"""Does a request cost more when the store holds more pins? An opening and a pinned turn through
the router at 1k, 100k and 1M pins, file store and Redis, in one run.

    .venv/bin/python scripts/bench_scale.py [--sizes 1000,100000,1000000] [--kinds file,redis]
                                            [--turns 40] [--warmup 5] [--dir DIR] [--redis-url redis://HOST:PORT]

One router (mitmdump -s addons/route.py) per kind and size, each on its own store filled by
``scripts/fill_pins.py`` (file stores in DIR, kept there for the next run, so only the first run
pays the fill; Redis stores under a prefix ``{scale-N}:``, each size in a database of its own
(1, 2, 3: a walk of the keyspace, SCAN, then costs what it would on a server holding that store
alone), on the server ``--redis-url redis://HOST:PORT`` names, else on a redis-server of its own
started here with a bounded memory and no persistence).
All routers route to one local TLS upstream. Each step sends, through every router in turn,
the opening of a new conversation (a durable pin write) and a turn of a conversation pinned
before the timing began (a pin read); the routers take turns request by request, in a new
random order each step, so load from other processes on this shared machine falls on every size
alike. Reported per kind: the
median of each, and its ratio to the smallest size's (the goal: within 10 %).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_proxy import body, headers  # noqa: E402
from e2e.harness import Client, FakeServer, Mitmdump, TestCA, toml_config  # noqa: E402

KEY_ENV = "SESSIONPIN_BENCH_KEY"
UPSTREAM_KEY = "bench-upstream-key-" + uuid.uuid4().hex[:8]
BODY_SIZE = 10 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_url(base: str, n: int, db: int) -> str:
    """Each size in a database of its own (1, 2, 3…): what walks a keyspace (SCAN) then walks
    that store's keys only, as on a server holding one store."""
    return (f"{base.rstrip('/')}/{db}?prefix={urllib.parse.quote('{scale-%d}:' % n)}"
            "&durability=accept-weaker")


def filled(url: str, n: int) -> bool:
    """Whether the store already holds the fill (its index counts n live pins)."""
    import asyncio

    from sessionpin.records import pins
    from sessionpin.store import open_store

    async def count() -> int:
        store = open_store(url)
        try:
            return sum(c for c, _ in (await pins.counts(store, time.time())).values())
        finally:
            await store.close()
    return asyncio.run(count()) >= n


def fill(url: str, n: int) -> None:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "scripts" / "fill_pins.py"), "--not-durable", url, str(n)],
                   check=True, stderr=subprocess.DEVNULL)
    print(f"  filled {url} with {n} pins in {time.perf_counter() - t0:.0f} s", flush=True)


class Router:
    def __init__(self, name: str, tmp: Path, ca: TestCA, upstream: FakeServer, origin: FakeServer,
                 store: str) -> None:
        config = toml_config(
            {"anthropic": {"url": origin.url},
             "up": {"url": upstream.url, "key_env": KEY_ENV, "models": {"claude-opus-*": "glm-4.6"}}},
            {"claude-code": "up"})
        self.name, self.origin = name, origin
        self.mitm = Mitmdump.router(tmp / name, ca, config, env={KEY_ENV: UPSTREAM_KEY},
                                    options={"sessionpin_store": store})
        self.conn = None
        self.pinned = str(uuid.uuid4())

    def start(self) -> None:
        self.mitm.start(timeout=600)      # a big file store's first open checks its pages
        self.conn = Client.via_proxy(self.mitm.port, self.mitm.mitm_ca, timeout=60).connect(self.origin.origin)
        self.send("opening", self.pinned)

    def send(self, kind: str, session: str) -> float:
        assert self.conn is not None
        r = self.conn.request("POST", "/v1/messages?beta=true", headers(kind, session),
                              body(kind, session, BODY_SIZE))
        if r.status != 200:
            raise SystemExit(f"{self.name}: {kind} answered {r.status} {r.body[:200]!r}")
        return r.t_done - r.t_sent

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.mitm.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,100000,1000000")
    ap.add_argument("--kinds", default="file,redis")
    ap.add_argument("--turns", type=int, default=40, help="timed openings and pinned turns per router")
    ap.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    ap.add_argument("--dir", type=Path, help="where the file stores are kept between runs (default: a temp dir)")
    ap.add_argument("--redis-url", help="a running Redis (no database number) to fill and use (default: a redis-server of our own)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    with tempfile.TemporaryDirectory(prefix="sessionpin-bench-scale-") as tmp_:
        tmp = Path(tmp_)
        stores = args.dir or tmp / "stores"
        stores.mkdir(parents=True, exist_ok=True)
        redis_proc = None
        base = args.redis_url
        if "redis" in kinds and base is None:
            port = free_port()
            (tmp / "redis").mkdir()
            redis_proc = subprocess.Popen(
                [shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--maxmemory", "3gb", "--maxmemory-policy", "noeviction",
                 "--dir", str(tmp / "redis")], stdout=subprocess.DEVNULL)
            base = f"redis://127.0.0.1:{port}"
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        ca = TestCA(tmp / "ca")
        upstream = FakeServer("up", ca, prefix="/api/anthropic").start()
        origin = FakeServer("origin", ca).start()
        routers: list[Router] = []
        try:
            for kind in kinds:
                for i, n in enumerate(sizes):
                    url = f"file:{stores / f'scale-{n}.db'}" if kind == "file" else redis_url(base, n, i + 1)
                    if not filled(url, n):
                        fill(url, n)
                    routers.append(Router(f"{kind}-{n}", tmp, ca, upstream, origin, url))
            for r in routers:
                t0 = time.perf_counter()
                r.start()
                print(f"  {r.name}: router up in {time.perf_counter() - t0:.1f} s", flush=True)
            for _ in range(args.warmup):     # untimed: connections, caches, the first pin writes
                for r in routers:
                    r.send("opening", str(uuid.uuid4()))
                    r.send("continuation", r.pinned)
            times: dict[tuple[str, str], list[float]] = {}
            order = random.Random(22)
            for _ in range(args.turns):
                order.shuffle(routers)       # no size always first in a step (disk flushes, the upstream)
                for r in routers:
                    times.setdefault((r.name, "opening"), []).append(r.send("opening", str(uuid.uuid4())))
                    times.setdefault((r.name, "pinned"), []).append(r.send("continuation", r.pinned))
        finally:
            for r in routers:
                r.stop()
            upstream.stop()
            origin.stop()
            if redis_proc is not None:
                redis_proc.terminate()
                redis_proc.wait(timeout=10)
    print(f"\nmedian ms over {args.turns} requests each ({BODY_SIZE // 1024} KB bodies); ratio to "
          f"{sizes[0]} pins")
    print("| store | pins | opening ms | ratio | pinned turn ms | ratio |")
    print("|---|---|---|---|---|---|")
    for kind in kinds:
        base_o = statistics.median(times[(f"{kind}-{sizes[0]}", "opening")])
        base_p = statistics.median(times[(f"{kind}-{sizes[0]}", "pinned")])
        for n in sizes:
            o = statistics.median(times[(f"{kind}-{n}", "opening")])
            p = statistics.median(times[(f"{kind}-{n}", "pinned")])
            print(f"| {kind} | {n:,} | {o * 1000:.2f} | {o / base_o:.2f} | {p * 1000:.2f} | {p / base_p:.2f} |")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
