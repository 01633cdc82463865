#!/usr/bin/env python3
"""CPU of the file store's writes as the proxy's record batches make them (issue 22).

    .venv/bin/python scripts/bench_batches.py [--batches 300]
    PYTHONPATH=<another tree> .venv/bin/python scripts/bench_batches.py     # another tree's store

On a ``FileStore`` (both copies, the writer's own thread here: ``apply`` called directly), the
thread CPU (``time.thread_time``) of:
  ledger batch   one ``apply`` of what ``LedgerWatch`` writes for 8 conversations in one flush:
                 two ``HSet`` and six ``HIncr`` per conversation's hash, two ``ZAdd`` turn records
  lineage batch  one ``apply`` of 20 ``Set``s (a response's anchor each, 1-day TTL)
  one Set        one ``apply`` of a single ``Set``: the cost of a transaction itself
Each printed per batch, mean over ``--batches`` (the ledger's in blocks of 50: its keys grow).

``--inblock [DIR]``: instead, ~3,000 commits of a lineage batch and a ledger-like one made as
the event loop makes them (``write_now``; a forced checkpoint every 300), on a store in DIR
(default: the temp directory), counting those during which this thread's block reads or major
faults moved (``getrusage``: what sends the facade's writes to its thread for a while).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

from sessionpin.store.base import HIncr, HSet, Set, ZAdd
from sessionpin.store.file import FileStore


def ledger_batch(sessions: list[str], i: int) -> list:
    writes: list = []
    for s in sessions:
        k = "ledger:" + s
        writes += [HSet(k, "agent", "claude-code"), HSet(k, "lane:main", '{"x":%d}' % i)]
        writes += [HIncr(k, f"up|glm|{f}", 10) for f in ("input", "output", "cache_read", "cache_write", "turns")]
        writes += [HIncr(k, "turns", 2)]
        writes += [ZAdd("ledger:turns:" + s, '{"t":%d,"u":"%s"}' % (i, s), float(i)),
                   ZAdd("ledger:turns:" + s, '{"t":%d.5,"u":"%s"}' % (i, s), float(i))]
    return writes


def inblock(where: str | None) -> None:
    import resource
    import threading

    from sessionpin.store.base import WouldBlock
    slow: list[float] = []
    fast: list[float] = []
    moved = {"block reads": 0, "major faults": 0, "commits": 0, "waited (made on the writer's connection)": 0}
    with tempfile.TemporaryDirectory(prefix="sessionpin-inblock-", dir=where) as tmp:
        store = FileStore(Path(tmp) / "state.db")
        try:
            store.open_now(threading.get_ident())
            for i in range(3000):
                writes = [Set(f"lin:claude-code:req:{uuid.uuid4().hex}", "x" * 80, 86400) for _ in range(20)]
                writes += [ZAdd(f"ledger:turns:s{j}", '{"t":%d,"u":"%s"}' % (i, uuid.uuid4().hex), float(i))
                           for j in range(8)]
                before, t = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
                try:
                    store.write_now("apply", [], writes)
                except WouldBlock:          # (the WAL waits for its checkpoint: not the loop's)
                    store.apply([], writes)
                    moved["waited (made on the writer's connection)"] += 1
                    continue
                after, took = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter() - t
                blocks, faults = after.ru_inblock != before.ru_inblock, after.ru_majflt != before.ru_majflt
                moved["commits"] += 1
                moved["block reads"] += blocks
                moved["major faults"] += faults
                (slow if blocks or faults else fast).append(took)
                if i % 300 == 299:
                    store._writer.checkpoint(force=True)
        finally:
            store.close()
    print(", ".join(f"{k}: {v}" for k, v in moved.items()))
    for name, took in (("that read from the disk", slow), ("the others", fast)):
        if took:
            took.sort()
            print(f"commits {name}: median {took[len(took) // 2] * 1000:.2f} ms, "
                  f"slowest {took[-1] * 1000:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--inblock", nargs="?", const="", metavar="DIR",
                    help="count the loop's commits that read from the disk, on a store in DIR")
    args = ap.parse_args()
    if args.inblock is not None:
        inblock(args.inblock or None)
        return
    with tempfile.TemporaryDirectory(prefix="sessionpin-batches-") as tmp:
        store = FileStore(Path(tmp) / "state.db")
        try:
            sessions = [str(uuid.uuid4()) for _ in range(8)]
            block = 50
            for start in range(0, args.batches, block):
                t0 = time.thread_time()
                for i in range(start, start + block):
                    store.apply([], ledger_batch(sessions, i))
                print(f"ledger batch (88 writes), after {start + block:4d}: "
                      f"{(time.thread_time() - t0) / block * 1000:.2f} ms")
            t0 = time.thread_time()
            for _ in range(50):
                store.apply([], [Set(f"lin:claude-code:{uuid.uuid4().hex}", "x" * 60, 86400) for _ in range(20)])
            print(f"lineage batch (20 Sets): {(time.thread_time() - t0) / 50 * 1000:.2f} ms")
            t0 = time.thread_time()
            for _ in range(200):
                store.apply([], [Set(f"lin:x:{uuid.uuid4().hex}", "x", 86400)])
            print(f"one Set: {(time.thread_time() - t0) / 200 * 1000:.3f} ms")
        finally:
            store.close()


if __name__ == "__main__":
    main()
