#!/usr/bin/env python3
"""What the router costs: plain mitmdump vs mitmdump -s addons/route.py, in one run, one upstream.

    .venv/bin/python scripts/bench_proxy.py [--quick] [--rounds N] [--only latency|first-byte]
                                            [--shapes opening,history] [--sizes 10KB,1MB,8MB] [--redis]

Throughput: 4 and 8 keep-alive clients send 10 KB turns of pinned sessions back to back;
plain and router take turns in phases of a few seconds; the ratio of their median rates.

Latency: Claude-Code-shaped POST /v1/messages requests with 10 KB, 1 MB and 8 MB bodies, from 1 and
from 8 concurrent clients (each on its own keep-alive connection through the proxy's CONNECT tunnel).
Plain mitmdump carries them to the local upstream as addressed; the router gets them addressed to
another configured origin and routes every one of them to the same upstream (its key, its model
name: the full rewrite). Each client's first request is its session's opening turn (it writes the
pin) and is not timed; the timed ones are turns of pinned sessions. Plain and router alternate
request by request (a step = one request on each connection), so load from other processes on a
shared machine hits both alike. Reported: the median latency of each and the ratio router / plain, and each proxy's CPU time per
request (its process's user + system time over the timed steps, with the processes it started —
the router's body reader —, from /proc; Linux only), which
load from other processes moves far less than latency (it counts in clock ticks, usually 10 ms:
--quick runs too few requests for it to mean much).
``--redis`` adds a third proxy to the latency table: the same router with its pins in Redis (a
redis-server of its own on loopback, ``appendonly yes``, ``appendfsync always``), taking its turn
in the same steps, so its ratio to plain mitmdump stands beside the file store's from one run.
``--reverse`` runs plain mitmdump and the router(s) in reverse mode instead (``--mode
reverse:ORIGIN``: the client sends plain HTTP to the proxy, as an agent whose base URL names it,
and the proxy speaks TLS upstream); latency and throughput only.
``--no-lineage`` adds the router without its lineage watch (``LineageWatch``: what it records
from responses for later forks — here a ``request-id`` anchor per Claude Code answer) the same
way: the lineage's cost is the difference between the two routers' ratios in one run.
``--no-ledger`` likewise adds the router without its ledger watch (``LedgerWatch``: every answer's
usage read as it streams, the request's prompt shape after it, the ledger's store writes).
``--against DIR`` likewise adds the router of another tree's ``sessionpin`` (a ``git worktree``
of an earlier commit): before and after taking turns request by request in one run, latency only.
Two body shapes: ``opening`` (the issue's measure: the bulk is the opening user message, the part
the reader must read for the conversation's fingerprint) and ``history`` (the bulk is tool results
later in the conversation, as in a long Claude Code session; the reader skips it); and
``recorded`` (``--shapes recorded``, ``bench_parts.py --shape recorded``): a recorded Claude Code
continuation as the client sent it, 115 KB of which 92 KB are tool schemas (what real traffic
makes every part read; the sizes are then ignored); ``grown``: that recorded continuation with
its real messages repeated to about the size (a long Claude Code conversation: real tool schemas,
among them the Agent tool's ``model`` property, real tool calls and results); ``toolcalls``: the
``history`` shape with results of a few bytes (a session of many small steps: more than 20,000
JSON objects in a megabyte, which a whole read could not do on the event loop), written compactly
as clients write their bodies (the other shapes keep ``json.dumps``' spaces, as their figures were
measured).

First byte: a streamed response whose upstream pauses after its first event. The router against
mitmdump with a one-line addon that only turns streaming on (and plain mitmdump, which buffers the
whole stream, for reference). Two ways to connect:
- ``new connection`` (the issue's measure): each sample opens a new client connection (CONNECT,
  TLS), so the proxy opens a new upstream connection too. The streaming-only mitmdump runs with
  mitmproxy's default connection_strategy=eager: it connects upstream when the client's CONNECT
  arrives, in parallel with the client's TLS handshake. The router needs lazy (it picks the
  upstream from the request), so its upstream TCP+TLS handshake comes after the request. A
  streaming-only mitmdump with connection_strategy=lazy is measured too, to show that part.
- ``keep-alive``: each proxy's samples share one client connection (what agents do: their HTTP
  clients keep connections open), so no handshake is in the sample.
Reported: median time to first byte, ratio router / streaming.

``--rounds N`` runs everything N times (fresh sessions, same proxies) and prints each round's
ratios and their median and range: on a shared machine a single round can be off by 10 %.

Everything runs on 127.0.0.1 (fake TLS upstream from tests/e2e/harness.py, a throwaway CA and
confdirs in a temp dir). Clients and upstream share this process: their cost is in both columns.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from e2e.harness import Client, FakeServer, Mitmdump, TestCA, toml_config  # noqa: E402

KEY_ENV = "SESSIONPIN_BENCH_KEY"
UPSTREAM_KEY = "bench-upstream-key-" + uuid.uuid4().hex[:8]
CLIENT_KEY = "sk-ant-bench-client-" + uuid.uuid4().hex[:8]
STREAM_ONLY = "def responseheaders(flow):\n    flow.response.stream = True\n"
NO_LINEAGE = "from sessionpin.proxy import make_addons\naddons = make_addons(without=('lineage',))\n"
NO_LEDGER = "from sessionpin.proxy import make_addons\naddons = make_addons(without=('ledger',))\n"
SIZES = {"10KB": 10 * 1024, "100KB": 100 * 1024, "250KB": 250 * 1024, "1MB": 1024 * 1024, "8MB": 8 * 1024 * 1024}
DEFAULT_SIZES = "10KB,1MB,8MB"   # the sizes (100KB, 250KB on request: long conversations read on the event loop)


SHAPES = ("opening", "history", "recorded", "grown", "toolcalls")
RESULT = 32 * 1024   # one tool result in the ``history`` shape
SMALL_RESULT = 8     # one tool result in the ``toolcalls`` shape (many small objects: ~23,000 ``{`` per MB)
KEEP_ALIVE_PAUSE_MS = 100


def recorded(session: str, stream: bool = False) -> bytes:
    """A recorded Claude Code continuation as its client sent it (115 KB: 92 KB of tool schemas,
    a system prompt with cache marks, a short history; compact JSON), under ``session``."""
    doc = json.loads(RECORDED.read_text())["body"]
    meta = json.loads(doc["metadata"]["user_id"])
    meta["session_id"] = session
    doc["metadata"]["user_id"] = json.dumps(meta, separators=(",", ":"))
    doc["stream"] = stream
    _own_first_message(doc["messages"], session)
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def _own_first_message(messages: list[dict], session: str) -> None:
    """The session's name in its first user message: each conversation's history has a root of
    its own, as real ones do (their tool call ids alone are unique). With one first exchange
    shared by every session, the lineage watch rewrote that root's record for another session
    on every turn — a store write per request that real traffic does not make."""
    first = messages[0]
    if isinstance(first["content"], str):
        first["content"] = f"({session}) " + first["content"]
        return
    texts = [b for b in first["content"] if b.get("type") == "text"]
    if texts:
        texts[-1]["text"] = f"({session}) " + texts[-1]["text"]


RECORDED = ROOT / "tests/fixtures/traffic/claude-code/interactive-06-continuation.json"


def grown(session: str, size: int, stream: bool = False) -> bytes:
    """The recorded continuation (``recorded``) with its messages after the first repeated, in
    order, until the body is about ``size`` bytes (at least the recorded one): a long
    conversation as Claude Code sends it."""
    doc = json.loads(recorded(session, stream))
    messages = doc["messages"]
    repeat, left = messages[1:], size - len(json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode())
    each = len(json.dumps(repeat, separators=(",", ":"), ensure_ascii=False).encode())
    for _ in range(max(0, left // max(each, 1))):
        messages += repeat
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def body(kind: str, session: str, size: int, stream: bool = False, shape: str = "opening") -> bytes:
    """A Claude Code request of about ``size`` bytes; ``shape`` says where the bulk is
    (``recorded``: a real continuation, whatever the size)."""
    if shape == "recorded" and kind == "continuation":
        return recorded(session, stream)
    if shape == "grown" and kind == "continuation":
        return grown(session, size, stream)
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.e4b; cc_entrypoint=cli;"}
    tools = [{"name": "Bash", "description": "Run a command.",
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    messages: list[dict] = [{"role": "user", "content": "Fix the failing test. "}]
    _own_first_message(messages, session)
    if kind == "continuation":
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                                "input": {"command": "pytest"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]},
        ]
    doc = {"model": "claude-opus-4-5", "messages": messages, "system": [billing], "tools": tools,
           "metadata": {"user_id": json.dumps({"session_id": session})}, "max_tokens": 1024, "stream": stream}
    raw = json.dumps(doc).encode()
    if size <= len(raw):
        return raw
    if shape == "opening" or kind != "continuation":
        messages[0]["content"] += "x" * (size - len(raw))
        return json.dumps(doc).encode()
    # history: tool calls and their results (at most RESULT bytes each) fill the conversation;
    # toolcalls: the same with results of SMALL_RESULT bytes (a session of many small steps)
    most = SMALL_RESULT if shape == "toolcalls" else RESULT
    left, i = size - len(raw), 1
    while left > 0:
        i += 1
        call = {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "Bash",
                                                  "input": {"command": f"cat part{i}.txt"}}]}
        result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": ""}]}
        overhead = len(json.dumps(call)) + len(json.dumps(result)) + 4
        result["content"][0]["content"] = "y" * max(0, min(most, left - overhead))
        messages[-2:-2] = [call, result]
        left -= overhead + len(result["content"][0]["content"])
    if shape == "toolcalls":        # compact, as every client sends it (the other shapes keep their figures' layout)
        return json.dumps(doc, separators=(",", ":")).encode()
    return json.dumps(doc).encode()


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

    def load(self, size: int, shape: str = "opening") -> None:
        self.payloads = [body("continuation", s, size, shape=shape) for s in self.sessions]

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

    def run_for(self, seconds: float) -> int:
        """Every connection sends back to back for ``seconds``; how many requests completed."""
        done = [0] * len(self.conns)
        errors: list[str] = []
        stop = time.monotonic() + seconds

        def loop(i: int) -> None:
            while time.monotonic() < stop:
                out: list[float] = []
                self._one(i, out, errors)
                if errors:
                    return
                done[i] += 1
        threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(self.conns))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise SystemExit(f"requests failed: {errors[:3]}")
        return sum(done)

    def close(self) -> None:
        for c in self.conns:
            c.close()


class FirstByte:
    """One pinned session through one proxy; ``one()`` times the first byte of a streamed turn,
    on a new client connection each time, or on one kept-alive connection (``keep_alive``)."""

    def __init__(self, client: Client, target: str, keep_alive: bool = False) -> None:
        self.client, self.url = client, target + "/v1/messages?beta=true"
        rest = target.split("://", 1)[1].partition("/")[2]
        self.path = ("/" + rest if rest else "") + "/v1/messages?beta=true"
        self.conn = client.connect(target) if keep_alive else None
        self.session = str(uuid.uuid4())
        self._send("opening")
        if self.conn is not None:
            self._send("continuation")  # the upstream connection is open from here on

    def _send(self, kind: str) -> float:
        h, b = headers(kind, self.session), body(kind, self.session, 2048, stream=True)
        if self.conn is None:
            return self._first_byte_only(h, b)
        r = self.conn.request("POST", self.path, h, b)
        if r.status != 200 or r.t_first_byte is None:
            raise SystemExit(f"stream failed: {r.status} {r.body[:200]!r}")
        return r.t_first_byte - r.t_sent

    def _first_byte_only(self, h: list[tuple[str, str]], b: bytes) -> float:
        """A new connection (CONNECT, TLS), one request, closed once its first body byte is in
        (what Client.request measures, without waiting out the upstream's pause)."""
        u = urllib.parse.urlsplit(self.url)
        assert self.client.proxy_port is not None
        c = http.client.HTTPSConnection("127.0.0.1", self.client.proxy_port, timeout=self.client.timeout,
                                        context=self.client.context)
        c.set_tunnel(u.hostname or "127.0.0.1", u.port or 443)
        try:
            t_sent = time.monotonic()
            c.putrequest("POST", self.path, skip_accept_encoding=True)
            for k, v in h:
                c.putheader(k, v)
            c.putheader("Content-Length", str(len(b)))
            c.endheaders(b)
            resp = c.getresponse()
            first = resp.read1(65536)
            t_first = time.monotonic()
            if resp.status != 200 or not first:
                raise SystemExit(f"stream failed: {resp.status} {first[:200]!r}")
            return t_first - t_sent
        finally:
            c.close()

    def one(self) -> float:
        return self._send("continuation")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def ms(x: float) -> str:
    return f"{x * 1000:8.1f}"


def process_cpu(pid: int) -> tuple[float, float]:
    """User + system CPU seconds of a process so far, and those of its children it waited for."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (Linux /proc: each thread's ``children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def children_cpu(pid: int) -> float:
    """CPU seconds of the processes a proxy started (the router's body reader): the live ones'
    and those it waited for. Counted with the proxy's own: they do its work."""
    total = 0.0
    for kid in descendants(pid):
        try:
            total += process_cpu(kid)[0]
        except (OSError, ValueError, IndexError):
            pass                  # ended meanwhile: counted in its parent's children's time
    try:
        total += process_cpu(pid)[1]
    except (OSError, ValueError, IndexError):
        pass
    return total


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process so far, with the processes it started (the router's
    body reader: its reads are the proxy's work), from Linux /proc; or None."""
    if pid is None:
        return None
    try:
        return process_cpu(pid)[0] + children_cpu(pid)
    except (OSError, ValueError, IndexError, TypeError):
        return None


def latency(via: dict, pids: dict[str, int | None], sizes: dict[str, int], shapes: list[str],
            steps: dict[str, int], routers: tuple[str, ...] = ("router",)) -> dict[tuple, float]:
    """Median latency ratio router / plain per (shape, body, clients); prints a table.
    ``routers``: "router" (the file store) and, with --redis, "redis" (the same router on Redis).

    Also each proxy's CPU time per timed request (its process's and its children's user + system
    time over the timed steps): latency on a shared machine is noisy, the CPU a proxy spends is not."""
    ratios: dict[tuple, float] = {}
    names = ("plain", *routers)
    head = "".join(f" {name + ' ms':>9} {'ratio':>6}" for name in routers)
    cpu_head = "".join(f" {name + ' ms':>9} {'ratio':>6}" for name in routers)
    print(f"{'shape':>8} {'body':>6} {'clients':>7} {'n':>5} {'plain ms':>9}{head}   {'cpu/req: plain ms':>17}{cpu_head}")
    for clients in (1, 8):
        pools = {name: Clients(*via[name], n=clients) for name in names}
        for shape in shapes:
            for label, size in sizes.items():
                if shape == "recorded" and label != next(iter(sizes)):
                    continue                # one real body, whatever the sizes: timed once (labelled by the first)
                got: dict[str, list[float]] = {name: [] for name in names}
                cpu = {name: 0.0 for name in got}
                for pool in pools.values():
                    pool.load(size, shape)
                    pool.step()  # warm-up at this size, not timed
                for i in range(steps[label]):
                    k = i % len(names)
                    for name in names[k:] + names[:k]:      # rotate: none always goes first
                        before = cpu_seconds(pids[name])
                        got[name] += pools[name].step()
                        after = cpu_seconds(pids[name])
                        if before is not None and after is not None:
                            cpu[name] += after - before
                med = {name: statistics.median(got[name]) for name in names}
                per = {name: cpu[name] / len(got[name]) for name in names}
                cols, cpu_cols = "", ""
                for name in routers:
                    key = (shape, label, clients) + (() if name == "router" else (name,))
                    ratios[key] = med[name] / med["plain"]
                    cols += f" {ms(med[name]):>9} {ratios[key]:6.2f}"
                    if per["plain"] > 0:
                        ratios[key + ("cpu",)] = per[name] / per["plain"]
                        cpu_cols += f" {ms(per[name]):>9} {ratios[key + ('cpu',)]:6.2f}"
                cpu_cols = f"   {ms(per['plain']):>17}{cpu_cols}" if per["plain"] > 0 else ""
                print(f"{shape:>8} {label:>6} {clients:>7} {len(got['plain']):>5} {ms(med['plain']):>9}{cols}"
                      + cpu_cols, flush=True)
        for pool in pools.values():
            pool.close()
    return ratios


def throughput(via: dict, clients_list: tuple[int, ...], size: int, seconds: float, phases: int) -> dict[tuple, float]:
    """Requests per second through each proxy with ``n`` keep-alive clients sending back to back.

    Each client has its own connection and pinned session (turns of running conversations).
    Plain and router take turns in phases of ``seconds`` (``phases`` each, alternating which
    goes first), so a neighbour's load hits both alike; reported: the median rate of each and
    the ratio router / plain."""
    ratios: dict[tuple, float] = {}
    print(f"\nthroughput, {size // 1024} KB bodies, phases of {seconds:g} s, {phases} per proxy")
    print(f"{'clients':>7} {'plain req/s':>12} {'router req/s':>13} {'ratio':>6}")
    for n in clients_list:
        pools = {name: Clients(*via[name], n=n) for name in ("plain", "router")}
        for pool in pools.values():
            pool.load(size)
            pool.step()
        rates: dict[str, list[float]] = {"plain": [], "router": []}
        for i in range(phases):
            for name in (("plain", "router") if i % 2 == 0 else ("router", "plain")):
                rates[name].append(pools[name].run_for(seconds) / seconds)
        for pool in pools.values():
            pool.close()
        p, q = statistics.median(rates["plain"]), statistics.median(rates["router"])
        ratios[(n,)] = q / p
        print(f"{n:>7} {p:12.0f} {q:13.0f} {q / p:6.2f}", flush=True)
    return ratios


def first_byte(via: dict, upstream: FakeServer, n: int, pause_ms: int, with_plain: bool) -> dict[tuple, float]:
    """Median time to first byte per proxy, new connection and keep-alive; prints a table.

    The first byte comes before the upstream's pause, so the pause's length does not change
    it: new-connection samples close at the first byte; keep-alive samples read the whole
    stream (the connection is reused), with a pause of at most KEEP_ALIVE_PAUSE_MS."""
    ratios: dict[tuple, float] = {}
    keep_pause = min(pause_ms, KEEP_ALIVE_PAUSE_MS)
    print(f"\nfirst byte of a stream whose upstream pauses {pause_ms} ms ({keep_pause} ms on keep-alive) "
          f"after its first event (median of {n})")
    print(f"{'connection':>14} {'streaming ms':>13} {'streaming-lazy ms':>18} {'router ms':>10} "
          f"{'router/streaming':>17} {'router/lazy':>12}")
    for keep in (False, True):
        upstream.pause_after_first_ms = keep_pause if keep else pause_ms
        names = ("streaming", "lazy", "router")
        probes = {name: FirstByte(*via[name], keep_alive=keep) for name in names}
        got: dict[str, list[float]] = {name: [] for name in names}
        for i in range(n):
            order = names[i % 3:] + names[:i % 3]   # rotate: none always goes first
            for name in order:
                got[name].append(probes[name].one())
        for probe in probes.values():
            probe.close()
        s, z, q = (statistics.median(got[k]) for k in names)
        label = "keep-alive" if keep else "new"
        ratios[(label, "streaming")] = q / s
        ratios[(label, "lazy")] = q / z
        print(f"{label:>14} {ms(s):>13} {ms(z):>18} {ms(q):>10} {q / s:17.2f} {q / z:12.2f}", flush=True)
    if with_plain:
        upstream.pause_after_first_ms = pause_ms
        plain = FirstByte(*via["plain"])
        p = statistics.median([plain.one() for _ in range(2)])
        print(f"{'plain mitmdump (buffers the stream), new connection':>52}: {ms(p).strip()} ms")
    upstream.pause_after_first_ms = 0
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (about a minute)")
    ap.add_argument("--repeat", type=int, default=1, help="multiply the number of timed requests")
    ap.add_argument("--rounds", type=int, default=1, help="run everything this many times; report the spread")
    ap.add_argument("--only", choices=("latency", "first-byte", "throughput"), help="run one of the benchmarks")
    ap.add_argument("--shapes", default="opening,history", help=f"body shapes for latency, of {', '.join(SHAPES)}")
    ap.add_argument("--pause-ms", type=int, default=1000, help="upstream pause after the first SSE event")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"body sizes for latency, of {', '.join(SIZES)}")
    ap.add_argument("--redis", action="store_true",
                    help="also the router with its pins in Redis (a redis-server of its own, appendfsync always)")
    ap.add_argument("--reverse", action="store_true",
                    help="plain mitmdump and the router(s) in reverse mode (the client sends plain HTTP to the "
                         "proxy, which speaks TLS upstream); latency and throughput only")
    ap.add_argument("--no-lineage", action="store_true", help="also the router without its lineage watch")
    ap.add_argument("--no-ledger", action="store_true", help="also the router without its ledger watch")
    ap.add_argument("--against", type=Path, metavar="DIR",
                    help="also the router of DIR's sessionpin (another tree: before and after in one run)")
    args = ap.parse_args()
    sizes = {k: SIZES[k] for k in args.sizes.split(",") if k}
    if not sizes or not set(args.sizes.split(",")) - {""} <= set(SIZES):
        ap.error(f"--sizes: choose from {', '.join(SIZES)}")
    steps = {"10KB": 20, "100KB": 12, "250KB": 10, "1MB": 8, "8MB": 2} if args.quick else {"10KB": 80, "100KB": 50, "250KB": 40, "1MB": 30, "8MB": 8}
    steps = {k: v * args.repeat for k, v in steps.items()}
    ttfb_n = 8 if args.quick else 30
    shapes = [x for x in args.shapes.split(",") if x]
    if not set(shapes) <= set(SHAPES):
        ap.error(f"--shapes: choose from {', '.join(SHAPES)}")

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
        # --reverse: each proxy is the server its clients address (plain: the upstream's origin;
        # the routers: the origin they route away from), as an agent whose base URL names it
        rev_plain = [f"reverse:{upstream.origin}"] if args.reverse else None
        rev_router = [f"reverse:{origin.origin}"] if args.reverse else None
        plain = Mitmdump(tmp / "plain", script=None, options=trust, modes=rev_plain)
        router = Mitmdump.router(tmp / "router", ca, config, env={KEY_ENV: UPSTREAM_KEY}, modes=rev_router)
        streaming = Mitmdump(tmp / "streaming", script=tmp / "stream.py", options=trust)
        lazy = Mitmdump(tmp / "lazy", script=tmp / "stream.py", options={**trust, "connection_strategy": "lazy"})
        procs = [plain, router, streaming, lazy]
        redis = on_redis = None
        if args.redis:
            from redis_servers import RedisServer   # tests/ is on the path

            (tmp / "redis").mkdir()
            redis = RedisServer(tmp / "redis").start()
            on_redis = Mitmdump.router(tmp / "router-redis", ca, config, modes=rev_router,
                                       env={KEY_ENV: UPSTREAM_KEY, "SESSIONPIN_STORE": redis.url("{bench}:")})
            on_redis.options.pop("sessionpin_store")
            procs.append(on_redis)
        no_lineage = None
        if args.no_lineage:
            (tmp / "nolin.py").write_text(NO_LINEAGE)
            no_lineage = Mitmdump.router(tmp / "router-nolin", ca, config, env={KEY_ENV: UPSTREAM_KEY}, modes=rev_router)
            no_lineage.script = tmp / "nolin.py"
            procs.append(no_lineage)
        no_ledger = None
        if args.no_ledger:
            (tmp / "noledger.py").write_text(NO_LEDGER)
            no_ledger = Mitmdump.router(tmp / "router-noledger", ca, config, env={KEY_ENV: UPSTREAM_KEY},
                                        modes=rev_router)
            no_ledger.script = tmp / "noledger.py"
            procs.append(no_ledger)
        against = None
        if args.against:
            (tmp / "against.py").write_text(f"import sys\nsys.path.insert(0, {str(args.against.resolve())!r})\n"
                                            "from sessionpin.proxy import make_addons\naddons = make_addons()\n")
            against = Mitmdump.router(tmp / "router-against", ca, config, env={KEY_ENV: UPSTREAM_KEY},
                                      modes=rev_router)
            against.script = tmp / "against.py"
            procs.append(against)
        routers = ("router",) + (("redis",) if on_redis else ()) + (("nolin",) if no_lineage else ()) \
            + (("noledger",) if no_ledger else ()) + (("against",) if against else ())
        try:
            for p in procs:
                p.start()
            # plain and streaming address the upstream itself; the router's clients address the origin
            via = {name: (Client.via_proxy(p.port, p.mitm_ca, timeout=120), upstream.url)
                   for name, p in (("plain", plain), ("streaming", streaming), ("lazy", lazy))}
            via["router"] = (Client.via_proxy(router.port, router.mitm_ca, timeout=120), origin.origin)
            for name, p in (("redis", on_redis), ("nolin", no_lineage), ("noledger", no_ledger), ("against", against)):
                if p is not None:
                    via[name] = (Client.via_proxy(p.port, p.mitm_ca, timeout=120), origin.origin)
            if args.reverse:
                via["plain"] = (Client.reverse(plain.port, timeout=120), upstream.url)
                for name, p in (("router", router), ("redis", on_redis), ("nolin", no_lineage),
                                ("noledger", no_ledger), ("against", against)):
                    if p is not None:
                        via[name] = (Client.reverse(p.port, timeout=120), origin.origin)

            # is the router routing? (otherwise the ratios below measure nothing)
            for name in routers:
                upstream.keep_bodies = True
                before = len(upstream.received())
                check = Clients(*via[name], n=1)
                check.load(1024)
                check.step()
                check.close()
                routed = upstream.received()[before:]
                upstream.keep_bodies = False
                ok = (len(routed) == 2 and all(r.header("x-api-key") == UPSTREAM_KEY for r in routed)
                      and all(b'"model": "glm-4.6"' in r.body for r in routed)
                      and not origin.received("/v1/messages"))
                if name == "redis" and redis is not None:
                    ok = ok and any(k.startswith("{bench}:pin:") for k in redis.client().keys("*"))
                print(f"{name} routes to the upstream with its key and model"
                      f"{' (its pins in Redis)' if name == 'redis' else ''}: {'yes' if ok else 'NO'}")
                if not ok:
                    print("  (the router is not routing: the figures below measure a pass-through addon)")

            rounds: list[dict[tuple, float]] = []
            for r in range(args.rounds):
                got: dict[tuple, float] = {}
                if args.rounds > 1:
                    print(f"\n== round {r + 1} of {args.rounds}")
                if args.only in (None, "latency"):
                    print(f"\nlatency, median per request ({'quick' if args.quick else 'full'};"
                          f" {', '.join(('plain',) + routers)} take turns request by request)")
                    pids = {name: p.proc.pid if p.proc else None
                            for name, p in (("plain", plain), ("router", router), ("redis", on_redis),
                                            ("nolin", no_lineage), ("noledger", no_ledger), ("against", against)) if p}
                    got.update({("latency",) + k: v
                                for k, v in latency(via, pids, sizes, shapes, steps, routers).items()})
                if args.only in (None, "throughput"):
                    got.update({("throughput",) + k: v for k, v in
                                throughput(via, (4, 8), 10 * 1024, 3.0 if args.quick else 6.0,
                                           3 if args.quick else 5).items()})
                if args.only in (None, "first-byte") and not args.reverse:
                    got.update({("first byte",) + k: v for k, v in
                                first_byte(via, upstream, ttfb_n, args.pause_ms, with_plain=r == 0).items()})
                rounds.append(got)
            if args.rounds > 1:
                print(f"\nratios over {args.rounds} rounds: median (min - max)")
                for key in rounds[0]:
                    xs = [g[key] for g in rounds]
                    print(f"  {' '.join(str(k) for k in key):<40} {statistics.median(xs):5.2f} "
                          f"({min(xs):.2f} - {max(xs):.2f})   " + " ".join(f"{x:.2f}" for x in xs))
            stray = len(origin.received("/v1/"))
            if stray:
                print(f"\nwarning: {stray} model requests reached the origin instead of the upstream")
        finally:
            for p in procs:
                p.stop()
            upstream.stop()
            origin.stop()
            if redis is not None:
                redis.cleanup()


if __name__ == "__main__":
    main()
