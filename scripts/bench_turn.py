#!/usr/bin/env python3
"""A whole pinned turn through the one addon, in process (issue 22): every hook of a flow
(``requestheaders``, ``request``, ``responseheaders``, ``response``) with a file store, the
answer a buffered Anthropic JSON message as the e2e fake server sends it. No TLS, no sockets:
what sessionpin costs a turn, and how many store operations it makes.

    .venv/bin/python scripts/bench_turn.py [--size 10KB] [--turns 2000] [--rounds 3]
                                           [--variants full,nolin,noledger,bare] [--shape recorded] [--tree DIR] [--hooks] [--keys]

Per variant (``make_addons(without=...)``; ``bare``: without both and the OpenCode id pool),
best of ``--rounds``: CPU per turn of this process's event-loop thread and of all its other
threads (the store's, the off-loop reads'), from ``/proc/self/task`` — the turns are sent 8
sessions round robin, each one's hooks awaited in order, then every background effect waited
out (``settle``) inside the timed span; and the store operations per turn, counted at the file
store (``_read``: reads; ``_write``: writes, ``apply`` and its records among them; writes on
the loop: those the facade made without a hop to the writer thread).
``--keys``: also the records applied per turn by their key's family (``lin:claude-code:req``: an
anchor, ``…:root``: a root, the ledger's own): which part writes what.
``--hooks``: also each hook's thread CPU per turn (``time.thread_time_ns`` around each call, the
awaited part included; the median over every round's turns) — the figure that decided the
issue's sixth and seventh rounds (``--tree`` before/after, alternated).
``--shape recorded``: every turn a recorded 115 KB Claude Code continuation (``bench_proxy.recorded``:
92 KB of tool schemas) instead of ``--size`` of opening text. ``--tree DIR``: that tree's
``sessionpin`` (a ``git worktree`` of an earlier commit: before/after in two runs).
Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
if "--tree" in sys.argv[:-1]:        # before anything imports sessionpin
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--tree") + 1]).resolve()))

from mitmproxy import http  # noqa: E402
from mitmproxy.test import taddons  # noqa: E402

import bench_hook as BH  # noqa: E402
import bench_proxy as BP  # noqa: E402

SIZES = {"10KB": 10 * 1024, "100KB": 100 * 1024, "250KB": 250 * 1024, "1MB": 1024 * 1024}
VARIANTS = {"full": dict(without=()), "nolin": dict(without=("lineage",)),
            "noledger": dict(without=("ledger",)), "bare": dict(participants=[], without=("lineage", "ledger"))}


def thread_cpu() -> dict[int, float]:
    """Each thread's CPU seconds so far; under the key 0, the processes this one started (the
    body reader's: its reads are the router's work)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {0: BP.children_cpu(os.getpid())}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def answer(n: int) -> http.Response:
    body = json.dumps({"id": f"msg_{n}", "type": "message", "role": "assistant", "model": "glm-4.6",
                       "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                       "usage": {"input_tokens": 12, "output_tokens": 6,
                                 "cache_read_input_tokens": 2000}}).encode()
    return http.Response.make(200, body, {"content-type": "application/json", "request-id": f"req_bench_{n}"})


class Counted:
    """Counts the file store's operations (wrapping the class: every instance, every thread)."""

    def __init__(self, keys: bool = False) -> None:
        from sessionpin.store.file import FileStore
        self.keys = keys     # also the records applied by their key's first three parts
        self.counts: Counter[str] = Counter()
        self.cls, self.saved = FileStore, {}
        for name in ("_write", "_read", "apply"):
            orig = getattr(FileStore, name)
            self.saved[name] = orig
            setattr(FileStore, name, self._wrap(name, orig))

    def _wrap(self, name, orig):
        counts, keys = self.counts, self.keys

        def counted(store, *a, **k):
            counts[name] += 1
            if name == "apply" and len(a) > 1:
                counts["apply records"] += len(a[1])
                if keys:            # e.g. "lin:claude-code:req": an anchor record
                    for w in a[1]:
                        counts[":".join(str(getattr(w, "key", "?")).split(":")[:3])[:24]] += 1
            return orig(store, *a, **k)
        return counted


HOOKS = ("requestheaders", "request", "responseheaders", "response")


async def turns(p, sessions, payloads, start: int, n: int, hooks: dict[str, list[int]] | None = None) -> None:
    """``n`` turns; ``hooks``: receives each hook's thread CPU time (ns) per turn (the awaited
    part of an async hook included; what it leaves to background tasks not)."""
    clock = time.thread_time_ns
    for i in range(start, start + n):
        s = i % len(sessions)
        f = BH.make_flow(sessions[s], payloads[s])
        t0 = clock()
        p.bundle.requestheaders(f)
        t1 = clock()
        await p.bundle.request(f)
        t2 = clock()
        f.response = answer(i)
        t3 = clock()
        p.bundle.responseheaders(f)
        t4 = clock()
        got = p.bundle.response(f)
        if got is not None:
            await got
        f.live = False          # as mitmproxy marks it once the answer is sent (what ``later`` waits for)
        t5 = clock()
        if hooks is not None:
            for name, took in zip(HOOKS, (t1 - t0, t2 - t1, t4 - t3, t5 - t4)):
                hooks[name].append(took)


async def settle(p) -> None:
    await p.settle()
    for part in p.bundle.parts:
        wait = getattr(part, "settled", None)
        got = wait() if callable(wait) else None
        if asyncio.iscoroutine(got):
            await got
    await asyncio.sleep(0.3)           # batched writes wait (lineage 0.1 s, ledger 0.2 s) before they go
    for part in p.bundle.parts:
        wait = getattr(part, "settled", None)
        got = wait() if callable(wait) else None
        if asyncio.iscoroutine(got):
            await got


async def run_variant(name: str, args, counted: Counted) -> tuple[float, float, dict, dict]:
    import shellkit
    from sessionpin.proxy import make_addons
    from mitmproxy import hooks

    size = SIZES[args.size]
    with tempfile.TemporaryDirectory(prefix="sessionpin-bench-turn-") as tmp:
        cfg = Path(tmp) / "config.toml"
        cfg.write_text(BH.CONFIG)
        kw = VARIANTS[name]
        addons = make_addons(participants=kw.get("participants"), env=shellkit.env(cfg), without=kw["without"])
        bundle = addons[0]
        tctx = taddons.context(bundle)
        tctx.options.update(sessionpin_config=str(cfg), sessionpin_connect_check=False,
                            sessionpin_store=f"file:{tmp}/pins.db", sessionpin_decision_log="off")
        tctx.master.addons.invoke_addon_sync(bundle, hooks.ConfigureHook(set(tctx.options.keys())))
        p = shellkit.Proxy(tctx, bundle, bundle.parts, bundle.config, bundle.runtime, bundle.connect,
                           bundle.status, bundle.router)
        try:
            sessions = [f"bench-{i:04d}-0000-4000-8000-000000000000" for i in range(8)]
            for s in sessions:
                f = BH.make_flow(s, BP.body("opening", s, 1024))
                await bundle.request(f)
            await settle(p)
            payloads = [BP.body("continuation", s, size, shape=args.shape) for s in sessions]
            await turns(p, sessions, payloads, 0, 16)
            await settle(p)
            main = __import__("threading").get_native_id()
            per_hook = {h: [] for h in HOOKS} if args.hooks else None
            best = None
            for r in range(args.rounds):
                gc.collect()
                counted.counts.clear()
                store = p.runtime.store
                on_loop = getattr(store, "now_writes", 0)
                before = thread_cpu()
                await turns(p, sessions, payloads, 100 + r * args.turns, args.turns, per_hook)
                await settle(p)
                after = thread_cpu()
                counted.counts["writes on the loop"] = getattr(store, "now_writes", 0) - on_loop
                loop = (after.get(main, 0) - before.get(main, 0)) / args.turns * 1e3
                others = sum(v - before.get(t, 0) for t, v in after.items() if t != main) / args.turns * 1e3
                ops = {k: v / args.turns for k, v in counted.counts.items()}
                if best is None or loop + others < best[0] + best[1]:
                    best = (loop, others, ops)
            medians = {h: statistics.median(v) / 1e3 for h, v in per_hook.items()} if per_hook else {}
            return (*best, medians)
        finally:
            p.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="10KB", choices=sorted(SIZES))
    ap.add_argument("--turns", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="full,nolin,noledger,bare")
    ap.add_argument("--shape", default="opening", choices=BP.SHAPES)
    ap.add_argument("--tree", type=Path, help="another tree's sessionpin (read before any import)")
    ap.add_argument("--hooks", action="store_true",
                    help="also each hook's thread CPU per turn, µs (median over every round's turns)")
    ap.add_argument("--keys", action="store_true",
                    help="also the records applied per turn by their key's first three parts (which part writes what)")
    args = ap.parse_args()
    counted = Counted(keys=args.keys)
    from sessionpin import __file__ as where
    print(f"sessionpin from {Path(where).resolve().parents[1].name}; {args.size if args.shape != 'recorded' else 'recorded'} "
          f"pinned turns, {args.turns} per round, best of {args.rounds}; CPU ms per turn")
    print(f"{'variant':10} {'loop':>6} {'others':>7} {'total':>6}  store operations per turn")

    async def every() -> None:         # one loop for all (a closed loop's master would still log)
        for name in args.variants.split(","):
            loop, others, ops, medians = await run_variant(name, args, counted)
            said = ", ".join(f"{k} {v:.3f}" for k, v in sorted(ops.items()))
            print(f"{name:10} {loop:6.3f} {others:7.3f} {loop + others:6.3f}  {said}", flush=True)
            if medians:
                print(f"{'':10} hooks, µs per turn: " + ", ".join(f"{h} {v:.0f}" for h, v in medians.items())
                      + f"; the four {sum(medians.values()):.0f}", flush=True)
    asyncio.run(every())


if __name__ == "__main__":
    main()
