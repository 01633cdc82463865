#!/usr/bin/env python3
"""What one store call costs, and whether it grows with the number of keys.

For a file store holding 1,000 and then 100,000 keys (prefilled in one transaction: 9 in
10 pins, 1 in 10 hashes of two fields, and every pin in one sorted-set index; its second
copy rebuilt from it), time each
call on the backend (``FileStore``, the SyncStore the facade runs on its threads):
  durable write   set(new pin key, value, 30 d TTL, nx=True, durable=True)    (pin create:
                  one commit to both copies, fsync'd in both WALs)
  cas             cas(existing pin, its value, new value, 30 d TTL)            (pin renew/move)
  ordinary write  set(existing key, value, 30 d TTL)
  hash write      hincr(seen key, "requests")                                  (activity)
  read            get(existing key)                                            (pin load)
  zcount recent   zcount(index, last 100 scores)                               (active per server)
  zcount all      zcount(index, -inf, +inf)                  (counts every member: grows with n)
then the read and the durable write through the async facade (``open_store``: a thread
hop each). Prints median and 90th percentile per call, and the ratio 100k / 1k of the
medians (goal for writes and reads: <= 2). Both sizes are measured in this one run, on the
same disk, taking turns in 10 blocks so disk drift falls on both alike.

Beside them, in the same blocks, the same two calls on a Redis store (``redis://`` on
loopback, a redis-server of its own in DIR with ``appendonly yes``, ``appendfsync always``)
holding 100,000 keys, and the ratio Redis / file at 100,000 keys. Needs ``redis-server``
($SESSIONPIN_REDIS_SERVER, PATH, /usr/sbin, /usr/bin); ``--no-redis`` leaves it out.

    .venv/bin/python scripts/bench_store.py [--dir DIR] [--durable N] [--ops N] [--no-redis]

DIR should be on the disk the store will live on (durable writes cost an fsync there);
default: the system temp directory.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sessionpin.store import open_store  # noqa: E402
from sessionpin.store.file import FileStore  # noqa: E402

TTL = 30 * 86_400.0
VALUE = '{"agent":"claude-code","server":"gpu-a","since":1764460800.0,"renewed":1764460800.0,"rule":"new"}'
INDEX = "index:gpu-a"
OPS = ("durable write", "cas", "ordinary write", "hash write", "read", "zcount recent", "zcount all")
FACADE = ("read (facade)", "durable write (facade)")
REDIS = ("read (redis)", "durable write (redis)")


def prefill(path: Path, n: int) -> None:
    FileStore(path).close()                      # creates the schema
    c = sqlite3.connect(path, isolation_level=None)
    now = time.time()
    c.execute("BEGIN")
    c.executemany(
        "INSERT INTO entries (key, kind, value, expires_at) VALUES (?, ?, ?, ?)",
        ((f"pin:{i:08d}", "s", VALUE, now + TTL) if i % 10 else (f"seen:{i:08d}", "h", None, now + TTL)
         for i in range(n)))
    c.executemany(
        "INSERT INTO fields (key, field, value) VALUES (?, ?, ?)",
        ((f"seen:{i:08d}", f, "1") for i in range(0, n, 10) for f in ("requests", "last")))
    c.execute("INSERT INTO entries (key, kind, value, expires_at) VALUES (?, 'z', NULL, NULL)", (INDEX,))
    c.executemany("INSERT INTO zsets (key, member, score) VALUES (?, ?, ?)",
                  ((INDEX, f"pin:{i:08d}", float(i)) for i in range(n) if i % 10))
    c.execute("COMMIT")
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.close()
    Path(f"{path}.copy").unlink()
    FileStore(path).close()                      # its copy: rebuilt from the database, as after a fault


def timed(calls) -> list[float]:
    out = []
    for call in calls:
        t0 = time.perf_counter_ns()
        call()
        out.append((time.perf_counter_ns() - t0) / 1000)   # µs
    return out


async def timed_async(calls) -> list[float]:
    out = []
    for call in calls:
        t0 = time.perf_counter_ns()
        await call()
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def measure(d: Path, sizes: tuple[int, ...], durable_ops: int, ops: int, with_redis: bool, rounds: int = 10):
    stores, pins, seen, opened = {}, {}, {}, {}
    for n in sizes:
        prefill(d / f"bench-{n}.db", n)
        t0 = time.perf_counter()
        stores[n] = FileStore(d / f"bench-{n}.db")   # quick_check of both copies
        opened[n] = (time.perf_counter() - t0) * 1000
        pins[n] = [f"pin:{i:08d}" for i in range(n) if i % 10]
        seen[n] = [f"seen:{i:08d}" for i in range(0, n, 10)]
    rng = random.Random(1)
    times: dict = {n: {op: [] for op in OPS} for n in sizes}
    try:
        for n in sizes:   # warm the page cache, as a running proxy has it
            for k in rng.sample(pins[n], min(2000, len(pins[n]))):
                stores[n].get(k)
        for r in range(rounds):
            for n in sizes:
                s, t, few = stores[n], times[n], max(1, ops // rounds // 10)
                t["durable write"] += timed(
                    (lambda k=f"pin:new-{r}-{j}": s.set(k, VALUE, TTL, nx=True, durable=True))
                    for j in range(durable_ops // rounds))
                t["cas"] += timed(
                    (lambda k=rng.choice(pins[n]): s.cas(k, VALUE, VALUE, TTL)) for _ in range(ops // rounds))
                t["ordinary write"] += timed(
                    (lambda k=rng.choice(pins[n]): s.set(k, VALUE, TTL)) for _ in range(ops // rounds))
                t["hash write"] += timed(
                    (lambda k=rng.choice(seen[n]): s.hincr(k, "requests")) for _ in range(ops // rounds))
                t["read"] += timed(
                    (lambda k=rng.choice(pins[n]): s.get(k)) for _ in range(ops // rounds))
                t["zcount recent"] += timed(
                    (lambda: s.zcount(INDEX, n - 111, n)) for _ in range(ops // rounds))
                t["zcount all"] += timed(
                    (lambda: s.zcount(INDEX, float("-inf"), float("inf"))) for _ in range(few))
        for n in sizes:
            assert len(stores[n].keys("pin:new-")) == durable_ops // rounds * rounds
            assert stores[n].zcount(INDEX, n - 111, n) == 100
    finally:
        for s in stores.values():
            s.close()
    asyncio.run(measure_facade(d, sizes, pins, times, durable_ops, ops, rounds, with_redis))
    return times, opened


def redis_server_binary() -> str | None:
    for c in (os.environ.get("SESSIONPIN_REDIS_SERVER", ""), shutil.which("redis-server") or "",
              "/usr/sbin/redis-server", "/usr/bin/redis-server"):
        if c and os.access(c, os.X_OK):
            return c
    return None


def start_redis(d: Path) -> tuple[subprocess.Popen, int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (d / "redis").mkdir()
    proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir",
                             str(d / "redis"), "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                             "--logfile", "redis.log"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


async def prefill_redis(s, pins: list[str], n: int) -> None:
    """n keys as the file store holds them (9 in 10 pins, 1 in 10 hashes), one script call per 1,000."""
    from sessionpin.store import HSet, Set

    batch = []
    for i in range(n):
        batch.append(Set(f"pin:{i:08d}", VALUE, TTL) if i % 10 else HSet(f"seen:{i:08d}", "requests", "1"))
        if len(batch) == 1000:
            await s.apply([], batch)
            batch = []
    if batch:
        await s.apply([], batch)


async def measure_facade(d: Path, sizes, pins, times, durable_ops: int, ops: int, rounds: int,
                         with_redis: bool) -> None:
    stores = {n: open_store(f"file:{d}/bench-{n}.db") for n in sizes}
    rng = random.Random(2)
    big = sizes[-1]
    redis, proc = None, None
    if with_redis:
        proc, port = start_redis(d)
        redis = open_store(f"redis://127.0.0.1:{port}/0")
        for _ in range(200):
            try:
                await redis.keys("none")
                break
            except Exception:  # noqa: BLE001 - still starting
                await asyncio.sleep(0.05)
        await prefill_redis(redis, pins[big], big)
        assert redis.describe()["durable"] is True, redis.describe()
        times[big].update({op: [] for op in REDIS})
    try:
        for n in sizes:
            times[n].update({op: [] for op in FACADE})
        for r in range(rounds):
            for n in sizes:
                s = stores[n]
                times[n]["read (facade)"] += await timed_async(
                    (lambda k=rng.choice(pins[n]): s.get(k)) for _ in range(ops // rounds // 5))
                times[n]["durable write (facade)"] += await timed_async(
                    (lambda k=f"pin:facade-{r}-{j}": s.set(k, VALUE, TTL, nx=True, durable=True))
                    for j in range(durable_ops // rounds // 5))
            if redis is not None:
                times[big]["read (redis)"] += await timed_async(
                    (lambda k=rng.choice(pins[big]): redis.get(k)) for _ in range(ops // rounds // 5))
                times[big]["durable write (redis)"] += await timed_async(
                    (lambda k=f"pin:redis-{r}-{j}": redis.set(k, VALUE, TTL, nx=True, durable=True))
                    for j in range(durable_ops // rounds // 5))
        if redis is not None:
            assert await redis.get(pins[big][0]) == VALUE
    finally:
        for s in stores.values():
            await s.close()
        if redis is not None:
            await redis.close()
        if proc is not None:
            proc.terminate()
            proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--durable", type=int, default=500, help="durable writes per size")
    ap.add_argument("--ops", type=int, default=5000, help="other calls of each kind per size")
    ap.add_argument("--no-redis", action="store_true", help="leave the Redis store out")
    args = ap.parse_args()
    with_redis = not args.no_redis
    if with_redis and redis_server_binary() is None:
        sys.exit("redis-server not found ($SESSIONPIN_REDIS_SERVER, PATH, /usr/sbin, /usr/bin); "
                 "install it or pass --no-redis")
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(args.dir)], capture_output=True, text=True).stdout.strip()
    print(f"python {sys.version.split()[0]}, SQLite {sqlite3.sqlite_version}, dir on {fs or '?'}")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-store-") as tmp:
        sizes = (1_000, 100_000)
        t0 = time.perf_counter()
        runs, opened = measure(Path(tmp), sizes, args.durable, args.ops, with_redis)
        print(f"(measured in {time.perf_counter() - t0:.1f} s)\n")
    head = f"{'operation':<23}" + "".join(f"{f'median {n:,}':>16}{f'p90 {n:,}':>14}" for n in sizes) + f"{'ratio 100k/1k':>16}"
    print(head)
    print("-" * len(head))
    worst = 0.0
    for op in OPS + FACADE:
        row = f"{op:<23}"
        medians = []
        for n in sizes:
            xs = runs[n][op]
            med, p90 = statistics.median(xs), statistics.quantiles(xs, n=10)[-1]
            medians.append(med)
            row += f"{med:>13.1f} µs{p90:>11.1f} µs"
        ratio = medians[1] / medians[0]
        if op != "zcount all":
            worst = max(worst, ratio)
        print(row + f"{ratio:>16.2f}")
    print("open (one-time)        " + "".join(f"{opened[n]:>13.1f} ms{'':>14}" for n in sizes))
    print(f"\nworst ratio 100k/1k (all but 'zcount all'): {worst:.2f} (goal <= 2): {'ok' if worst <= 2 else 'OVER'}")
    if with_redis:
        big = sizes[-1]
        print(f"\nRedis store (loopback, appendfsync always) at {big:,} keys, beside the file store (facade):")
        print(f"{'operation':<23}{'redis median':>16}{'p90':>14}{'file median':>16}{'redis / file':>16}")
        for redis_op, file_op in zip(REDIS, FACADE):
            xs, fs = runs[big][redis_op], runs[big][file_op]
            med, p90, fmed = statistics.median(xs), statistics.quantiles(xs, n=10)[-1], statistics.median(fs)
            print(f"{redis_op:<23}{med:>13.1f} µs{p90:>11.1f} µs{fmed:>13.1f} µs{med / fmed:>16.2f}")


if __name__ == "__main__":
    main()
