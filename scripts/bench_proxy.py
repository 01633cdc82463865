#!/usr/bin/env python3
"""What the router costs: plain mitmdump vs mitmdump -s addons/route.py, in one run, one upstream.

    .venv/bin/python scripts/bench_proxy.py [--quick] [--repeat N]

Latency: Claude-Code-shaped POST /v1/messages requests with 10 KB, 1 MB and 8 MB bodies, from 1 and
from 8 concurrent clients (each on its own keep-alive connection through the proxy's CONNECT tunnel).
Plain mitmdump carries them to the local upstream as addressed; the router gets them addressed to
another configured origin and routes every one of them to the same upstream (its key, its model
name: the full rewrite). Each client's first request is its session's opening turn (it writes the
pin) and is not timed; the timed ones are turns of pinned sessions. Plain and router alternate
request by request (a step = one request on each connection), so load from other processes on a
shared machine hits both alike. Reported: the median latency of each and the ratio router / plain.

First byte: a streamed response whose upstream pauses after its first event. The router against
mitmdump with a one-line addon that only turns streaming on (and plain mitmdump, which buffers the
whole stream, for reference). Reported: median time to first byte, ratio router / streaming.

Everything runs on 127.0.0.1 (fake TLS upstream from tests/e2e/harness.py, a throwaway CA and
confdirs in a temp dir). Clients and upstream share this process: their cost is in both columns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from e2e.harness import Client, FakeServer, Mitmdump, TestCA, toml_config  # noqa: E402

KEY_ENV = "SESSIONPIN_BENCH_KEY"
UPSTREAM_KEY = "bench-upstream-key-" + uuid.uuid4().hex[:8]
CLIENT_KEY = "sk-ant-bench-client-" + uuid.uuid4().hex[:8]
STREAM_ONLY = "def responseheaders(flow):\n    flow.response.stream = True\n"
SIZES = {"10KB": 10 * 1024, "1MB": 1024 * 1024, "8MB": 8 * 1024 * 1024}


def body(kind: str, session: str, size: int, stream: bool = False) -> bytes:
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.e4b; cc_entrypoint=cli;"}
    tools = [{"name": "Bash", "description": "Run a command.",
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    messages: list[dict] = [{"role": "user", "content": "Fix the failing test. "}]
    if kind == "continuation":
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                                "input": {"command": "pytest"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]},
        ]
    doc = {"model": "claude-opus-4-5", "messages": messages, "system": [billing], "tools": tools,
           "metadata": {"user_id": json.dumps({"session_id": session})}, "max_tokens": 1024, "stream": stream}
    raw = json.dumps(doc).encode()
    if size > len(raw):
        messages[0]["content"] += "x" * (size - len(raw))
        raw = json.dumps(doc).encode()
    return raw


def headers(kind: str, session: str) -> list[tuple[str, str]]:
    return [("Content-Type", "application/json"), ("User-Agent", "claude-cli/2.1.332 (external, cli)"),
            ("anthropic-version", "2023-06-01"), ("x-api-key", CLIENT_KEY),
            ("X-Claude-Code-Session-Id", session), ("x-claude-code-request-class", "main")]


class Clients:
    """``n`` keep-alive connections through one proxy, each carrying its own pinned session.

    Each connection's first request is its session's opening turn (it writes the pin) and is
    not timed. ``step()`` then sends one turn on every connection at once and returns their
    latencies, so plain and router can alternate request by request.
    """

    def __init__(self, client: Client, target: str, n: int) -> None:
        rest = target.split("://", 1)[1].partition("/")[2]
        self.path = ("/" + rest if rest else "") + "/v1/messages?beta=true"
        self.conns = []
        self.sessions = []
        for _ in range(n):
            session = str(uuid.uuid4())
            conn = client.connect(target)
            r = conn.request("POST", self.path, headers("opening", session), body("opening", session, 1024))
            if r.status != 200:
                raise SystemExit(f"opening failed: {r.status} {r.body[:200]!r}")
            self.conns.append(conn)
            self.sessions.append(session)
        self.payloads: list[bytes] = []

    def load(self, size: int) -> None:
        self.payloads = [body("continuation", s, size) for s in self.sessions]

    def _one(self, i: int, out: list[float], errors: list[str]) -> None:
        try:
            r = self.conns[i].request("POST", self.path, headers("continuation", self.sessions[i]), self.payloads[i])
        except OSError as e:
            errors.append(repr(e))
            return
        if r.status != 200:
            errors.append(f"{r.status} {r.body[:200]!r}")
        out.append(r.t_done - r.t_sent)

    def step(self) -> list[float]:
        out: list[float] = []
        errors: list[str] = []
        if len(self.conns) == 1:
            self._one(0, out, errors)
        else:
            threads = [threading.Thread(target=self._one, args=(i, out, errors)) for i in range(len(self.conns))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise SystemExit(f"requests failed: {errors[:3]}")
        return out

    def close(self) -> None:
        for c in self.conns:
            c.close()


class FirstByte:
    """One pinned session through one proxy; ``one()`` times the first byte of a streamed turn."""

    def __init__(self, client: Client, target: str) -> None:
        self.client, self.url = client, target + "/v1/messages?beta=true"
        self.session = str(uuid.uuid4())
        self._send("opening")

    def _send(self, kind: str) -> float:
        r = self.client.request("POST", self.url, headers(kind, self.session),
                                body(kind, self.session, 2048, stream=True))
        if r.status != 200 or r.t_first_byte is None:
            raise SystemExit(f"stream failed: {r.status} {r.body[:200]!r}")
        return r.t_first_byte - r.t_sent

    def one(self) -> float:
        return self._send("continuation")


def ms(x: float) -> str:
    return f"{x * 1000:8.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (about a minute)")
    ap.add_argument("--repeat", type=int, default=1, help="multiply the number of timed requests")
    ap.add_argument("--pause-ms", type=int, default=1000, help="upstream pause after the first SSE event")
    args = ap.parse_args()
    steps = {"10KB": 20, "1MB": 8, "8MB": 2} if args.quick else {"10KB": 80, "1MB": 30, "8MB": 8}
    ttfb_n = 4 if args.quick else 12

    with tempfile.TemporaryDirectory(prefix="sessionpin-bench-") as tmp_:
        tmp = Path(tmp_)
        ca = TestCA(tmp / "ca")
        upstream = FakeServer("upstream", ca, prefix="/api/anthropic").start()
        origin = FakeServer("origin", ca).start()  # what the router's clients address; it should see nothing
        upstream.keep_bodies = origin.keep_bodies = False
        trust = {"ssl_verify_upstream_trusted_ca": str(ca.pem)}
        config = toml_config(
            {"anthropic": {"url": origin.url},
             "up": {"url": upstream.url, "key_env": KEY_ENV, "models": {"claude-opus-*": "glm-4.6"}}},
            {"claude-code": "up"},
        )
        (tmp / "stream.py").write_text(STREAM_ONLY)
        plain = Mitmdump(tmp / "plain", script=None, options=trust)
        router = Mitmdump.router(tmp / "router", ca, config, env={KEY_ENV: UPSTREAM_KEY})
        streaming = Mitmdump(tmp / "streaming", script=tmp / "stream.py", options=trust)
        procs = [plain, router, streaming]
        try:
            for p in procs:
                p.start()
            # plain and streaming address the upstream itself; the router's clients address the origin
            via = {
                "plain": (Client.via_proxy(plain.port, plain.mitm_ca, timeout=120), upstream.url),
                "router": (Client.via_proxy(router.port, router.mitm_ca, timeout=120), origin.origin),
                "streaming": (Client.via_proxy(streaming.port, streaming.mitm_ca, timeout=120), upstream.url),
            }

            # is the router routing? (otherwise the ratios below measure nothing)
            upstream.keep_bodies = True
            before = len(upstream.received())
            check = Clients(*via["router"], n=1)
            check.load(1024)
            check.step()
            check.close()
            routed = upstream.received()[before:]
            upstream.keep_bodies = False
            ok = (len(routed) == 2 and all(r.header("x-api-key") == UPSTREAM_KEY for r in routed)
                  and all(b'"model": "glm-4.6"' in r.body for r in routed)
                  and not origin.received("/v1/messages"))
            print(f"router routes to the upstream with its key and model: {'yes' if ok else 'NO'}")
            if not ok:
                print("  (the router is not routing: the figures below measure a pass-through addon)")

            print(f"\nlatency, median per request ({'quick' if args.quick else 'full'};"
                  " plain and router alternate request by request)")
            print(f"{'body':>6} {'clients':>7} {'n':>5} {'plain ms':>9} {'router ms':>9} {'ratio':>6}")
            for clients in (1, 8):
                pools = {name: Clients(*via[name], n=clients) for name in ("plain", "router")}
                for label, size in SIZES.items():
                    got: dict[str, list[float]] = {"plain": [], "router": []}
                    for pool in pools.values():
                        pool.load(size)
                        pool.step()  # warm-up at this size, not timed
                    for i in range(steps[label] * args.repeat):
                        for name in (("plain", "router") if i % 2 == 0 else ("router", "plain")):
                            got[name] += pools[name].step()
                    p, q = statistics.median(got["plain"]), statistics.median(got["router"])
                    print(f"{label:>6} {clients:>7} {len(got['plain']):>5} {ms(p):>9} {ms(q):>9} {q / p:6.2f}",
                          flush=True)
                for pool in pools.values():
                    pool.close()

            upstream.pause_after_first_ms = args.pause_ms
            probes = {name: FirstByte(*via[name]) for name in ("streaming", "router", "plain")}
            ttfb: dict[str, list[float]] = {name: [] for name in probes}
            for i in range(ttfb_n):
                for name in (("streaming", "router") if i % 2 == 0 else ("router", "streaming")):
                    ttfb[name].append(probes[name].one())
            ttfb["plain"] = [probes["plain"].one() for _ in range(2)]
            upstream.pause_after_first_ms = 0
            s, q, p = (statistics.median(ttfb[k]) for k in ("streaming", "router", "plain"))
            print(f"\nfirst byte of a stream whose upstream pauses {args.pause_ms} ms after its first event (median)")
            print(f"{'streaming-only addon ms':>24} {'router ms':>9} {'ratio':>6} {'plain (buffers) ms':>19}")
            print(f"{ms(s):>24} {ms(q):>9} {q / s:6.2f} {ms(p):>19}")
            stray = len(origin.received("/v1/"))
            if stray:
                print(f"\nwarning: {stray} model requests reached the origin instead of the upstream")
        finally:
            for p in procs:
                p.stop()
            upstream.stop()
            origin.stop()


if __name__ == "__main__":
    main()
