#!/usr/bin/env python3
"""CPU of the router's request hook per request, in process (issue 22): no TLS, no sockets, no
other addon — what sessionpin's own code costs a pinned turn, and its parts.

    .venv/bin/python scripts/bench_hook.py [--size 10KB] [--repeat 2000] [--rounds 5]
    PYTHONPATH=/tmp/before .venv/bin/python scripts/bench_hook.py     # another tree's sessionpin

The bench_proxy turn: a Claude Code continuation of a pinned session (``bench_proxy.body``,
``headers``), addressed to one server and routed to another that renames the model (a new key,
the header allowlist, the model renamed in the body). The router's hook runs in a taddons
context with a file store (a pin read per request, on the loop when SQLite answers at once).
Reported: ``time.process_time`` per request (every thread of this process: the store's too),
best of ``--rounds`` runs of ``--repeat`` requests, and the parts timed alone (``thread_time``)
on the same request.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from mitmproxy import http  # noqa: E402
from mitmproxy.test import tflow, tutils  # noqa: E402

import bench_proxy as BP  # noqa: E402
import shellkit  # noqa: E402

SIZES = {"10KB": 10 * 1024, "100KB": 100 * 1024, "1MB": 1024 * 1024}
CONFIG = '''
[servers.anthropic]
url = "https://api.anthropic.com"

[servers.glm]
url = "https://api.z.ai/api/anthropic"
key_env = "ZAI_API_KEY"
models = { "claude-opus-*" = "glm-4.6" }

[agents.claude-code]
server = "glm"
'''


def make_flow(session: str, content: bytes) -> http.HTTPFlow:
    h = [(b"host", b"api.anthropic.com")] + [(n.encode(), v.encode()) for n, v in BP.headers("continuation", session)]
    req = tutils.treq(method=b"POST", scheme=b"https", host="api.anthropic.com", port=443,
                      path=b"/v1/messages?beta=true", headers=http.Headers(h), content=content)
    f = tflow.tflow(req=req)
    f.client_conn.peername = ("127.0.0.1", 5555)
    return f


def parts(router, f: http.HTTPFlow, n: int) -> dict[str, float]:
    """Each piece of the hook alone on this request, µs (thread CPU, best of 5 × n)."""
    from sessionpin.reader import facts as F
    from sessionpin.decision import headers as H, rewrite
    req = f.request
    raw, hdrs = req.raw_content, tuple(req.headers.items(multi=True))
    facts = F.read(req.method, req.url, req.headers.fields, raw, None)
    cfg = router.config.config
    out = {}

    def best(name, fn):
        times = []
        for _ in range(5):
            t0 = time.thread_time()
            for _ in range(n):
                fn()
            times.append(time.thread_time() - t0)
        out[name] = min(times) / n * 1e6

    best("facts.read", lambda: F.read(req.method, req.url, req.headers.fields, raw, None))
    best("config.scope", lambda: cfg.scope(req.method, req.scheme, req.host, req.port, req.path))
    best("headers.dropped_for_move", lambda: H.dropped_for_move(hdrs))
    best("rewrite.model_span", lambda: rewrite.model_span(raw))
    best("rewrite.replace_model", lambda: rewrite.replace_model(raw, facts.model or "", "glm-4.6", facts.model_span))
    return out


async def run(args) -> None:
    size = SIZES[args.size]
    with tempfile.TemporaryDirectory(prefix="sessionpin-bench-hook-") as tmp:
        cfg = Path(tmp) / "config.toml"
        cfg.write_text(CONFIG)
        p = shellkit.start(cfg, sessionpin_store=f"file:{tmp}/pins.db", sessionpin_decision_log="off")
        try:
            router = p.router
            sessions = [f"bench-{i:04d}-0000-4000-8000-000000000000" for i in range(8)]
            for s in sessions:      # the openings: each session's pin
                await router.request(make_flow(s, BP.body("opening", s, 1024)))
            await p.settle()
            payloads = [BP.body("continuation", s, size) for s in sessions]
            check = make_flow(sessions[0], payloads[0])
            await router.request(check)
            meta = check.metadata["sessionpin"]
            assert meta["rule"] == "pinned" and meta["model"] == ["claude-opus-4-5", "glm-4.6"], meta
            assert check.request.host == "api.z.ai" and check.request.headers["x-api-key"] == "zai-sentinel"
            best = []
            for _ in range(args.rounds):
                flows = [make_flow(sessions[i % 8], payloads[i % 8]) for i in range(args.repeat)]
                gc.collect()
                t0 = time.process_time()
                for f in flows:
                    await router.request(f)
                best.append((time.process_time() - t0) / args.repeat * 1e6)
                await p.settle()
            print(f"{args.size} pinned turn, Router.request: {min(best):.1f} µs CPU per request "
                  f"(best of {args.rounds} × {args.repeat}; all: {', '.join(f'{b:.1f}' for b in best)})")
            for name, us in parts(router, make_flow(sessions[0], payloads[0]), max(50, args.repeat // 10)).items():
                print(f"  {name}: {us:.1f} µs")
        finally:
            p.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="10KB", choices=sorted(SIZES))
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import sessionpin
    print(f"sessionpin from {Path(sessionpin.__file__).parent.parent.name}/")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
