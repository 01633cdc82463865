#!/usr/bin/env python3
"""What flushing activity every 0.5 s (issue 19: a kill -9 loses at most a second of request
counts) costs the request path, against an earlier commit that flushed every 5 s.

    .venv/bin/python scripts/bench_activity_flush.py --old REV [--sessions 200] [--turns 300] [--seconds 3]

Both routers run in one run (``bench_request_path.Version``: a real mitmdump each, its own
file store, a local TLS upstream). Each pins ``--sessions`` conversations, then:

latency     ``--turns`` continuation turns, one at a time, spread over the sessions (each
            flush writes one activity record per session seen since the last), the two
            routers taking turns request by request: median and p95 of each.
throughput  4 keep-alive clients send turns back to back for ``--seconds``, one router then
            the other, twice: requests per second of each (the better of its two phases).

The ratios (this checkout / old) are what to compare: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_request_path import Version, body, headers  # noqa: E402
from e2e.harness import FakeServer, TestCA  # noqa: E402


def rate(v: Version, sessions: list[str], seconds: float, clients: int = 4) -> float:
    done = [0] * clients
    until = time.monotonic() + seconds

    def run(k: int) -> None:
        with v.client().connect(v.origin.origin) as conn:
            i = k
            while time.monotonic() < until:
                s = sessions[i % len(sessions)]
                r = conn.request("POST", "/v1/messages?beta=true", headers(s), body("continuation", s))
                assert r.status == 200, r.status
                done[k] += 1
                i += clients
    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the git revision to compare with (its flush every 5 s)")
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        old = tmp / "old-tree"
        old.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.old], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
        ca = TestCA(tmp / "ca")
        fakes = [FakeServer(n, ca) for n in ("up", "anthropic")]
        for f in fakes:
            f.start()
        versions = [Version("this checkout", ROOT, tmp, ca, *fakes), Version(f"old {args.old}", old, tmp, ca, *fakes)]
        try:
            for v in versions:
                v.mitm.start()
            sessions = [str(uuid.uuid4()) for _ in range(args.sessions)]
            for v in versions:
                for s in sessions:
                    assert v.send("opening", s)[0] == 200
            lat: dict[str, list[float]] = {v.name: [] for v in versions}
            for i in range(args.turns):
                for v in versions:
                    status, t = v.send("continuation", sessions[i % len(sessions)])
                    assert status == 200
                    lat[v.name].append(t)
            rates: dict[str, list[float]] = {v.name: [] for v in versions}
            for _ in range(2):
                for v in versions:
                    rates[v.name].append(rate(v, sessions, args.seconds))
            for v in versions:
                xs = sorted(lat[v.name])
                print(f"{v.name:>24}: latency median {statistics.median(xs) * 1000:.1f} ms, "
                      f"p95 {xs[int(len(xs) * 0.95)] * 1000:.1f} ms; throughput {max(rates[v.name]):.0f} req/s "
                      f"(phases: {', '.join(f'{r:.0f}' for r in rates[v.name])})")
            new, old_v = versions
            print(f"ratio this/old: latency {statistics.median(lat[new.name]) / statistics.median(lat[old_v.name]):.3f}, "
                  f"throughput {max(rates[new.name]) / max(rates[old_v.name]):.3f}")
        finally:
            for v in versions:
                v.mitm.stop()
            for f in fakes:
                f.stop()


if __name__ == "__main__":
    main()
