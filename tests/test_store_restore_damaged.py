"""Rebuilding when the data the store still has at its paths is damaged or gone (the fault
soak's finding: pages overwritten unnoticed, then the directory deleted).

Was (with the journal): the restore from the open connection copied the damaged pages and
put the copy in place; the open after it failed ("database disk image is malformed") and
the repair was tried again forever; after kill -9 the next start started EMPTY.

Now: neither path holds a whole file, so the source is what the writer connection still has
open, and only a schema of it that passes ``quick_check``: the copy (its pages whole) when
the database's are damaged. Both files are rebuilt from it. A damaged database with no copy
at all (a second fault) is set aside, kept, and the store starts empty, at ERROR.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from sessionpin.store.file import FileStore

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
def test_directory_gone_after_unnoticed_damage_rebuilds_from_the_whole_copy_still_open(tmp_path, caplog, gone):
    d = tmp_path / "state"
    path = d / "state.db"
    pins = fill(path, 300)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        s = FileStore(path, watch_interval=3600)                 # no verification: the damage stays unnoticed
        try:
            assert s.get("pin:00001") == "server-1"
            _damage_unnoticed(s, path)
            moved = tmp_path / "moved"
            os.rename(d, moved)
            if gone == "deleted":
                shutil.rmtree(moved)                             # the db, its copy, their -wal/-shm
            wait_for(lambda: s.describe()["last_repair"] is not None and s.describe()["unsure"] is None,
                     timeout=20)
            assert {k: s.get(k) for k in pins} == pins           # every durable pin
            assert (d / "state.db.copy").exists()                # the copy came back with it
            s.set("after", "1", durable=True)
        finally:
            s.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any("rebuilt its database from the connection still open" in m for m in messages), messages
    assert any("rebuilt its copy from the connection still open" in m for m in messages), messages
    assert not any("cannot repair it" in m or "EMPTY" in m for m in messages), messages
    assert not list(d.glob("state.db*.new-*"))
    view = fresh_view(path)                                      # the next start (as after kill -9)
    assert pins_of(view) == pins and view.get("after") == "1"


def test_damaged_pages_and_the_copy_deleted_both_come_back_from_the_connection(tmp_path, caplog):
    path = tmp_path / "state.db"
    pins = fill(path, 3000)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        s = FileStore(path, watch_interval=3600)                 # the thread only when woken
        try:
            assert s.get("pin:00001") == "server-1"
            pages = path.stat().st_size // 4096
            _damage_unnoticed(s, path, pages=(pages // 2, pages // 2 + 1, pages // 2 + 2))
            os.unlink(f"{path}.copy")
            for k in pins:                                       # reads meet the damage
                try:
                    s.get(k)
                except Exception:
                    pass
            s._writer.wake.set()
            wait_for(lambda: s.describe()["last_repair"] is not None and s.describe()["unsure"] is None,
                     timeout=20)
            assert {k: s.get(k) for k in pins} == pins
            assert (tmp_path / "state.db.copy").exists()
        finally:
            s.close()
    assert list(tmp_path.glob("state.db.corrupt-*"))             # the damaged database, kept
    assert pins_of(fresh_view(path)) == pins


def test_damaged_at_start_with_no_copy_starts_empty_loudly_and_keeps_the_file(tmp_path, caplog):
    path = tmp_path / "state.db"
    fill(path, 300)
    os.unlink(f"{path}.copy")                                    # a second fault
    data = bytearray(path.read_bytes())
    pages = len(data) // 4096
    data[4096 * (pages // 2): 4096 * (pages // 2 + 3)] = os.urandom(4096 * 3)
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        s = FileStore(path)
    try:
        assert s.keys() == []
        assert s.describe()["repairs"]                          # doctor shows it
    finally:
        s.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("starts EMPTY" in m for m in errors), errors
    assert len([p for p in tmp_path.glob("state.db.corrupt-*") if not p.name.endswith(("-wal", "-shm"))]) == 1
