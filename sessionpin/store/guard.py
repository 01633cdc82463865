"""Keeping the database and its journal whole: what the file store does when either is lost
or damaged. The functions here take a connection (the writer's, unless said) and the
``Journal``; the caller holds the store's ``FileLock`` (and, in this process, its writer
lock), so no durable write of any process runs meanwhile.

Rules they keep:
- The database's ``meta.journal_seq`` says how much of the journal it holds. At open,
  journal lines above it (and the snapshot, if the database is older than it) are
  replayed into the database in one durable transaction: either commits the database lost
  (its -wal deleted, its pages damaged and set aside, the file gone) or the in-flight
  write of a process killed between its append and its commit, which a crash may leave.
- A missing, damaged or lagging journal is rebuilt from the database: every live key, as
  a snapshot at a new sequence (bumped in the database in the same durable transaction),
  so a fresh database (sequence 0) always replays it.
- Identity: the store knows the inodes of its database, -wal and -shm from the moment it
  opened them. A path that names something else (or nothing) means the files it writes
  are not the ones the next process will read; the store then restores the database
  from the connection it still has open (SQLite's backup API reads an unlinked file
  through it), checks the copy with ``quick_check`` (the backup copies damaged pages as
  they are), and only if it is whole puts it in place of the stale files and opens it.
- Salvage reads, row by row, what a damaged file still holds (``salvage``); the journal
  is replayed over it, so for every key the journal holds, the journal wins.
- Compaction keeps, of the keys the journal has durably written, those the database
  still holds, with their state there; it runs only when the database is at the journal's
  last sequence.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path
from typing import NamedTuple

from . import ops
from . import sqlitefile as sf
from .filelock import FileLock
from .journal import Journal, Parsed, fold, touched


class Identity(NamedTuple):
    db: tuple[int, int] | None
    wal: tuple[int, int] | None
    shm: tuple[int, int] | None

    def differs(self, other: "Identity") -> str | None:
        """Why ``other`` (what the paths name now) is not this (what we opened), or None."""
        for name, mine, now in (("database file", self.db, other.db), ("-wal", self.wal, other.wal),
                                ("-shm", self.shm, other.shm)):
            if mine != now:
                return f"its {name} was {'deleted' if now is None else 'replaced'}"
        return None


def _inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_dev, st.st_ino)


def identity(path: Path) -> Identity:
    p = str(path)
    return Identity(_inode(p), _inode(p + "-wal"), _inode(p + "-shm"))


# == sequence =============================================================================

def db_seq(c: sqlite3.Connection) -> int:
    row = c.execute("SELECT value FROM meta WHERE name = 'journal_seq'").fetchone()
    return int(row[0]) if row else 0


def set_seq(c: sqlite3.Connection, seq: int) -> None:
    c.execute("INSERT INTO meta (name, value) VALUES ('journal_seq', ?) "
              "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (seq,))


# == replay, rebuild, compaction ==========================================================

def replay(conn: sqlite3.Connection, parsed: Parsed, now: float) -> tuple[int, int]:
    """Put into the database what the journal holds beyond it; (lines replayed, keys written)."""
    def body(c: sqlite3.Connection) -> tuple[int, int]:
        have = db_seq(c)
        use_snapshot = have < parsed.base
        records = [r for r in parsed.records if r.seq > have]
        if not use_snapshot and not records:
            return 0, 0
        keys = touched(parsed.snapshot) if use_snapshot else set()
        for r in records:
            keys |= touched(r.entries)
        states = {k: s for k in keys if (s := ops.read_state(c, k)) is not None}
        if use_snapshot:
            fold(states, parsed.snapshot, parsed.at or 0.0)
        for r in records:
            fold(states, r.entries, r.at)
        for k in keys:
            state = states.get(k)
            ops.write_state(c, k, None if state is None or ops.expired(state[2], now) else state)
        set_seq(c, max(have, parsed.last_seq))
        return len(records) + (len(parsed.snapshot) if use_snapshot else 0), len(keys)

    return sf.txn(conn, body, durable=True)


def rebuild_journal(conn: sqlite3.Connection, journal: Journal, now: float) -> int:
    """Write a new journal from every live key of the database; return how many keys."""
    def body(c: sqlite3.Connection) -> int:
        seq = max(db_seq(c), _journal_seq(journal)) + 1
        set_seq(c, seq)
        return journal.replace(seq, now, list(ops.all_states(c, now)))

    return sf.txn(conn, body, durable=True)


def _journal_seq(journal: Journal) -> int:
    try:
        parsed = journal.read()
    except Exception:
        return 0
    return parsed.last_seq if parsed is not None and not parsed.damaged else 0


def compact(reader: sqlite3.Connection, journal: Journal, lock: FileLock, lock_wait: float,
            now: float) -> int | None:
    """Rewrite the journal as the states, in the database, of the keys it has durably
    written and the database still holds; how many, or None if it was left as it is.

    The heavy part runs without the lock: one read snapshot of the database (at sequence
    S), then the journal (which by then holds every line up to S: a line is appended before
    its commit), folded to find its keys, written to a temp file and fsync'd. Only then,
    under the lock, the lines appended since (above S) are copied after it and it is
    renamed into place: other processes' durable writes wait for that alone."""
    reader.execute("BEGIN")
    try:
        seq = db_seq(reader)
        every = dict(ops.all_states(reader, now))
    finally:
        reader.execute("COMMIT")
    if not journal.current():
        return None
    ino = journal.inode()
    parsed = journal.read_open()
    if parsed.damaged or parsed.last_seq < seq:
        return None                        # damaged or behind: not compacted; the keeper rebuilds a damaged one (Verifier.seen)
    if parsed.base > seq:
        return None                        # another process compacted it after our read: its turn
    states: dict = {}
    fold(states, parsed.snapshot, parsed.at or 0.0)
    for r in parsed.records:
        if r.seq <= seq:
            fold(states, r.entries, r.at)
    live = [(k, every[k]) for k in sorted(states) if k in every]
    tmp, n = journal.write_snapshot(seq, now, live)
    try:
        journal.sync_file(tmp)             # the big fsync, before the lock
        lock.acquire(lock_wait)
    except BaseException:
        os.unlink(tmp)
        raise
    try:
        if not journal.current() or journal.inode() != ino:
            os.unlink(tmp)                 # another process compacted it meanwhile
            return None
        journal.put_in_place(tmp, journal.lines_after(seq))
    finally:
        lock.release()
    journal.last_compaction = now
    return n


# == restoring through an open connection =================================================

def restore_from(conn: sqlite3.Connection, path: Path) -> tuple[Path, str | None]:
    """Copy what ``conn`` sees (the file it has open, unlinked or not, with its WAL) into a
    new file beside ``path``, fsync'd; return that file's path and, if the copy fails
    ``quick_check``, what is wrong with it (None: whole). The caller puts a whole copy in
    place and never a damaged one: the backup API copies pages as they are, so pages
    damaged on disk that no read met are in the copy. The directory is made again (0700)
    if it is gone."""
    sf.prepare_dir(path.parent)
    n = 0
    while True:
        tmp = path.with_name(f"{path.name}.restore-{os.getpid()}-{n}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            break
        except FileExistsError:
            n += 1
    try:
        dest = sqlite3.connect(tmp, isolation_level=None)
        try:
            conn.backup(dest)
            damaged = quick_check(dest)                    # the copy, as the next open reads it
            if damaged is None:
                try:
                    dest.execute("PRAGMA journal_mode = DELETE")   # one file: no -wal/-shm beside it
                except sqlite3.DatabaseError as exc:
                    if not sf.is_damage(exc):
                        raise
                    damaged = str(exc)
        finally:
            dest.close()
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)      # no SQLite connection has it now
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        for p in (tmp, Path(f"{tmp}-journal"), Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
            try:
                os.unlink(p)
            except OSError:
                pass
        raise
    return tmp, damaged


def put_in_place(tmp: Path, path: Path) -> None:
    """Replace whatever is at ``path`` (and its -wal/-shm, which belong to the file the
    restore came from) with ``tmp``. The stale -wal/-shm go first, so no connection can
    pair the restored file with them."""
    for stale in (Path(f"{path}-wal"), Path(f"{path}-shm"), path):
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass
    os.rename(tmp, path)
    sf.fsync_dir(path.parent)


def quick_check(conn: sqlite3.Connection, full: bool = False) -> str | None:
    """None if the database's pages are whole; what is wrong otherwise. ``full``: also
    check that every index agrees with its table (``integrity_check``: slower)."""
    try:
        rows = [r[0] for r in conn.execute("PRAGMA integrity_check(3)" if full else "PRAGMA quick_check")]
    except sqlite3.DatabaseError as exc:
        if sf.is_damage(exc):
            return str(exc)
        raise
    return sf.verdict(rows)



# == salvage: the rows of a damaged file that can still be read ===========================

class Salvaged(NamedTuple):
    keys: int          # keys copied (whole: a hash or sorted set only with all its members)
    errors: int        # reads that met damaged pages (scans cut short, keys skipped)


def salvage(src: Path, dest: sqlite3.Connection, now: float, seeds: set[str], *,
            busy_timeout: float = 2.0) -> Salvaged:
    """Copy, row by row, every live key of the damaged database ``src`` that can still be
    read into ``dest`` (a new, empty database), in one durable transaction.

    A scan stops at the first damaged page it meets, so the keys are found by many: the
    whole table forwards and backwards, then forwards and backwards again from every key
    known otherwise (``seeds``: the journal's keys; the keys of the expiry index, of the
    fields and of the sorted-set members), which reaches each whole leaf page that any of
    them lies on or next to. A hash or sorted set is copied only with all its members (a
    key any of whose reads fails is skipped). Expired keys are not copied."""
    errors = 0
    scratch = src.with_name(f"{src.name}.salvage-{os.getpid()}")
    try:                                        # read a copy: SQLite may rewrite or delete a
        for suffix in ("", "-wal"):             # -wal it opens, and the damaged file is the
            _unlink(Path(f"{scratch}{suffix}"))  # operator's to inspect, as it was
            if suffix == "" or Path(f"{src}-wal").exists():
                shutil.copyfile(f"{src}{suffix}", f"{scratch}{suffix}")
        c = sf.connect(scratch, busy_timeout=busy_timeout)
    except (sqlite3.Error, OSError):
        for suffix in ("", "-wal", "-shm"):
            _unlink(Path(f"{scratch}{suffix}"))
        return Salvaged(0, 1)
    try:
        c.execute("PRAGMA query_only = 1")
        c.execute("PRAGMA cache_size = -65536")         # 64 MiB: the walks read pages again
        rows: dict[str, tuple] = {}
        errors += _scan_rows(c, rows)
        known = set(seeds)
        for table in ("fields", "zsets"):
            errors += _scan_column(c, f"SELECT DISTINCT key FROM {table}", "key", known)
        errors += _scan_column(c, "SELECT key FROM entries INDEXED BY entries_expiry WHERE expires_at IS NOT NULL",
                               "expires_at", known)
        starts = sorted(known - rows.keys())
        fwd_done: set[str] = set()
        bwd_done: set[str] = set()
        for start in starts:                    # each walk stops where an earlier one went on
            if start not in fwd_done:
                errors += _walk(c, start, ">=", "ASC", rows, fwd_done)
        for start in reversed(starts):
            if start not in bwd_done:
                errors += _walk(c, start, "<=", "DESC", rows, bwd_done)
        states = []
        for key in sorted(rows):
            kind, value, x = rows[key]
            if ops.expired(x, now):
                continue
            if kind in (ops.HASH, ops.ZSET):
                try:
                    state = ops.read_state(c, key)
                except sqlite3.DatabaseError:
                    errors += 1
                    continue
                if state is None:
                    continue
            else:
                state = (kind, value, x)
            states.append((key, state))
    finally:
        c.close()
        for suffix in ("", "-wal", "-shm", "-journal"):
            _unlink(Path(f"{scratch}{suffix}"))

    def body(d: sqlite3.Connection) -> None:
        d.executemany("INSERT OR REPLACE INTO entries (key, kind, value, expires_at) VALUES (?, ?, ?, ?)",
                      ((k, st[0], st[1], st[2]) for k, st in states if st[0] == ops.STRING))
        for key, state in states:
            if state[0] != ops.STRING:
                ops.write_state(d, key, state)

    sf.txn(dest, body, durable=True)
    return Salvaged(len(states), errors)


_ROW = "SELECT key, kind, value, expires_at FROM entries"


def _scan_rows(c: sqlite3.Connection, rows: dict[str, tuple]) -> int:
    """The table forwards until it fails, then backwards until it fails or meets what the
    forward scan read; how many scans failed."""
    last = None
    try:
        for key, kind, value, x in c.execute(f"{_ROW} ORDER BY key"):
            rows[key] = (kind, value, x)
            last = key
        return 0
    except sqlite3.DatabaseError:
        pass
    try:
        for key, kind, value, x in c.execute(f"{_ROW} ORDER BY key DESC"):
            if last is not None and key <= last:
                break
            rows[key] = (kind, value, x)
    except sqlite3.DatabaseError:
        return 2
    return 1


def _scan_column(c: sqlite3.Connection, select: str, order: str, into: set[str]) -> int:
    """The keys ``select`` names (its own pages: an index, another table), forwards by
    ``order`` and then backwards; how many scans failed."""
    errors = 0
    try:
        for (key,) in c.execute(f"{select} ORDER BY {order}"):
            into.add(key)
        return 0
    except sqlite3.DatabaseError:
        errors += 1
    try:
        for (key,) in c.execute(f"{select} ORDER BY {order} DESC"):
            into.add(key)
    except sqlite3.DatabaseError:
        errors += 1
    return errors


def _walk(c: sqlite3.Connection, start: str, op: str, order: str, rows: dict[str, tuple], done: set[str]) -> int:
    """Read the table from ``start`` on, in one direction, until a damaged page or a key a
    walk in the same direction has passed already; 1 if it met damage."""
    try:
        for key, kind, value, x in c.execute(f"{_ROW} WHERE key {op} ? ORDER BY key {order}", (start,)):
            if key in done:
                return 0
            done.add(key)
            rows[key] = (kind, value, x)
        return 0
    except sqlite3.DatabaseError:
        return 1


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
