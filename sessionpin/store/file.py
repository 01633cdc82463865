"""The file store: the Store rules of ``base`` kept in one SQLite file shared by processes.

Format (docs/store.md has the why): a SQLite database in WAL mode, ``application_id``
0x73706e31 ("spn1"), ``user_version`` = FORMAT_VERSION, two tables:
``entries(key, kind 's'|'h', value, expires_at)`` and ``fields(key, field, value)``;
deleting an entry deletes its fields (a trigger).

Rules it keeps:
- Every write is one ``BEGIN IMMEDIATE`` transaction that reads and writes the file, so
  processes sharing the file lose no update; every read goes to the file, so each
  process sees the others' commits at once (no cache to go stale).
- ``durable=True``: that commit runs with ``synchronous=FULL`` (the WAL is fsync'd
  before the call returns; SQLite fsyncs the directory when it creates the WAL, and we
  fsync it when we create the directory or the database file). Other writes commit with
  ``synchronous=NORMAL`` and a background thread fsyncs the WAL and the
  directory within ``flush_interval`` (0.5 s); ``close`` does the same.
- Created 0600 (O_CREAT|O_EXCL) in a directory created 0700; SQLite gives -wal/-shm the
  database file's mode. We only chmod a directory we created or our own default one.
- We never close a descriptor of the database file while SQLite may hold it open in this
  process (POSIX would drop SQLite's locks with it): no fsync of it from here, and the
  header is read by us only when no other store of this process has the file.
- A file that is not a database is moved aside to ``<name>.corrupt-<utc>-<pid>-<n>``
  (never over an earlier one, its -wal/-shm with it), logged with both paths; the store
  starts empty. A newer ``user_version`` raises StoreVersionError before anything is
  written. A torn WAL frame (crash mid-commit) is SQLite's own recovery: that commit is
  dropped, earlier ones stay.
- Expired rows read as absent, are dropped at open and swept in bounded batches.
- Faults (disk full, read-only or vanished directory, I/O errors, a lock held too long):
  the store keeps serving from a memory overlay of the keys written since (read through
  to the file for the rest), logs one error, retries every ``retry_interval`` by replaying
  the pending writes in order in one durable transaction, and logs when it recovered.
  Nothing on disk is rewritten to get there; a failed transaction is rolled back.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import struct
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Callable

import platformdirs

from .base import StoreError, StoreVersionError, WrongType
from .memory import HASH, STRING, MemoryStore, as_int, prefix_end

log = logging.getLogger(__name__)

APPLICATION_ID = 0x73706E31  # "spn1"
FORMAT_VERSION = 1
SQLITE_MAGIC = b"SQLite format 3\x00"

SCHEMA = [
    """CREATE TABLE entries (
    key        TEXT PRIMARY KEY,
    kind       TEXT NOT NULL CHECK (kind IN ('s', 'h')),
    value      TEXT,            -- the string; NULL for a hash
    expires_at REAL             -- epoch seconds; NULL: no TTL
) WITHOUT ROWID""",
    "CREATE INDEX entries_expiry ON entries (expires_at) WHERE expires_at IS NOT NULL",
    """CREATE TABLE fields (
    key   TEXT NOT NULL,
    field TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (key, field)
) WITHOUT ROWID""",
    """CREATE TRIGGER entries_drop_fields AFTER DELETE ON entries
    BEGIN
        DELETE FROM fields WHERE key = old.key;
    END""",
]
OUR_TABLES = {"entries", "fields"}

# SQLite's result codes that mean "the disk or the file failed", not "the code is wrong".
_FAULT_CODES = {
    sqlite3.SQLITE_PERM, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_NOMEM,
    sqlite3.SQLITE_READONLY, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_FULL,
    sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PROTOCOL, sqlite3.SQLITE_NOTADB,
}


def is_fault(exc: BaseException) -> bool:
    """A failure of the disk or of the file, not of the caller: serve from memory."""
    if isinstance(exc, sqlite3.Error):
        return _code(exc) in _FAULT_CODES
    return isinstance(exc, OSError)


# Stores of this process, by file. A descriptor of the database file must never be
# closed while SQLite has the file open in this process: POSIX drops every lock the process
# holds on a file when any descriptor of it closes, and SQLite's "am I the last connection"
# check then lies to another process, which deletes the WAL under us. So the header is read
# with our own descriptor only when no other store here has the file.
_open_here: dict[str, int] = {}
_open_here_lock = threading.Lock()


def _hold(path: Path, delta: int) -> None:
    """Count a store of this process on ``path`` in (+1) or out (-1)."""
    key = os.path.realpath(path)
    with _open_here_lock:
        n = _open_here.get(key, 0) + delta
        if n > 0:
            _open_here[key] = n
        else:
            _open_here.pop(key, None)


def _others_here(path: Path) -> bool:
    with _open_here_lock:
        return _open_here.get(os.path.realpath(path), 0) > 1


class _Unreadable(Exception):
    """The file is not a database we can read: set it aside."""


class FileStore:
    def __init__(
        self,
        path: str | os.PathLike,
        *,
        url: str | None = None,
        clock: Callable[[], float] = time.time,
        flush_interval: float = 0.5,
        sweep_interval: float = 30.0,
        sweep_batch: int = 500,
        retry_interval: float = 1.0,
        busy_timeout: float = 2.0,
        on_connect: Callable[[sqlite3.Connection], None] | None = None,
    ) -> None:
        self.path = Path(path).expanduser().absolute()
        self.url = url or f"file:{path}"
        self._clock = clock
        self._flush_interval = flush_interval
        self._sweep_interval = sweep_interval
        self._sweep_batch = sweep_batch
        self._retry_interval = retry_interval
        self._busy_timeout = busy_timeout
        self._on_connect = on_connect  # runs on every new connection (tests set limits with it)
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._checked = False        # quick_check ran on this file (once per store)
        self._dirty = False          # ordinary commits not yet fsync'd
        self._closed = False
        # Degraded mode: ``_overlay`` is not None. It holds the whole state of every key
        # written since the fault (``_touched``); ``_pending`` the writes to replay.
        self._overlay: MemoryStore | None = None
        self._touched: set[str] = set()
        self._pending: list[tuple[str, str, tuple, float]] = []
        self._fault: str | None = None  # the error logged; cleared when a write succeeds
        _hold(self.path, +1)
        try:
            self._connect()
        except Exception as exc:
            if not is_fault(exc):
                _hold(self.path, -1)
                raise
            self._degrade(exc)
            self._open_read_only()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._background, name="sessionpin-store", daemon=True)
        self._thread.start()

    # == opening ======================================================================
    def _connect(self) -> None:
        for _ in range(3):
            try:
                self._conn = self._open_db()
                return
            except _Unreadable as why:
                self._set_aside(str(why))
        raise StoreError(f"{self.path}: still unreadable after setting it aside")

    def _open_db(self) -> sqlite3.Connection:
        self._prepare_dir()
        self._check_header()
        self._create_file()
        conn = sqlite3.connect(
            self.path, timeout=self._busy_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            self._init_db(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _prepare_dir(self) -> None:
        d = self.path.parent
        if d.is_dir():
            if d == default_dir() and stat.S_IMODE(d.stat().st_mode) != 0o700:
                os.chmod(d, 0o700)  # our own directory: keep it private
            return
        d.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(d, 0o700)  # the umask can only take bits away: never wider than 0700
        except FileExistsError:
            return
        os.chmod(d, 0o700)
        fsync_dir(d.parent)

    def _check_header(self) -> None:
        """Refuse or set aside from the header alone, before SQLite touches the file."""
        if _others_here(self.path):
            return  # another store here has it open: SQLite checks the same through PRAGMAs
        try:
            with open(self.path, "rb") as f:
                head = f.read(100)
        except FileNotFoundError:
            return
        if not head:
            return  # the empty file we pre-create: a valid, empty database
        if len(head) < 100 or not head.startswith(SQLITE_MAGIC):
            raise _Unreadable("not a SQLite database")
        user_version, _, application_id = struct.unpack(">III", head[60:72])
        self._check_ids(application_id, user_version)

    def _check_ids(self, application_id: int, user_version: int) -> None:
        # We set both in the transaction that makes the schema: a version without our id is
        # another program's database.
        if application_id not in (0, APPLICATION_ID) or (application_id == 0 and user_version != 0):
            raise StoreError(f"{self.path} is a SQLite database of another application "
                             f"(id {application_id:#x}, version {user_version}); not touching it")
        if user_version > FORMAT_VERSION:
            raise StoreVersionError(
                f"{self.path} was written by a newer sessionpin (store format {user_version}, "
                f"this one reads {FORMAT_VERSION}); upgrade sessionpin or point the store elsewhere. "
                "The file was left untouched."
            )

    def _create_file(self) -> None:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            st = self.path.stat()
            if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
                log.warning("store file %s was mode %o; made it 0600", self.path, stat.S_IMODE(st.st_mode))
                os.chmod(self.path, 0o600)
            return
        try:
            os.fchmod(fd, 0o600)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.path.parent)

    def _init_db(self, conn: sqlite3.Connection) -> None:
        conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
        try:
            application_id = conn.execute("PRAGMA application_id").fetchone()[0]
            user_version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            if _code(exc) in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
                raise _Unreadable(str(exc)) from None
            raise
        self._check_ids(application_id & 0xFFFFFFFF, user_version)
        if conn.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
            # a file we may not write (or a filesystem without shared memory): a fault, retried
            raise OSError(f"{self.path}: SQLite could not switch the file to WAL mode")
        conn.execute("PRAGMA synchronous = NORMAL")
        if self._on_connect is not None:
            self._on_connect(conn)
        if not self._checked:
            try:
                verdict = [r[0] for r in conn.execute("PRAGMA quick_check")]
            except sqlite3.DatabaseError as exc:
                if _code(exc) in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
                    raise _Unreadable(str(exc)) from None
                raise
            if verdict != ["ok"]:
                raise _Unreadable("; ".join(verdict[:3]))
            self._checked = True
        if user_version == 0:
            self._create_schema(conn)
        try:
            self._txn(conn, lambda c: c.execute("DELETE FROM entries WHERE expires_at <= ?", (self._clock(),)), durable=False)
            self._dirty = True
        except sqlite3.DatabaseError as exc:
            if not is_fault(exc):
                raise
            # dropping expired rows can wait for the sweeper (disk full, say)

    def _create_schema(self, conn: sqlite3.Connection) -> None:
        def create(c: sqlite3.Connection) -> None:
            if c.execute("PRAGMA user_version").fetchone()[0] != 0:
                return  # another process made it first
            tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables - OUR_TABLES:
                raise StoreError(f"{self.path} is a database of something else (tables {sorted(tables)}); not touching it")
            for statement in SCHEMA:
                c.execute(statement)
            c.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            c.execute(f"PRAGMA user_version = {FORMAT_VERSION}")

        self._txn(conn, create, durable=True)

    def _set_aside(self, why: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        n = 0
        while True:
            dest = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{os.getpid()}-{n}")
            try:
                if _move_no_clobber(self.path, dest):
                    break
            except FileNotFoundError:
                log.warning("store file %s could not be read (%s); another process set it aside", self.path, why)
                return
            n += 1
        for suffix in ("-wal", "-shm"):
            src = Path(f"{self.path}{suffix}")
            try:
                _move_no_clobber(src, Path(f"{dest}{suffix}"))
            except FileNotFoundError:
                pass
        fsync_dir(self.path.parent)
        log.warning("store file %s could not be read (%s); moved it aside to %s and started empty", self.path, why, dest)

    # == transactions =================================================================
    def _txn(self, conn: sqlite3.Connection, body, *, durable: bool):
        if durable:
            conn.execute("PRAGMA synchronous = FULL")
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = body(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    try:
                        conn.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                raise
        finally:
            if durable:
                try:
                    conn.execute("PRAGMA synchronous = NORMAL")
                except sqlite3.Error:
                    pass
        return result

    def _write(self, op: str, key: str, args: tuple, durable: bool):
        try:
            return self._write_now(op, key, args, durable)
        except UnicodeEncodeError as exc:  # a lone surrogate: SQLite takes only UTF-8
            raise StoreError(f"key or value is not valid Unicode text: {exc.reason}") from None

    def _write_now(self, op: str, key: str, args: tuple, durable: bool):
        now = self._clock()
        with self._lock:
            self._check_open()
            if self._overlay is None:
                try:
                    result = self._txn(self._conn, lambda c: _DB_OPS[op](c, now, key, *args), durable=durable)
                except Exception as exc:
                    if not is_fault(exc):
                        raise
                    self._degrade(exc)
                else:
                    if not durable:
                        self._dirty = True
                    if self._fault is not None:
                        self._recovered()
                    return result
            self._take(key)
            result = _MEM_OPS[op](self._overlay, key, *args)
            self._pending.append((op, key, args, now))
            return result

    def _read(self, key: str | None, query: Callable[[sqlite3.Connection, float], object], from_overlay):
        with self._lock:
            self._check_open()
            if self._overlay is not None and (key in self._touched or self._conn is None):
                return from_overlay(self._overlay)
            try:
                return query(self._conn, self._clock())
            except UnicodeEncodeError as exc:
                raise StoreError(f"key is not valid Unicode text: {exc.reason}") from None
            except Exception as exc:
                if not is_fault(exc):
                    raise
                self._degrade(exc)
                return from_overlay(self._overlay)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.url}: store is closed")

    # == degraded mode ================================================================
    def _degrade(self, exc: BaseException) -> None:
        if self._overlay is None:
            self._overlay = MemoryStore(self.url, clock=self._clock)
            self._touched.clear()
            self._pending.clear()
        if self._fault is None:
            self._fault = f"{type(exc).__name__}: {exc}"
            log.error(
                "store %s cannot write its file (%s); serving from memory and retrying every %gs. "
                "Writes made meanwhile are not on disk until it recovers.",
                self.path, self._fault, self._retry_interval,
            )
        # The connection stays open: it may still read (a full disk reads fine). The retry
        # opens a fresh one, since one opened read-only stays read-only.

    def _take(self, key: str) -> None:
        """Copy one key's state from the file into the overlay, before its first write there."""
        if key in self._touched:
            return
        state = None
        if self._conn is not None:
            try:
                state = _db_state(self._conn, self._clock(), key)
            except Exception as exc:
                if not is_fault(exc):
                    raise
        self._overlay._restore(key, state)
        self._touched.add(key)

    def _retry(self) -> None:
        with self._lock:
            if self._overlay is None or self._closed:
                return
            try:
                if self._conn is not None:
                    old, self._conn = self._conn, None
                    try:
                        old.close()
                    except sqlite3.Error:
                        pass
                self._connect()
                pending = self._pending

                def replay(c: sqlite3.Connection) -> None:
                    for op, key, args, now in pending:
                        try:
                            _DB_OPS[op](c, now, key, *args)
                        except StoreError:
                            pass  # another process changed the key's type meanwhile: as redis, the write fails
                    if not pending:
                        # prove the file takes writes before leaving degraded mode
                        c.execute(f"PRAGMA user_version = {FORMAT_VERSION}")

                self._txn(self._conn, replay, durable=True)
            except Exception as exc:
                if not is_fault(exc):
                    log.error("store %s: giving up a replay: %s", self.path, exc)
                    raise
                log.debug("store %s still failing: %s", self.path, exc)
                if self._conn is None:
                    self._open_read_only()
                return  # an open connection stays, for reading through
            self._overlay = None
            self._touched.clear()
            self._pending = []
            self._recovered()

    def _open_read_only(self) -> None:
        """Degraded and unable to open the file for writing: read through it if we can.

        ``mode=ro`` needs the -wal/-shm to exist or be creatable; on a read-only filesystem
        (nobody can change the file) ``immutable=1`` reads it without them."""
        if self._conn is not None or not self.path.is_file():
            return
        uri = "file:" + urllib.parse.quote(str(self.path)) + "?mode=ro"
        try:
            if os.statvfs(self.path.parent).f_flag & os.ST_RDONLY:
                uri += "&immutable=1"
            conn = sqlite3.connect(uri, uri=True, timeout=self._busy_timeout,
                                   isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error):
            return
        try:
            application_id = conn.execute("PRAGMA application_id").fetchone()[0] & 0xFFFFFFFF
            user_version = conn.execute("PRAGMA user_version").fetchone()[0]
            if application_id != APPLICATION_ID or user_version != FORMAT_VERSION:
                raise sqlite3.DatabaseError("not a store of this version")
            conn.execute("SELECT count(*) FROM entries WHERE key = ''").fetchone()
        except sqlite3.Error as exc:
            log.debug("store %s: cannot read it either: %s", self.path, exc)
            conn.close()
            return
        self._conn = conn

    def _recovered(self) -> None:
        log.warning("store %s recovered: writing to its file again (was: %s)", self.path, self._fault)
        self._fault = None

    @property
    def degraded(self) -> bool:
        """True while writes are held in memory because the file cannot take them."""
        return self._overlay is not None

    # == background: flush, sweep, retry ==============================================
    def _background(self) -> None:
        tick = min(self._flush_interval, self._retry_interval, self._sweep_interval)
        next_flush = time.monotonic() + self._flush_interval
        next_sweep = time.monotonic() + self._sweep_interval
        next_retry = time.monotonic() + self._retry_interval
        while not self._stop.wait(tick):
            try:
                now = time.monotonic()
                if now >= next_flush:
                    next_flush = now + self._flush_interval
                    self._flush()
                if now >= next_retry:
                    next_retry = now + self._retry_interval
                    self._retry()
                if now >= next_sweep:
                    next_sweep = now + self._sweep_interval
                    self.sweep()
            except Exception:  # never let the thread die: the next tick tries again
                log.exception("store %s: background work failed", self.path)

    def _flush(self) -> None:
        """Put ordinary commits on stable storage: fsync the WAL and the directory.

        (The database file is SQLite's to fsync, after each checkpoint; see below.)"""
        with self._lock:
            if not self._dirty:
                return
            self._dirty = False
        try:
            # The WAL only. Opening and closing a descriptor of the database file itself
            # drops every POSIX lock this process holds on it, SQLite's included: another
            # process closing its connection then believes it is the last one, checkpoints
            # and deletes the WAL under our open connection, and our later commits vanish.
            # SQLite fsyncs the database file itself after each checkpoint.
            for p in (Path(f"{self.path}-wal"),):
                try:
                    fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue  # the WAL was checkpointed (fsync'd) and removed
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_dir(self.path.parent)
        except OSError as exc:
            self._dirty = True
            log.debug("store %s: flush failed: %s", self.path, exc)

    def sweep(self, limit: int | None = None) -> int:
        """Delete expired keys in batches of ``sweep_batch`` (at most ``limit``); return how many."""
        done = 0
        while limit is None or done < limit:
            batch = self._sweep_batch if limit is None else min(self._sweep_batch, limit - done)
            with self._lock:
                if self._closed:
                    break
                if self._overlay is not None:
                    return done + self._overlay.sweep(batch)
                now = self._clock()
                try:
                    n = self._txn(self._conn, lambda c: c.execute(
                        "DELETE FROM entries WHERE key IN "
                        "(SELECT key FROM entries WHERE expires_at <= ? LIMIT ?)", (now, batch)).rowcount,
                        durable=False)
                except Exception as exc:
                    if not is_fault(exc):
                        raise
                    self._degrade(exc)
                    break
                self._dirty = self._dirty or n > 0
            done += n
            if n < batch:
                break
        return done

    # == strings ======================================================================
    def get(self, key: str) -> str | None:
        def query(c, now):
            row = c.execute("SELECT kind, value, expires_at FROM entries WHERE key = ?", (key,)).fetchone()
            if row is None or _expired(row[2], now):
                return None
            if row[0] != STRING:
                raise _wrong(key, row[0])
            return row[1]
        return self._read(key, query, lambda m: m.get(key))

    def set(self, key: str, value: str, ttl: float | None = None, *, nx: bool = False, durable: bool = False) -> bool:
        return self._write("set", key, (value, ttl, nx), durable)

    def delete(self, key: str, *, durable: bool = False) -> bool:
        return self._write("delete", key, (), durable)

    def expire(self, key: str, ttl: float, *, durable: bool = False) -> bool:
        return self._write("expire", key, (ttl,), durable)

    def ttl(self, key: str) -> float | None:
        def query(c, now):
            row = c.execute("SELECT expires_at FROM entries WHERE key = ?", (key,)).fetchone()
            if row is None or row[0] is None or _expired(row[0], now):
                return None
            return row[0] - now
        return self._read(key, query, lambda m: m.ttl(key))

    def incr(self, key: str, by: int = 1, *, durable: bool = False) -> int:
        return self._write("incr", key, (by,), durable)

    # == hashes =======================================================================
    def hget(self, key: str, field: str) -> str | None:
        def query(c, now):
            row = c.execute(
                "SELECT e.kind, e.expires_at, f.value FROM entries e "
                "LEFT JOIN fields f ON f.key = e.key AND f.field = ? WHERE e.key = ?", (field, key)).fetchone()
            if row is None or _expired(row[1], now):
                return None
            if row[0] != HASH:
                raise _wrong(key, row[0])
            return row[2]
        return self._read(key, query, lambda m: m.hget(key, field))

    def hgetall(self, key: str) -> dict[str, str]:
        def query(c, now):
            rows = c.execute(
                "SELECT e.kind, e.expires_at, f.field, f.value FROM entries e "
                "LEFT JOIN fields f ON f.key = e.key WHERE e.key = ?", (key,)).fetchall()
            if not rows or _expired(rows[0][1], now):
                return {}
            if rows[0][0] != HASH:
                raise _wrong(key, rows[0][0])
            return {f: v for _, _, f, v in rows if f is not None}
        return self._read(key, query, lambda m: m.hgetall(key))

    def hset(self, key: str, field: str, value: str, *, durable: bool = False) -> None:
        self._write("hset", key, (field, value), durable)

    def hsetnx(self, key: str, field: str, value: str, *, durable: bool = False) -> bool:
        return self._write("hsetnx", key, (field, value), durable)

    def hdel(self, key: str, field: str, *, durable: bool = False) -> bool:
        return self._write("hdel", key, (field,), durable)

    def hincr(self, key: str, field: str, by: int = 1, *, durable: bool = False) -> int:
        return self._write("hincr", key, (field, by), durable)

    # == keys =========================================================================
    def keys(self, prefix: str = "") -> list[str]:
        def query(c, now):
            end = prefix_end(prefix)
            sql = "SELECT key FROM entries WHERE key >= ? AND (expires_at IS NULL OR expires_at > ?)"
            params: tuple = (prefix, now)
            if end is not None:
                sql += " AND key < ?"
                params += (end,)
            return [r[0] for r in c.execute(sql + " ORDER BY key", params)]

        with self._lock:
            self._check_open()
            overlay = self._overlay
            if overlay is None:
                return self._read(None, query, lambda m: m.keys(prefix))
            on_disk: list[str] = []
            if self._conn is not None:
                try:
                    on_disk = query(self._conn, self._clock())
                except Exception as exc:
                    if not is_fault(exc):
                        raise
            mine = set(overlay.keys(prefix))
            return sorted({k for k in on_disk if k not in self._touched} | mine)

    def close(self) -> None:
        """Stop the background thread, replay what is pending if it can, fsync, close."""
        if self._closed:
            return
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        try:
            self._retry()
        except Exception:
            log.exception("store %s: last replay failed", self.path)
        with self._lock:
            if self._overlay is not None and self._pending:
                log.error("store %s closed with %d writes it could not put on disk (%s)",
                          self.path, len(self._pending), self._fault)
            self._dirty = True
            self._flush()
            if self._conn is not None:
                try:
                    self._conn.close()
                except sqlite3.Error:
                    pass
                self._conn = None
            self._closed = True
            _hold(self.path, -1)

    def __enter__(self) -> "FileStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FileStore {self.path}{' degraded' if self.degraded else ''}>"


# == operations inside one write transaction ============================================
# Each takes (connection, now, key, *args); ``now`` is the time the caller asked, so a
# replay after a fault computes the same expiry times the overlay did.

def _expired(expires_at: float | None, now: float) -> bool:
    return expires_at is not None and expires_at <= now


def _wrong(key: str, kind: str) -> WrongType:
    return WrongType(f"{key!r} holds a {'hash' if kind == HASH else 'string'}")


def _live(c: sqlite3.Connection, now: float, key: str):
    row = c.execute("SELECT kind, value, expires_at FROM entries WHERE key = ?", (key,)).fetchone()
    if row is not None and _expired(row[2], now):
        c.execute("DELETE FROM entries WHERE key = ?", (key,))
        return None
    return row


def _hash_for_write(c: sqlite3.Connection, now: float, key: str) -> None:
    row = _live(c, now, key)
    if row is None:
        c.execute("INSERT INTO entries (key, kind, value, expires_at) VALUES (?, 'h', NULL, NULL)", (key,))
    elif row[0] != HASH:
        raise _wrong(key, row[0])


def _db_set(c, now, key, value, ttl, nx):
    row = _live(c, now, key)
    if nx and row is not None:
        return False
    if row is not None and (row[0] == HASH or (ttl is not None and ttl <= 0)):
        c.execute("DELETE FROM entries WHERE key = ?", (key,))
    if ttl is not None and ttl <= 0:
        return True
    c.execute(
        "INSERT INTO entries (key, kind, value, expires_at) VALUES (?, 's', ?, ?) "
        "ON CONFLICT (key) DO UPDATE SET kind = 's', value = excluded.value, expires_at = excluded.expires_at",
        (key, value, None if ttl is None else now + ttl))
    return True


def _db_delete(c, now, key):
    found = _live(c, now, key) is not None
    if found:
        c.execute("DELETE FROM entries WHERE key = ?", (key,))
    return found


def _db_expire(c, now, key, ttl):
    if _live(c, now, key) is None:
        return False
    if ttl <= 0:
        c.execute("DELETE FROM entries WHERE key = ?", (key,))
    else:
        c.execute("UPDATE entries SET expires_at = ? WHERE key = ?", (now + ttl, key))
    return True


def _db_incr(c, now, key, by):
    row = _live(c, now, key)
    if row is None:
        c.execute("INSERT INTO entries (key, kind, value, expires_at) VALUES (?, 's', ?, NULL)", (key, str(by)))
        return by
    if row[0] != STRING:
        raise _wrong(key, row[0])
    n = as_int(row[1]) + by
    c.execute("UPDATE entries SET value = ? WHERE key = ?", (str(n), key))
    return n


def _db_hset(c, now, key, field, value):
    _hash_for_write(c, now, key)
    c.execute(
        "INSERT INTO fields (key, field, value) VALUES (?, ?, ?) "
        "ON CONFLICT (key, field) DO UPDATE SET value = excluded.value", (key, field, value))


def _db_hsetnx(c, now, key, field, value):
    _hash_for_write(c, now, key)
    return c.execute(
        "INSERT INTO fields (key, field, value) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
        (key, field, value)).rowcount == 1


def _db_hdel(c, now, key, field):
    row = _live(c, now, key)
    if row is None:
        return False
    if row[0] != HASH:
        raise _wrong(key, row[0])
    if c.execute("DELETE FROM fields WHERE key = ? AND field = ?", (key, field)).rowcount == 0:
        return False
    if c.execute("SELECT 1 FROM fields WHERE key = ? LIMIT 1", (key,)).fetchone() is None:
        c.execute("DELETE FROM entries WHERE key = ?", (key,))  # redis: an empty hash is no key
    return True


def _db_hincr(c, now, key, field, by):
    _hash_for_write(c, now, key)
    row = c.execute("SELECT value FROM fields WHERE key = ? AND field = ?", (key, field)).fetchone()
    n = (0 if row is None else as_int(row[0])) + by
    c.execute(
        "INSERT INTO fields (key, field, value) VALUES (?, ?, ?) "
        "ON CONFLICT (key, field) DO UPDATE SET value = excluded.value", (key, field, str(n)))
    return n


def _db_state(c, now, key):
    """One key's whole state, in MemoryStore._restore's shape (None: absent)."""
    row = c.execute("SELECT kind, value, expires_at FROM entries WHERE key = ?", (key,)).fetchone()
    if row is None or _expired(row[2], now):
        return None
    if row[0] == HASH:
        fields = dict(c.execute("SELECT field, value FROM fields WHERE key = ?", (key,)).fetchall())
        return (HASH, fields, row[2])
    return (STRING, row[1], row[2])


_DB_OPS = {
    "set": _db_set, "delete": _db_delete, "expire": _db_expire, "incr": _db_incr,
    "hset": _db_hset, "hsetnx": _db_hsetnx, "hdel": _db_hdel, "hincr": _db_hincr,
}
_MEM_OPS = {
    "set": lambda m, k, value, ttl, nx: m.set(k, value, ttl, nx=nx),
    "delete": lambda m, k: m.delete(k),
    "expire": lambda m, k, ttl: m.expire(k, ttl),
    "incr": lambda m, k, by: m.incr(k, by),
    "hset": lambda m, k, field, value: m.hset(k, field, value),
    "hsetnx": lambda m, k, field, value: m.hsetnx(k, field, value),
    "hdel": lambda m, k, field: m.hdel(k, field),
    "hincr": lambda m, k, field, by: m.hincr(k, field, by),
}


# == small file-system helpers ==========================================================

def _code(exc: sqlite3.Error) -> int:
    return (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_no_clobber(src: Path, dest: Path) -> bool:
    """Move ``src`` to ``dest`` unless ``dest`` exists (then False). link+unlink: no race."""
    try:
        os.link(src, dest)          # FileNotFoundError: src is gone (another process moved it)
    except FileExistsError:
        return False
    except FileNotFoundError:
        raise
    except OSError:
        # no hard links here: fall back to a checked rename
        if dest.exists():
            return False
        os.rename(src, dest)
        return True
    os.unlink(src)
    return True


def default_dir() -> Path:
    return Path(platformdirs.user_state_dir("sessionpin"))
