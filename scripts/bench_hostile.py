#!/usr/bin/env python3
"""What a hostile socket or an abandoned request costs the proxy (issue 20): peak memory and the
worst stall of another client.

    .venv/bin/python scripts/bench_hostile.py [--old REV] [--bomb-mb 256] [--plain-bomb-mb 16] [--long-mb 300]
                                              [--abandon 3000] [--repeat 1] [--no-plain] [SCENARIO ...]

Each scenario runs against a fresh real mitmdump with the router (this checkout, and with
``--old`` an earlier commit unpacked by ``git archive``), a routed Codex WebSocket to a local
TLS fake (tests/e2e/wsfake.py, permessage-deflate both ways), and another client sending a
small request through the proxy every 20 ms on its own keep-alive connection. ``bomb-*`` and
``long`` also run through ``plain`` mitmdump (no addon; ``connection_strategy=lazy`` and
``stream_large_bodies=64m`` as sessionpin sets them), relaying the same socket to the same fake
unrouted: what mitmproxy itself costs. Plain mitmdump has no message limit (a 256 MiB bomb
costs it what the router cost before issue 20: seconds and over a GB), so its bomb is
``--plain-bomb-mb`` (default 16, sessionpin's ``sessionpin_ws_max_message_mb``): the inflating
the router does before it closes the socket, which plain mitmdump then relays (deflated again).
With ``--repeat N`` every scenario runs N times, the versions' order turned by one each time,
and a table of the medians follows.

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
import collections
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
PLAIN_OPTIONS = {"connection_strategy": "lazy", "stream_large_bodies": "64m"}
PLAIN_SCENARIOS = ("bomb-client", "bomb-server", "long")
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


def run(name: str, tree: Path | None, scenario: str, args: argparse.Namespace, tmp: Path, ca: TestCA,
        fakes: dict) -> dict:
    work = tmp / f"{name}-{scenario}-{time.monotonic_ns()}".replace(" ", "-")
    config = toml_config({"openai": {"url": fakes["openai"].origin},
                          "alt": {"url": fakes["alt"].origin, "key_env": KEY_ENV}}, {"codex": "alt"})
    reverse = free_port()
    modes = ["regular", f"reverse:{fakes['openai'].origin}@{reverse}"]
    plain = tree is None
    if plain:       # no addon: the socket goes to the fake it addresses, unrouted
        mitm = Mitmdump(work, script=None, modes=modes,
                        options={"ssl_verify_upstream_trusted_ca": str(ca.pem), **PLAIN_OPTIONS})
    else:
        mitm = Mitmdump.router(work, ca, config, env={KEY_ENV: "bench-key"}, modes=modes)
    bomb_mb = args.plain_bomb_mb if plain else args.bomb_mb
    if tree is not None and tree != ROOT:
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
        frame = deflate_frame(bomb_mb << 20, masked=True) if scenario.startswith("bomb") else b""
        other = Other(port, mitm.mitm_ca, fakes["other"])
        time.sleep(1.5)
        out["rss_before_mb"] = status_kb(pid, "VmRSS") // 1024
        t0 = time.perf_counter()
        m0 = time.monotonic()
        if scenario == "bomb-client":
            ws.send_raw(frame)
            if plain:   # relayed whole: the fake answers its spaces with an error message
                ws.read_until(lambda e: e.get("type") == "error", timeout=60)
            else:
                ws.wait_closed(30)
            out["close_code"] = ws.close_code
        elif scenario == "bomb-server":
            # the router closes the socket; plain mitmdump relays the spaces (not JSON: a ValueError here)
            ws.send(json.dumps({"type": "test.bomb", "size": bomb_mb << 20}))
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
        if scenario.startswith("bomb"):
            out["bomb_mb"] = bomb_mb
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
    ap.add_argument("--plain-bomb-mb", type=int, default=16,
                    help="plain mitmdump's bomb (it has no limit; 16: what the router inflates before it closes)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each scenario (a table of the medians follows)")
    ap.add_argument("--no-plain", action="store_true", help="leave plain mitmdump out")
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
        if not args.no_plain:
            trees.append(("plain", None))
        ca = TestCA(tmp / "ca")
        fakes = {"openai": WsFake("openai", ca).start(), "alt": WsFake("alt", ca).start(),
                 "other": FakeServer("other", ca).start()}
        got: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
        loads = [loadavg()]
        try:
            for rnd in range(args.repeat):
                for scenario in args.scenarios:
                    these = [(n, t) for n, t in trees if t is not None or scenario in PLAIN_SCENARIOS]
                    k = rnd % len(these)
                    for name, tree in these[k:] + these[:k]:
                        one = run(name, tree, scenario, args, tmp, ca, fakes)
                        got[(scenario, name)].append(one)
                        print(json.dumps({"scenario": scenario, "version": name, **one, "load": loadavg()}), flush=True)
                loads.append(loadavg())
        finally:
            for f in fakes.values():
                f.stop()
        print(f"\nload average (1, 5, 15 min) at the start and after each round: {' | '.join(loads)}")
        table(got)


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def table(got: dict[tuple[str, str], list[dict]]) -> None:
    """Medians per scenario and version; ``minus plain``: the other client's worst less plain mitmdump's."""
    def med(xs: list[dict], key: str) -> float | None:
        vals = [x[key] for x in xs if x.get(key) is not None]
        return statistics.median(vals) if vals else None

    print("| scenario | version | n | bomb MiB | seconds | RSS before -> peak -> after MB | other client worst ms "
          "(median of n) | range | its median ms | minus plain ms | close |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (scenario, name), xs in got.items():
        worst = med(xs, "other_worst_ms")
        base = med(got.get((scenario, "plain"), []), "other_worst_ms")
        share = "-" if name == "plain" or base is None or worst is None else f"{worst - base:+.0f}"
        ws = [x["other_worst_ms"] for x in xs if x.get("other_worst_ms") is not None]
        rss = " -> ".join(f"{med(xs, k):.0f}" for k in ("rss_before_mb", "peak_mb", "rss_after_mb"))
        print(f"| {scenario} | {name} | {len(xs)} | {xs[0].get('bomb_mb', '-')} | {med(xs, 'seconds'):.1f} | {rss} | "
              f"{worst:.0f} | {min(ws):.0f}-{max(ws):.0f} | {med(xs, 'other_median_ms'):.1f} | {share} | "
              f"{sorted({str(x.get('close_code', '-')) for x in xs})} |")


if __name__ == "__main__":
    main()
