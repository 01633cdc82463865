"""The file store's writer side: the writer connection, the journal, opening, repairs and the
background thread. ``FileStore`` (file.py) is the API and the readers over it.

Rules it keeps:
- One writer connection, used under ``wlock`` (this process's writers, one at a time);
  readers never take it. After a failed write the connection is dropped and the next
  write reconnects (a connection SQLite opened read-only stays read-only).
- Opening (at start, and after a repair) runs under the store's lock file, so two
  processes never open, rebuild or restore at once: set aside an unreadable database,
  create or upgrade the schema, then reconcile with the journal (guard.py).
- A durable write takes the lock file before ``BEGIN IMMEDIATE`` (one order, so no two
  processes deadlock), cuts any journal line above the database's sequence (a process
  died between its append and its commit), makes its changes, checks that the paths
  still name the files it has open, appends its line (fsync'd) and commits (fsync'd).
  If anything fails the transaction is rolled back and the line cut: nothing stays.
- Every write checks, just before it commits, that the database, -wal and -shm paths
  still name the files it has open. If not, nothing is committed, the store becomes
  *unsure* (reads and writes raise) and the background thread repairs it at once: it
  restores the database from the open connection (or follows the file another process
  put in place), reopens, reconciles with the journal, and is sure again. It also looks
  every ``watch_interval`` (0.25 s), so a vanished file is noticed within a second even
  when nobody writes.
- A read or write that meets damaged pages makes the background thread run
  ``quick_check`` (``integrity_check`` when a call met them); if the pages are damaged the
  database is restored from the writer connection if that copy passes the check, else the
  file is set aside and the database rebuilt from the journal (under the rows still
  readable). A journal that vanished is put back from the descriptor still open, else
  rebuilt from the database; one damaged while running (journal.Verifier's looks, or a
  compaction) is rebuilt from the database, as at open.
- The background thread also fsyncs ordinary commits (WAL and directory) within
  ``flush_interval``, sweeps expired keys in bounded batches, and compacts the journal
  when it has grown past ``compact_factor`` × its live size (and ``compact_min_bytes``).
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable

from . import guard, recovery
from . import sqlitefile as sf
from .base import StoreError
from .filelock import FileLock
from .journal import Journal, decode

log = logging.getLogger("sessionpin.store.file")


class Unsure(OSError):
    """The store's paths no longer name the files it has open (a fault: nothing written)."""

    def __init__(self, why: str) -> None:
        super().__init__(errno.ESTALE, why)


class Faults:
    """One ERROR when a kind of call starts failing, one WARNING when it works again."""

    def __init__(self, store: str, doing: str, consequence: str) -> None:
        self.store, self.doing, self.consequence = store, doing, consequence
        self.cause: str | None = None
        self.since: float | None = None
        self._lock = threading.Lock()

    def failed(self, exc: BaseException) -> str:
        cause = cause_of(exc)
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


def cause_of(exc: BaseException) -> str:
    if isinstance(exc, sqlite3.Error):
        return f"{getattr(exc, 'sqlite_errorname', None) or type(exc).__name__}: {exc}"
    if isinstance(exc, OSError) and exc.strerror and not exc.filename:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}"


class Keeper:
    def __init__(self, path: Path, url: str, clock: Callable[[], float], *, flush_interval: float,
                 sweep_interval: float, sweep_batch: int, busy_timeout: float,
                 on_connect: Callable[[sqlite3.Connection], None] | None, watch_interval: float,
                 compact_factor: float, compact_min_bytes: int) -> None:
        self.path, self.url, self.clock = path, url, clock
        self.flush_interval, self.sweep_interval, self.sweep_batch = flush_interval, sweep_interval, sweep_batch
        self.busy_timeout, self.on_connect, self.watch_interval = busy_timeout, on_connect, watch_interval
        self.compact_factor, self.compact_min_bytes = compact_factor, compact_min_bytes
        self.lock_wait = max(busy_timeout, 5.0)         # opening and repairing may wait longer
        self.wlock = threading.RLock()
        self.w: sqlite3.Connection | None = None
        self.parked: sqlite3.Connection | None = None  # the writer a fault dropped, closed once a new one is open
        self.lock = FileLock(path.with_name(path.name + ".lock"))
        self.journal = Journal(path.with_name(path.name + ".journal"))
        self.ident: guard.Identity | None = None       # what the paths named when we opened
        self.unsure: str | None = None                 # why reads and writes refuse, until repaired
        self.damaged: str | None = None                # quick_check's verdict, when it failed
        self.damaged_db: tuple[int, int] | None = None # the database file it was about
        self.salvage_from: Path | None = None          # a damaged file set aside: its readable rows go in
        self.salvaged: Any = None                      # the last salvage's counts (guard.Salvaged)
        self.suspect = False                           # a call met damaged pages: check them
        self.gen = 0                                   # readers reopen when it moves
        self.checked = False
        self.dirty = False
        self.closed = False
        self.last_repair: dict | None = None
        self.repairs: list = []                        # the history kept in the database (recovery.remember)
        self.pending: list[str] = []                   # repairs made before there was a database to record them
        self.repair_failing: str | None = None         # why the last repair failed, in a streak of failures
        self.journal_counts: dict = {"bytes": None, "records": None}
        self.wfaults = Faults(url, f"write {path}", "writes fail (durable ones with NotDurable)")
        self.rfaults = Faults(url, f"read {path}", "reads fail with StoreUnavailable")
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._background, name="sessionpin-store", daemon=True)

    def start(self, read_header: bool) -> None:
        try:
            with self.wlock:
                recovery.open_full(self, read_header)
        except Exception as exc:
            if not sf.is_fault(exc):
                raise
            self.wfaults.failed(exc)                    # the next write opens it again
        self.count_journal()
        self.thread.start()

    def connect(self, read_only: bool = False) -> sqlite3.Connection:
        conn = sf.connect(self.path, busy_timeout=self.busy_timeout, read_only=read_only)
        try:
            if self.on_connect is not None:
                self.on_connect(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def drop_writer(self) -> None:
        for conn in (self.w, self.parked):
            if conn is not None:
                try:
                    conn.close()
                except sqlite3.Error:
                    pass
        self.w = self.parked = None

    # == writes =======================================================================
    def write(self, op: Callable, args: tuple, now: float, durable: bool):
        """One write (wlock taken here); raises what SQLite or the disk raised."""
        if self.unsure is not None:                 # before the lock: a repair may hold it
            raise Unsure(f"not sure of its file: {self.unsure}; repairing")
        with self.wlock:
            if self.closed:
                raise StoreError(f"{self.url}: store is closed")
            if self.unsure is not None:
                raise Unsure(f"not sure of its file: {self.unsure}; repairing")
            try:
                if self.w is None:
                    recovery.open_full(self) if self.ident is None else self._reconnect()
                if durable:
                    return self._durable(op, args, now)
                result = sf.txn(self.w, lambda c: op(c, now, None, *args), durable=False,
                                before_commit=self.check_identity)
                self.dirty = True
                return result
            except Exception as exc:
                if sf.is_fault(exc) and not isinstance(exc, Unsure):
                    self._after_fault()
                if sf.is_damage(exc):
                    self.suspect = True
                    self.wake.set()
                raise

    def _after_fault(self) -> None:
        """Drop the writer connection (the next write opens a fresh one) — unless the paths
        no longer name its files: then it holds what the repair restores from. Dropped, it
        stays open (parked) until the fresh one is: closing the process's last connection
        makes SQLite checkpoint and delete the -wal and -shm, and the fresh connection's new
        ones would be taken for files replaced under us (a repair for nothing)."""
        why = self.ident.differs(guard.identity(self.path)) if self.ident is not None else None
        if why:
            self.notice(why)
        elif self.w is not None:
            parked, self.parked, self.w = self.parked, self.w, None
            if parked is not None:
                try:
                    parked.close()
                except sqlite3.Error:
                    pass

    def _reconnect(self) -> None:
        conn = self.connect()
        try:
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("SELECT value FROM meta LIMIT 1").fetchall()
        except BaseException:
            conn.close()
            raise
        self.w = conn
        self.gen += 1
        if self.parked is not None:             # the fresh one is open: the -wal stays
            parked, self.parked = self.parked, None
            try:
                parked.close()
            except sqlite3.Error:
                pass
        self.check_identity()

    def _durable(self, op: Callable, args: tuple, now: float):
        rec: list = []
        appended: list[int] = []
        j = self.journal

        def body(c: sqlite3.Connection):
            self.check_identity()               # the database is the one we opened: it is the truth
            have = guard.db_seq(c)
            last = j.settle(have)               # lines of a process that died before its commit go
            result = op(c, now, rec, *args)
            if rec:
                seq = max(have, last) + 1
                guard.set_seq(c, seq)
                appended.append(j.append(seq, now, rec))
            return result

        self.lock.acquire(self.busy_timeout)
        try:
            if not j.current():
                self.wake.set()                 # the background thread rebuilds it
                raise Unsure(f"its journal {j.path} is missing; rebuilding it")
            try:
                return sf.txn(self.w, body, durable=True, before_commit=self.check_identity)
            except BaseException:
                if appended:
                    try:
                        j.cut(appended[0])
                    except OSError as exc:      # the next durable write cuts it (its seq is dead)
                        log.error("store %s: could not take back a journal line of a failed write: %s", self.url, exc)
                raise
        finally:
            self.lock.release()

    def check_identity(self) -> None:
        why = self.ident.differs(guard.identity(self.path)) if self.ident is not None else None
        if why:
            self.notice(why)
            raise Unsure(f"{why} while it was open; repairing")

    def notice(self, why: str) -> None:
        if self.unsure is None:
            self.unsure = why
            log.error("store %s: %s while it was open; reads and writes refuse until it is repaired",
                      self.url, why)
        self.wake.set()

    # == background ===================================================================
    def _background(self) -> None:
        tick = min(self.flush_interval, self.watch_interval, self.sweep_interval)
        now = time.monotonic()
        next_flush, next_sweep = now + self.flush_interval, now + self.sweep_interval
        while not self.stop.is_set():
            self.wake.wait(tick)
            self.wake.clear()
            if self.stop.is_set():
                break
            try:
                self.watch()
                now = time.monotonic()
                if now >= next_flush:
                    next_flush = now + self.flush_interval
                    self.flush()
                    recovery.maybe_compact(self)
                    self.count_journal()
                if now >= next_sweep:
                    next_sweep = now + self.sweep_interval
                    self.sweep()
            except Exception:  # never let the thread die: the next tick tries again
                log.exception("store %s: background work failed", self.path)

    def watch(self) -> None:
        if self.closed or self.ident is None:
            return
        if self.unsure is None:
            why = self.ident.differs(guard.identity(self.path))
            if why:
                self.notice(why)
        if self.unsure is None and self.suspect:
            recovery.check_pages(self)
        if self.unsure is not None:
            recovery.repair(self)
        elif self.w is not None and not self.journal.path.exists():
            recovery.repair_journal(self)
        elif self.w is not None and self.journal.verifier.due(time.monotonic()):
            self.verify_journal()

    def verify_journal(self) -> None:
        """A journal damaged while the store runs (journal.Verifier, no lock) is confirmed
        under the lock file, set aside and rebuilt from the database, as at open."""
        v = self.journal.verifier
        if v.check() is None:
            return
        with self.wlock:
            if self.closed or self.w is None or self.unsure is not None or \
                    self.ident.differs(guard.identity(self.path)):
                return                          # the database is not sure: its repair comes first
            try:
                self.lock.acquire(self.lock_wait)
                try:
                    parsed = self.journal.read() if v.check() is not None else None
                    if parsed is not None and parsed.damaged:
                        recovery.reconcile_locked(self, self.w, parsed, fresh=False, found=0)
                finally:
                    self.lock.release()
            except Exception as exc:            # tried again at the next look; said once
                (log.error if v.failing is None else log.debug)(
                    "store %s: its journal is damaged and cannot be rebuilt yet: %s", self.url, cause_of(exc))
                v.failing = cause_of(exc)
                return
            v.failing = None

    def flush(self) -> None:
        """Put ordinary commits on stable storage: fsync the WAL and the directory.

        The WAL only: opening and closing a descriptor of the database file itself would
        drop every POSIX lock this process holds on it, SQLite's included (another process
        would then delete the WAL under our open connection). SQLite fsyncs the database
        file itself after each checkpoint."""
        if not self.dirty:
            return
        self.dirty = False
        try:
            try:
                fd = os.open(f"{self.path}-wal", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = None                       # checkpointed (fsync'd) and removed
            if fd is not None:
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            sf.fsync_dir(self.path.parent)
        except OSError as exc:
            self.dirty = True
            log.debug("store %s: flush failed: %s", self.path, exc)

    def sweep(self, limit: int | None = None) -> int:
        """Delete expired keys in batches of ``sweep_batch`` (at most ``limit``); return how
        many. Each batch is one short transaction; the writer lock is let go between them."""
        done = 0
        while limit is None or done < limit:
            batch = self.sweep_batch if limit is None else min(self.sweep_batch, limit - done)
            now = self.clock()
            with self.wlock:
                if self.closed or self.w is None or self.unsure is not None:
                    break
                try:
                    n = sf.txn(self.w, lambda c: c.execute(
                        "DELETE FROM entries WHERE key IN "
                        "(SELECT key FROM entries WHERE expires_at <= ? LIMIT ?)", (now, batch)).rowcount,
                        durable=False, before_commit=self.check_identity)
                except (sqlite3.Error, OSError) as exc:
                    if not sf.is_fault(exc):
                        raise
                    log.debug("store %s: sweep failed: %s", self.path, exc)
                    break
                self.dirty = self.dirty or n > 0
            done += n
            if n < batch:
                break
        return done

    # == the store itself ==============================================================
    def describe(self) -> dict[str, Any]:
        """For status and doctor: no file is touched here (the facade calls it on the event
        loop); the journal's figures are the background thread's latest count."""
        faults = {k: {"cause": f.cause, "since": f.since}
                  for k, f in (("write", self.wfaults), ("read", self.rfaults)) if f.cause is not None}
        j = self.journal
        return {"healthy": not faults and self.unsure is None, "faults": faults, "unsure": self.unsure,
                "last_repair": self.last_repair, "repairs": list(self.repairs),
                "journal": {"path": str(j.path), "bytes": self.journal_counts["bytes"],
                            "records": self.journal_counts["records"], "live_bytes": j.live_bytes,
                            "last_compaction": j.last_compaction, "last_rebuild": j.last_rebuild}}

    def count_journal(self) -> None:
        """Keep the journal's figures for describe() (background thread): only the bytes
        appended since the last count are read, unless the file was replaced or cut."""
        try:
            st = self.journal.path.stat()
        except OSError:
            self.journal_counts = {"bytes": None, "records": None}
            return
        seen = self.journal_counts
        if (st.st_ino, st.st_size) == (seen.get("_ino"), seen.get("bytes")):
            return
        try:
            with open(self.journal.path, "rb") as f:
                if st.st_ino == seen.get("_ino") and st.st_size > (seen.get("bytes") or 0):
                    f.seek(seen["bytes"])
                    records = seen["records"] + f.read(st.st_size - seen["bytes"]).count(b"\n")
                else:
                    records = _records(f.read(st.st_size))
        except OSError:
            return
        self.journal_counts = {"bytes": st.st_size, "records": records, "_ino": st.st_ino}

    def close(self) -> None:
        self.stop.set()
        self.wake.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join()
        with self.wlock:
            self.closed = True
            self.dirty = True
            self.flush()
            self.drop_writer()
            self.journal.close()
            self.lock.close()


def _records(data: bytes) -> int:
    """How many durable-write lines a journal holds after its snapshot."""
    head = decode(data.split(b"\n", 1)[0])
    keys = int(head.get("keys", 0)) if isinstance(head, dict) else 0
    return max(data.count(b"\n") - 1 - keys, 0)
