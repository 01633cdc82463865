"""What the file store does to be whole: opening, reconciling with the journal, repairing.
Functions over the ``Keeper``'s state (keeper.py), with the writer lock held by the caller
unless said; the mechanisms are guard.py's, the log lines the operator reads are here.

Rules they keep:
- Opening takes the store's lock file only to change something (set a file aside,
  replay, rebuild): the usual open reads the journal, sees it agree with the database
  and takes no lock, so a CLI run never holds up the proxy's durable writes.
- Every change is logged once, with counts: "moved it aside to …", "rebuilt from the
  journal: N keys", "lacked N durable writes … replayed them", "journal … rebuilt from
  the store (N keys)", "repaired: restored it from the connection still open (why)".
- A repair keeps the writer connection until the restored file is in place: for a
  deleted file, that connection is the only copy of what it held.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import TYPE_CHECKING

from . import guard
from . import sqlitefile as sf
from .journal import Journal

if TYPE_CHECKING:
    from .keeper import Keeper

log = logging.getLogger("sessionpin.store.file")


def open_full(k: Keeper, read_header: bool = False) -> None:
    """Open the writer connection with everything checked (wlock held). The lock file
    is taken only to change something: set a file aside, replay, rebuild."""
    sf.prepare_dir(k.path.parent)
    if read_header:
        try:
            sf.check_header(k.path)             # a newer or foreign file: refused before we write
        except sf.Unreadable:
            pass                                # set aside below, under the lock
    Journal.check_version(k.journal.path)
    conn, fresh, found = connect_db(k, read_header)
    try:
        reconcile(k, conn, fresh=fresh, found=found)
        try:
            sf.txn(conn, lambda c: c.execute("DELETE FROM entries WHERE expires_at <= ?", (k.clock(),)),
                   durable=False)
            k.dirty = True
        except sqlite3.Error as exc:
            if not sf.is_fault(exc):
                raise                           # dropping expired rows can wait for the sweeper
    except BaseException:
        conn.close()
        raise
    k.w = conn
    k.ident = guard.identity(k.path)
    k.gen += 1                                  # readers opened meanwhile open afresh


def connect_db(k: Keeper, read_header: bool) -> tuple[sqlite3.Connection, bool, int]:
    """(connection, whether the database is new, the version it had)."""
    try:
        return try_connect(k, read_header)
    except sf.Unreadable:
        pass
    k.lock.acquire(k.lock_wait)                 # another process may be setting it aside too
    try:
        try:
            return try_connect(k, read_header)
        except sf.Unreadable as why:
            aside = sf.set_aside(k.path, str(why))
            log.warning("store file %s could not be read (%s); moved it aside to %s", k.path, why, aside)
        conn, _, found = try_connect(k, False)
        return conn, True, found
    finally:
        k.lock.release()


def try_connect(k: Keeper, read_header: bool) -> tuple[sqlite3.Connection, bool, int]:
    if read_header:
        sf.check_header(k.path)
    created = sf.create_file(k.path)
    conn = k.connect()
    try:
        try:
            found = sf.init_db(conn, k.path, quick_check=not k.checked)
        except sqlite3.DatabaseError as exc:
            if sf.is_damage(exc):
                raise sf.Unreadable(str(exc)) from None
            raise
    except BaseException:
        conn.close()
        raise
    k.checked = True
    return conn, created or found == 0, found


def reconcile(k: Keeper, conn: sqlite3.Connection, *, fresh: bool, found: int) -> None:
    j = k.journal
    parsed = j.read()
    if parsed is not None and not parsed.damaged and parsed.last_seq == guard.db_seq(conn):
        j.current()                             # the usual case: they agree, nothing to change
        j.live_bytes = parsed.snapshot_end
        return
    k.lock.acquire(k.lock_wait)
    try:
        reconcile_locked(k, conn, j.read(), fresh=fresh, found=found)
    finally:
        k.lock.release()


def reconcile_locked(k: Keeper, conn: sqlite3.Connection, parsed, *, fresh: bool, found: int) -> None:
    now, j = k.clock(), k.journal
    if parsed is None:
        n = guard.rebuild_journal(conn, j, now)
        if not fresh and found >= 2:            # a journal this store had: lost
            log.warning("journal %s was missing; rebuilt it from the store (%d keys)", j.path, n)
            j.last_rebuild = {"rebuilt": "journal", "from": "store", "keys": n, "at": now, "why": "missing"}
        return
    if parsed.damaged:
        lines, keys = guard.replay(conn, parsed, now)  # what can still be read of it
        dest = sf.set_aside(j.path, parsed.damaged)
        n = guard.rebuild_journal(conn, j, now)
        log.warning("journal %s was damaged (%s); moved it aside to %s, replayed %d of its lines the store "
                    "lacked, and rebuilt it from the store (%d keys)", j.path, parsed.damaged, dest, lines, n)
        j.last_rebuild = {"rebuilt": "journal", "from": "store", "keys": n, "at": now, "why": parsed.damaged}
        return
    j.current()
    lines, keys = guard.replay(conn, parsed, now)
    if lines and fresh:
        log.warning("store file %s rebuilt from the journal %s: %d keys", k.path, j.path, keys)
        k.last_repair = j.last_rebuild = {"rebuilt": "database", "from": "journal", "keys": keys, "at": now}
    elif lines:
        log.warning("store file %s lacked %d durable writes that the journal %s holds; replayed them (%d keys)",
                    k.path, lines, j.path, keys)
        j.last_rebuild = {"rebuilt": "database", "from": "journal", "lines": lines, "keys": keys, "at": now}
    if parsed.last_seq < guard.db_seq(conn):
        n = guard.rebuild_journal(conn, j, now)
        log.warning("journal %s lacked durable writes the store holds; rebuilt it from the store (%d keys)",
                    j.path, n)
        j.last_rebuild = {"rebuilt": "journal", "from": "store", "keys": n, "at": now, "why": "behind"}
    else:
        j.live_bytes = parsed.snapshot_end


def check_pages(k: Keeper) -> None:
    """A call met damaged pages: check them on a fresh connection (the writer's page
    cache may still hold good copies: under WAL another's commit does not empty it)."""
    k.suspect = False
    try:
        conn = k.connect()
    except (sqlite3.Error, OSError):
        return
    try:
        why = guard.quick_check(conn)
    finally:
        conn.close()
    if why is not None:
        k.damaged = why
        k.notice(f"its pages are damaged ({why})")


def repair(k: Keeper) -> None:
    with k.wlock:
        if k.closed or k.unsure is None:
            return
        why = k.unsure
        try:
            sf.prepare_dir(k.path.parent)       # gone with its directory: made again
            k.lock.acquire(k.lock_wait)
            try:
                action = repair_locked(k)
            finally:
                k.lock.release()
        except Exception as exc:
            log.debug("store %s: repair failed, trying again: %s", k.url, exc)
            return
        k.unsure = k.damaged = None
        k.last_repair = {"why": why, "action": action, "at": time.time()}
        log.warning("store %s repaired: %s (%s); reads and writes go on", k.url, action, why)


def repair_locked(k: Keeper) -> str:
    now = guard.identity(k.path)
    if k.ident is not None and now.db is not None and now.db != k.ident.db:
        action = "opened the database file another process put in its place"  # (it repaired first)
    elif k.damaged is not None:
        dest = sf.set_aside(k.path, k.damaged)
        action = f"moved the damaged file aside to {dest} and rebuilt it from the journal"
    elif k.w is not None and k.ident is not None and k.ident.differs(now):
        guard.put_in_place(guard.restore_from(k.w, k.path), k.path)
        action = "restored it from the connection still open"
    else:
        action = "reopened it"
    k.drop_writer()                             # only now: for a deleted file it was the only copy
    open_full(k)
    return action


def repair_journal(k: Keeper) -> None:
    with k.wlock:
        if k.w is None or k.closed:
            return
        k.lock.acquire(k.lock_wait)
        try:
            if k.journal.current():
                return                          # another process made it again
            n = guard.rebuild_journal(k.w, k.journal, k.clock())
        finally:
            k.lock.release()
    log.warning("journal %s was deleted while the store was open; rebuilt it from the store (%d keys)",
                k.journal.path, n)
    k.journal.last_rebuild = {"rebuilt": "journal", "from": "store", "keys": n, "at": time.time(),
                                 "why": "deleted"}


def maybe_compact(k: Keeper) -> None:
    if k.closed or k.unsure is not None or k.w is None or not k.journal.current():
        return
    before = k.journal.size()
    if before <= max(k.compact_min_bytes, k.compact_factor * k.journal.live_bytes):
        return
    reader = k.connect()
    try:
        n = guard.compact(reader, k.journal, k.lock, k.busy_timeout, k.clock())
    finally:
        reader.close()
    if n is not None:
        log.info("journal %s compacted: %d live durable keys, %d -> %d bytes", k.journal.path, n, before,
                 k.journal.size())
