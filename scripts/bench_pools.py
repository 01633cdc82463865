#!/usr/bin/env python3
"""What a server pool's allocation costs a new conversation, alone and under contention.

One file store (the default kind), in DIR. Each new conversation is timed from the call to
its return, through the async store facade a proxy uses:

  baseline     ``pins.create``: the durable pin of a new conversation on one server (what
               every new conversation pays without pools)
  allocation   ``members.allocate``: read the cursor, the drains and the members' quota,
               choose (round-robin over three members), and write the pin, its index,
               the cursor's advance and the record in one durable ``apply``

first on a memory store (no disk: what the transaction itself costs in CPU), then on the
file store in one process with one conversation at a time, then in three processes at
once ("three proxies": each its own store handle, CONCURRENCY openings in flight, one
allocation at a time per process as the proxy's per-pool lock keeps it), baseline and
allocation taking turns in BLOCKS blocks (each first in every other block) so disk drift
falls on both alike. Prints the
median and 90th percentile per conversation, the ratio allocation / baseline of the
medians measured in this run, the retries contention cost (conflicts per allocation),
and checks the contended allocations came out exactly round-robin.

    .venv/bin/python scripts/bench_pools.py [--dir DIR] [--n N] [--concurrency C] [--blocks B]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sessionpin.serverpools import members  # noqa: E402
from sessionpin.records import pins  # noqa: E402
from sessionpin.config.config import parse  # noqa: E402
from sessionpin.store import open_store  # noqa: E402

CONFIG = parse('''
[servers.glm-a]
url = "https://a.example"
[servers.glm-b]
url = "https://b.example"
[servers.glm-c]
url = "https://c.example"
[pools.glm]
members = ["glm-a", "glm-b", "glm-c"]
[agents.claude-code]
server = "glm"
''')
POOL = CONFIG.pools["glm"]
NONE = pins.Loaded(None, None)


def template() -> pins.Pin:
    t = time.time()
    return pins.Pin(agent="claude-code", server=None, since=t, renewed=t, rule="opening", turn="opening")


async def run(url: str, kind: str, n: int, concurrency: int, store=None) -> tuple[list[float], int, list[str]]:
    """``n`` new conversations, ``concurrency`` in flight; (latencies in s, conflicts, members)."""
    own = store is None
    store = store or open_store(url)
    lock = asyncio.Lock()
    latencies: list[float] = []
    chosen: list[str] = []
    conflicts = 0
    worst = [0]
    todo = iter(range(n))

    async def worker() -> None:
        nonlocal conflicts
        for _ in todo:
            session = str(uuid.uuid4())
            t0 = time.perf_counter()
            if kind == "baseline":
                p = template()
                got = await pins.create(store, session, pins.Pin(agent=p.agent, server="glm-a", since=p.since,
                                                                 renewed=p.renewed, rule=p.rule, turn=p.turn))
                assert got.pin is not None
            else:
                async with lock:
                    got = await members.allocate(store, CONFIG, POOL, session, template(), NONE)
                if isinstance(got, members.Refused):      # 20 conflicts: the agent is told to retry
                    assert got.kind == "pool-contention", got
                    chosen.append("")
                    conflicts += members.MAX_CONFLICTS
                    continue
                assert isinstance(got, members.Allocated), got
                conflicts += got.conflicts
                worst[0] = max(worst[0], got.conflicts)
                chosen.append(got.member)
            latencies.append(time.perf_counter() - t0)
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        if own:
            await store.close()
    return latencies, conflicts, chosen + [f"worst:{worst[0]}"]


def child(url: str, kind: str, n: int, concurrency: int, barrier, out) -> None:
    barrier.wait()
    out.put(asyncio.run(run(url, kind, n, concurrency)))


def contended(url: str, kind: str, n: int, concurrency: int) -> tuple[list[float], int, list[str], float]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=child, args=(url, kind, n, concurrency, barrier, out)) for _ in range(3)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    lat = [x for r in results for x in r[0]]
    return lat, sum(r[1] for r in results), [m for r in results for m in r[2]], wall


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--n", type=int, default=60, help="conversations per process per block")
    ap.add_argument("--concurrency", type=int, default=4, help="openings in flight per process")
    ap.add_argument("--blocks", type=int, default=4)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-pools-", dir=args.dir))
    url = f"file:{work / 'state.db'}"
    asyncio.run(_cursor(url))      # create the file before the children race to
    lat: dict[str, list[float]] = {k: [] for k in ("baseline", "allocation", "baseline x3", "allocation x3",
                                                   "baseline (memory)", "allocation (memory)")}
    memory = open_store("memory:")
    conflicts = allocations = refused = worst = 0
    exact = True
    for block in range(args.blocks):
        # each takes the first turn in every other block (the disk's state drifts within a block)
        for kind in ("baseline", "allocation") if block % 2 == 0 else ("allocation", "baseline"):
            got, c, _ = asyncio.run(run(url, kind, args.n, 1))
            lat[kind] += got
            got, c, _ = asyncio.run(run("memory:", kind, args.n * 5, 1, memory))
            lat[kind + " (memory)"] += got
            before = asyncio.run(_cursor(url))
            got, c, chosen, _ = contended(url, kind, args.n, args.concurrency)
            lat[kind + " x3"] += got
            if kind == "allocation":
                worst = max([worst] + [int(m[6:]) for m in chosen if m.startswith("worst:")])
                chosen = [m for m in chosen if not m.startswith("worst:")]
                refused += chosen.count("")
                chosen = [m for m in chosen if m]
                conflicts += c
                allocations += len(chosen)
                counts = Counter(chosen)
                exact &= asyncio.run(_cursor(url)) == before + len(chosen) and max(counts.values()) - min(
                    counts.values()) <= 1
    print(f"file store in {work}; {args.blocks} blocks; one process: {args.n} conversations per block one at a "
          f"time; three processes: {args.n} each per block, {args.concurrency} in flight per process")
    print(f"{'new conversation':<28}{'median':>12}{'p90':>12}{'ratio to baseline':>20}")
    print("-" * 72)
    for kind, base in (("baseline (memory)", "baseline (memory)"), ("allocation (memory)", "baseline (memory)"),
                       ("baseline", "baseline"), ("allocation", "baseline"), ("baseline x3", "baseline x3"),
                       ("allocation x3", "baseline x3")):
        med = statistics.median(lat[kind])
        print(f"{kind:<28}{med * 1e3:>10.3f}ms{pct(lat[kind], 0.9) * 1e3:>10.3f}ms"
              f"{med / statistics.median(lat[base]):>20.2f}")
    print(f"\nconflicts under contention: {conflicts} retries over {allocations} allocations "
          f"({conflicts / max(1, allocations):.2f} per allocation, at most {worst} for one; the limit is "
          f"{members.MAX_CONFLICTS}); refused after {members.MAX_CONFLICTS} conflicts: {refused}")
    print(f"contended allocations exactly round-robin (cursor advanced once per allocation, "
          f"members within one of each other): {'yes' if exact else 'NO'}")


async def _cursor(url: str) -> int:
    store = open_store(url)
    try:
        return (await members.cursor(store, "glm")).n
    finally:
        await store.close()


if __name__ == "__main__":
    main()
