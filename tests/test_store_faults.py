"""The file store when its disk fails: it keeps serving from memory, logs one error, retries,
logs when it recovered, and damages nothing already on disk.

Three tiers, real faults each:
- no privileges: SQLite's own page limit (``PRAGMA max_page_count``) → SQLITE_FULL;
- root on a filesystem with attributes (ext4): ``chattr +i`` on the files or the directory
  → EPERM from the kernel, while the store is open;
- root allowed to mount: a small tmpfs filled to the last byte, and one mounted read-only.
Tiers that cannot run here are skipped, saying why.
"""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from sessionpin.store.file import FileStore

LOGGER = "sessionpin.store.file"


def wait_for(cond, timeout: float = 5.0) -> bool:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.02)
    return True


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


def errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.ERROR]


def recoveries(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "recovered" in r.getMessage()]


def seed(s: FileStore) -> None:
    s.set("old", "1", durable=True)
    s.set("doomed", "x")
    s.incr("n")
    s.hset("h", "f", "1")


def write_during_fault(s: FileStore) -> None:
    big = "x" * 8000
    for i in range(10):
        s.set(f"big{i}", big)                       # needs new pages: the disk refuses
    assert s.set("pin:new", "p", 3600, nx=True, durable=True) is True   # does not raise
    assert s.incr("n") == 2                          # read from the file, applied in memory
    s.hset("h", "g", "2")
    assert s.hincr("h", "f", 10) == 11
    assert s.delete("doomed") is True


def check_served_from_memory(s: FileStore) -> None:
    assert s.degraded
    assert s.get("big3") == "x" * 8000
    assert s.get("old") == "1"                       # untouched keys read through to the file
    assert s.get("n") == "2"
    assert s.hgetall("h") == {"f": "11", "g": "2"}
    assert s.get("doomed") is None
    assert s.ttl("pin:new") == pytest.approx(3600, abs=5)
    assert s.keys("big") == [f"big{i}" for i in range(10)]
    assert "doomed" not in s.keys() and {"old", "n", "h", "pin:new"} <= set(s.keys())


def check_replayed(path: Path) -> None:
    after = on_disk(path)
    assert after["strings"]["pin:new"] == "p"
    assert after["strings"]["n"] == "2"
    assert after["strings"]["old"] == "1"
    assert "doomed" not in after["strings"]
    assert all(after["strings"][f"big{i}"] == "x" * 8000 for i in range(10))
    assert after["hashes"] == {("h", "f"): "11", ("h", "g"): "2"}


# == tier 1: SQLite's page limit (no privileges needed) ====================================

def test_disk_full_by_page_limit(tmp_path, caplog):
    limit: dict[str, int | None] = {"pages": None}

    def apply_limit(conn):
        if limit["pages"]:
            conn.execute(f"PRAGMA max_page_count = {limit['pages']}")

    path = tmp_path / "s.db"
    s = FileStore(path, on_connect=apply_limit, retry_interval=0.05)
    try:
        seed(s)
        before = on_disk(path)
        limit["pages"] = s._conn.execute("PRAGMA page_count").fetchone()[0]
        apply_limit(s._conn)                         # the disk is full from now on
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            write_during_fault(s)
            check_served_from_memory(s)
            time.sleep(0.4)                          # several retries, all failing
            assert s.degraded
            assert on_disk(path) == before           # nothing on disk changed
            assert len(errors(caplog)) == 1          # ONE error, however many writes and retries
            assert "serving from memory" in errors(caplog)[0] and "full" in errors(caplog)[0]
            assert recoveries(caplog) == []
            limit["pages"] = None                    # space again
            assert wait_for(lambda: not s.degraded)
        assert len(recoveries(caplog)) == 1
        check_replayed(path)                         # the pending writes, in order
        assert s.get("big9") == "x" * 8000 and s.incr("n") == 3
    finally:
        s.close()


def test_close_while_failing_says_what_is_lost(tmp_path, caplog):
    limit = {"pages": 0}
    path = tmp_path / "s.db"
    s = FileStore(path, on_connect=lambda c: limit["pages"] and c.execute(f"PRAGMA max_page_count = {limit['pages']}"))
    seed(s)
    before = on_disk(path)
    limit["pages"] = s._conn.execute("PRAGMA page_count").fetchone()[0]
    s._conn.execute(f"PRAGMA max_page_count = {limit['pages']}")
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        s.set("big", "x" * 20000)
        s.close()
    assert "closed with 1 writes it could not put on disk" in errors(caplog)[-1]
    assert on_disk(path) == before
    assert FileStore(path).get("old") == "1"


# == tier 2: the kernel refuses (chattr +i), while the store is open =======================

def chattr(flag: str, *paths: Path) -> None:
    r = subprocess.run(["chattr", flag, *map(str, paths)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"chattr {flag} not possible here: {r.stderr.strip()[:120]}")


def test_unwritable_files_while_running(tmp_path, caplog):
    path = tmp_path / "s.db"
    s = FileStore(path, retry_interval=0.05)
    frozen = [path, Path(f"{path}-wal")]
    try:
        seed(s)
        before = on_disk(path)
        chattr("+i", *frozen)
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            write_during_fault(s)
            check_served_from_memory(s)
            time.sleep(0.3)
            assert s.degraded and len(errors(caplog)) == 1
            chattr("-i", *frozen)
            assert on_disk(path) == before
            assert wait_for(lambda: not s.degraded)
        assert len(recoveries(caplog)) == 1
        check_replayed(path)
    finally:
        subprocess.run(["chattr", "-i", *map(str, frozen)], capture_output=True)
        s.close()


def test_unwritable_directory_at_open(tmp_path, caplog):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    chattr("+i", d)
    try:
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            s = FileStore(d / "s.db", retry_interval=0.05)
            assert s.degraded
            s.set("pin:a", "1", durable=True)
            s.hincr("h", "n", 5)
            assert s.get("pin:a") == "1" and s.keys() == ["h", "pin:a"]
            time.sleep(0.2)
            assert len(errors(caplog)) == 1
            assert not (d / "s.db").exists()
            chattr("-i", d)
            assert wait_for(lambda: not s.degraded)
        assert len(recoveries(caplog)) == 1
        assert on_disk(d / "s.db") == {"strings": {"pin:a": "1"}, "hashes": {("h", "n"): "5"}}
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
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return filler


def test_full_tmpfs(tmpfs, caplog):
    path = tmpfs / "s.db"
    s = FileStore(path, retry_interval=0.05)
    try:
        seed(s)
        before = on_disk(path)
        filler = fill(tmpfs)
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            write_during_fault(s)
            check_served_from_memory(s)
            time.sleep(0.3)
            assert s.degraded and len(errors(caplog)) == 1
            assert on_disk(path) == before
            filler.unlink()
            assert wait_for(lambda: not s.degraded)
        assert len(recoveries(caplog)) == 1
        check_replayed(path)
    finally:
        s.close()
    check_replayed(path)


def test_read_only_filesystem_at_open(tmpfs, caplog):
    d = tmpfs / "sessionpin"
    d.mkdir(mode=0o700)
    r = subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()[:120]}")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        s = FileStore(d / "state.db", retry_interval=0.05)
        try:
            assert s.degraded
            s.set("pin:a", "1", durable=True)
            assert s.set("pin:a", "2", nx=True) is False
            assert s.incr("n") == 1 and s.incr("n") == 2
            assert s.get("pin:a") == "1" and s.keys() == ["n", "pin:a"]
            time.sleep(0.2)
            assert len(errors(caplog)) == 1 and "Read-only file system" in errors(caplog)[0]
            subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
            assert wait_for(lambda: not s.degraded)
        finally:
            s.close()
    assert len(recoveries(caplog)) == 1
    assert on_disk(d / "state.db")["strings"] == {"pin:a": "1", "n": "2"}


def test_read_only_filesystem_with_an_existing_store(tmpfs, caplog):
    # The pins already on disk stay readable (read-only, immutable connection) while
    # new writes wait in memory; nothing is lost either way once it is writable again.
    path = tmpfs / "state.db"
    s = FileStore(path)
    s.set("pin:old", "1", durable=True)
    s.hset("seen:old", "requests", "3")
    s.close()
    r = subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()[:120]}")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        s = FileStore(path, retry_interval=0.05)
        try:
            assert s.degraded
            assert s.get("pin:old") == "1"                 # read through to the file
            assert s.hincr("seen:old", "requests") == 4    # its state copied, then changed in memory
            s.set("pin:new", "2", durable=True)
            assert s.keys() == ["pin:new", "pin:old", "seen:old"]
            time.sleep(0.2)
            assert s.degraded and len(errors(caplog)) == 1
            subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
            assert wait_for(lambda: not s.degraded)
        finally:
            s.close()
    assert len(recoveries(caplog)) == 1
    assert on_disk(path) == {"strings": {"pin:old": "1", "pin:new": "2"},
                             "hashes": {("seen:old", "requests"): "4"}}
