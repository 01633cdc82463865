"""The file store: the SyncStore rules of ``base`` kept in one SQLite file shared by processes.

The file, its format and how it is opened are ``sqlitefile``'s; the SQL of each operation
is ``ops``'. Rules this class keeps:
- Writes go through one writer connection under the store's own lock, each one
  ``BEGIN IMMEDIATE`` transaction, so processes sharing the file lose no update.
- Reads go through reader connections of their own, one per thread (opened lazily),
  with no lock shared with the writer: under WAL a read never waits for a writer of this
  or another process. Every read goes to the file (no cache to go stale).
- ``durable=True``: that commit runs with ``synchronous=FULL`` (fsync'd before the call
  returns). Other writes commit with ``synchronous=NORMAL``; a background thread fsyncs
  the WAL and the directory within ``flush_interval`` (0.5 s), and ``close`` does too.
- Durable or raise: a write that fails (disk full, read-only, I/O error, a lock held past
  ``busy_timeout``) is rolled back and raises ``NotDurable`` (durable) or
  ``StoreUnavailable``; nothing of it stays anywhere. A read that fails raises
  ``StoreUnavailable``, never "absent". One ERROR line when faults begin, one WARNING
  when the next write (or read) succeeds — not one line per call.
- After a failed write the writer connection is dropped; the next write opens a fresh
  one (a connection opened read-only stays read-only).
- Expired rows read as absent, are dropped at open and swept in bounded batches by the
  background thread, each batch one short transaction on the writer side.
- We never close a descriptor of the database file while SQLite may hold it open in this
  process (POSIX would drop SQLite's locks with it): the flush fsyncs only the WAL and
  the directory; SQLite fsyncs the database file itself after each checkpoint.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from . import ops
from . import sqlitefile as sf
from .base import Check, NotDurable, StoreError, StoreUnavailable, Write

log = logging.getLogger(__name__)

# Kept importable from here (tests and tools name them through this module).
APPLICATION_ID = sf.APPLICATION_ID
FORMAT_VERSION = sf.FORMAT_VERSION
fsync_dir = sf.fsync_dir
is_fault = sf.is_fault


class _Faults:
    """One ERROR when a kind of call starts failing, one WARNING when it works again."""

    def __init__(self, store: str, doing: str, consequence: str) -> None:
        self.store, self.doing, self.consequence = store, doing, consequence
        self.cause: str | None = None
        self.since: float | None = None
        self._lock = threading.Lock()

    def failed(self, exc: BaseException) -> str:
        cause = _cause(exc)
        with self._lock:
            if self.cause is None:
                self.cause, self.since = cause, time.time()
                log.error("store %s cannot %s (%s); %s until it recovers", self.store, self.doing, cause,
                          self.consequence)
        return cause

    def ok(self) -> None:
        if self.cause is None:       # the common case: no lock taken
            return
        with self._lock:
            if self.cause is not None:
                log.warning("store %s recovered: it can %s again (was: %s)", self.store, self.doing, self.cause)
                self.cause = self.since = None


def _end_read(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass


def _cause(exc: BaseException) -> str:
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
        return f"{name}: {exc}"
    return f"{type(exc).__name__}: {exc}"


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
        busy_timeout: float = 2.0,
        on_connect: Callable[[sqlite3.Connection], None] | None = None,
    ) -> None:
        self.path = Path(path).expanduser().absolute()
        self.url = url or f"file:{path}"
        self._clock = clock
        self._flush_interval = flush_interval
        self._sweep_interval = sweep_interval
        self._sweep_batch = sweep_batch
        self._busy_timeout = busy_timeout
        self._on_connect = on_connect     # runs on every new connection (tests set limits with it)
        self._wlock = threading.RLock()   # the writer connection's; readers never take it
        self._w: sqlite3.Connection | None = None
        self._checked = False             # quick_check ran (once per store)
        self._dirty = False               # ordinary commits not yet fsync'd
        self._closed = False
        self._local = threading.local()   # .conn, .gen: this thread's reader connection
        self._readers: set[sqlite3.Connection] = set()
        self._readers_lock = threading.Lock()   # guards the set only (opening, closing)
        self._gen = 0                     # bumped to make every reader reopen
        self._wfaults = _Faults(self.url, f"write {self.path}", "writes fail (durable ones with NotDurable)")
        self._rfaults = _Faults(self.url, f"read {self.path}", "reads fail with StoreUnavailable")
        first = sf.hold(self.path, +1) == 1
        try:
            with self._wlock:
                self._open(read_header=first)
        except Exception as exc:
            if not is_fault(exc):
                sf.hold(self.path, -1)
                raise
            self._wfaults.failed(exc)     # opens again on the next write
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._background, name="sessionpin-store", daemon=True)
        self._thread.start()

    # == opening ======================================================================
    def _open(self, *, read_header: bool = False) -> None:
        """Open the writer connection (with the wlock held), setting unreadable files aside."""
        for _ in range(3):
            try:
                self._w = self._open_db(read_header)
                self._gen += 1     # readers opened meanwhile (read-only, say) open afresh
                return
            except sf.Unreadable as why:
                dest = sf.set_aside(self.path, str(why))
                if dest is None:
                    log.warning("store file %s could not be read (%s); another process set it aside", self.path, why)
                else:
                    log.warning("store file %s could not be read (%s); moved it aside to %s and started empty",
                                self.path, why, dest)
                read_header = False
        raise StoreError(f"{self.path}: still unreadable after setting it aside")

    def _open_db(self, read_header: bool) -> sqlite3.Connection:
        sf.prepare_dir(self.path.parent)
        if read_header:
            sf.check_header(self.path)
        sf.create_file(self.path)
        conn = self._connect()
        try:
            try:
                sf.init_db(conn, self.path, quick_check=not self._checked)
            except sqlite3.DatabaseError as exc:
                if sf.is_damage(exc):
                    raise sf.Unreadable(str(exc)) from None
                raise
            self._checked = True
            try:
                sf.txn(conn, lambda c: c.execute("DELETE FROM entries WHERE expires_at <= ?", (self._clock(),)),
                       durable=False)
                self._dirty = True
            except sqlite3.Error as exc:
                if not is_fault(exc):
                    raise   # dropping expired rows can wait for the sweeper (disk full, say)
        except BaseException:
            conn.close()
            raise
        return conn

    def _connect(self, read_only: bool = False) -> sqlite3.Connection:
        conn = sf.connect(self.path, busy_timeout=self._busy_timeout, read_only=read_only)
        try:
            if self._on_connect is not None:
                self._on_connect(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _drop_writer(self) -> None:
        if self._w is not None:
            try:
                self._w.close()
            except sqlite3.Error:
                pass
            self._w = None

    # == writes =======================================================================
    def _write(self, op: Callable, *args: Any, durable: bool = False):
        now = self._clock()
        rec: list | None = [] if durable else None
        try:
            with self._wlock:
                self._check_open()
                try:
                    if self._w is None:
                        self._open()
                    result = sf.txn(self._w, lambda c: op(c, now, rec, *args), durable=durable)
                except Exception as exc:
                    if is_fault(exc):
                        self._drop_writer()
                    raise
                if not durable:
                    self._dirty = True
        except UnicodeEncodeError as exc:   # a lone surrogate: SQLite takes only UTF-8
            raise StoreError(f"key or value is not valid Unicode text: {exc.reason}") from None
        except Exception as exc:
            if not is_fault(exc):
                raise
            cause = self._wfaults.failed(exc)
            kind = NotDurable if durable else StoreUnavailable
            raise kind(f"store {self.url}: {'durable ' if durable else ''}write to {self.path} failed, "
                       f"nothing written ({cause})") from exc
        self._wfaults.ok()
        return result

    def set(self, key: str, value: str, ttl: float | None = None, *, nx: bool = False, durable: bool = False) -> bool:
        return self._write(ops.op_set, key, value, ttl, nx, durable=durable)

    def cas(self, key: str, expected: str | None, value: str | None, ttl: float | None = None, *,
            durable: bool = False) -> bool:
        return self._write(ops.op_cas, key, expected, value, ttl, durable=durable)

    def delete(self, key: str, *, durable: bool = False) -> bool:
        return self._write(ops.op_delete, key, durable=durable)

    def expire(self, key: str, ttl: float, *, durable: bool = False) -> bool:
        return self._write(ops.op_expire, key, ttl, durable=durable)

    def incr(self, key: str, by: int = 1, *, durable: bool = False) -> int:
        return self._write(ops.op_incr, key, by, durable=durable)

    def hset(self, key: str, field: str, value: str, *, durable: bool = False) -> None:
        self._write(ops.op_hset, key, field, value, durable=durable)

    def hsetnx(self, key: str, field: str, value: str, *, durable: bool = False) -> bool:
        return self._write(ops.op_hsetnx, key, field, value, durable=durable)

    def hdel(self, key: str, field: str, *, durable: bool = False) -> bool:
        return self._write(ops.op_hdel, key, field, durable=durable)

    def hincr(self, key: str, field: str, by: int = 1, *, durable: bool = False) -> int:
        return self._write(ops.op_hincr, key, field, by, durable=durable)

    def zadd(self, key: str, member: str, score: float, *, durable: bool = False) -> None:
        self._write(ops.op_zadd, key, member, score, durable=durable)

    def zrem(self, key: str, member: str, *, durable: bool = False) -> bool:
        return self._write(ops.op_zrem, key, member, durable=durable)

    def zremrange(self, key: str, lo: float, hi: float) -> int:
        return self._write(ops.op_zremrange, key, lo, hi)

    def apply(self, checks: Sequence[Check], writes: Sequence[Write], *, durable: bool = False) -> bool:
        return self._write(ops.op_apply, list(checks), list(writes), durable=durable)

    # == reads ========================================================================
    def _reader(self) -> sqlite3.Connection:
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is not None and local.gen == self._gen:
            return conn
        if conn is not None:
            self._forget_reader(conn)
        gen = self._gen
        try:
            conn = self._connect()
            try:
                conn.execute("PRAGMA schema_version").fetchone()   # SQLite opens lazily: open now
            except BaseException:
                conn.close()
                raise
        except (sqlite3.Error, OSError) as exc:
            if not is_fault(exc):
                raise
            conn = self._connect(read_only=True)   # a read-only filesystem: read it as it is
        conn.execute("PRAGMA query_only = 1")
        with self._readers_lock:
            self._readers.add(conn)
        local.conn, local.gen = conn, gen
        return conn

    def _forget_reader(self, conn: sqlite3.Connection) -> None:
        with self._readers_lock:
            self._readers.discard(conn)
        self._local.conn = None
        try:
            conn.close()
        except sqlite3.Error:
            pass

    def _read(self, query: Callable, *args: Any, snapshot: bool = False):
        self._check_open()
        conn = None
        try:
            conn = self._reader()
            if not snapshot:
                result = query(conn, self._clock(), *args)
            else:
                conn.execute("BEGIN")       # one read transaction: one snapshot of the file
                try:
                    result = query(conn, self._clock(), *args)
                except BaseException:
                    _end_read(conn)
                    raise
                conn.execute("COMMIT")
        except UnicodeEncodeError as exc:
            raise StoreError(f"key is not valid Unicode text: {exc.reason}") from None
        except sqlite3.ProgrammingError:
            self._check_open()              # closed under us: say so
            raise
        except Exception as exc:
            missing = isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc)
            if not (is_fault(exc) or missing):
                raise
            if conn is not None:
                self._forget_reader(conn)   # the next read opens a fresh one
            cause = self._rfaults.failed(exc)
            raise StoreUnavailable(f"store {self.url}: cannot read {self.path} ({cause})") from exc
        self._rfaults.ok()
        return result

    def get(self, key: str) -> str | None:
        return self._read(ops.q_get, key)

    def mget(self, keys: Sequence[str]) -> list[str | None]:
        return self._read(ops.q_mget, list(keys), snapshot=True)

    def ttl(self, key: str) -> float | None:
        return self._read(ops.q_ttl, key)

    def hget(self, key: str, field: str) -> str | None:
        return self._read(ops.q_hget, key, field, snapshot=True)

    def hgetall(self, key: str) -> dict[str, str]:
        return self._read(ops.q_hgetall, key, snapshot=True)

    def zcount(self, key: str, lo: float, hi: float) -> int:
        return self._read(ops.q_zcount, key, lo, hi, snapshot=True)

    def zrange(self, key: str, lo: float, hi: float, limit: int | None = None) -> list[tuple[str, float]]:
        return self._read(ops.q_zrange, key, lo, hi, limit, snapshot=True)

    def keys(self, prefix: str = "") -> list[str]:
        return self._read(ops.q_keys, prefix)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.url}: store is closed")

    # == background: flush, sweep =====================================================
    def _background(self) -> None:
        tick = min(self._flush_interval, self._sweep_interval, 0.25)
        next_flush = time.monotonic() + self._flush_interval
        next_sweep = time.monotonic() + self._sweep_interval
        while not self._stop.wait(tick):
            try:
                now = time.monotonic()
                if now >= next_flush:
                    next_flush = now + self._flush_interval
                    self._flush()
                if now >= next_sweep:
                    next_sweep = now + self._sweep_interval
                    self.sweep()
            except Exception:  # never let the thread die: the next tick tries again
                log.exception("store %s: background work failed", self.path)

    def _flush(self) -> None:
        """Put ordinary commits on stable storage: fsync the WAL and the directory.

        The WAL only: opening and closing a descriptor of the database file itself would
        drop every POSIX lock this process holds on it, SQLite's included (another process
        would then delete the WAL under our open connection). SQLite fsyncs the database
        file itself after each checkpoint."""
        if not self._dirty:
            return
        self._dirty = False
        try:
            try:
                fd = os.open(f"{self.path}-wal", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = None           # checkpointed (fsync'd) and removed
            if fd is not None:
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_dir(self.path.parent)
        except OSError as exc:
            self._dirty = True
            log.debug("store %s: flush failed: %s", self.path, exc)

    def sweep(self, limit: int | None = None) -> int:
        """Delete expired keys in batches of ``sweep_batch`` (at most ``limit``); return how many.
        Each batch is one short transaction; the writer lock is let go between batches."""
        done = 0
        while limit is None or done < limit:
            batch = self._sweep_batch if limit is None else min(self._sweep_batch, limit - done)
            now = self._clock()
            with self._wlock:
                if self._closed or self._w is None:
                    break
                try:
                    n = sf.txn(self._w, lambda c: c.execute(
                        "DELETE FROM entries WHERE key IN "
                        "(SELECT key FROM entries WHERE expires_at <= ? LIMIT ?)", (now, batch)).rowcount,
                        durable=False)
                except sqlite3.Error as exc:
                    if not is_fault(exc):
                        raise
                    log.debug("store %s: sweep failed: %s", self.path, exc)
                    break
                self._dirty = self._dirty or n > 0
            done += n
            if n < batch:
                break
        return done

    # == the store itself ==============================================================
    def describe(self) -> dict[str, Any]:
        faults = {k: {"cause": f.cause, "since": f.since}
                  for k, f in (("write", self._wfaults), ("read", self._rfaults)) if f.cause is not None}
        return {"kind": "file", "url": self.url, "path": str(self.path), "durable": True,
                "format": FORMAT_VERSION, "healthy": not faults, "faults": faults}

    def close(self) -> None:
        """Stop the background thread, fsync what ordinary writes left, close every connection."""
        if self._closed:
            return
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        with self._wlock:
            if self._closed:
                return
            self._closed = True
            self._dirty = True
            self._flush()
            self._drop_writer()
            with self._readers_lock:
                readers, self._readers = list(self._readers), set()
            for conn in readers:
                try:
                    conn.close()
                except sqlite3.Error:
                    pass
            sf.hold(self.path, -1)

    def __enter__(self) -> "FileStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FileStore {self.path}>"
