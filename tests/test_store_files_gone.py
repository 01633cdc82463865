"""The file store when its files are gone or replaced, the cases the end-to-end fault tests
(tests/e2e/test_store_faults_e2e.py) found or need, one mechanism each:

- a miss (``None``) is an answer only from the file the path names: a read that misses
  while the database file was deleted or replaced, before the watch noticed, raises;
- a database made where one was deleted never reads the old file's leftover -wal/-shm,
  and is made (and filled from the copy) by one process at a time;
- a repair that keeps failing is logged once, not once per try;
- the repairs are kept in the store, so another process (``sessionpin doctor``) shows them;
- ``sessionpin sessions`` works when only the copy is left.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sessionpin.records import pins
from sessionpin.store import StoreUnavailable
from sessionpin.store.file import FileStore

from test_store_damage import ENV, LOGGER, fill, fresh_view, pins_of, run, spawn, wait_for

QUIET = {"flush_interval": 3600, "sweep_interval": 3600, "watch_interval": 3600}   # the thread only when woken


def test_a_miss_while_the_database_file_is_replaced_is_not_an_answer(tmp_path):
    path = tmp_path / "state.db"
    fill(path, 20)
    s = FileStore(path, **QUIET)
    try:
        assert s.get("pin:00001") == "server-1"
        assert s.get("pin:new") is None
        # another process puts a new file in place (as its repair does), holding a pin
        # this store's open connection cannot see
        run(r"""
import os, shutil, sqlite3, sys
p = sys.argv[1]
src = sqlite3.connect(p); dst = sqlite3.connect(p + ".new"); src.backup(dst)
dst.execute("INSERT INTO entries (key, kind, value) VALUES ('pin:new', 's', 'glm')"); dst.commit()
dst.execute("PRAGMA journal_mode = DELETE"); dst.close(); src.close()
for stale in (p + "-wal", p + "-shm"):               # as guard.put_in_place does
    os.unlink(stale)
os.rename(p + ".new", p)
""", str(path))
        with pytest.raises(StoreUnavailable, match="replaced"):
            s.get("pin:new")                             # never "no pin"
        with pytest.raises(StoreUnavailable):
            s.mget(["pin:00001", "pin:new"])
        wait_for(lambda: s.describe()["unsure"] is None)  # the miss woke the repair: it follows the file
        assert s.get("pin:new") == "glm" and s.get("pin:00001") == "server-1"
    finally:
        s.close()


def test_a_miss_while_the_database_file_is_deleted_raises_until_restored(tmp_path):
    path = tmp_path / "state.db"
    pins = fill(path, 20)
    s = FileStore(path, **QUIET)
    try:
        os.unlink(path)
        with pytest.raises(StoreUnavailable, match="deleted"):
            s.get("pin:absent")
        wait_for(lambda: s.describe()["unsure"] is None)
        assert s.get("pin:absent") is None and s.get("pin:00002") == "server-2"
    finally:
        s.close()
    assert pins_of(fresh_view(path)) == pins


KILLED = r"""
import os, signal, sys
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1], flush_interval=3600, watch_interval=3600)
for i in range(int(sys.argv[2])):
    s.set(f"pin:{i:05d}", f"server-{i % 7}", 86400, durable=True)
os.kill(os.getpid(), signal.SIGKILL)                 # the -wal and -shm stay behind
"""


def leftover_wal(path: Path, n: int) -> dict[str, str]:
    """A store whose writer was killed (its commits in the -wal), then its database deleted."""
    FileStore(path).close()
    p = subprocess.run([sys.executable, "-c", KILLED, str(path), str(n)], env=ENV, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert Path(f"{path}-wal").stat().st_size > 0
    os.unlink(path)
    return {f"pin:{i:05d}": f"server-{i % 7}" for i in range(n)}


def test_a_new_database_never_reads_the_deleted_ones_wal(tmp_path, caplog):
    path = tmp_path / "state.db"
    pins = leftover_wal(path, 200)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s = FileStore(path)
    try:
        assert {k: s.get(k) for k in s.keys()} == pins        # from the copy
    finally:
        s.close()
    c = sqlite3.connect(path)
    assert c.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    c.close()
    assert any("rebuilt its database from the copy (missing)" in r.getMessage() for r in caplog.records)


OPENER = r"""
import json, sys
from sessionpin.store.file import FileStore
sys.stdin.readline()
s = FileStore(sys.argv[1])
print(json.dumps({k: s.get(k) for k in s.keys()}), flush=True)
s.close()
"""


def test_processes_racing_to_make_a_missing_database_make_it_once(tmp_path):
    path = tmp_path / "state.db"
    pins = leftover_wal(path, 300)
    procs = [spawn(OPENER, str(path)) for _ in range(4)]
    for p in procs:                                          # as close to together as we can
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert json.loads(out) == pins                       # every process: every pin, nothing else
    assert not list(tmp_path.glob("state.db.corrupt-*"))
    assert fresh_view(path) == pins


def test_a_repair_that_keeps_failing_is_logged_once(tmp_path, caplog):
    d = tmp_path / "state"
    path = d / "state.db"
    pins = fill(path, 20)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        s = FileStore(path, watch_interval=0.02)
        try:
            os.rename(d, tmp_path / "gone")
            d.write_text("a file where the directory was: the repair cannot make it again")
            wait_for(lambda: s.describe()["unsure"] is not None)
            for _ in range(20):                              # callers keep asking meanwhile
                with pytest.raises(StoreUnavailable):
                    s.get("pin:00001")
            wait_for(lambda: len([r for r in caplog.records if "repair failed again" in r.getMessage()]) >= 5)
            d.unlink()
            wait_for(lambda: s.describe()["unsure"] is None)
            assert s.get("pin:00001") == "server-1"
        finally:
            s.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len([m for m in errors if "cannot repair it" in m]) == 1, errors
    assert len([m for m in errors if "while it was open" in m]) == 1, errors
    assert len([r for r in caplog.records if "repaired:" in r.getMessage()]) == 1
    assert pins_of(fresh_view(path)) == pins


def test_repairs_are_kept_in_the_store_for_other_processes(tmp_path):
    path = tmp_path / "state.db"
    fill(path, 30)
    os.truncate(path, path.stat().st_size // 2)
    FileStore(path).close()                                  # set aside, rebuilt
    s = FileStore(path, **QUIET)                             # later, another process
    try:
        repairs = [r["what"] for r in s.describe()["repairs"]]
        assert any("moved it aside to" in w for w in repairs), repairs
        assert repairs[-1] == "rebuilt the database from the copy (database disk image is malformed): 60 keys", \
            repairs
        os.unlink(path)
        with pytest.raises(StoreUnavailable):
            s.get("pin:absent")
        wait_for(lambda: s.describe()["unsure"] is None)
    finally:
        s.close()
    s = FileStore(path)
    try:
        last = s.describe()["repairs"][-1]["what"]
        assert "deleted while it was open; rebuilt the database from the copy" in last
    finally:
        s.close()


def test_sessions_when_only_the_copy_is_left(tmp_path):
    path = tmp_path / "state.db"
    now = time.time()
    pin = pins.encode(pins.Pin(agent="claude-code", server="glm", since=now, renewed=now, rule="opening"))
    # the pin and its index entries in one durable write, as pins.create writes them (sessions
    # walks the pin index)
    run("import sys\nfrom sessionpin.records import pins\nfrom sessionpin.store.base import Set\n"
        "from sessionpin.store.file import FileStore\ns = FileStore(sys.argv[1])\n"
        "s.apply([], [Set('pin:s-1', sys.argv[2], 86400), *pins.index_writes('s-1', pins.decode(sys.argv[2]))], "
        "durable=True)\ns.close()", str(path), pin)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    env = {k: v for k, v in ENV.items() if not k.startswith("SESSIONPIN_")}
    env["SESSIONPIN_STORE_MEMORY"] = os.environ["SESSIONPIN_STORE_MEMORY"]    # the run's (tests/conftest.py)
    out = subprocess.run([sys.executable, "-m", "sessionpin.cli", "--config", str(tmp_path / "config.toml"),
                          "--store", f"file:{path}", "sessions", "--json"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [(r["session"], r["server"]) for r in json.loads(out.stdout)] == [("s-1", "glm")]
