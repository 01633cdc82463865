"""Restoring and rebuilding when the data the store still has is damaged (the fault soak's
finding: pages overwritten unnoticed, then the directory deleted).

Was: the restore from the open connection copied the damaged pages and put the copy in
place; the open after it failed ("database disk image is malformed") and the repair was
tried again forever (every read and write refused); the journal, deleted with the
directory, was never put back (its rebuild "from the store" read the damaged copy); and
after kill -9 the next start set the copy aside and, with no journal, started EMPTY.

Now: a copy is put in place only if it passes ``quick_check``; a damaged one is set aside,
the journal is restored first (from the descriptor still open), and the database is
rebuilt from it, under the rows of the damaged copy that can still be read. A damaged
database with no journal at all is salvaged row by row, at ERROR with the counts.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import time

import pytest

from sessionpin.store.file import FileStore
from sessionpin.store import guard

from test_store_damage import LOGGER, fill, fresh_view, pins_of, scribble, wait_for


def _damage_unnoticed(s: FileStore, path, pages=(5, 9, 12)) -> None:
    """Overwrite pages of the database file, with nothing reading them, and leave the writer
    connection no good copies in its page cache (as after a while of other work)."""
    s._w.execute("PRAGMA wal_checkpoint(TRUNCATE)")              # every page in the main file
    for p in pages:
        scribble(path, 4096 * p, os.urandom(4096))
    s._w.execute("PRAGMA shrink_memory")
    s._w.execute("PRAGMA cache_size = 1")


@pytest.mark.parametrize("gone", ["deleted", "moved away"])
def test_directory_gone_after_unnoticed_damage_rebuilds_from_the_restored_journal(tmp_path, caplog, gone):
    """``moved away`` (``mv``, or a delete that renames first): the journal still has a name,
    elsewhere, but our path names no file; its descriptor is read as for a deleted one (the
    fault soak: the journal was taken for present, the damaged copy salvaged alone, and the
    keys on its damaged pages lost)."""
    d = tmp_path / "state"
    path = d / "state.db"
    pins = fill(path, 300)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        s = FileStore(path)
        try:
            assert s.get("pin:00001") == "server-1"
            _damage_unnoticed(s, path)
            moved = tmp_path / "moved"
            os.rename(d, moved)
            if gone == "deleted":
                shutil.rmtree(moved)                             # the db, its -wal/-shm, the journal
            wait_for(lambda: s.describe()["last_repair"] is not None and s.describe()["unsure"] is None,
                     timeout=20)
            assert {k: s.get(k) for k in pins} == pins           # every durable pin
            assert (d / "state.db.journal").exists()             # the journal came back with it
            s.set("after", "1", durable=True)
        finally:
            s.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any("restored it from the descriptor still open" in m for m in messages), messages
    assert any("reads damaged pages" in m and "moved its copy aside" in m for m in messages), messages
    assert not any("cannot repair it" in m or "no journal" in m for m in messages), messages
    copies = [p for p in d.glob("state.db.corrupt-*") if not p.name.endswith(("-wal", "-shm"))]
    assert len(copies) == 1                                      # the damaged copy, kept
    assert not list(d.glob("state.db.restore-*"))
    view = fresh_view(path)                                      # the next start (as after kill -9)
    assert pins_of(view) == pins and view.get("after") == "1"


def test_a_damaged_copy_is_reported_by_restore_from(tmp_path):
    path = tmp_path / "state.db"
    fill(path, 300)
    s = FileStore(path)
    try:
        _damage_unnoticed(s, path)
        tmp, damaged = guard.restore_from(s._w, tmp_path / "copy.db")
        assert damaged                                           # never taken for a whole copy
    finally:
        s.close()
    os.unlink(tmp)
    fill(tmp_path / "whole.db", 50)
    s = FileStore(tmp_path / "whole.db")
    try:
        tmp, damaged = guard.restore_from(s._w, tmp_path / "copy2.db")
        assert damaged is None
        c = sqlite3.connect(tmp)
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        c.close()
    finally:
        s.close()


def test_damaged_pages_and_the_journal_deleted_the_journal_comes_back_first(tmp_path, caplog):
    path = tmp_path / "state.db"
    pins = fill(path, 3000)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        s = FileStore(path, watch_interval=3600)                 # the thread only when woken
        try:
            assert s.get("pin:00001") == "server-1"
            pages = path.stat().st_size // 4096
            _damage_unnoticed(s, path, pages=(pages // 2, pages // 2 + 1, pages // 2 + 2))
            os.unlink(f"{path}.journal")
            for k in pins:                                       # reads meet the damage
                try:
                    s.get(k)
                except Exception:
                    pass
            s._keeper.wake.set()
            wait_for(lambda: s.describe()["last_repair"] is not None and s.describe()["unsure"] is None,
                     timeout=20)
            assert {k: s.get(k) for k in pins} == pins
            assert (tmp_path / "state.db.journal").exists()
        finally:
            s.close()
    assert pins_of(fresh_view(path)) == pins


def test_damaged_at_start_with_no_journal_salvages_what_it_can_read_loudly(tmp_path, caplog):
    path = tmp_path / "state.db"
    pins = fill(path, 3000)
    os.unlink(f"{path}.journal")
    data = bytearray(path.read_bytes())
    pages = len(data) // 4096
    data[4096 * (pages // 2): 4096 * (pages // 2 + 3)] = os.urandom(4096 * 3)
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s = FileStore(path)
    try:
        got = {k: s.get(k) for k in s.keys("pin:")}
        assert all(pins[k] == v for k, v in got.items())        # never a wrong value
        assert len(got) > len(pins) // 2                        # not empty: what is readable
        assert s.describe()["repairs"]                          # doctor shows it
    finally:
        s.close()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert any("no journal" in r.getMessage() and "salvaged" in r.getMessage() for r in errors)
    assert (tmp_path / "state.db.journal").exists()             # rebuilt from what was salvaged
    assert pins_of(fresh_view(path)) == got


def test_a_repair_whose_open_meets_damaged_pages_is_not_tried_the_same_way_forever(tmp_path, caplog, monkeypatch):
    from sessionpin.store import recovery
    path = tmp_path / "state.db"
    pins = fill(path, 300)
    real, calls = recovery.reconcile, []

    def reconcile(k, conn, **kw):                          # the file put in place reads damaged
        calls.append(1)                                    # pages once it is opened
        if len(calls) == 1:
            exc = sqlite3.DatabaseError("database disk image is malformed")
            exc.sqlite_errorcode = sqlite3.SQLITE_CORRUPT
            raise exc
        return real(k, conn, **kw)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        s = FileStore(path)
        try:
            monkeypatch.setattr(recovery, "reconcile", reconcile)
            os.unlink(path)
            wait_for(lambda: s.describe()["last_repair"] is not None and s.describe()["unsure"] is None,
                     timeout=20)
            assert {k: s.get(k) for k in pins} == pins
        finally:
            s.close()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot repair it" in m for m in messages) == 1, messages
    assert any("moved the damaged file aside" in m and "rebuilt it from the journal" in m for m in messages)
    assert len(calls) == 2
