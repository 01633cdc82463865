"""A journal damaged while the store runs (issue 10's journal, found by scripts/soak_faults.py):
noticed by the keeper's background verification (journal.Verifier) or by a compaction, set
aside and rebuilt from the database under the lock file, so that losing the database
afterwards loses no pin. Before, the damage was noticed only at the next open: a database
lost before then took the damaged lines' pins with it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from children import communicate
from sessionpin.store.file import FileStore

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
LOGGER = "sessionpin.store.file"


def wait_for(cond, timeout: float = 30.0) -> None:
    """A bound for a slow shared machine, not a timing asserted."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def damage_the_middle(journal: Path) -> None:
    size = journal.stat().st_size
    with open(journal, "r+b") as f:
        f.seek(size // 2)
        f.write(b"#" * 64)


def lose_the_database(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def reopened(path: Path) -> dict:
    """Every pin, as a new process opening the store (from the journal alone) sees it."""
    out = subprocess.run([sys.executable, "-c", r"""
import json, sys
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
print(json.dumps({k: s.get(k) for k in s.keys("pin:")}))
s.close()
""", str(path)], env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import json
    return json.loads(out.stdout)


def damage_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "was damaged" in r.getMessage()]


def test_a_journal_damaged_while_running_is_rebuilt_so_a_lost_database_loses_no_pin(tmp_path, caplog):
    path = tmp_path / "state.db"
    journal = Path(f"{path}.journal")
    pins = {f"pin:{i:03d}": "x" * 200 for i in range(100)}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s = FileStore(path)
        try:
            for k, v in pins.items():
                s.set(k, v, durable=True)
            damage_the_middle(journal)
            try:                                                 # (before the fix: never; the pins
                wait_for(lambda: (s.describe()["journal"]["last_rebuild"] or {}).get("from") == "store")
            except AssertionError:                               # of the damaged lines are lost below)
                pass
            assert s.describe()["healthy"]
            s.set("pin:after", "y", durable=True)                # appended to the rebuilt journal
        finally:
            s.close()
    lose_the_database(path)                                      # (the soak: deleted, then kill -9)
    assert reopened(path) == {**pins, "pin:after": "y"}
    [line] = damage_warnings(caplog)                              # logged once
    assert "bad line at byte" in line and "rebuilt it from the store (100 keys)" in line
    assert len(list(tmp_path.glob("state.db.journal.corrupt-*"))) == 1


SHARER = r"""
import sys
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
s.close()
"""


def test_any_process_sharing_the_store_may_notice_and_the_others_follow(tmp_path, caplog):
    path = tmp_path / "state.db"
    journal = Path(f"{path}.journal")
    s = FileStore(path)
    s._keeper.journal.verifier.next_at = float("inf")            # this one never looks: the other must
    other = subprocess.Popen([sys.executable, "-c", SHARER, str(path)], env=ENV, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert other.stdout.readline().strip() == "ready"
        for i in range(60):
            s.set(f"pin:{i:03d}", "a" * 100, durable=True)
        inode = journal.stat().st_ino
        damage_the_middle(journal)
        wait_for(lambda: list(tmp_path.glob("state.db.journal.corrupt-*")))
        wait_for(lambda: journal.exists() and journal.stat().st_ino != inode)   # set aside, then rebuilt
        s.set("pin:late", "b", durable=True)                     # this process follows the new file
    finally:
        out, err = communicate(other, "\n", timeout=60)
        s.close()
    assert other.returncode == 0 and "was damaged (bad line at byte" in err
    lose_the_database(path)
    assert reopened(path) == {**{f"pin:{i:03d}": "a" * 100 for i in range(60)}, "pin:late": "b"}


def test_a_compaction_that_sees_damage_rebuilds_the_journal(tmp_path, caplog):
    path = tmp_path / "state.db"
    journal = Path(f"{path}.journal")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s = FileStore(path, compact_min_bytes=1 << 30, flush_interval=0.05)
        k = s._keeper
        try:
            for i in range(80):
                s.set(f"pin:{i:03d}", "c" * 100, durable=True)
            k.journal.verifier.next_at = float("inf")            # no verification but the compaction's
            damage_the_middle(journal)
            k.compact_min_bytes = 0                              # the next flush tick compacts
            wait_for(lambda: list(tmp_path.glob("state.db.journal.corrupt-*")))
        finally:
            s.close()
    assert len(damage_warnings(caplog)) == 1
    lose_the_database(path)
    assert reopened(path) == {f"pin:{i:03d}": "c" * 100 for i in range(80)}
