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
- A repair puts the journal back first (from the descriptor still open, if its file is
  gone), and never puts in place or opens a database it has not ``quick_check``ed: when
  the data the store still has is damaged, the journal is the source of truth.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import guard, safefile
from . import sqlitefile as sf
from .journal import Journal, parse, touched

if TYPE_CHECKING:
    from .keeper import Keeper

log = logging.getLogger("sessionpin.store.file")


def open_full(k: Keeper, read_header: bool = False) -> None:
    """Open the writer connection with everything checked (wlock held). The lock file
    is taken only to change something: make a missing database, set a file aside,
    replay, rebuild."""
    sf.prepare_dir(k.path.parent)
    for p in (k.journal.path, k.lock.path):    # a link, another user's: refused at open, with its line
        safefile.check_existing(p)
    if read_header:
        try:
            sf.check_header(k.path)             # a newer or foreign file: refused before we write
        except sf.Unreadable:
            pass                                # set aside below, under the lock
    Journal.check_version(k.journal.path)
    making = not k.path.exists()
    if making:                                  # made, filled and reconciled by one process at a time
        k.lock.acquire(k.lock_wait)
    try:
        if making and not k.path.exists():
            clear_leftovers(k)
        conn, fresh, found = connect_db(k, read_header)
        try:
            src, k.salvage_from = k.salvage_from, None
            if src is not None and fresh:
                salvage_into(k, conn, src)
            reconcile(k, conn, fresh=fresh, found=found)
            try:
                sf.txn(conn, lambda c: c.execute("DELETE FROM entries WHERE expires_at <= ?", (k.clock(),)),
                       durable=False)
                k.dirty = True
            except sqlite3.Error as exc:
                if not sf.is_fault(exc):
                    raise                       # dropping expired rows can wait for the sweeper
            if k.pending:
                remember(k, conn)
            k.repairs = history(conn)
        except BaseException:
            conn.close()
            raise
    finally:
        if making:
            k.lock.release()
    k.w = conn
    k.ident = guard.identity(k.path)
    k.gen += 1                                  # readers opened meanwhile open afresh


def clear_leftovers(k: Keeper) -> None:
    """The database file is missing (lock file held): a -wal or -shm still there belongs to
    the file that was deleted, and SQLite would pair a new file with them (reading the
    old WAL's pages into it). The -shm goes; the -wal is moved aside for the operator
    (what its durable commits held is in the journal)."""
    try:
        Path(f"{k.path}-shm").unlink()
    except FileNotFoundError:
        pass
    wal = Path(f"{k.path}-wal")
    if wal.exists():
        dest = sf.set_aside(wal, "its database file is missing", label="orphan")
        log.warning("store file %s is missing but its -wal was left behind; moved it aside to %s (a new "
                    "database never reads another's WAL)", k.path, dest)
    Path(f"{k.path}-journal").unlink(missing_ok=True)   # SQLite's rollback journal of that file


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
            k.pending.append(f"the database could not be read ({why}); moved it aside to {aside}")
            if aside is not None:
                k.salvage_from = aside          # its readable rows, under the journal's (open_full)
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


def salvage_into(k: Keeper, conn: sqlite3.Connection, src: Path) -> None:
    """A damaged database was set aside (``src``) and ``conn`` is its new, empty file (lock
    file held): copy into it every key of ``src`` that can still be read, row by row. The
    journal is replayed over them next (reconcile: a fresh database replays all of it), so
    for every key the journal holds, the journal's state wins; the salvaged rows add what
    only the database had (ordinary writes: activity, renewed expiries). Without a journal
    they are all there is: said at ERROR, with the counts."""
    parsed = k.journal.read()
    seeds: set[str] = set()
    if parsed is not None:
        seeds = touched(parsed.snapshot)
        for r in parsed.records:
            seeds |= touched(r.entries)
    try:
        got = guard.salvage(src, conn, k.clock(), seeds, busy_timeout=k.busy_timeout)
    except sqlite3.Error as exc:
        if not sf.is_fault(exc):
            raise
        got = guard.Salvaged(0, 1)
    k.salvaged = got
    if parsed is not None:
        log.warning("store file %s: read %d keys row by row from the damaged file %s (%d reads met damaged "
                    "pages); the journal %s is replayed over them", k.path, got.keys, src, got.errors, k.journal.path)
        k.pending.append(f"read {got.keys} keys row by row from the damaged file ({got.errors} reads met "
                         f"damaged pages); the journal replayed over them")
    else:
        log.error("store file %s was damaged and there is no journal %s to rebuild it from: salvaged %d keys "
                  "row by row from %s; %d reads met damaged pages, and the keys on those pages are LOST (pins "
                  "among them route as new conversations). The damaged file is kept there for inspection",
                  k.path, k.journal.path, got.keys, src, got.errors)
        k.pending.append(f"damaged with no journal: salvaged {got.keys} keys row by row from {src}; "
                         f"{got.errors} reads met damaged pages, the keys on them are lost")


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
            remember(k, conn, f"the journal was missing; rebuilt it from the database ({n} keys)")
        return
    if parsed.damaged:
        lines, keys = guard.replay(conn, parsed, now)  # what can still be read of it
        dest = sf.set_aside(j.path, parsed.damaged)
        n = guard.rebuild_journal(conn, j, now)
        log.warning("journal %s was damaged (%s); moved it aside to %s, replayed %d of its lines the store "
                    "lacked, and rebuilt it from the store (%d keys)", j.path, parsed.damaged, dest, lines, n)
        j.last_rebuild = {"rebuilt": "journal", "from": "store", "keys": n, "at": now, "why": parsed.damaged}
        remember(k, conn, f"the journal was damaged ({parsed.damaged}); moved it aside to {dest}, replayed "
                          f"{lines} of its lines, rebuilt it from the database ({n} keys)")
        return
    j.current()
    lines, keys = guard.replay(conn, parsed, now)
    if lines and fresh:
        log.warning("store file %s rebuilt from the journal %s: %d keys", k.path, j.path, keys)
        k.last_repair = j.last_rebuild = {"rebuilt": "database", "from": "journal", "keys": keys, "at": now}
        remember(k, conn, f"rebuilt from the journal: {keys} keys")
    elif lines:
        log.warning("store file %s lacked %d durable writes that the journal %s holds; replayed them (%d keys)",
                    k.path, lines, j.path, keys)
        j.last_rebuild = {"rebuilt": "database", "from": "journal", "lines": lines, "keys": keys, "at": now}
        remember(k, conn, f"lacked {lines} durable writes the journal holds; replayed them ({keys} keys)")
    if parsed.last_seq < guard.db_seq(conn):
        n = guard.rebuild_journal(conn, j, now)
        log.warning("journal %s lacked durable writes the store holds; rebuilt it from the store (%d keys)",
                    j.path, n)
        j.last_rebuild = {"rebuilt": "journal", "from": "store", "keys": n, "at": now, "why": "behind"}
        remember(k, conn, f"the journal lacked durable writes the database holds; rebuilt it ({n} keys)")
    else:
        j.live_bytes = parsed.snapshot_end


# == the repair history (for doctor: the proxy's repairs seen from another process) ========

HISTORY = 20          # the last repairs kept in the database's meta table


def remember(k: Keeper, conn: sqlite3.Connection, what: str | None = None) -> None:
    """Add a repair to the history kept in the database (with those waiting from before the
    database could take them: a set-aside happens before there is one)."""
    entries = [{"at": time.time(), "what": w} for w in [*k.pending, *([what] if what else [])]]
    if not entries:
        return
    k.pending.clear()

    def body(c: sqlite3.Connection) -> list:
        kept = _history(c) + entries
        c.execute("INSERT INTO meta (name, value) VALUES ('repairs', ?) "
                  "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (json.dumps(kept[-HISTORY:]),))
        return kept[-HISTORY:]
    try:
        k.repairs = sf.txn(conn, body, durable=True)
    except sqlite3.Error as exc:
        if not sf.is_fault(exc):
            raise
        log.debug("store %s: could not record a repair: %s", k.url, exc)


def history(conn: sqlite3.Connection) -> list:
    try:
        return _history(conn)
    except sqlite3.Error:
        return []


def _history(c: sqlite3.Connection) -> list:
    row = c.execute("SELECT value FROM meta WHERE name = 'repairs'").fetchone()
    try:
        got = json.loads(row[0]) if row else []
    except ValueError:
        return []
    return got if isinstance(got, list) else []


def check_pages(k: Keeper) -> None:
    """A call met damaged pages: check them on a fresh connection (the writer's page
    cache may still hold good copies: under WAL another's commit does not empty it).
    The full ``integrity_check``, since a call did raise: an index that disagrees with its
    table raises "malformed" on the keys it covers, and ``quick_check`` passes it."""
    k.suspect = False
    db = guard.identity(k.path).db
    try:
        conn = k.connect()
    except (sqlite3.Error, OSError):
        return
    try:
        why = guard.quick_check(conn, full=True)
    finally:
        conn.close()
    if why is not None:
        k.damaged, k.damaged_db = why, db
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
            if sf.is_damage(exc):
                # the file it opened met damaged pages after all: the next try sets it aside
                # and rebuilds it from the journal, rather than opening it again and again
                k.damaged, k.damaged_db = str(exc), guard.identity(k.path).db
            # one line per streak of failures (tried again every watch_interval)
            if k.repair_failing is None:
                log.error("store %s: cannot repair it (%s): %s; reads and writes refuse until it can, trying "
                          "again every %g s", k.url, why, recovery_cause(exc), k.watch_interval)
            else:
                log.debug("store %s: repair failed again: %s", k.url, exc)
            k.repair_failing = recovery_cause(exc)
            return
        k.unsure = k.damaged = k.damaged_db = None
        k.last_repair = {"why": why, "action": action, "at": time.time()}
        log.warning("store %s repaired: %s (%s); reads and writes go on", k.url, action, why)
        k.repair_failing = None
        if k.w is not None:
            remember(k, k.w, f"{why} while it was open; {action}")


def recovery_cause(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return f"{type(exc).__name__}: {exc}"


def repair_locked(k: Keeper) -> str:
    """One repair (lock file held). The journal first: if its path names no file it is put
    back from the descriptor still open, before anything is done to the database (whose
    rebuild may need it). Then the database: follow the file another process put in place;
    or restore it from the connection still open, if that copy passes ``quick_check``;
    or, when the copy is damaged or there is no connection, set the damaged file aside and
    rebuild it from the journal, with the rows of the damaged file that can still be read
    under the journal's. No file is opened after a repair without ``quick_check``, except
    a copy this repair has just checked."""
    journal_note = restore_journal_first(k)
    now = guard.identity(k.path)
    damaged_here = k.damaged is not None and now.db is not None and now.db == k.damaged_db
    if k.ident is not None and now.db is not None and now.db != k.ident.db and not damaged_here:
        action = "opened the database file another process put in its place"  # (it repaired first)
        k.checked = False
    elif k.w is not None and k.ident is not None and (damaged_here or k.ident.differs(now)):
        tmp, bad = guard.restore_from(k.w, k.path)
        if bad is None:
            guard.put_in_place(tmp, k.path)
            action = "restored it from the connection still open"
        else:
            action = set_aside_damaged(k, bad, copy=tmp)
    elif damaged_here:
        action = set_aside_damaged(k, k.damaged or "damaged")
    else:
        action = "reopened it"
        k.checked = False
    k.drop_writer()                             # only now: for a deleted file it was the only copy
    open_full(k)
    return f"{action}; {journal_note}" if journal_note else action


def set_aside_damaged(k: Keeper, why: str, copy: Path | None = None) -> str:
    """The data the store has is damaged: keep it for the operator (``.corrupt-…``), clear the
    path (the file there, and any -wal/-shm, set aside with it), and leave the rebuild to
    ``open_full``: the journal, with what of the damaged data can be read (``salvage_from``)."""
    if copy is not None:
        dest = sf.set_aside(k.path, why, src=copy)
        old = sf.set_aside(k.path, why)         # the file at the path: the same damage, or stale
        also = f" (and the file at its path to {old})" if old is not None else ""
        k.salvage_from = dest
        return (f"the connection still open reads damaged pages ({why}): moved its copy aside to {dest}{also} "
                f"and rebuilt it from the journal")
    dest = sf.set_aside(k.path, why)
    k.salvage_from = dest
    return f"moved the damaged file aside to {dest} and rebuilt it from the journal"


def restore_journal_first(k: Keeper) -> str:
    """Before a repair touches the database: a journal whose path names no file is put back
    from the descriptor still open on it, as it is (the reconcile that follows the repair
    replays it, or rebuilds it from the database if it is behind). '' if nothing was done."""
    j = k.journal
    if j.current():
        return ""
    data = j.read_deleted()
    if not data:
        return ""                               # no descriptor on it: the reconcile rebuilds it
    j.restore(data)
    parsed = parse(data)
    n = len(parsed.snapshot) + len(parsed.records)
    log.warning("journal %s was deleted while the store was open; restored it from the descriptor still open "
                "(%d lines)", j.path, n)
    j.last_rebuild = {"rebuilt": "journal", "from": "descriptor", "lines": n, "at": time.time(), "why": "deleted"}
    return f"restored the deleted journal from the descriptor still open ({n} lines)"


def repair_journal(k: Keeper) -> None:
    """The journal's path names no file: restore it from the descriptor we still have open
    (the deleted file, every line in it), or, without one, rebuild it from the database."""
    with k.wlock:
        if k.w is None or k.closed:
            return
        j = k.journal
        k.lock.acquire(k.lock_wait)
        try:
            if j.current():
                return                          # another process made it again
            how, n = "", 0
            data = j.read_deleted()
            try:
                seq: int | None = guard.db_seq(k.w)
            except sqlite3.DatabaseError as exc:
                if not sf.is_damage(exc):
                    raise
                seq = None                      # the database is damaged: the journal is the truth
                k.suspect = True                # (the watch checks its pages next)
                k.wake.set()
            if data is not None:
                parsed = parse(data)
                if (not parsed.damaged and parsed.last_seq == seq) or (seq is None and data):
                    j.restore(data)
                    how, n = "restored it from the descriptor still open", len(parsed.snapshot) + len(parsed.records)
            if not how and seq is not None:
                try:
                    n = guard.rebuild_journal(k.w, j, k.clock())
                    how = "rebuilt it from the store"
                except sqlite3.DatabaseError as exc:
                    if not sf.is_damage(exc):
                        raise
                    k.suspect = True            # never a journal from damaged pages: check them
                    k.wake.set()
                    if data:                    # and put back what the descriptor holds meanwhile
                        parsed = parse(data)
                        j.restore(data)
                        how, n = "restored it from the descriptor still open", len(parsed.snapshot) + len(parsed.records)
            if not how:
                return                          # nothing to rebuild it from until the database is repaired
        finally:
            k.lock.release()
    what = f"{how} ({n} {'lines' if how.startswith('restored') else 'keys'})"
    log.warning("journal %s was deleted while the store was open; %s", j.path, what)
    j.last_rebuild = {"rebuilt": "journal", "from": "descriptor" if how.startswith("restored") else "store",
                      "keys" if not how.startswith("restored") else "lines": n, "at": time.time(), "why": "deleted"}
    with k.wlock:
        if k.w is not None and not k.closed:
            remember(k, k.w, f"the journal was deleted while it was open; {what}")


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
