#!/usr/bin/env python3
"""Fill a store quickly with fake pins (ids only: nothing from a prompt) for the benchmarks.

    .venv/bin/python scripts/fill_pins.py STORE_URL N [--seen 1.0] [--batch 1000] [--start 0]

Writes N pins ``fill-<n>`` through the store's own ``apply`` (so the file store's copy
and the Redis store's key prefix are what the router would leave), each with its index entry
as ``pins.create`` writes it; a share ``--seen`` of them also gets an activity record
(``seen:<session>``: last seen and requests, as ``pins.record_seen`` leaves it, without its
TTL: an ``apply`` sets none on a hash) and its ``active:`` member. Pins are spread over
three agents and four servers (one of them "not routed"), renewed within the last day and
seen within the last hour, so a listing sorted or filtered has something to do.

Each batch is one durable ``apply``, as the router's pins are durable: a file store's copy
then holds every pin, as a real one does (what opening the store costs depends on it), and a
Redis store needs ``?durability=accept-weaker`` unless its server fsyncs every write.
``--not-durable`` writes ordinary ones instead (they reach disk within ~2 s instead of before each call). A 1M-pin
``--not-durable`` fill took 2-4 minutes on a file store and on loopback Redis on a busy
2-core machine. Run it on a store no proxy uses.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sessionpin.records import pins  # noqa: E402
from sessionpin.store import HSet, Set, ZAdd, open_store  # noqa: E402

AGENTS = ("claude-code", "opencode", "codex")
SERVERS = ("anthropic", "glm", "gpu-a", None)


def session(i: int) -> str:
    return f"fill-{i:08d}"


def writes_for(i: int, now: float, seen: bool) -> list:
    s = session(i)
    agent, server = AGENTS[i % len(AGENTS)], SERVERS[(i // len(AGENTS)) % len(SERVERS)]
    renewed = now - (i * 7919 % 86_400)             # spread over the last day
    pin = pins.Pin(agent=agent, server=server, since=renewed - 3600, renewed=renewed, rule="opening",
                   turn="opening")
    out = [Set(pins.key(s), pins.encode(pin), pins.PIN_TTL), *pins.index_writes(s, pin)]
    if seen:
        last = now - (i * 104_729 % 3600)
        out += [HSet(pins.SEEN_PREFIX + s, "requests", str(1 + i % 50)),
                HSet(pins.SEEN_PREFIX + s, "last", repr(last)),
                ZAdd(pins.active_key(agent, server), s, last)]
    return out


async def fill(url: str, n: int, start: int, seen_share: float, batch: int, durable: bool) -> None:
    store = open_store(url)
    now = time.time()
    every = round(1 / seen_share) if seen_share > 0 else 0
    try:
        t0 = time.perf_counter()
        for first in range(start, start + n, batch):
            writes: list = []
            for i in range(first, min(start + n, first + batch)):
                writes += writes_for(i, now, bool(every) and i % every == 0)
            await store.apply([], writes, durable=durable)
            done = first + batch - start
            if done % (100 * batch) == 0:
                print(f"{done} pins, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    finally:
        await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", metavar="STORE_URL")
    ap.add_argument("n", type=int, metavar="N")
    ap.add_argument("--start", type=int, default=0, help="the first pin's number (to add to a filled store)")
    ap.add_argument("--seen", type=float, default=1.0, help="the share of pins with an activity record (0-1)")
    ap.add_argument("--batch", type=int, default=1000, help="pins per apply")
    ap.add_argument("--not-durable", action="store_true",
                    help="ordinary writes: not fsync'd before each call returns (the router's pins are)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    asyncio.run(fill(args.url, args.n, args.start, args.seen, args.batch, not args.not_durable))
    print(f"{args.n} pins written to {args.url} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
