#!/usr/bin/env python3
"""When does work a response hook schedules run: before or after mitmproxy sends the answer?
(issue 22, seventeenth round: what ``sessionpin.proxy.later`` waits for.)

    .venv/bin/python scripts/bench_after_answer.py [--requests 60] [--busy-ms 5]

One local TLS upstream and one mitmdump per variant, each with a one-hook script whose
``response`` does ``--busy-ms`` of busy work: inline; scheduled by ``call_soon``; by two
``call_soon`` in a row; by ``call_soon`` again while the flow is live (``later.Later``'s
rule); by ``call_later`` 1 ms. Plus plain mitmdump, first and last. A client sends
``--requests`` small requests through each, 20 ms apart (an agent's requests are apart:
the work has time to run), and the median latency of each is printed. Work that runs
before the answer is sent adds about ``--busy-ms`` to it; work that runs after, about nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from e2e.harness import Client, FakeServer, Mitmdump, TestCA  # noqa: E402

BUSY = ("import asyncio, time\n"
        "def busy():\n"
        "    t = time.perf_counter()\n"
        "    while time.perf_counter() - t < {seconds}:\n"
        "        pass\n")
VARIANTS = {
    "plain": None,
    "inline": "def response(flow):\n    busy()\n",
    "call_soon": "def response(flow):\n    asyncio.get_running_loop().call_soon(busy)\n",
    "call_soon twice": "def response(flow):\n    loop = asyncio.get_running_loop()\n"
                       "    loop.call_soon(loop.call_soon, busy)\n",
    "while live": "def response(flow):\n    loop = asyncio.get_running_loop()\n"
                  "    def later(n=0):\n"
                  "        if flow.live and n < 8:\n"
                  "            loop.call_soon(later, n + 1)\n"
                  "            return\n"
                  "        busy()\n"
                  "    loop.call_soon(later)\n",
    "call_later 1 ms": "def response(flow):\n    asyncio.get_running_loop().call_later(0.001, busy)\n",
    "plain again": None,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--busy-ms", type=float, default=5.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sessionpin-after-answer-") as tmp_:
        tmp = Path(tmp_)
        ca = TestCA(tmp / "ca")
        upstream = FakeServer("upstream", ca).start()
        trust = {"ssl_verify_upstream_trusted_ca": str(ca.pem)}
        procs: dict[str, Mitmdump] = {}
        try:
            for i, (name, hook) in enumerate(VARIANTS.items()):
                script = None
                if hook is not None:
                    script = tmp / f"v{i}.py"
                    script.write_text(BUSY.format(seconds=args.busy_ms / 1000) + hook)
                procs[name] = m = Mitmdump(tmp / f"v{i}", script=script, options=trust)
                m.start()
            print(f"response hook with {args.busy_ms:g} ms of work; median latency of {args.requests} requests, "
                  f"20 ms apart")
            for name, m in procs.items():
                conn = Client.via_proxy(m.port, m.mitm_ca, timeout=30).connect(upstream.url)
                took = []
                for _ in range(args.requests):
                    r = conn.request("POST", "/v1/messages", [("content-type", "application/json")],
                                     b'{"model":"x","messages":[]}')
                    took.append(r.t_done - r.t_sent)
                    time.sleep(0.02)
                conn.close()
                print(f"  {name:<16} {statistics.median(took[5:]) * 1000:6.2f} ms", flush=True)
        finally:
            for m in procs.values():
                m.stop()
            upstream.stop()


if __name__ == "__main__":
    main()
