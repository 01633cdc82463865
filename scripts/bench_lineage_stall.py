#!/usr/bin/env python3
"""What one pathological body costs every other client: the worst stall of a probe while it passes.

    .venv/bin/python scripts/bench_lineage_stall.py [--old REV] [--mb 60] [--shapes tiny,huge,deep] [--repeat 1] [--lag FILE]

Issue 20 ("no body costs other clients more than ~100 ms"). Through a real mitmdump with the
router (file store, local TLS servers), for this checkout and (``--old``) an earlier commit:

- a probe client sends small GETs to a server through the proxy on one keep-alive connection,
  back to back, and records each one's latency;
- meanwhile one Claude Code continuation of ``--mb`` MiB (the body limit is 64 MiB) is sent:
  ``pinless`` (a session never seen: its lineage — links and root — is read to look for a
  parent) and ``pinned`` (a session pinned by its opening: no lineage is read, only the
  request's facts). Its history is one of:
    tiny  a million-odd tiny user messages before the first answer;
    huge  one user message of the whole size before the first answer;
    deep  a first message nested as deep as the size allows (``[[[…]]]``).
- the stall is the probe's worst latency while the body was in flight (from its first byte
  sent to its answer, plus 0.3 s for what runs after it left), against the probe's worst and
  median latency over 3 s before (``quiet``).

Each case also gives the peak RSS (VmHWM, reset before each send) of the proxy and of its
children (the body reader's process). ``--lag FILE`` adds ``scripts/lagwatch.py`` to the proxy:
where its event loop was whenever it was late by more than 100 ms.

The machine is shared and noisy: compare the stalls with the quiet worst of the same run.
With ``--repeat N`` each case is sent N times (a new session each) and the row shows the
median of the N worst stalls, and their range.
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
    a body of a MiB or more is not decoded whole — stdlib ``json.loads`` of two million tiny
    messages holds this process's GIL for seconds, and the probe's stall would be the bench's,
    not the proxy's. Its model and stream are all the fake needs."""

    dumps = staticmethod(json.dumps)

    @staticmethod
    def loads(data):
        head = re.match(rb'\{"model":\s*"([^"]*)"', data) if isinstance(data, (bytes, bytearray)) else None
        if head is not None and len(data) >= 2**20:
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
    """Small GETs back to back through the proxy; (start, latency) of each."""

    def __init__(self, client: Client, url: str) -> None:
        self.client, self.url = client, url
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self.client.connect(self.url) as conn:
                    while not self._stop.is_set():
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


def run_tree(name: str, tree: Path, tmp: Path, ca: TestCA, size: int, shapes: list[str], repeat: int,
             lag: Path | None = None) -> list[dict]:
    origin = FakeServer("origin", ca).start()
    up = FakeServer("up", ca, prefix="/api/anthropic").start()
    origin.keep_bodies = up.keep_bodies = False
    config = toml_config({"anthropic": {"url": origin.url}, "up": {"url": up.url, "key_env": KEY_ENV}},
                         {"claude-code": "up"})
    env = {KEY_ENV: UPSTREAM_KEY}
    if lag is not None:
        env["SESSIONPIN_LAGWATCH"] = str(lag.with_name(f"{lag.stem}-{name}{lag.suffix}"))
    mitm = Mitmdump.router(tmp / name, ca, config, env=env)
    if tree != ROOT or lag is not None:
        shim = tmp / f"{name}-route.py"
        text = SHIM.format(root=str(tree))
        if lag is not None:      # where the event loop is when it is late (scripts/lagwatch.py)
            text += LAG_SHIM.format(path=str(ROOT / "scripts" / "lagwatch.py"))
        shim.write_text(text)
        mitm.script = shim
    rows = []
    try:
        mitm.start()
        client = Client.via_proxy(mitm.port, mitm.mitm_ca, timeout=120)
        url = origin.origin + "/v1/messages?beta=true"
        with Probe(client, origin.origin) as probe:
            time.sleep(0.5)
            t0 = time.perf_counter()
            time.sleep(3)
            quiet = probe.worst(t0, time.perf_counter())
            rows.append({"code": name, "case": "quiet", "shape": "-", "mb": 0, "request_s": 0.0,
                         "worst_ms": quiet[0] * 1000, "min_ms": quiet[0] * 1000, "max_ms": quiet[0] * 1000, "n": 1,
                         "median_probe_ms": quiet[1] * 1000})
            for shape in shapes:
                body = pathological(shape, size)
                for case in ("pinless", "pinned"):
                    worsts, took, statuses = [], [], set()
                    peak, child_peak = 0.0, 0.0
                    for _ in range(repeat):
                        reset_peaks(mitm.proc.pid)
                        session = str(uuid.uuid4())
                        if case == "pinned":
                            r = client.request("POST", url, headers(session), opening(session))
                            assert r.status == 200, r.status
                        t0 = time.perf_counter()
                        r = client.request("POST", url, headers(session), body)
                        t1 = time.perf_counter()
                        time.sleep(AFTER)
                        worsts.append(probe.worst(t0, t1 + AFTER)[0] * 1000)
                        took.append(t1 - t0)
                        statuses.add(r.status)
                        got = peaks(mitm.proc.pid)
                        peak, child_peak = max(peak, got[0]), max(child_peak, got[1])
                    rows.append({"code": name, "case": case, "shape": shape, "mb": len(body) / 2**20,
                                 "request_s": statistics.median(took), "status": sorted(statuses),
                                 "worst_ms": statistics.median(worsts), "min_ms": min(worsts), "max_ms": max(worsts),
                                 "n": repeat, "peak_mb": peak, "child_peak_mb": child_peak})
                    print(f"{name} {case} {shape}: {rows[-1]['worst_ms']:.0f} ms worst probe (median of {repeat}: "
                          f"{min(worsts):.0f}-{max(worsts):.0f}; request {statistics.median(took):.1f} s, "
                          f"{sorted(statuses)}; peak RSS {peak:.0f} MB, children {child_peak:.0f} MB)", flush=True)
    except BaseException:
        print(mitm.output[-4000:], file=sys.stderr)
        raise
    finally:
        mitm.stop()
        origin.stop()
        up.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="also measure this git revision (e.g. the commit before issue 20's fix)")
    ap.add_argument("--mb", type=float, default=60.0, help="the body's size in MiB (the limit is 64)")
    ap.add_argument("--shapes", default="tiny,huge,deep")
    ap.add_argument("--repeat", type=int, default=1, help="sends per case (the median worst stall is shown)")
    ap.add_argument("--lag", type=Path, help="write where the proxy's event loop was when late to FILE-<code>.txt "
                                             "(scripts/lagwatch.py)")
    args = ap.parse_args()
    size = int(args.mb * 2**20)
    shapes = [s for s in args.shapes.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="sessionpin-bench-stall-") as tmp_:
        tmp = Path(tmp_)
        trees = [("new", ROOT)]
        if args.old:
            old = tmp / "old-tree"
            old.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.old], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
            trees.insert(0, (f"old-{args.old}", old))
        ca = TestCA(tmp / "ca")
        rows = []
        for name, tree in trees:
            rows += run_tree(name, tree, tmp, ca, size, shapes, args.repeat, args.lag.resolve() if args.lag else None)
        print("\n| code | case | history | body MiB | request s | worst probe ms (median of n) | range | n "
              "| peak RSS MB: proxy (its children) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            extra = f" (probe median {r['median_probe_ms']:.1f} ms)" if "median_probe_ms" in r else ""
            rss = f"{r['peak_mb']:.0f} ({r['child_peak_mb']:.0f})" if "peak_mb" in r else "-"
            print(f"| {r['code']} | {r['case']}{extra} | {r['shape']} | {r['mb']:.0f} | {r['request_s']:.1f} | "
                  f"{r['worst_ms']:.0f} | {r['min_ms']:.0f}-{r['max_ms']:.0f} | {r['n']} | {rss} |")


if __name__ == "__main__":
    main()
