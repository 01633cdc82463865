"""The two copies (sessionpin/store/copies.py): every write leaves ``state.db`` and
``state.db.copy`` holding the same rows; a file is judged and rebuilt on its own."""

from __future__ import annotations

import random
import sqlite3

from sessionpin.store import copies
from sessionpin.store.base import Delete, HIncr, HSet, Set, ZAdd, ZRem
from sessionpin.store.file import FileStore


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def rows(c: sqlite3.Connection, schema: str) -> dict[str, list]:
    return {t: sorted(c.execute(f"SELECT * FROM {schema}.{t}").fetchall()) for t in copies.TABLES}


def test_every_write_leaves_both_copies_holding_the_same_rows(tmp_path):
    clock, rng = Clock(), random.Random(7)
    s = FileStore(tmp_path / "state.db", clock=clock)
    try:
        keys = [f"k{i}" for i in range(12)]
        for step in range(1500):
            k, d = rng.choice(keys), rng.random() < 0.3
            op = rng.randrange(12)
            try:
                if op == 0:
                    s.set(k, f"v{step}", rng.choice([None, 5, 50]), nx=rng.random() < 0.3, durable=d)
                elif op == 1:
                    s.hset(k, f"f{rng.randrange(4)}", str(step), durable=d)
                elif op == 2:
                    s.hdel(k, f"f{rng.randrange(4)}", durable=d)
                elif op == 3:
                    s.hincr(k, f"f{rng.randrange(4)}", 2, durable=d)
                elif op == 4:
                    s.zadd(k, f"m{rng.randrange(6)}", rng.randrange(100), durable=d)
                elif op == 5:
                    s.zrem(k, f"m{rng.randrange(6)}", durable=d)
                elif op == 6:
                    s.zremrange(k, 20, 60)
                elif op == 7:
                    s.delete(k, durable=d)
                elif op == 8:
                    s.expire(k, rng.choice([-1, 3, 30]), durable=d)
                elif op == 9:
                    s.incr(k, 3, durable=d)
                elif op == 10:
                    s.apply([], [Set(k, "a", 10), HSet(rng.choice(keys), "f0", "x"), HIncr(rng.choice(keys), "f1", 1),
                                 ZAdd(rng.choice(keys), "m0", 1.5), ZRem(rng.choice(keys), "m1"),
                                 Delete(rng.choice(keys))], durable=d)
                else:
                    s.cas(k, s.get(k), f"c{step}", 20, durable=d)
            except Exception as exc:       # a type error (WrongType/StoreError) changes nothing
                assert "holds a" in str(exc) or "integer" in str(exc), exc
            clock.now += rng.choice([0, 1, 4])
            if step % 300 == 0:
                s.sweep()
            if step % 50 == 0:
                assert rows(s._w, "main") == rows(s._w, "copy"), step
        assert rows(s._w, "main") == rows(s._w, "copy")
        assert copies.seq(s._w) == copies.seq(s._w, "copy") > 100       # raised by durable writes
    finally:
        s.close()


def test_judge_and_rebuild(tmp_path):
    path = tmp_path / "state.db"
    s = FileStore(path)
    for i in range(300):
        s.set(f"k{i}", str(i))
    s.hset("h", "f", "v", durable=True)
    s.zadd("z", "m", 1.0, durable=True)              # the sequence: raised by durable writes
    s.close()
    connect = lambda p: sqlite3.connect(copies.uri(p), uri=True, isolation_level=None)   # noqa: E731
    whole = copies.judge(path, connect)
    assert whole.why is None and whole.seq == 2 == copies.judge(copies.copy_path(path), connect).seq
    assert copies.judge(tmp_path / "absent.db", connect) == copies.Verdict(None, "missing")
    src = connect(path)
    try:
        assert copies.rebuild(src, "main", tmp_path / "other.db") == 302
    finally:
        src.close()
    c = connect(tmp_path / "other.db")
    c.execute("ATTACH DATABASE ? AS orig", (copies.uri(path),))
    assert rows(c, "main") == rows(c, "orig")
    assert c.execute("PRAGMA user_version").fetchone()[0] == 2
    c.close()
    assert not list(tmp_path.glob("*.new-*"))
    data = bytearray((tmp_path / "other.db").read_bytes())
    data[4096 * 2: 4096 * 4] = b"\xff" * 8192
    (tmp_path / "other.db").write_bytes(bytes(data))
    assert copies.judge(tmp_path / "other.db", connect).why is not None
