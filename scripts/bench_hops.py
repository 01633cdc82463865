#!/usr/bin/env python3
"""What the store's and the lineage watch's background work costs the proxy's process in CPU,
for this checkout and an earlier commit, in one run (issue 22: a pin read's thread hop, the
activity flush's calls, a lineage read's hop per request).

    .venv/bin/python scripts/bench_hops.py --old REV [--reads 3000] [--flushes 200] [--requests 2000]

Each measure runs in a fresh process of its own per version (the version's tree first on
``PYTHONPATH``; ``--old`` is unpacked with ``git archive``), the versions taking turns
``--rounds`` times; reported: the median process CPU (user + system, all threads) per unit,
and this / old. CPU, not wall time: on a shared machine wall time moves with other
processes' load, a process's own CPU far less (a hop's cost is CPU: a queue, a thread's
wakeup, the GIL passed, the answer's wakeup of the loop).

pin read   ``store.get`` of a pin through the async facade of a file store (``open_store``),
           one at a time on an event loop: the pinned turn's one store read.
flush      ``pins.record_seen`` of 8 sessions' activity (the 8-client bench's flush every
           0.5 s), through the facade.
lineage    the lineage watch's root read of a 10 KB Claude Code request with history
           (``LineageWatch.reads.submit``), 8 at a time every 2 ms (8 clients' turns), all
           answered: per request.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MEASURE = r"""
import asyncio, json, sys, tempfile, time
sys.path.insert(0, sys.argv[1] + "/scripts")
from sessionpin.records import pins
from sessionpin.store import open_store
from sessionpin.proxy.lineagewatch import LineageWatch, _root
from bench_proxy import body

what, n = sys.argv[2], int(sys.argv[3])

async def main():
    with tempfile.TemporaryDirectory() as d:
        store = open_store(f"file:{d}/state.db")
        try:
            await store.set("pin:s", '{"agent":"claude-code","server":"glm","since":1,"renewed":1}', 3600)
            for _ in range(50):                       # warm: threads, connections, pages
                await store.get("pin:s")
            await pins.record_seen(store, [("s", "claude-code", "glm", time.time(), 1)])
            await asyncio.sleep(0.1)
            t = time.process_time()
            if what == "read":
                for _ in range(n):
                    await store.get("pin:s")
            elif what == "flush":
                for _ in range(n):
                    await pins.record_seen(store, [(f"s{i}", "claude-code", "glm", time.time(), 1) for i in range(8)])
            else:
                raw = body("continuation", "s", 10_000)
                reads = LineageWatch(None).reads
                futs = []
                for _ in range(n // 8):
                    futs += [reads.submit(len(raw), _root, raw, "anthropic-messages", "") for _ in range(8)]
                    await asyncio.sleep(0.002)
                await asyncio.gather(*[f for f in futs if f is not None])
                reads.close()
            print(json.dumps((time.process_time() - t) / n))
        finally:
            await store.close()

asyncio.run(main())
"""


def run(tree: Path, what: str, n: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(tree), what, str(n)], env=env, cwd=tree,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the git revision to compare with")
    ap.add_argument("--reads", type=int, default=3000)
    ap.add_argument("--flushes", type=int, default=200)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sessionpin-hops-") as tmp:
        old = Path(tmp) / "old"
        old.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.old], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
        print(f"process CPU per unit, median of {args.rounds} rounds (versions taking turns)")
        print(f"{'measure':>10}  {'this checkout':>14}  {'old ' + args.old[:10]:>16}  this/old")
        for what, n, unit in (("read", args.reads, "read"), ("flush", args.flushes, "flush"),
                              ("lineage", args.requests, "request")):
            this, then = [], []
            for _ in range(args.rounds):
                this.append(run(ROOT, what, n))
                then.append(run(old, what, n))
            a, b = statistics.median(this), statistics.median(then)
            print(f"{what:>10}  {a * 1e6:>11.1f} µs  {b * 1e6:>13.1f} µs  {a / b:>8.2f}   (per {unit})")


if __name__ == "__main__":
    main()
