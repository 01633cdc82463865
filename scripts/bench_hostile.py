#!/usr/bin/env python3
"""What a hostile socket or an abandoned request costs the proxy (issue 20): peak memory and the
worst stall of another client.

    .venv/bin/python scripts/bench_hostile.py [--old REV] [--bomb-mb 256] [--long-mb 300] [--abandon 3000]
                                              [SCENARIO ...]

Each scenario runs against a fresh real mitmdump with the router (this checkout, and with
``--old`` an earlier commit unpacked by ``git archive``), a routed Codex WebSocket to a local
TLS fake (tests/e2e/wsfake.py, permessage-deflate both ways), and another client sending a
small request through the proxy every 20 ms on its own keep-alive connection:

bomb-client  Codex's side sends one compressed frame inflating to ``--bomb-mb`` MiB of spaces.
bomb-server  the server's side does.
long         the server streams ``--long-mb`` MB over one socket (100 KB messages), then the socket
             closes.
abandon      ``--abandon`` requests with a Content-Length over the body limit whose client goes away
             after 100 bytes (reverse mode), then 2 s of quiet.

Reported per scenario: the proxy's RSS before, its peak (VmHWM) and after (after the socket
closed: ``long``), and the other client's worst and median request time while it ran.
"""

from __future__ import annotations

import argparse
import json
import socket
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

from e2e.harness import Client, FakeServer, Mitmdump, TestCA, free_port, toml_config  # noqa: E402
from e2e.replay import Replay, load  # noqa: E402
from e2e.wsfake import LOOPBACK, WsClient, WsFake, deflate_frame  # noqa: E402

KEY_ENV = "SESSIONPIN_BENCH_ALT_KEY"
SHIM = """import sys
sys.path.insert(0, {root!r})
from sessionpin.proxy import make_addons
addons = make_addons()
"""


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


OTHER = """import sys, json, time
sys.path.insert(0, sys.argv[1])
from e2e.harness import Client
port, ca, origin = int(sys.argv[2]), sys.argv[3], sys.argv[4]
conn = Client.via_proxy(port, ca, timeout=60).connect(origin)
while True:
    t0 = time.monotonic()
    try:
        conn.request("GET", "/ping")
    except OSError:
        conn = Client.via_proxy(port, ca, timeout=60).connect(origin)
        continue
    print(json.dumps([t0, time.monotonic() - t0]), flush=True)
    time.sleep(0.02)
"""


class Other:
    """Another client, in a process of its own (the bench's own work must not stall it): a small
    request every 20 ms through the proxy, each timed."""

    def __init__(self, port: int, ca: Path, fake: FakeServer) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", OTHER, str(ROOT / "tests"), str(port), str(ca),
                                      fake.origin], stdout=subprocess.PIPE, text=True)
        self.times: list[tuple[float, float]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.times.append(tuple(json.loads(line)))

    def between(self, t0: float, t1: float) -> list[float]:
        """Request times of the requests under way between t0 and t1 (monotonic)."""
        return [d for start, d in list(self.times) if start + d >= t0 and start <= t1]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(5)


def run(name: str, tree: Path, scenario: str, args: argparse.Namespace, tmp: Path, ca: TestCA,
        fakes: dict) -> dict:
    work = tmp / f"{name}-{scenario}".replace(" ", "-")
    config = toml_config({"openai": {"url": fakes["openai"].origin},
                          "alt": {"url": fakes["alt"].origin, "key_env": KEY_ENV}}, {"codex": "alt"})
    reverse = free_port()
    mitm = Mitmdump.router(work, ca, config, env={KEY_ENV: "bench-key"},
                           modes=["regular", f"reverse:{fakes['openai'].origin}@{reverse}"])
    if tree != ROOT:
        shim = work / "route.py"
        shim.write_text(SHIM.format(root=str(tree)))
        mitm.script = shim
    mitm.start()
    [port] = set(mitm.ports) - {reverse}
    pid = mitm.proc.pid
    other = None
    out: dict = {}
    try:
        r = Replay(uuid.uuid4().hex[:8])
        p = r.prepare(next(x for x in load("codex", "websocket") if x.nn == 1))
        ws = None
        if scenario != "abandon":
            ws = WsClient.via_proxy(port, mitm.mitm_ca, LOOPBACK, fakes["openai"].port, p.path, p.headers,
                                    timeout=120)
            ws.turn(json.dumps({"type": "response.create", "model": "gpt-6.2-sol", "input": []}))
        frame = deflate_frame(args.bomb_mb << 20, masked=True) if scenario.startswith("bomb") else b""
        other = Other(port, mitm.mitm_ca, fakes["other"])
        time.sleep(1.5)
        out["rss_before_mb"] = status_kb(pid, "VmRSS") // 1024
        t0 = time.perf_counter()
        m0 = time.monotonic()
        if scenario == "bomb-client":
            ws.send_raw(frame)
            ws.wait_closed(30)
            out["close_code"] = ws.close_code
        elif scenario == "bomb-server":
            ws.send(json.dumps({"type": "test.bomb", "size": args.bomb_mb << 20}))
            try:
                ws.read_until(lambda e: False, timeout=30)
            except (TimeoutError, ValueError, MemoryError):
                pass
            out["close_code"] = ws.close_code
        elif scenario == "long":
            count = args.long_mb * 10
            ws.send(json.dumps({"type": "test.stream", "count": count, "size": 100_000}))
            ws.read_until(lambda e: e.get("type") == "response.completed", timeout=600)
            out["rss_end_of_stream_mb"] = status_kb(pid, "VmRSS") // 1024
            ws.received.clear()
        elif scenario == "abandon":
            for _ in range(args.abandon):
                s = socket.create_connection((LOOPBACK, reverse))
                s.sendall(b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 999999999\r\n\r\n" + b"x" * 100)
                s.close()
        out["seconds"] = round(time.perf_counter() - t0, 1)
        if ws is not None:
            ws.close()
        time.sleep(2.0)
        stalls = other.between(m0, time.monotonic())
        out["peak_mb"] = status_kb(pid, "VmHWM") // 1024
        out["rss_after_mb"] = status_kb(pid, "VmRSS") // 1024
        out["other_worst_ms"] = round(max(stalls) * 1000, 1) if stalls else None
        out["other_median_ms"] = round(statistics.median(stalls) * 1000, 1) if stalls else None
        out["other_requests"] = len(stalls)
    finally:
        if other is not None:
            other.stop()
        mitm.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="also measure this git revision (e.g. 62321f7, before issue 20)")
    ap.add_argument("--bomb-mb", type=int, default=256)
    ap.add_argument("--long-mb", type=int, default=300)
    ap.add_argument("--abandon", type=int, default=3000)
    ap.add_argument("scenarios", nargs="*", default=["bomb-client", "bomb-server", "long", "abandon"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sessionpin-bench-hostile-") as tmp_:
        tmp = Path(tmp_)
        trees = [("new", ROOT)]
        if args.old:
            old = tmp / "old-tree"
            old.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.old], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
            trees.append((f"old {args.old}", old))
        ca = TestCA(tmp / "ca")
        fakes = {"openai": WsFake("openai", ca).start(), "alt": WsFake("alt", ca).start(),
                 "other": FakeServer("other", ca).start()}
        try:
            for scenario in args.scenarios:
                for name, tree in trees:
                    got = run(name, tree, scenario, args, tmp, ca, fakes)
                    print(json.dumps({"scenario": scenario, "version": name, **got}), flush=True)
        finally:
            for f in fakes.values():
                f.stop()


if __name__ == "__main__":
    main()
