"""The file store when its disk fails: a write that cannot be made raises (``NotDurable``
when durable, ``StoreUnavailable`` otherwise) and leaves nothing behind — not on disk, not
in any later read; reads of what is on disk go on; one ERROR line when the faults begin,
one "recovered" line when a write succeeds again; nothing already on disk is damaged.

Four tiers, real faults each:
- no privileges: SQLite's own page limit (``PRAGMA max_page_count``) → SQLITE_FULL; a
  write lock held by another process past ``busy_timeout`` → SQLITE_BUSY;
- root on a filesystem with attributes (ext4): ``chattr +i`` on the files or the directory
  → EPERM from the kernel, while the store is open;
- root allowed to mount: a small tmpfs filled to the last byte, and one mounted read-only.
Tiers that cannot run here are skipped, saying why.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sessionpin.store import NotDurable, StoreUnavailable
from sessionpin.store.file import FileStore

LOGGER = "sessionpin.store.file"
ROOT = Path(__file__).resolve().parent.parent
BIG = "x" * 50_000          # more pages than the WAL can reuse: the file must grow


def on_disk(path: Path) -> dict:
    """Everything in the file, through a connection of its own."""
    c = sqlite3.connect(path)
    try:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        return {
            "strings": dict(c.execute("SELECT key, value FROM entries WHERE kind = 's'")),
            "hashes": {(k, f): v for k, f, v in c.execute("SELECT key, field, value FROM fields")},
        }
    finally:
        c.close()


def lines(caplog, level: int, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == level and words in r.getMessage()]


def write_errors(caplog) -> list[str]:
    return lines(caplog, logging.ERROR, "cannot write")


def write_recoveries(caplog) -> list[str]:
    return lines(caplog, logging.WARNING, "recovered: it can write")


def seed(s: FileStore) -> None:
    s.set("old", "1", durable=True)
    s.set("doomed", "x")
    s.incr("n")
    s.hset("h", "f", "1")


def writes_fail_and_leave_nothing(s: FileStore, path: Path) -> None:
    """Every kind of write raises; no read sees any of them; the file is as it was."""
    with pytest.raises(NotDurable) as durable:
        s.set("pin:new", BIG, 3600, nx=True, durable=True)
    assert s.url in str(durable.value) and str(path) in str(durable.value)
    with pytest.raises(NotDurable):
        s.hset("h", "g", BIG, durable=True)
    for i in range(3):
        with pytest.raises(StoreUnavailable) as ordinary:
            s.set(f"big{i}", BIG)
        assert not isinstance(ordinary.value, NotDurable)
    assert s.get("pin:new") is None and s.ttl("pin:new") is None      # nothing behind
    assert s.hgetall("h") == {"f": "1"} and s.get("big0") is None
    assert s.get("old") == "1" and s.get("n") == "1"                  # the file still reads
    assert s.keys() == ["doomed", "h", "n", "old"]


def recovers(s: FileStore, path: Path, caplog) -> None:
    assert s.set("pin:new", BIG, 3600, nx=True, durable=True) is True
    assert s.incr("n") == 2 and s.delete("doomed") is True
    assert len(write_recoveries(caplog)) == 1
    after = on_disk(path)
    assert after["strings"]["pin:new"] == BIG and after["strings"]["n"] == "2"
    assert "doomed" not in after["strings"] and after["hashes"] == {("h", "f"): "1"}


# == tier 1: no privileges ==================================================================

def test_disk_full_by_page_limit(tmp_path, caplog):
    limit: dict[str, int | None] = {"pages": None}

    def apply_limit(conn):
        if limit["pages"]:
            conn.execute(f"PRAGMA max_page_count = {limit['pages']}")

    path = tmp_path / "s.db"
    s = FileStore(path, on_connect=apply_limit)
    try:
        seed(s)
        before = on_disk(path)
        limit["pages"] = s._w.execute("PRAGMA page_count").fetchone()[0]
        apply_limit(s._w)                            # the disk is full from now on
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            writes_fail_and_leave_nothing(s, path)
            writes_fail_and_leave_nothing(s, path)   # again: still no second error line
            assert on_disk(path) == before           # nothing on disk changed
            [error] = write_errors(caplog)           # ONE error, however many writes
            assert "full" in error and str(path) in error
            assert write_recoveries(caplog) == []
            assert not s.describe()["healthy"] and "full" in s.describe()["faults"]["write"]["cause"]
            limit["pages"] = None                    # space again
            recovers(s, path, caplog)
        assert len(write_errors(caplog)) == 1 and s.describe()["healthy"]
    finally:
        s.close()


def test_close_while_failing_keeps_the_file(tmp_path):
    limit = {"pages": 0}
    path = tmp_path / "s.db"
    s = FileStore(path, on_connect=lambda c: limit["pages"] and c.execute(f"PRAGMA max_page_count = {limit['pages']}"))
    seed(s)
    before = on_disk(path)
    limit["pages"] = s._w.execute("PRAGMA page_count").fetchone()[0]
    s._w.execute(f"PRAGMA max_page_count = {limit['pages']}")
    with pytest.raises(StoreUnavailable):
        s.set("big", BIG)
    s.close()
    assert on_disk(path) == before
    s = FileStore(path)
    assert s.get("old") == "1" and s.get("big") is None
    s.close()


LOCK_HOLDER = r"""
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN IMMEDIATE")
c.execute("UPDATE entries SET value = value WHERE key = 'old'")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
c.execute("COMMIT")
"""


def hold_write_lock(path: Path, seconds: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(path), str(seconds)], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline() == "locked\n", p.stderr.read()
    return p


def test_lock_held_past_busy_timeout(tmp_path, caplog):
    path = tmp_path / "s.db"
    s = FileStore(path, busy_timeout=0.5)
    try:
        seed(s)
        holder = hold_write_lock(path, 2.0)
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            t0 = time.monotonic()
            with pytest.raises(NotDurable, match="locked"):
                s.set("pin:new", "p", durable=True)
            waited = time.monotonic() - t0
            assert 0.4 < waited < 1.5                      # busy_timeout, not more
            assert s.get("pin:new") is None and s.get("old") == "1"
            assert len(write_errors(caplog)) == 1
            holder.wait(timeout=10)
            assert s.set("pin:new", "p", durable=True) is True
        assert len(write_recoveries(caplog)) == 1
        assert on_disk(path)["strings"]["pin:new"] == "p"
    finally:
        s.close()


# == tier 2: the kernel refuses (chattr +i), while the store is open =======================

def chattr(flag: str, *paths: Path) -> None:
    r = subprocess.run(["chattr", flag, *map(str, paths)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"chattr {flag} not possible here: {r.stderr.strip()[:120]}")


def test_unwritable_files_while_running(tmp_path, caplog):
    path = tmp_path / "s.db"
    s = FileStore(path)
    frozen = [path, Path(f"{path}-wal")]
    try:
        seed(s)
        before = on_disk(path)
        chattr("+i", *frozen)
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            writes_fail_and_leave_nothing(s, path)
            assert len(write_errors(caplog)) == 1
            chattr("-i", *frozen)
            assert on_disk(path) == before
            recovers(s, path, caplog)
    finally:
        subprocess.run(["chattr", "-i", *map(str, frozen)], capture_output=True)
        s.close()


def test_unwritable_directory_at_open(tmp_path, caplog):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    chattr("+i", d)
    try:
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            s = FileStore(d / "s.db")
            with pytest.raises(NotDurable):
                s.set("pin:a", "1", durable=True)
            with pytest.raises(StoreUnavailable):
                s.hincr("h", "n", 5)
            with pytest.raises(StoreUnavailable):     # no file to read: not "absent"
                s.get("pin:a")
            assert len(write_errors(caplog)) == 1 and not (d / "s.db").exists()
            chattr("-i", d)
            assert s.set("pin:a", "1", durable=True) is True
            assert s.get("pin:a") == "1"
        assert len(write_recoveries(caplog)) == 1
        assert len(lines(caplog, logging.ERROR, "cannot read")) == 1
        assert len(lines(caplog, logging.WARNING, "recovered: it can read")) == 1
        assert on_disk(d / "s.db") == {"strings": {"pin:a": "1"}, "hashes": {}}
        assert (d / "s.db").stat().st_mode & 0o777 == 0o600
        s.close()
    finally:
        subprocess.run(["chattr", "-i", str(d)], capture_output=True)


# == tier 3: real filesystems (mount) ======================================================

@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[:120]}")
    try:
        yield mnt
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], capture_output=True)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(d: Path) -> Path:
    filler = d / "filler"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass                                   # ENOSPC: full to the last page
    finally:
        os.close(fd)
    return filler


def test_full_tmpfs(tmpfs, caplog):
    path = tmpfs / "s.db"
    s = FileStore(path)
    try:
        seed(s)
        before = on_disk(path)
        filler = fill(tmpfs)
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            writes_fail_and_leave_nothing(s, path)
            assert len(write_errors(caplog)) == 1
            assert on_disk(path) == before
            filler.unlink()
            recovers(s, path, caplog)
    finally:
        s.close()


def remount_ro(mnt: Path) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()[:120]}")


def test_read_only_filesystem_at_open(tmpfs, caplog):
    d = tmpfs / "sessionpin"
    d.mkdir(mode=0o700)
    remount_ro(tmpfs)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        s = FileStore(d / "state.db")
        try:
            with pytest.raises(NotDurable, match="Read-only file system"):
                s.set("pin:a", "1", durable=True)
            with pytest.raises(StoreUnavailable):
                s.incr("n")
            assert len(write_errors(caplog)) == 1 and "Read-only file system" in write_errors(caplog)[0]
            subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
            assert s.set("pin:a", "1", durable=True) is True
            assert s.set("pin:a", "2", nx=True) is False and s.incr("n") == 1
        finally:
            s.close()
    assert len(write_recoveries(caplog)) == 1
    assert on_disk(d / "state.db")["strings"] == {"pin:a": "1", "n": "1"}


def test_read_only_filesystem_with_an_existing_store(tmpfs, caplog):
    # The pins already on disk stay readable (a read-only, immutable connection) while
    # writes raise; once it is writable again, writes work and reads see them.
    path = tmpfs / "state.db"
    s = FileStore(path)
    s.set("pin:old", "1", durable=True)
    s.hset("seen:old", "requests", "3")
    s.close()
    remount_ro(tmpfs)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        s = FileStore(path)
        try:
            assert s.get("pin:old") == "1"
            assert s.hgetall("seen:old") == {"requests": "3"}
            with pytest.raises(NotDurable):
                s.set("pin:new", "2", durable=True)
            with pytest.raises(StoreUnavailable):
                s.hincr("seen:old", "requests")
            assert s.keys() == ["pin:old", "seen:old"]
            assert len(write_errors(caplog)) == 1
            subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
            assert s.set("pin:new", "2", durable=True) is True
            assert s.hincr("seen:old", "requests") == 4
            assert s.get("pin:new") == "2" and s.hget("seen:old", "requests") == "4"   # not a stale view
        finally:
            s.close()
    assert len(write_recoveries(caplog)) == 1
    assert on_disk(path) == {"strings": {"pin:old": "1", "pin:new": "2"},
                             "hashes": {("seen:old", "requests"): "4"}}
