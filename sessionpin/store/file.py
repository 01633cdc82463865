"""The file store: the SyncStore rules of ``base`` kept in one SQLite file shared by processes,
with a second copy of it beside it, written in the same transaction.

Who does what: ``sqlitefile`` the database file (format, opening, set-aside), ``ops`` the
SQL of each operation, ``copies`` the two copies (mirroring, judging, rebuilding),
``filelock`` the lock file, ``writer`` the writer side, the one recovery path and the
background thread; this class is the API and the readers. Rules it keeps:
- Reads go through reader connections of their own, one per thread (opened lazily),
  sharing no lock with the writer: under WAL a read never waits for a writer of this or
  another process. Every read goes to the file (no cache to go stale).
- ``read_now``: a single-key read answered on the caller's thread (the event loop: a pin
  read without a thread hop) through a connection of that thread's that never waits
  (``busy_timeout`` 0): where SQLite would wait (a WAL index being rebuilt after another
  process crashed) it raises ``WouldBlock`` and the caller reads on a thread instead; that
  connection is opened there too (``open_now``), never on the caller's thread. (A page not
  in the OS's cache is read from the disk all the same: ``aio.Threaded`` sees that in the
  thread's counts of disk reads and goes back to its own thread for a while.)
- Durable or raise: a write that cannot be made is rolled back (in both copies) and
  raises ``NotDurable`` (durable) or ``StoreUnavailable``, naming the URL, the path
  and the cause; nothing of it stays anywhere. A read that fails raises
  ``StoreUnavailable``, never "absent". One ERROR line when faults begin, one WARNING when
  the next call succeeds — not one line per call.
- While the store is not sure its paths name the files it has open (deleted, replaced,
  damaged: see writer.py), reads and writes raise rather than answer from the wrong file.
- ``durable=True``: the commit is fsync'd in both copies before the call returns.
  Other writes reach the disk within ``flush_interval`` (a background fsync) and on close.
- We never close a descriptor of the database file while SQLite may hold it open in this
  process (POSIX would drop SQLite's locks with it): the header is read with our own
  descriptor only by the first store of this process on the file, before it connects.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from . import ops
from . import sqlitefile as sf
from .base import Check, NotDurable, StoreError, StoreUnavailable, WouldBlock, Write
from .copies import Identity
from .writer import State, Unsure, Writer

# Kept importable from here (tests and tools name them through this module).
APPLICATION_ID = sf.APPLICATION_ID
FORMAT_VERSION = sf.FORMAT_VERSION
fsync_dir = sf.fsync_dir
is_fault = sf.is_fault


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
        watch_interval: float = 0.25,
        check_at_open: bool = True,
    ) -> None:
        self.path = Path(path).expanduser().absolute()
        self.url = url or f"file:{path}"
        self._clock = clock
        self._writer = Writer(self.path, self.url, clock, flush_interval=flush_interval,
                              sweep_interval=sweep_interval, sweep_batch=sweep_batch, busy_timeout=busy_timeout,
                              on_connect=on_connect, watch_interval=watch_interval, check_at_open=check_at_open)
        self._local = threading.local()   # .conn, .gen: this thread's reader connection
        self._readers: set[sqlite3.Connection] = set()
        self._readers_lock = threading.Lock()   # guards the set only (opening, closing)
        self._now: dict[int, tuple[sqlite3.Connection, int]] = {}   # thread -> read_now's connection, gen
        self._closed = False
        first = sf.hold(self.path, +1) == 1
        try:
            self._writer.start(read_header=first)
        except BaseException:
            sf.hold(self.path, -1)
            raise

    @property
    def _w(self) -> sqlite3.Connection | None:
        """The writer connection (tests set SQLite limits on it)."""
        return self._writer.w

    # == writes =======================================================================
    def _write(self, op: Callable, *args: Any, durable: bool = False):
        k = self._writer
        try:
            if getattr(self._local, "now", False):      # (``write_now``: never durable)
                result = k.write_now(op, args, self._clock())
            else:
                result = k.write(op, args, self._clock(), durable)
        except UnicodeEncodeError as exc:   # a lone surrogate: SQLite takes only UTF-8
            raise StoreError(f"key or value is not valid Unicode text: {exc.reason}") from None
        except Exception as exc:
            if not is_fault(exc):
                raise
            cause = k.wfaults.failed(exc)
            kind = NotDurable if durable else StoreUnavailable
            raise kind(f"store {self.url}: {'durable ' if durable else ''}write to {self.path} failed, "
                       f"nothing written ({cause})") from exc
        k.wfaults.ok()
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

    # what ``write_now`` makes on the caller's thread: small writes (an ``apply`` up to
    # ``NOW_RECORDS`` records); never a durable one (it fsyncs), never ``zremrange`` (unbounded)
    now_writes = frozenset({"set", "cas", "delete", "expire", "incr", "hset", "hsetnx", "hdel", "hincr",
                            "zadd", "zrem", "apply"})
    NOW_RECORDS = 256

    def write_now(self, name: str, *args: Any, **kw: Any) -> Any:
        """The ordinary write ``name(*args, **kw)`` made on this thread if it need not wait;
        ``WouldBlock`` otherwise, nothing written (the caller writes on a thread that may
        wait). A fault or damage raises as the write itself says it."""
        if name not in self.now_writes or kw.get("durable"):
            raise WouldBlock(name)
        if name == "apply" and (len(args) != 2 or len(args[0]) + len(args[1]) > self.NOW_RECORDS):
            raise WouldBlock("a large apply")
        self._local.now = True
        try:
            return getattr(self, name)(*args, **kw)
        finally:
            self._local.now = False

    # == reads ========================================================================
    def _reader(self) -> sqlite3.Connection:
        local, k = self._local, self._writer
        conn = getattr(local, "conn", None)
        if conn is not None and local.gen == k.gen:
            return conn
        if conn is not None:
            self._forget_reader(conn)
        gen = k.gen
        try:
            conn = k.connect()
            try:
                conn.execute("PRAGMA schema_version").fetchone()   # SQLite opens lazily: open now
            except BaseException:
                conn.close()
                raise
        except (sqlite3.Error, OSError) as exc:
            if not is_fault(exc):
                raise
            conn = k.connect(read_only=True)   # a read-only filesystem: read it as it is
        conn.execute("PRAGMA query_only = 1")
        with self._readers_lock:
            self._readers.add(conn)
        local.conn, local.gen = conn, gen
        return conn

    now_reads = frozenset({"get", "ttl", "hget", "hgetall", "zscore"})    # what read_now answers

    def open_now(self, thread: int) -> None:
        """Open the never-waiting connection ``read_now`` uses on the thread ``thread`` (an
        ident): here, on a thread that may wait (opening reads the file's header)."""
        k = self._writer
        held = self._now.get(thread)
        if held is not None and held[1] == k.gen:
            return
        self._check_open()
        gen = k.gen
        conn = sf.connect(self.path, busy_timeout=0.0)
        try:
            if k.on_connect is not None:
                k.on_connect(conn)
            conn.execute("PRAGMA query_only = 1")
            conn.execute("PRAGMA schema_version").fetchone()   # SQLite opens lazily: open now
        except BaseException:
            conn.close()
            raise
        with self._readers_lock:
            self._readers.add(conn)
        self._now[thread] = (conn, gen)
        if held is not None:
            self._forget_reader(held[0])

    def read_now(self, name: str, *args: Any) -> Any:
        """The read ``name(*args)`` answered on this thread if it need not wait; ``WouldBlock``
        otherwise (a read that is not a single key's; no connection for this thread opened by
        ``open_now`` on the file the store has now; SQLite busy): the caller reads on a thread."""
        query = _NOW.get(name)
        held = self._now.get(threading.get_ident())
        if query is None or held is None or held[1] != self._writer.gen:
            raise WouldBlock(name)
        return self._read(query[0], *args, snapshot=query[1], now=held[0])

    def _forget_reader(self, conn: sqlite3.Connection) -> None:
        with self._readers_lock:
            self._readers.discard(conn)
        for thread, held in list(self._now.items()):
            if held[0] is conn:
                self._now.pop(thread, None)
                break
        else:
            self._local.conn = None
        try:
            conn.close()
        except sqlite3.Error:
            pass

    def _read(self, query: Callable, *args: Any, snapshot: bool = False, now: sqlite3.Connection | None = None):
        self._check_open()
        k, conn = self._writer, None
        try:
            if k.state is State.UNSURE:
                raise Unsure(f"not sure of its file: {k.why}; repairing")
            conn = now if now is not None else self._reader()
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
            if now is not None and sf.code(exc) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise WouldBlock(str(exc)) from exc     # not a fault: the thread's read waits it out
            missing = isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc)
            if not (is_fault(exc) or missing):
                raise
            if conn is not None:
                self._forget_reader(conn)   # the next read opens a fresh one
            if sf.is_damage(exc):
                k.suspect()                 # the background thread checks the pages
            elif k.ident is not None and not isinstance(exc, Unsure):
                why = k.ident.differs(Identity.of(self.path))
                if why:                     # (a reader opening after the file was deleted, say)
                    k.notice(why)
                    exc = Unsure(f"{why} while it was open; repairing")
            cause = k.rfaults.failed(exc)
            raise StoreUnavailable(f"store {self.url}: cannot read {self.path} ({cause})") from exc
        if (not result or (isinstance(result, list) and (None in result or {} in result))) and k.ident is not None:
            # A miss is an answer only from the file the path names: one deleted or replaced
            # (not yet noticed by the watch) may lack what the current one holds.
            why = k.ident.differs(Identity.of(self.path))
            if why:
                k.notice(why)
                cause = k.rfaults.failed(Unsure(f"{why} while it was open; repairing"))
                raise StoreUnavailable(f"store {self.url}: cannot read {self.path} ({cause})")
        k.rfaults.ok()
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

    def zscore(self, key: str, member: str) -> float | None:
        return self._read(ops.q_zscore, key, member, snapshot=True)

    def zrange(self, key: str, lo: float, hi: float, limit: int | None = None) -> list[tuple[str, float]]:
        return self._read(ops.q_zrange, key, lo, hi, limit, snapshot=True)

    def zpage(self, key: str, lo: float, hi: float, after: tuple[str, float] | None = None,
              limit: int = 1000, *, reverse: bool = False) -> list[tuple[str, float]]:
        return self._read(ops.q_zpage, key, lo, hi, after, limit, reverse, snapshot=True)

    def hgetall_many(self, keys: Sequence[str]) -> list[dict[str, str]]:
        return self._read(ops.q_hgetall_many, list(keys), snapshot=True)

    def keys(self, prefix: str = "") -> list[str]:
        return self._read(ops.q_keys, prefix)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.url}: store is closed")

    # == the store itself ==============================================================
    def verdict(self, timeout: float | None = None) -> str | None:
        """What the check of every page found, once it is done: None (whole), or the damage
        (the store repairs itself from the other file). Opened with ``check_at_open=False``,
        the check runs on the background thread while reads go on; a caller that read before
        it ended asks here before it says all was read. Raises ``StoreUnavailable`` if the
        check has not ended within ``timeout``."""
        k = self._writer
        if not k.checked.wait(timeout):
            raise StoreUnavailable(f"store {self.url}: the check of its pages did not end within {timeout:g} s")
        return k.found

    def sweep(self, limit: int | None = None) -> int:
        """Delete expired keys now, in bounded batches (at most ``limit``); return how many."""
        return self._writer.sweep(limit)

    def describe(self) -> dict[str, Any]:
        return {"kind": "file", "url": self.url, "path": str(self.path), "durable": True,
                "format": FORMAT_VERSION, **self._writer.describe()}

    def close(self) -> None:
        """Stop the background thread, fsync what ordinary writes left, close every connection."""
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        self._now.clear()
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


# The reads ``read_now`` answers: one key's (a few pages), and whether they take a snapshot.
_NOW: dict[str, tuple[Callable, bool]] = {    # (FileStore.now_reads)
    "get": (ops.q_get, False), "ttl": (ops.q_ttl, False), "hget": (ops.q_hget, True),
    "hgetall": (ops.q_hgetall, True), "zscore": (ops.q_zscore, True),
}


def _end_read(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
