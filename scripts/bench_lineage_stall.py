#!/usr/bin/env python3
"""What one pathological body costs every other client: the worst stall of a probe while it passes.

    .venv/bin/python scripts/bench_lineage_stall.py [--old REV] [--mb 60[,8…]] [--shapes tiny,huge,deep]
                                                    [--repeat 1] [--no-plain] [--lag FILE]

Issue 20 ("no body costs other clients more than ~100 ms"). Through real mitmdumps (local TLS
servers), all started at once and taking turns: ``plain`` mitmdump (no addon; the options
sessionpin sets on mitmproxy, ``connection_strategy=lazy`` and ``stream_large_bodies=64m``;
its client addresses the server itself), the router of this checkout (``new``: file store) and
(``--old``) the router of an earlier commit:

- a probe client sends small GETs to a server through the proxy under test on one keep-alive
  connection, back to back, and records each one's latency (each proxy has its own probe, on
  only while that proxy's body is sent);
- meanwhile one Claude Code continuation of ``--mb`` MiB (the body limit is 64 MiB) is sent:
  to the router ``pinless`` (a session never seen: its lineage — links and root — is read to
  look for a parent) and ``pinned`` (a session pinned by its opening: no lineage is read, only
  the request's facts); to plain mitmdump once (``plain``: relayed, nothing read). Its history
  is one of:
    tiny  a million-odd tiny user messages before the first answer;
    huge  one user message of the whole size before the first answer;
    deep  a first message nested as deep as the size allows (``[[[…]]]``).
- the stall is the probe's worst latency while the body was in flight (from its first byte
  sent to its answer, plus 0.3 s for what runs after it left); the probe's worst over the 1 s
  before each send is that send's ``quiet worst``. ``minus plain`` is a row's worst stall less
  plain mitmdump's for the same body: sessionpin's share.

Each case also gives the peak RSS (VmHWM, reset before each send) of the proxy and of its
children (the body reader's process). ``--lag FILE`` adds ``scripts/lagwatch.py`` to every
proxy (plain mitmdump included): where its event loop was whenever it was late by more than
100 ms, in ``FILE-<code>``.

The machine is shared and noisy: compare the stalls with the quiet worst of the same run.
With ``--repeat N`` every case is sent N times (a new session each), in N rounds whose order of
contenders turns by one each round; the row shows the median of the N worst stalls, and their
range. The load average is printed after each round.
"""

from __future__ import annotations

import argparse
import json
import re
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

import e2e.harness  # noqa: E402
from e2e.harness import Client, FakeServer, Mitmdump, TestCA, toml_config  # noqa: E402


class _QuickJSON:
    """The fake servers' ``json`` (they run in this process, beside the probe and its origin):
    a body of 64 KiB or more is not decoded whole — stdlib ``json.loads`` of two million tiny
    messages holds this process's GIL for seconds, and the probe's stall would be the bench's,
    not the proxy's. Its model and stream are all the fake needs."""

    dumps = staticmethod(json.dumps)

    @staticmethod
    def loads(data):
        head = re.match(rb'\{"model":\s*"([^"]*)"', data) if isinstance(data, (bytes, bytearray)) else None
        if head is not None and len(data) >= 2**16:   # and a deep body would be a RecursionError: a 500
            return {"model": head.group(1).decode(), "stream": True}
        return json.loads(data)


e2e.harness.json = _QuickJSON   # type: ignore[assignment]

KEY_ENV = "SESSIONPIN_BENCH_KEY"
UPSTREAM_KEY = "bench-upstream-key-" + uuid.uuid4().hex[:8]
CLIENT_KEY = "sk-ant-bench-client-" + uuid.uuid4().hex[:8]
AFTER = 0.3           # seconds after the answer still counted: what runs once the request left

SHIM = """import sys
sys.path.insert(0, {root!r})
from sessionpin.proxy import make_addons
addons = make_addons()
"""

HEAD = b'{"model":"claude-opus-4-5","max_tokens":5,"stream":true,"system":[{"type":"text","text":"You are Claude Code."}],"messages":['
TAIL = (b'{"role":"assistant","content":"ok"},{"role":"user","content":"more"}],'
        b'"tools":[{"name":"Bash","input_schema":{"type":"object"}}]}')


def pathological(shape: str, size: int) -> bytes:
    room = size - len(HEAD) - len(TAIL) - 64
    if shape == "tiny":
        one = b'{"role":"user","content":"x"},'
        return HEAD + one * (room // len(one)) + TAIL
    if shape == "huge":
        return HEAD + b'{"role":"user","content":"' + b"y" * room + b'"},' + TAIL
    if shape == "deep":
        d = room // 2
        return HEAD + b'{"role":"user","content":' + b"[" * d + b"]" * d + b"}," + TAIL
    raise ValueError(shape)


def opening(session: str) -> bytes:
    return json.dumps({"model": "claude-opus-4-5", "max_tokens": 5, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}],
                       "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
                       "metadata": {"user_id": json.dumps({"session_id": session})}}).encode()


def headers(session: str) -> list[tuple[str, str]]:
    return [("Content-Type", "application/json"), ("User-Agent", "claude-cli/2.1.332 (external, cli)"),
            ("anthropic-version", "2023-06-01"), ("x-api-key", CLIENT_KEY),
            ("X-Claude-Code-Session-Id", session), ("x-claude-code-request-class", "main")]


def family(pid: int) -> list[int]:
    """The proxy and its children (the body reader's process)."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    return [pid, *map(int, kids)]


def reset_peaks(pid: int) -> None:
    """Start each process's peak RSS (VmHWM) again from its current RSS (Linux: clear_refs 5)."""
    for p in family(pid):
        try:
            Path(f"/proc/{p}/clear_refs").write_text("5")
        except OSError:
            pass


def peaks(pid: int) -> tuple[float, float]:
    """(the proxy's peak RSS, its children's summed) in MB since ``reset_peaks``."""
    out = []
    for p in family(pid):
        try:
            hwm = next(line for line in Path(f"/proc/{p}/status").read_text().splitlines() if line.startswith("VmHWM"))
            out.append(int(hwm.split()[1]) / 1024)
        except (OSError, StopIteration):
            out.append(0.0)
    return out[0], sum(out[1:])


class Probe:
    """Small GETs back to back through the proxy while on; (start, latency) of each."""

    def __init__(self, client: Client, url: str) -> None:
        self.client, self.url = client, url
        self.samples: list[tuple[float, float]] = []
        self.on = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self.client.connect(self.url) as conn:
                    while not self._stop.is_set():
                        if not self.on.wait(0.1):
                            continue
                        t0 = time.perf_counter()
                        conn.request("GET", "/probe")
                        self.samples.append((t0, time.perf_counter() - t0))
                        time.sleep(0.002)
            except OSError:
                time.sleep(0.01)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.on.set()
        self._stop.set()
        self._thread.join(30)

    def worst(self, t0: float, t1: float) -> tuple[float, float, int]:
        """(worst, median, n) latency of the probes that were in flight during [t0, t1]."""
        xs = [lat for start, lat in self.samples if start <= t1 and start + lat >= t0]
        return (max(xs), statistics.median(xs), len(xs)) if xs else (float("nan"), float("nan"), 0)


LAG_SHIM = """
import importlib.util as _u
_spec = _u.spec_from_file_location("lagwatch", {path!r})
_lag = _u.module_from_spec(_spec)
_spec.loader.exec_module(_lag)
addons = addons + _lag.addons
"""

# plain mitmdump is given the options sessionpin sets on mitmproxy (defaults.py, limits.py), so
# that what differs is sessionpin's addons alone
PLAIN_OPTIONS = {"connection_strategy": "lazy", "stream_large_bodies": "64m"}
QUIET = 1.0           # seconds of probing before each send: that send's quiet worst


class Contender:
    """One proxy of the run: plain mitmdump, or the router of a tree; its client and its probe."""

    def __init__(self, name: str, tree: Path | None, tmp: Path, ca: TestCA, origin: FakeServer, up: FakeServer,
                 lag: Path | None) -> None:
        self.name, self.origin, self.up = name, origin, up
        env = {KEY_ENV: UPSTREAM_KEY}
        if lag is not None:
            env["SESSIONPIN_LAGWATCH"] = str(lag.with_name(f"{lag.stem}-{name}{lag.suffix}"))
        if tree is None:      # plain mitmdump: no addon (but lagwatch's, if asked)
            self.mitm = Mitmdump(tmp / name, script=ROOT / "scripts" / "lagwatch.py" if lag else None,
                                 options={"ssl_verify_upstream_trusted_ca": str(ca.pem), **PLAIN_OPTIONS}, env=env)
            self.cases = ("plain",)
        else:
            config = toml_config({"anthropic": {"url": origin.url}, "up": {"url": up.url, "key_env": KEY_ENV}},
                                 {"claude-code": "up"})
            self.mitm = Mitmdump.router(tmp / name, ca, config, env=env)
            if tree != ROOT or lag is not None:
                shim = tmp / f"{name}-route.py"
                text = SHIM.format(root=str(tree))
                if lag is not None:      # where the event loop is when it is late (scripts/lagwatch.py)
                    text += LAG_SHIM.format(path=str(ROOT / "scripts" / "lagwatch.py"))
                shim.write_text(text)
                self.mitm.script = shim
            self.cases = ("pinless", "pinned")
        self.client: Client | None = None
        self.probe: Probe | None = None

    def start(self) -> None:
        self.mitm.start()
        self.client = Client.via_proxy(self.mitm.port, self.mitm.mitm_ca, timeout=120)
        self.probe = Probe(self.client, self.origin.origin).__enter__()

    def stop(self) -> None:
        if self.probe is not None:
            self.probe.__exit__()
        self.mitm.stop()

    def url(self) -> str:
        # the router's clients address Anthropic (the origin); plain mitmdump's address the server itself
        base = self.up.url if self.cases == ("plain",) else self.origin.origin
        return base + "/v1/messages?beta=true"

    def send(self, case: str, body: bytes) -> dict:
        """One send of ``body`` with the probe on; its stall, its quiet worst before it, its peaks."""
        assert self.client is not None and self.probe is not None
        pid = self.mitm.proc.pid
        session = str(uuid.uuid4())
        if case == "pinned":
            r = self.client.request("POST", self.url(), headers(session), opening(session))
            assert r.status == 200, r.status
        self.probe.on.set()
        try:
            q0 = time.perf_counter()
            time.sleep(QUIET)
            reset_peaks(pid)
            at = time.time()
            t0 = time.perf_counter()
            r = self.client.request("POST", self.url(), headers(session), body)
            t1 = time.perf_counter()
            time.sleep(AFTER)
        finally:
            self.probe.on.clear()
        peak, child = peaks(pid)
        return {"worst_ms": self.probe.worst(t0, t1 + AFTER)[0] * 1000, "quiet_ms": self.probe.worst(q0, t0)[0] * 1000,
                "request_s": t1 - t0, "status": r.status, "at": at, "peak_mb": peak, "child_peak_mb": child}


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run(contenders: list[Contender], sizes: list[int], shapes: list[str], repeat: int) -> list[dict]:
    """Every (size, shape): each contender's cases one send each, the order turned by one each round, ``repeat`` rounds."""
    cases = [(c, case) for c in contenders for case in c.cases]
    got: dict[tuple, list[dict]] = {}
    loads = [loadavg()]
    for rnd in range(repeat):
        for size in sizes:
            for shape in shapes:
                body = pathological(shape, size)
                k = rnd % len(cases)
                for c, case in cases[k:] + cases[:k]:
                    one = c.send(case, body)
                    got.setdefault((size, shape, c.name, case), []).append(one)
                    print(f"{time.strftime('%H:%M:%S', time.gmtime(one['at']))} "
                          f"round {rnd + 1}/{repeat} {size / 2**20:g} MiB {shape} {c.name} {case}: "
                          f"{one['worst_ms']:.0f} ms worst probe (quiet {one['quiet_ms']:.0f}; request "
                          f"{one['request_s']:.1f} s, {one['status']}; peak RSS {one['peak_mb']:.0f} MB, "
                          f"children {one['child_peak_mb']:.0f} MB; load {loadavg()})", flush=True)
        loads.append(loadavg())
    print(f"\nload average (1, 5, 15 min) at the start and after each round: {' | '.join(loads)}")
    rows = []
    for (size, shape, name, case), xs in got.items():
        w = [x["worst_ms"] for x in xs]
        rows.append({"mb": size / 2**20, "shape": shape, "code": name, "case": case, "n": len(xs),
                     "worst_ms": statistics.median(w), "min_ms": min(w), "max_ms": max(w),
                     "quiet_ms": statistics.median(x["quiet_ms"] for x in xs),
                     "request_s": statistics.median(x["request_s"] for x in xs),
                     "status": sorted({x["status"] for x in xs}),
                     "peak_mb": max(x["peak_mb"] for x in xs), "child_peak_mb": max(x["child_peak_mb"] for x in xs)})
    return rows


def table(rows: list[dict]) -> None:
    plain = {(r["mb"], r["shape"]): r["worst_ms"] for r in rows if r["case"] == "plain"}
    print("\n| body MiB | history | code | case | status | request s | worst probe ms (median of n) | range "
          "| quiet worst ms | n | minus plain ms | peak RSS MB: proxy (its children) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (-r["mb"], r["shape"], r["case"] != "plain", r["code"], r["case"])):
        base = plain.get((r["mb"], r["shape"]))
        share = "-" if base is None or r["case"] == "plain" else f"{r['worst_ms'] - base:+.0f}"
        print(f"| {r['mb']:g} | {r['shape']} | {r['code']} | {r['case']} | {','.join(map(str, r['status']))} | "
              f"{r['request_s']:.1f} | {r['worst_ms']:.0f} | {r['min_ms']:.0f}-{r['max_ms']:.0f} | "
              f"{r['quiet_ms']:.0f} | {r['n']} | {share} | {r['peak_mb']:.0f} ({r['child_peak_mb']:.0f}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="also measure this git revision (e.g. the commit before issue 20's fix)")
    ap.add_argument("--mb", default="60", help="the body's size in MiB, or several: 45,8 (the limit is 64)")
    ap.add_argument("--shapes", default="tiny,huge,deep")
    ap.add_argument("--repeat", type=int, default=1, help="sends per case (the median worst stall is shown)")
    ap.add_argument("--no-plain", action="store_true", help="leave plain mitmdump out")
    ap.add_argument("--lag", type=Path, help="write where each proxy's event loop was when late to FILE-<code>.txt "
                                             "(scripts/lagwatch.py)")
    args = ap.parse_args()
    sizes = [int(float(x) * 2**20) for x in args.mb.split(",") if x]
    shapes = [s for s in args.shapes.split(",") if s]
    lag = args.lag.resolve() if args.lag else None
    with tempfile.TemporaryDirectory(prefix="sessionpin-bench-stall-") as tmp_:
        tmp = Path(tmp_)
        trees: list[tuple[str, Path | None]] = [] if args.no_plain else [("plain", None)]
        trees.append(("new", ROOT))
        if args.old:
            old = tmp / "old-tree"
            old.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.old], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
            trees.append((f"old-{args.old}", old))
        ca = TestCA(tmp / "ca")
        origin = FakeServer("origin", ca).start()
        up = FakeServer("up", ca, prefix="/api/anthropic").start()
        origin.keep_bodies = up.keep_bodies = False
        contenders = [Contender(name, tree, tmp, ca, origin, up, lag) for name, tree in trees]
        try:
            for c in contenders:
                c.start()
            time.sleep(0.5)
            rows = run(contenders, sizes, shapes, args.repeat)
        except BaseException:
            for c in contenders:
                print(f"--- {c.name}\n{c.mitm.output[-4000:]}", file=sys.stderr)
            raise
        finally:
            for c in contenders:
                c.stop()
            origin.stop()
            up.stop()
        table(rows)


if __name__ == "__main__":
    main()
