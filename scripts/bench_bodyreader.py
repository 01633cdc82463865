#!/usr/bin/env python3
"""What a large body costs on its trip to the body reader process (issue 22): the event loop's
CPU and the child's, per body, for its facts and for its prompt's shape.

    .venv/bin/python scripts/bench_bodyreader.py [--bodies 60] [--shapes history,grown] [--tree DIR]

``proxy.offprocess.BodyProcess`` (the router's: one child, a body at a time) is asked for the
facts and the shape of bench_proxy's 1 MB continuations (eight sessions' bodies in turn, as a
proxy meets them), ``--bodies`` times each after a first that starts the child. Reported per
body: the calling thread's CPU (the proxy's event loop: writing the body to the child, reading
its answer) and the child's (``/proc``; clock ticks, so take many bodies). ``--tree DIR``
measures another tree's sessionpin (a ``git worktree`` of an earlier commit), imported before
anything else; its child runs that tree's reader. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bodies", type=int, default=60)
    ap.add_argument("--shapes", default="history,grown")
    ap.add_argument("--tree", type=Path, default=ROOT)
    args = ap.parse_args()
    sys.path[:0] = [str(args.tree.resolve()), str(ROOT / "scripts"), str(ROOT / "tests")]
    import bench_proxy as BP
    import sessionpin
    from sessionpin.proxy.offprocess import BodyProcess
    url = "https://api.anthropic.com/v1/messages?beta=true"
    api = "anthropic-messages"
    print(f"sessionpin from {Path(sessionpin.__file__).parent.parent}; {args.bodies} bodies a figure")
    print(f"{'shape':8} {'task':6} {'loop ms/body':>13} {'child ms/body':>14}")
    for shape in args.shapes.split(","):
        sessions = [f"bench-{i:04d}-0000-4000-8000-000000000000" for i in range(8)]
        bodies = [BP.body("continuation", s, 1024 * 1024, shape=shape) for s in sessions]
        heads = [[(n.encode(), v.encode()) for n, v in BP.headers("continuation", s)] for s in sessions]

        async def run(task: str) -> tuple[float, float]:
            reader = BodyProcess()
            try:
                async def one(i: int) -> None:
                    if task == "facts":
                        await reader.facts("POST", url, heads[i % 8], bodies[i % 8], None, api)
                    else:
                        await reader.shape(bodies[i % 8], api, None)
                await one(0)                       # starts the child
                pid = reader._proc.pid
                child0, loop0 = BP.process_cpu(pid)[0], time.thread_time()
                for i in range(args.bodies):
                    await one(i)
                child1, loop1 = BP.process_cpu(pid)[0], time.thread_time()
                if reader.failures:
                    raise SystemExit(f"the body reader failed {reader.failures} times")
                return (loop1 - loop0) / args.bodies * 1e3, (child1 - child0) / args.bodies * 1e3
            finally:
                reader.close()

        for task in ("facts", "shape"):
            loop_ms, child_ms = asyncio.run(run(task))
            print(f"{shape:8} {task:6} {loop_ms:13.2f} {child_ms:14.2f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    main()
