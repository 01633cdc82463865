"""The file store survives damage and deletion of its files (issue 10, the store's part).

Each fault class of the issue, with real files and real processes (crashes are real
SIGKILLs); after each: every acknowledged durable key is there with its value, and no key
appears that nobody wrote (at most a killed writer's in-flight one).

- pages damaged while running, then another process commits. Was: the read error was
  taken as "no pin". Now: reads raise StoreUnavailable; the file is set aside and the
  database rebuilt from its copy.
- damaged at start (truncated to half, pages overwritten, garbage). Was: set aside and
  started EMPTY. Now: set aside and rebuilt from its copy.
- the database, database+wal+shm, or the directory deleted while running. Was: not
  noticed; "durable" pins went into the unlinked file and were lost at restart. Now:
  noticed within a second, writes refused meanwhile, restored from the open connection.
- the -wal deleted, then kill -9. Now: the database is behind its copy and rebuilt from it.
- the -shm deleted while processes share the store. Was: split brain (lost updates).
  Now: each notices and reopens; no update lost.
- the copy damaged or deleted (at open, while running): rebuilt from the database.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from children import communicate
from sessionpin.store import NotDurable, StoreError, StoreUnavailable, StoreVersionError, open_store
from sessionpin.store.file import FileStore
from sessionpin.store.sqlitefile import prepare_dir

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
LOGGER = "sessionpin.store.file"


def run(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", code, *args], env=ENV, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out


def spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], env=ENV, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(cond, timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.01)
    return time.monotonic() - t0


def fresh_view(path: Path) -> dict[str, str]:
    """Every string key, as a new process opening the store sees it."""
    out = run(r"""
import json, sys
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
print(json.dumps({k: s.get(k) for k in s.keys() if not k.startswith("h")}))
s.close()
""", str(path))
    return json.loads(out.stdout)


FILL = r"""
import sys
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
for i in range(int(sys.argv[2])):
    s.set(f"pin:{i:05d}", f"server-{i % 7}", 86400, durable=True)
    s.set(f"seen:{i:05d}", "ordinary")
s.close()
"""


_FILLED: dict[int, Path] = {}   # n -> a directory holding a store filled by FILL in this process


def fill(path: Path, n: int) -> dict[str, str]:
    """``path`` becomes a closed store of ``n`` durable pins and ``n`` ordinary keys, written by
    FILL one durable write at a time. That is done once per process and ``n``; later calls copy
    its files (the database and its copy, byte for byte: closed, they are all the store
    is), so the tests that damage a copy do not each wait for thousands of fsyncs."""
    if n not in _FILLED:
        d = Path(tempfile.mkdtemp(prefix=f"sessionpin-fill-{n}-"))
        atexit.register(shutil.rmtree, d, True)
        run(FILL, str(d / "state.db"), str(n))
        _FILLED[n] = d
    prepare_dir(path.parent)                     # as the store makes its directory (0700)
    for f in sorted(_FILLED[n].iterdir()):       # state.db, state.db.copy, state.db.lock
        shutil.copy2(f, path.with_name(path.name + f.name.removeprefix("state.db")))
    return {f"pin:{i:05d}": f"server-{i % 7}" for i in range(n)}


def pins_of(view: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in view.items() if k.startswith("pin:")}


def scribble(path: Path, offset: int, data: bytes) -> None:
    """Overwrite bytes of a file from another process (opening and closing the database in
    this one would drop the POSIX locks SQLite holds on it here)."""
    run("import sys; f = open(sys.argv[1], 'r+b'); f.seek(int(sys.argv[2])); "
        "f.write(bytes.fromhex(sys.argv[3])); f.close()", str(path), str(offset), data.hex())


# == damaged pages ===========================================================================

def test_pages_damaged_while_running_raise_then_are_rebuilt_from_the_copy(tmp_path, caplog):
    path = tmp_path / "state.db"
    pins = fill(path, 3000)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        s = FileStore(path)
        try:
            assert s.get("pin:00001") == "server-1"
            s._w.execute("PRAGMA wal_checkpoint(TRUNCATE)")       # every page in the main file
            pages = path.stat().st_size // 4096
            scribble(path, 4096 * (pages // 2), os.urandom(4096 * 3))
            s._w.execute("PRAGMA shrink_memory")                   # the writer keeps no good copies
            s._w.execute("PRAGMA cache_size = 1")
            run("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
                "c.execute(\"UPDATE meta SET value = value WHERE name = 'seq'\"); c.commit()", str(path))
            raised, wrong = 0, []
            for k, v in pins.items():                              # never "absent", never wrong
                try:
                    got = s.get(k)
                except StoreUnavailable:
                    raised += 1
                    continue
                if got != v:
                    wrong.append((k, got))
            assert wrong == [] and raised > 0
            wait_for(lambda: s.describe()["last_repair"] is not None and s.describe()["unsure"] is None)
            assert {k: s.get(k) for k in pins} == pins             # every durable pin, rebuilt
            assert {s.get(k) for k in s.keys("seen:")} == {"ordinary"} and len(s.keys("seen:")) == 3000
            s.set("after", "1", durable=True)                      # ordinary writes too: the copy has them
        finally:
            s.close()
    assert list(tmp_path.glob("state.db.corrupt-*"))               # kept for the operator
    messages = [r.getMessage() for r in caplog.records]
    assert any("pages are damaged" in m and "while it was open" in m for m in messages), messages
    assert any("rebuilt its database from the copy" in m and "6000 keys" in m for m in messages), messages
    assert pins_of(fresh_view(path)) == pins


@pytest.mark.parametrize("damage", ["truncate to half", "three pages overwritten", "not a database"])
def test_damaged_at_start_is_set_aside_and_rebuilt_from_the_copy(tmp_path, caplog, damage):
    path = tmp_path / "state.db"
    pins = fill(path, 2000)
    size = path.stat().st_size
    if damage == "truncate to half":
        os.truncate(path, size // 2)
    elif damage == "three pages overwritten":
        data = bytearray(path.read_bytes())
        data[4096 * 5: 4096 * 8] = os.urandom(4096 * 3)
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(b"garbage\n" * 1000)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s = FileStore(path)
    try:
        assert {k: s.get(k) for k in s.keys("pin:")} == pins       # not empty: every pin, nothing else
        assert {s.get(k) for k in s.keys("seen:")} == {"ordinary"}  # ordinary writes too
        rebuilt = s.describe()["last_repair"]
        assert rebuilt["action"] == "rebuilt the database from the copy" and rebuilt["keys"] == 4000
    finally:
        s.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any("moved it aside" in m for m in messages)
    assert any("rebuilt its database from the copy" in m and "4000 keys" in m for m in messages)
    assert len([p for p in tmp_path.glob("state.db.corrupt-*") if not p.name.endswith(("-wal", "-shm"))]) == 1


def test_missing_database_with_its_copy_is_rebuilt(tmp_path, caplog):
    path = tmp_path / "state.db"
    pins = fill(path, 500)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s = FileStore(path)
    assert pins_of({k: s.get(k) for k in s.keys()}) == pins
    s.close()
    assert any("rebuilt its database from the copy" in r.getMessage() and "1000 keys" in r.getMessage()
               for r in caplog.records)


# == files deleted while running ============================================================

WRITER = r"""
import json, sys, time
from sessionpin.store import StoreUnavailable
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1], **json.loads(sys.argv[2]))
tag = sys.argv[3]
print("ready", flush=True)
i = 0
while True:
    try:
        s.set(f"{tag}:{i}", str(i), durable=True)
        print("ack", i, flush=True)
    except StoreUnavailable as exc:
        print("refused", i, flush=True)
    try:
        s.set(f"o{tag}:{i}", "ordinary")
    except StoreUnavailable:
        pass
    i += 1
    time.sleep(0.002)
"""


def acked(out: str) -> dict[str, str]:
    return {line.split()[1]: line.split()[1] for line in out.splitlines() if line.startswith("ack ")}


def refused(out: str) -> set[str]:
    return {line.split()[1] for line in out.splitlines() if line.startswith("refused ")}


def in_flight(out: str) -> str:
    """The index after the last one a killed writer reported: the write it was making."""
    tried = [int(line.split()[1]) for line in out.splitlines() if line.startswith(("ack ", "refused "))]
    return str(max(tried, default=-1) + 1)


@pytest.mark.parametrize("what", ["db", "db+wal+shm", "directory"])
def test_files_deleted_while_running_are_noticed_and_restored(tmp_path, caplog, what):
    d = tmp_path / "state"
    path = d / "state.db"
    pins = fill(path, 300)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        s = FileStore(path)
        writer = spawn(WRITER, str(path), "{}", "w")           # another process writes meanwhile
        try:
            assert writer.stdout.readline() == "ready\n"
            for i in range(20):
                s.set(f"mine:{i}", str(i), durable=True)
            if what == "directory":
                shutil.rmtree(d)
            else:
                for suffix in ([""] if what == "db" else ["", "-wal", "-shm"]):
                    os.unlink(f"{path}{suffix}")
            ours = {}
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.5:                 # durable writes through it all
                i = len(ours)
                try:
                    s.set(f"during:{i}", str(i), durable=True)
                    ours[f"during:{i}"] = str(i)
                except NotDurable:
                    ours[f"during:{i}"] = None                 # refused: must not appear
                time.sleep(0.005)
            assert s.describe()["unsure"] is None and s.describe()["last_repair"] is not None
            noticed = [r for r in caplog.records if "while it was open" in r.getMessage()]
            assert noticed and None in ours.values()           # it noticed, and refused meanwhile
            assert {k: v for k, v in ours.items() if v} and list(ours.values())[-1] is not None
        finally:
            writer.send_signal(signal.SIGKILL)
            out, _ = communicate(writer)
            s.close()
    assert os.stat(d).st_mode & 0o777 == 0o700
    for name in ("state.db", "state.db.copy", "state.db.lock"):
        assert os.stat(d / name).st_mode & 0o777 == 0o600, name
    view = fresh_view(path)
    assert pins_of(view) == pins
    assert all(view.get(f"mine:{i}") == str(i) for i in range(20))
    for k, v in ours.items():
        assert view.get(k) == v, k                             # acknowledged: there; refused: not
    w = {f"w:{i}": v for i, v in acked(out).items()}
    assert refused(out)                                        # it was refused meanwhile too
    assert all(view.get(k) == v for k, v in w.items())         # the other process's acks too
    assert {k for k in view if k.startswith("w:")} - set(w) <= {f"w:{in_flight(out)}"}   # nothing refused


KILLED_WRITER = r"""
import sys
from sessionpin.store import StoreUnavailable
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1], watch_interval=3600)   # it will not look: the crash comes first
print("ready", flush=True)
for i in range(100000):
    if i == int(sys.argv[2]):
        print("paused", flush=True)
        sys.stdin.readline()
    try:
        s.set(f"k:{i}", str(i), durable=True)
        print("ack", i, flush=True)
    except StoreUnavailable:
        print("refused", i, flush=True)
"""


def test_wal_deleted_then_kill_9_loses_no_acknowledged_write(tmp_path, caplog):
    path = tmp_path / "state.db"
    FileStore(path).close()                               # the schema is in the main file
    p = spawn(KILLED_WRITER, str(path), "300")
    assert p.stdout.readline() == "ready\n"
    lines = [p.stdout.readline() for _ in range(301)]
    assert lines[-1] == "paused\n"
    os.unlink(f"{path}-wal")                               # its 300 commits since the last checkpoint
    p.send_signal(signal.SIGKILL)                          # before it writes (and looks) again
    out, _ = communicate(p)
    acks = acked("".join(lines) + out)
    assert len(acks) == 300
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s = FileStore(path)
    try:
        assert {k: s.get(k) for k in s.keys()} == {f"k:{i}": v for i, v in acks.items()}   # none invented
    finally:
        s.close()
    [warning] = [r.getMessage() for r in caplog.records]
    assert "rebuilt its database from the copy (it was behind" in warning and "of 300)" in warning


SHARER = r"""
import sys, time
from sessionpin.store import StoreUnavailable
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
me = sys.argv[2]
print("ready", flush=True)
sys.stdin.readline()
t0, i, incrs = time.monotonic(), 0, 0
while time.monotonic() - t0 < float(sys.argv[3]):
    try:
        s.incr("shared")
        incrs += 1
    except StoreUnavailable:
        pass
    try:
        s.set(f"{me}:{i}", str(i), durable=i % 5 == 0)
        print("ack", i, flush=True)
    except StoreUnavailable:
        pass
    i += 1
print("incrs", incrs, flush=True)
s.close()
"""


def test_shm_deleted_while_two_processes_share_the_store_is_no_split_brain(tmp_path, caplog):
    # Two processes share the store; its -shm is deleted; then a third opens it (a restarted
    # proxy, the CLI) and makes a new -shm. Without noticing, the first two keep one
    # wal-index and the third another over the same WAL: updates are lost (split brain).
    path = tmp_path / "state.db"
    FileStore(path).close()
    procs = [spawn(SHARER, str(path), f"p{j}", "3.0") for j in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        time.sleep(0.8)
        os.unlink(f"{path}-shm")
        procs.append(spawn(SHARER, str(path), "p2", "1.5"))
        assert procs[2].stdout.readline() == "ready\n"
        procs[2].stdin.write("go\n")
        procs[2].stdin.flush()
        outs = [communicate(p, timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    incrs = 0
    s = FileStore(path)
    try:
        for j, (out, err) in enumerate(outs):
            assert procs[j].returncode == 0, err
            incrs += int(out.split("incrs ")[1])
            for i in acked(out):
                assert s.get(f"p{j}:{i}") == i
        for j in (0, 1):                                     # each noticed, each repaired
            assert "while it was open" in outs[j][1] and "repaired" in outs[j][1], outs[j][1]
        assert s.get("shared") == str(incrs)                 # no update lost to a second -shm
        assert s._w.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        s.close()


PAUSER = r"""
import os, sys
from sessionpin.store.file import FileStore
from sessionpin.store import writer as w
flag = sys.argv[2]
check = w.Writer.check_identity
def paused(self):
    check(self)
    if os.path.exists(flag):             # checked: now wait between the check and COMMIT
        os.unlink(flag)
        print("paused", flush=True)
        sys.stdin.readline()
w.Writer.check_identity = paused
s = FileStore(sys.argv[1])
print("incr", s.incr("shared"), flush=True)
open(flag, "w").close()
print("incr", s.incr("shared"), flush=True)
s.close()
"""

INCRER = r"""
import sys, time
from sessionpin.store import StoreUnavailable
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
deadline = time.monotonic() + 20
while True:                  # refused while a process repairs what the deletion left: try again
    try:
        print("incr", s.incr("shared"), flush=True)
        break
    except StoreUnavailable:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
s.close()
"""


def test_a_commit_checked_before_the_shm_went_is_not_lost_to_a_new_shm(tmp_path):
    # The window the test above meets by chance (1 run in ~5 on a loaded machine), made
    # certain: a process checks its files, then waits before COMMIT; meanwhile the -shm is
    # deleted and another process opens the store (a new -shm) and increments. Without the
    # lock file held across both, each is acknowledged and the paused commit writes its
    # frames over the other's (2, not 3).
    path = tmp_path / "state.db"
    FileStore(path).close()
    a = spawn(PAUSER, str(path), str(tmp_path / "pause"))
    b = None
    try:
        assert a.stdout.readline() == "incr 1\n"
        assert a.stdout.readline() == "paused\n"        # its second incr checked, not committed
        os.unlink(f"{path}-shm")
        b = spawn(INCRER, str(path))
        ready, _, _ = select.select([b.stdout], [], [], 1.5)   # done at once only without the lock
        a.stdin.write("go\n")
        a.stdin.flush()
        out_a, err_a = communicate(a, timeout=30)
        out_b, err_b = communicate(b, timeout=30)
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
    assert a.returncode == 0 and b.returncode == 0, (err_a, err_b)
    s = FileStore(path)
    try:
        assert s.get("shared") == "3", (out_a, out_b)
    finally:
        s.close()


LOCK_HOLDER = r"""
import fcntl, sys, time
fd = open(sys.argv[1], "a")
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_while_not_sure_of_its_file_reads_raise_rather_than_answer(tmp_path):
    # Another process holds the store's lock file, so the repair has to wait: meanwhile
    # every read and write raises, none answers from the deleted file.
    path = tmp_path / "state.db"
    pins = fill(path, 50)
    s = FileStore(path, watch_interval=0.05)
    try:
        assert s.get("pin:00001") == "server-1"
        holder = spawn(LOCK_HOLDER, f"{path}.lock", "1.5")
        assert holder.stdout.readline() == "locked\n"
        os.unlink(path)
        wait_for(lambda: s.describe()["unsure"] is not None, timeout=1.0)   # noticed within a second
        for call in (lambda: s.get("pin:00001"), lambda: s.keys(), lambda: s.hgetall("h"),
                     lambda: s.set("pin:new", "x", durable=True), lambda: s.incr("n")):
            with pytest.raises(StoreUnavailable, match="deleted"):
                call()
        assert not s.describe()["healthy"]
        holder.wait(timeout=10)
        wait_for(lambda: s.describe()["unsure"] is None)
        assert {k: s.get(k) for k in s.keys("pin:")} == pins
        assert s.set("pin:new", "x", durable=True) is True
    finally:
        s.close()
    assert pins_of(fresh_view(path)) == {**pins, "pin:new": "x"}


# == the copy itself =========================================================================

@pytest.mark.parametrize("fault", ["damaged", "deleted"])
def test_a_damaged_or_deleted_copy_is_rebuilt_from_the_database_at_open(tmp_path, caplog, fault):
    path = tmp_path / "state.db"
    pins = fill(path, 200)
    copy = Path(f"{path}.copy")
    if fault == "damaged":
        data = bytearray(copy.read_bytes())
        data[4096 * 3: 4096 * 6] = os.urandom(4096 * 3)
        copy.write_bytes(bytes(data))
    else:
        copy.unlink()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s = FileStore(path)
        try:
            assert {k: s.get(k) for k in s.keys("pin:")} == pins
            s.set("pin:new", "x", durable=True)
        finally:
            s.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any("rebuilt its copy from the database" in m and "400 keys" in m for m in messages), messages
    assert len(list(tmp_path.glob("state.db.copy.corrupt-*"))) == (fault == "damaged")
    for suffix in ("", "-wal", "-shm"):                        # the copy alone rebuilds it all
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    assert pins_of(fresh_view(path)) == {**pins, "pin:new": "x"}


def test_a_copy_deleted_while_running_is_rebuilt_then_the_database_lost_loses_nothing(tmp_path, caplog):
    path = tmp_path / "state.db"
    pins = fill(path, 100)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s = FileStore(path)
        try:
            Path(f"{path}.copy").unlink()
            wait_for(lambda: s.describe()["last_repair"] is not None and s.describe()["unsure"] is None)
            assert Path(f"{path}.copy").exists()
            s.set("pin:new", "x", durable=True)
        finally:
            s.close()
    assert any("rebuilt the copy from the database" in r.getMessage() for r in caplog.records)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    assert pins_of(fresh_view(path)) == {**pins, "pin:new": "x"}


def test_copy_pages_damaged_while_running_are_found_and_rebuilt_then_the_database_lost_loses_nothing(
        tmp_path, caplog):
    """Nothing reads the copy, so its damage is found by the periodic verification (what the
    journal's verifier did for the journal): set aside and rebuilt from the database, with
    another process sharing the store. Then the database is lost with every process killed:
    the rebuilt copy has every pin (before the journal's verifier, the damaged lines' pins
    were lost this way: the fault soak's finding)."""
    path = tmp_path / "state.db"
    pins = fill(path, 2000)
    other = spawn(WRITER, str(path), "{}", "w")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s = FileStore(path, watch_interval=0.05)
        try:
            assert other.stdout.readline() == "ready\n"
            copy = Path(f"{path}.copy")
            s._w.execute("PRAGMA copy.wal_checkpoint(TRUNCATE)")
            pages = copy.stat().st_size // 4096
            scribble(copy, 4096 * (pages // 2), os.urandom(4096 * 2))
            wait_for(lambda: any("rebuilt" in r.getMessage() and "copy" in r.getMessage() for r in caplog.records),
                     timeout=20)
            wait_for(lambda: s.describe()["unsure"] is None)
            s.set("pin:after", "x", durable=True)
        finally:
            other.send_signal(signal.SIGKILL)
            out, _ = communicate(other)
            s.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any("copy's pages are damaged" in m for m in messages) or \
        any("copy" in m and "damaged" in m for m in out.splitlines()), messages
    assert list(tmp_path.glob("state.db.copy.corrupt-*"))         # kept for the operator
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    view = fresh_view(path)
    assert pins_of(view) == {**pins, "pin:after": "x"}
    assert all(view.get(k) == v for k, v in {f"w:{i}": v for i, v in acked(out).items()}.items())


def test_a_copy_of_a_newer_version_is_refused_untouched(tmp_path):
    path = tmp_path / "state.db"
    fill(path, 10)
    run("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute('PRAGMA user_version = 9'); c.close()",
        f"{path}.copy")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(StoreVersionError) as refused:
        FileStore(path)
    assert "\n" not in str(refused.value) and "store format 9" in str(refused.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_newer_database_is_one_clear_line_through_open_store(tmp_path):
    path = tmp_path / "state.db"
    fill(path, 10)
    run("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute('PRAGMA user_version = 9'); c.close()",
        str(path))
    with pytest.raises(StoreError) as refused:
        open_store(f"file:{path}")
    assert isinstance(refused.value, StoreVersionError) and "\n" not in str(refused.value)


def test_acknowledged_durable_writes_survive_sigkill_and_the_loss_of_either_file(tmp_path):
    """kill -9 a writer, then lose the database (or its copy): every acknowledged key."""
    for lose in ("database", "copy"):
        path = tmp_path / lose / "state.db"
        p = spawn(KILLED_WRITER, str(path), "0")
        assert p.stdout.readline() == "ready\n" and p.stdout.readline() == "paused\n"
        p.stdin.write("go\n")
        p.stdin.flush()
        lines = [p.stdout.readline() for _ in range(150)]
        p.send_signal(signal.SIGKILL)
        out, _ = communicate(p)
        acks = {f"k:{i}": i for i in acked("".join(lines) + out)}
        assert len(acks) >= 150
        lost = ["", "-wal", "-shm"] if lose == "database" else [".copy", ".copy-wal", ".copy-shm"]
        for suffix in lost:
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        view = fresh_view(path)
        assert {k: view.get(k) for k in acks} == acks
        assert len(set(view) - set(acks)) <= 1                 # the in-flight one at most
