"""The decision journal's format and the lock file (sessionpin/store/journal.py, filelock.py),
on real files; the store's use of them is tested in test_store_damage.py."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sessionpin.store.filelock import FileLock
from sessionpin.store.journal import Journal, encode, fold, parse

ROOT = Path(__file__).resolve().parent.parent
HEAD = encode({"sessionpin_journal": 1, "base": 5, "keys": 1, "at": 100.0})
SNAP = encode(["put", "pin:a", "s", "gpu-a", None])


def rec(seq: int, *entries, at: float = 200.0) -> bytes:
    return encode({"s": seq, "at": at, "w": list(entries)})


def test_parse_a_whole_journal():
    data = HEAD + SNAP + rec(6, ["put", "pin:b", "s", "x", None]) + rec(7, ["del", "pin:a"])
    p = parse(data)
    assert (p.version, p.base, p.damaged, p.torn) == (1, 5, None, False)
    assert p.snapshot == [["put", "pin:a", "s", "gpu-a", None]]
    assert [r.seq for r in p.records] == [6, 7] and p.last_seq == 7
    assert p.snapshot_end == len(HEAD + SNAP) and p.good_bytes == len(data)


@pytest.mark.parametrize("tail", [b"0123abcd {\"s\": 8", b"\x00" * 30, rec(8, ["del", "x"])[:-1]])
def test_a_torn_last_line_is_skipped_not_damage(tail):
    data = HEAD + SNAP + rec(6, ["del", "pin:a"])
    p = parse(data + tail)
    assert p.torn and p.damaged is None and p.last_seq == 6 and p.good_bytes == len(data)


def test_a_bad_line_with_good_ones_after_it_is_damage():
    line = bytearray(rec(6, ["put", "pin:b", "s", "x", None]))
    line[12] ^= 0xFF                                        # one flipped byte: its crc fails
    p = parse(HEAD + SNAP + bytes(line) + rec(7, ["del", "pin:a"]))
    assert p.damaged and "bad line" in p.damaged
    assert [r.seq for r in p.records] == [7]                # the good lines are still there to salvage
    assert parse(b"garbage\n" + rec(6, ["del", "x"])).damaged
    assert parse(HEAD + rec(6, ["del", "x"])).damaged == "snapshot has 0 of 1 keys"


def test_a_line_not_above_an_earlier_one_supersedes_it():
    # seq 6 was appended, its commit never happened; the next durable write took seq 6 again
    p = parse(HEAD + SNAP + rec(6, ["put", "pin:dead", "s", "x", None]) + rec(6, ["put", "pin:b", "s", "y", None]))
    assert [r.entries[0][1] for r in p.records] == ["pin:b"]
    p = parse(HEAD + SNAP + rec(4, ["put", "old", "s", "x", None]))   # at or below the snapshot: in it
    assert p.records == []


def test_fold_states():
    s: dict = {}
    fold(s, [["put", "a", "s", "1", 300.0], ["hset", "h", "f", "1", None], ["hset", "h", "g", "2", None],
             ["zadd", "z", "m", 1.0, None], ["zadd", "z", "n", math.inf, None]], at=100)
    assert s == {"a": ("s", "1", 300.0), "h": ("h", {"f": "1", "g": "2"}, None),
                 "z": ("z", {"m": 1.0, "n": math.inf}, None)}
    fold(s, [["hset", "a", "f", "v", None]], at=400)        # "a" expired at 300: a new hash, nothing of it
    fold(s, [["hdel", "h", "f"], ["hdel", "h", "g"], ["zremr", "z", 0, 2], ["exp", "z", 500.0]], at=400)
    assert s == {"a": ("h", {"f": "v"}, None), "z": ("z", {"n": math.inf}, 500.0)}
    fold(s, [["zrem", "z", "n"], ["del", "a"], ["exp", "gone", 9.0]], at=401)
    assert s == {}


def test_settle_cuts_a_torn_tail_and_the_lines_of_transactions_that_never_committed(tmp_path):
    path = tmp_path / "j"
    path.write_bytes(HEAD + SNAP + rec(6, ["del", "a"]) + rec(7, ["del", "b"]) + rec(8, ["del", "c"]) + b"0a1b2c")
    j = Journal(path)
    assert j.current()
    assert j.settle(6) == 6                                  # the database is at 6: 7 and 8 died
    assert path.read_bytes() == HEAD + SNAP + rec(6, ["del", "a"])
    assert j.settle(6) == 6
    size = j.append(7, 300.0, [["put", "k", "s", "v", None]])
    assert parse(path.read_bytes()).last_seq == 7
    j.cut(size)                                             # its commit failed: taken back
    assert path.read_bytes() == HEAD + SNAP + rec(6, ["del", "a"])
    path.write_bytes(HEAD + SNAP)
    assert j.current() and j.settle(0) == 5                  # only a snapshot: the header's base
    j.close()


def test_lines_after_and_replace(tmp_path):
    path = tmp_path / "j"
    path.write_bytes(HEAD + SNAP + rec(6, ["del", "a"]) + rec(7, ["del", "b"]))
    j = Journal(path)
    j.current()
    assert j.lines_after(6) == rec(7, ["del", "b"]) and j.lines_after(7) == b""
    before = os.stat(path).st_ino
    tmp, n = j.write_snapshot(7, 300.0, [("k", ("s", "v", None)), ("h", ("h", {"f": "1"}, 9.0))])
    j.put_in_place(tmp, rec(8, ["del", "k"]))
    p = parse(path.read_bytes())
    assert n == 2 and p.base == 7 and [r.seq for r in p.records] == [8] and os.stat(path).st_ino != before
    assert oct(os.stat(path).st_mode & 0o777) == "0o600" and not list(tmp_path.glob("j.tmp-*"))
    j.close()


HOLDER = r"""
import sys, time
from pathlib import Path
from sessionpin.store.filelock import FileLock
lock = FileLock(Path(sys.argv[1]))
lock.acquire(5)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
lock.release()
"""


def test_the_lock_file_excludes_other_processes_and_threads_and_bounds_the_wait(tmp_path):
    path = tmp_path / "s.lock"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), "0.6"], text=True, stdout=subprocess.PIPE,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.stdout.readline() == "held\n"
    lock = FileLock(path)
    with pytest.raises(TimeoutError):
        lock.acquire(0.1)                                    # bounded, like busy_timeout
    t0 = time.monotonic()
    lock.acquire(5)
    assert time.monotonic() - t0 > 0.3                       # it waited for the other process
    lock.acquire(1)                                          # the same thread: again
    lock.release()
    got = []
    t = threading.Thread(target=lambda: got.append(_try(lock)))
    t.start()
    t.join()
    assert got == [False]                                    # another thread of this process waits
    lock.release()
    assert _try(lock) is True
    p.wait(timeout=10)
    lock.close()


def _try(lock: FileLock) -> bool:
    try:
        lock.acquire(0.1)
    except TimeoutError:
        return False
    lock.release()
    return True


def test_the_lock_follows_a_replaced_file(tmp_path):
    path = tmp_path / "s.lock"
    a, b = FileLock(path), FileLock(path)
    a.acquire(1)
    os.unlink(path)                                          # deleted (its directory, say) while held
    b.acquire(1)                                             # b locks the file the path names now
    assert path.exists()
    a.release()
    assert not _try(a)                                       # a now finds b's file, held
    b.release()
    assert _try(a)
    a.close()
    b.close()


# == verifying the journal while the store runs (journal.Verifier) ========================

def damaged_copy(data: bytes, at: int, n: int = 16) -> bytes:
    return data[:at] + b"#" * n + data[at + n:]


def test_the_verifier_agrees_with_parse_on_what_is_damage(tmp_path):
    from sessionpin.store.journal import Verifier

    good = HEAD + SNAP + rec(6, ["put", "pin:b", "s", "x", None]) + rec(7, ["del", "pin:a"])
    torn_line = rec(8, ["del", "c"])
    samples = {
        "whole": good,
        "torn tail": good + torn_line[:-5],
        "bad last line": good + b"#" * 20 + b"\n",
        "bad line in the middle": damaged_copy(good, len(HEAD + SNAP) + 12),
        "bad header": damaged_copy(good, 12),
        "bad snapshot line": damaged_copy(good, len(HEAD) + 12),
        "a snapshot line missing": HEAD + rec(6, ["del", "x"]),
        "a snapshot line missing, no records": HEAD,
        "no header": SNAP + rec(6, ["del", "x"]),
        "empty": b"",
    }
    for name, data in samples.items():
        path = tmp_path / name.replace(" ", "-")
        path.write_bytes(data)
        assert bool(Verifier(path).check()) == bool(parse(data).damaged), name
    assert Verifier(tmp_path / "none").check() is None           # a missing journal is not its business


def test_the_verifier_checks_appends_incrementally_and_the_verified_bytes_again(tmp_path):
    from sessionpin.store.journal import Verifier

    path = tmp_path / "j"
    path.write_bytes(HEAD + SNAP + rec(6, ["del", "a"]))
    v = Verifier(path)
    assert v.check() is None
    with open(path, "ab") as f:                                  # appended: only the new lines are read
        f.write(rec(7, ["del", "b"]) + rec(8, ["del", "c"]))
    assert v.check() is None and v._end == path.stat().st_size
    with open(path, "r+b") as f:                                 # then bytes already verified are changed,
        f.seek(len(HEAD) + 3)                                    # within the second of the last look
        f.write(b"##")
    assert v.check() == f"bad line at byte {len(HEAD)}"
    path.write_bytes(HEAD + SNAP + rec(6, ["del", "a"]))          # a new, whole file: verified afresh
    assert v.check() is None


def test_appends_and_cuts_racing_the_verifier_are_not_damage(tmp_path):
    """A line being written (no newline yet), a cut (a failed write taken back, a dead line
    cut by settle), a torn line of a crash left at the end: none is damage, in any order."""
    from sessionpin.store.journal import Verifier

    path = tmp_path / "j"
    path.write_bytes(HEAD + SNAP)
    v = Verifier(path)
    fd = os.open(path, os.O_RDWR | os.O_APPEND)
    try:
        for seq in range(6, 60):
            line = rec(seq, ["put", f"pin:{seq}", "s", "x" * seq, None])
            before = os.fstat(fd).st_size
            os.write(fd, line[:len(line) // 2])                  # half of it written
            assert v.check() is None
            os.write(fd, line[len(line) // 2:])
            assert v.check() is None
            if seq % 3 == 0:                                     # its commit failed: cut back
                os.ftruncate(fd, before)
                assert v.check() is None
                os.write(fd, rec(seq, ["del", f"pin:{seq}"]))    # the next write takes its seq
            if seq % 5 == 0:                                     # a crash's torn line, cut by the next append
                os.write(fd, b"0badc0de {\"s\":" + b"#" * seq + b"\n")
                assert v.check() is None
                os.ftruncate(fd, os.fstat(fd).st_size - 15 - seq)
            assert v.check() is None
    finally:
        os.close(fd)
    assert parse(path.read_bytes()).damaged is None


APPENDER = r"""
import sys
from sessionpin.store import NotDurable
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
print("ready", flush=True)
for i in range(int(sys.argv[2])):
    try:
        s.set(f"pin:{sys.argv[3]}:{i}", "x" * (i % 300), durable=True)
    except NotDurable:          # the lock file held past busy_timeout on a loaded machine: not ours
        pass
s.close()
"""


def test_other_processes_appending_while_one_verifies_is_not_damage(tmp_path):
    from sessionpin.store.file import FileStore
    from sessionpin.store.journal import Verifier

    path = tmp_path / "state.db"
    FileStore(path).close()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(path), "400", str(j)], env=env,
                              stdout=subprocess.PIPE, text=True) for j in range(2)]
    v = Verifier(Path(f"{path}.journal"))
    looks = 0
    while any(p.poll() is None for p in procs) or looks < 10:
        assert v.check() is None
        looks += 1
    for p in procs:
        p.communicate(timeout=60)
        assert p.returncode == 0
    assert v.check() is None
