"""The file store across processes: crashes lose no acknowledged durable write, several
processes lose no update, and each sees the others' writes within 1 s.

Every child is a real Python process on the same file; the crashes are real SIGKILLs.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from children import communicate
from sessionpin.store.file import FileStore

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], env=ENV, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


DURABLE_CHILD = r"""
import sys
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
r = sys.argv[2]
i = 0
while True:
    s.set(f"r{r}:k{i}", str(i), durable=True)        # a new pin, say
    n = s.hincr("acks", r, 1, durable=True)
    print(i, n, flush=True)                           # acknowledged: both calls returned
    s.set(f"r{r}:o{i}", "ordinary")                   # ordinary writes in between
    s.hset(f"r{r}:h", "last", str(i))
    i += 1
"""


def test_sigkill_loses_no_acknowledged_durable_write(tmp_path):
    path = tmp_path / "state.db"
    rng = random.Random(0x5E55)
    acked_total = 0
    for r in range(24):
        p = spawn(DURABLE_CHILD, str(path), str(r))
        first = ""
        if r % 2:
            first = p.stdout.readline()   # odd rounds: die while writing, whatever the load
        # even rounds: some kills land while the child is still opening (or creating) the file
        time.sleep(rng.uniform(0.0, 0.3))
        p.send_signal(signal.SIGKILL)
        out, err = communicate(p)
        out = first + out
        assert p.returncode == -signal.SIGKILL, err
        acked = [tuple(map(int, line.split())) for line in out.split("\n")[:-1]]  # only whole lines
        assert [i for i, _ in acked] == list(range(len(acked)))
        acked_total += len(acked)

        s = FileStore(path)          # reopen after the crash, as the next proxy would
        try:
            for i, _ in acked:
                assert s.get(f"r{r}:k{i}") == str(i), (r, i)
            last = len(acked) - 1
            counted = int(s.hget("acks", str(r)) or 0)
            assert counted in (last + 1, last + 2)   # the in-flight increment may have committed
            # nothing invented: every key of this round is one the child wrote, with its value
            written = set(range(last + 2))            # acknowledged ones and the one in flight
            for key in s.keys(f"r{r}:"):
                name = key.split(":", 1)[1]
                if name == "h":
                    assert int(s.hget(key, "last")) in written
                elif name[0] == "k":
                    assert int(name[1:]) in written and s.get(key) == name[1:]
                else:
                    assert name[0] == "o" and int(name[1:]) in written and s.get(key) == "ordinary"
            assert set(s.hgetall("acks")) <= {str(x) for x in range(r + 1)}
        finally:
            s.close()
    assert acked_total >= 12   # the test did exercise acknowledged writes (hundreds, unloaded)


HAMMER_CHILD = r"""
import sys
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
me, n = sys.argv[2], int(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()                                  # all start together
claimed, took = [], []
for i in range(n):
    durable = i % 10 == 0
    s.incr("shared:n", durable=durable)
    s.incr(f"own:{me}")
    s.hincr("shared:h", "total")
    s.hincr("shared:h", me, durable=durable)
    s.set(f"last:{me}", str(i))
    s.hset("shared:last", me, str(i))
    if s.hsetnx("claims", f"c{i}", me):
        claimed.append(i)
    if s.hdel("tokens", f"t{i}"):
        took.append(i)
print("claimed", *claimed, flush=True)
print("took", *took, flush=True)
s.close()
"""


def test_three_processes_lose_no_update(tmp_path):
    path = tmp_path / "state.db"
    n = 400
    s = FileStore(path)
    for i in range(n):
        s.hset("tokens", f"t{i}", "1")
    procs = [spawn(HAMMER_CHILD, str(path), f"p{k}", str(n)) for k in range(3)]
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    claimed, took = {}, {}
    for k, (out, _) in enumerate(outs):
        lines = dict(line.split(" ", 1) if " " in line else (line, "") for line in out.splitlines())
        claimed[f"p{k}"] = {int(x) for x in lines["claimed"].split()}
        took[f"p{k}"] = {int(x) for x in lines["took"].split()}
    try:
        assert s.get("shared:n") == str(3 * n)
        assert all(s.get(f"own:p{k}") == str(n) for k in range(3))
        assert s.hgetall("shared:h") == {"total": str(3 * n), **{f"p{k}": str(n) for k in range(3)}}
        assert all(s.get(f"last:p{k}") == str(n - 1) for k in range(3))
        assert s.hgetall("shared:last") == {f"p{k}": str(n - 1) for k in range(3)}
        # hsetnx: each field set by exactly one process, the one that was told it won
        claims = s.hgetall("claims")
        assert len(claims) == n
        for me, won in claimed.items():
            assert won == {i for i in range(n) if claims[f"c{i}"] == me}
        # hdel as a claim: of three deleting one field, exactly one saw True
        assert sorted(i for won in took.values() for i in won) == list(range(n))
        assert s.hgetall("tokens") == {}
    finally:
        s.close()


WATCH_CHILD = r"""
import sys, time
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
s.get("warm")                     # this process has read the file before the change
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
while time.monotonic() - t0 < 5:
    if s.get("ping") == "1" and s.hget("h", "f") == "2" and s.get("gone") is None:
        print("seen", time.monotonic() - t0, flush=True)
        break
    time.sleep(0.002)
s.set("pong", repr(time.time()))  # when it was written, on the clock both processes share
s.close()
"""


def test_each_process_sees_the_others_within_1s(tmp_path):
    path = tmp_path / "state.db"
    s = FileStore(path)
    try:
        s.set("gone", "1")
        s.hset("h", "f", "1")
        p = spawn(WATCH_CHILD, str(path))
        assert p.stdout.readline() == "ready\n"
        s.set("ping", "1")
        s.hset("h", "f", "2")
        s.delete("gone")
        p.stdin.write("go\n")
        p.stdin.flush()
        line = p.stdout.readline()
        assert line.startswith("seen "), p.stderr.read()
        assert float(line.split()[1]) < 1.0
        t0 = time.monotonic()
        while (pong := s.get("pong")) is None and time.monotonic() - t0 < 5:
            time.sleep(0.002)
        assert pong is not None and time.time() - float(pong) < 1.0
        p.wait(timeout=10)
    finally:
        s.close()


READ_CHILD = r"""
import sys
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
if len(sys.argv) > 2:
    s.set(sys.argv[2], "child")
print(repr(s.get("after")))
s.close()
"""


def test_two_stores_in_one_process_keep_sqlites_locks(tmp_path):
    # Closing any descriptor of the database file drops every POSIX lock the process holds
    # on it, SQLite's too. If opening a second store on the file (the pool does) did that,
    # a third process closing would think it was the last, delete the WAL, and the first
    # store's later commits would vanish.
    path = tmp_path / "state.db"
    a = FileStore(path)
    a.set("before", "1")
    b = FileStore(path)
    try:
        out = subprocess.run([sys.executable, "-c", READ_CHILD, str(path), "child"], env=ENV,
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        a.set("after", "2", durable=True)
        out = subprocess.run([sys.executable, "-c", READ_CHILD, str(path)], env=ENV,
                             capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "'2'", out.stderr
        assert b.get("after") == "2" and b.get("child") == "child"
    finally:
        b.close()
        a.close()
    assert FileStore(path).get("after") == "2"


CLAIM_CHILD = r"""
import sys
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
me, n = sys.argv[2], int(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()
won_nx, won_cas = [], []
for i in range(n):
    if s.set(f"nx:{i}", me, 3600, nx=True, durable=i % 4 == 0):
        won_nx.append(i)
    # cas: first from absent, then a chain: each round moves the token from its last holder
    seen = s.get(f"cas:{i}")
    if s.cas(f"cas:{i}", seen, me + ":" + (seen or "-"), durable=i % 4 == 1):
        won_cas.append(i)
print("nx", *won_nx, flush=True)
print("cas", *won_cas, flush=True)
s.close()
"""


def run_together(code: str, path: Path, n: int, k: int = 3) -> list[dict[str, list[int]]]:
    procs = [spawn(code, str(path), f"p{j}", str(n)) for j in range(k)]
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n", p.stderr.read()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        results.append({line.split()[0]: [int(x) for x in line.split()[1:]] for line in out.splitlines()})
    return results


def test_cas_and_set_nx_have_exactly_one_winner_per_key_across_processes(tmp_path):
    path = tmp_path / "state.db"
    n = 300
    FileStore(path).close()
    results = run_together(CLAIM_CHILD, path, n)
    s = FileStore(path)
    try:
        for i in range(n):
            nx_winners = [f"p{j}" for j, r in enumerate(results) if i in r["nx"]]
            assert len(nx_winners) == 1 and s.get(f"nx:{i}") == nx_winners[0], i
            # every successful cas is one link of the chain on disk, and no link is lost
            chain = s.get(f"cas:{i}").split(":")
            cas_winners = sorted(f"p{j}" for j, r in enumerate(results) if i in r["cas"])
            assert chain[-1] == "-" and sorted(chain[:-1]) == cas_winners, i
    finally:
        s.close()


TRANSFER_CHILD = r"""
import random, sys
from sessionpin.store import Check, Set, ZAdd
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
me, n = sys.argv[2], int(sys.argv[3])
rng = random.Random(me)
print("ready", flush=True)
sys.stdin.readline()
done = []
for i in range(n):
    a, b = rng.sample(["acct:0", "acct:1", "acct:2", "acct:3"], 2)
    while True:               # optimistic: read, then apply only if nothing moved meanwhile
        va, vb = s.mget([a, b])
        moved = s.apply([Check(a, va), Check(b, vb)],
                        [Set(a, str(int(va) - 1)), Set(b, str(int(vb) + 1)), ZAdd("log", f"{me}:{i}", i)],
                        durable=i % 5 == 0)
        if moved:
            done.append(i)
            break
print("done", *done, flush=True)
s.close()
"""


def test_apply_keeps_a_multi_key_invariant_under_contention(tmp_path):
    path = tmp_path / "state.db"
    n = 200
    s = FileStore(path)
    for k in range(4):
        s.set(f"acct:{k}", "1000")
    try:
        results = run_together(TRANSFER_CHILD, path, n)
        balances = [int(v) for v in s.mget([f"acct:{k}" for k in range(4)])]
        assert sum(balances) == 4000                          # no transfer half-made
        assert balances != [1000] * 4                         # (the test did move money)
        assert all(r["done"] == list(range(n)) for r in results)
        assert s.zcount("log", float("-inf"), float("inf")) == 3 * n   # each transfer once
    finally:
        s.close()


LOCK_HOLDER = r"""
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN IMMEDIATE")
c.execute("UPDATE entries SET value = 'changed' WHERE key = 'pin:a'")   # uncommitted, then rolled back
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
c.execute("ROLLBACK")
"""


async def test_reads_never_wait_for_a_writer_of_another_process(tmp_path):
    from sessionpin.store import NotDurable, open_store

    path = tmp_path / "state.db"
    store = open_store(f"file:{path}", busy_timeout=1.0)
    try:
        await store.set("pin:a", "gpu-a", durable=True)
        await store.hset("seen:a", "requests", "1")
        holder = spawn(LOCK_HOLDER, str(path), "2.5")
        assert holder.stdout.readline() == "locked\n", holder.stderr.read()
        t0 = time.monotonic()
        write = asyncio.ensure_future(store.set("pin:b", "gpu-b", nx=True, durable=True))
        await asyncio.sleep(0.05)                             # the writer thread is waiting now
        for _ in range(20):
            t = time.monotonic()
            assert await store.get("pin:a") == "gpu-a"       # the committed value, at once
            assert await store.hget("seen:a", "requests") == "1"
            assert time.monotonic() - t < 0.25
        assert not write.done()                               # (the write really was waiting)
        with pytest.raises(NotDurable):
            await write
        assert 0.9 < time.monotonic() - t0 < 2.0              # busy_timeout, then it gave up
        assert await store.get("pin:b") is None               # nothing behind
        holder.wait(timeout=10)
        assert await store.set("pin:b", "gpu-b", nx=True, durable=True) is True
    finally:
        await store.close()
