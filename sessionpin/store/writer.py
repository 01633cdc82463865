"""The file store's writer side: the writer connection over both copies (copies.py), the one
recovery path, and the background thread. ``FileStore`` (file.py) is the API and the readers.

Rules it keeps:
- One writer connection (the database as ``main``, the copy attached), used under ``wlock``;
  readers never take it. Every write is one BEGIN IMMEDIATE transaction that changes both
  copies and raises their sequence; a durable one is fsync'd in both WALs. Every write
  holds the store's lock file for its whole transaction, and the open holds it while it
  connects: no repair of another process runs between a write's checks and its commit,
  and no process makes a new -shm (the old one deleted) while another still commits
  through the old one (SQLite's own locks live in the -shm, so they cannot exclude it). After a failed write the connection is dropped and the next write reconnects.
- Before every commit, and every ``watch_interval`` in the background, it checks that the
  paths still name the files it has open (six ``stat``s). If not — or a call met damaged
  pages and a check on a fresh connection confirms them, or the periodic verification finds
  them — the store is UNSURE: reads and writes raise, nothing is committed to the wrong
  file, one ERROR line, and the background thread recovers at once.
- One recovery path (``recover``), at open and while running, under the lock file: judge
  both files on connections of their own (whole? which sequence?), set aside a damaged one
  (``.corrupt-…``), rebuild each file that is damaged, missing, stale or behind from the
  whole one with the higher sequence — from the file at its path, or, when neither path
  holds a whole file (the directory deleted), from what the writer connection still has
  open — then reopen. The usual open (both whole, same sequence) takes no lock.
- The state is one ``State``: SURE, UNCHECKED (opened with its pages' check left to the
  background thread: reads go on, a write first waits for the check), SUSPECT (a call met
  damaged pages: check them), UNSURE (calls refuse until recovered), CLOSED.
- ``check_at_open=False`` (the CLI's read-only listings): the open checks the two files'
  headers and sequences, not every page (``quick_check`` of a 1M-pin store takes seconds); the
  background thread checks them at once, and ``verdict`` says what it found.
- The background thread also fsyncs ordinary commits (both WALs and the directory) within
  ``flush_interval``, sweeps expired keys in bounded batches, and verifies both files with
  ``quick_check`` at most every 50 × the time the last check took (≤ 2 % of a core).
"""

from __future__ import annotations

import enum
import errno
import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable

from . import copies, safefile
from . import sqlitefile as sf
from .base import StoreError, WouldBlock
from .copies import Identity
from .filelock import FileLock

log = logging.getLogger("sessionpin.store.file")

WRITER_BUSY_MS = 20   # the writer connection's own busy timeout (its transaction's loop waits longer)
AUTOCHECKPOINT = 1000 # pages (SQLite's default): a commit leaving a WAL this long checkpoints it
WAL_LIMIT = 16 << 20  # bytes: a WAL reset after a checkpoint is cut back to this (journal_size_limit)
WAL_GUARD = 32 << 20  # bytes: a WAL this large (checkpoints are not keeping up) takes no write on the loop
CHECKPOINT_COMMITS = 64   # the loop's commits that call for a checkpoint at the next flush
CHECKPOINT_EVERY = 5.0    # seconds: at most this long between a loop commit and its checkpoint
HISTORY = 20          # the last repairs kept in both files' meta table (for doctor)
VERIFY_SHARE = 50     # the verification waits this many times as long as it took


class State(enum.Enum):
    SURE = "sure"
    UNCHECKED = "unchecked" # opened without the pages' check: the background thread runs it now
    SUSPECT = "suspect"     # a call met damaged pages: check them on a fresh connection
    UNSURE = "unsure"       # a path names another file or none, or pages are damaged
    CLOSED = "closed"


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
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return f"{type(exc).__name__}: {exc}"


class Writer:
    def __init__(self, path: Path, url: str, clock: Callable[[], float], *, flush_interval: float,
                 sweep_interval: float, sweep_batch: int, busy_timeout: float,
                 on_connect: Callable[[sqlite3.Connection], None] | None, watch_interval: float,
                 check_at_open: bool = True) -> None:
        self.path, self.copy, self.url, self.clock = path, copies.copy_path(path), url, clock
        self.flush_interval, self.sweep_interval, self.sweep_batch = flush_interval, sweep_interval, sweep_batch
        self.busy_timeout, self.on_connect, self.watch_interval = busy_timeout, on_connect, watch_interval
        self.check_at_open = check_at_open
        self.checked = threading.Event()               # the open's pages check is done (or was made at open)
        self.found: str | None = None                  # what that check found damaged (None: whole)
        self.lock_wait = max(busy_timeout, 5.0)         # opening and repairing may wait longer
        self.wlock = threading.RLock()
        self.w: sqlite3.Connection | None = None
        self.parked: sqlite3.Connection | None = None  # the writer a fault dropped, closed once a new one is open
        self.lock = FileLock(path.with_name(path.name + ".lock"))
        self.ident: Identity | None = None             # what the paths named when we opened
        self.state, self.why = State.SURE, None        # why: what made it SUSPECT or UNSURE
        self.gen = 0                                   # readers reopen when it moves
        self.dirty = False
        self.next_verify = 0.0
        self.loop_commits = 0                          # writes made on the event loop since the last checkpoint
        self.checkpointed = time.monotonic()           # when the last one was made
        self.last_repair: dict | None = None
        self.repairs: list = []
        self.pending: list[str] = []                   # repairs to record once there is a file for them
        self.wfaults = Faults(url, f"write {path}", "writes fail (durable ones with NotDurable)")
        self.rfaults = Faults(url, f"read {path}", "reads fail with StoreUnavailable")
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._background, name="sessionpin-store", daemon=True)

    def start(self, read_header: bool) -> None:
        try:
            with self.wlock:
                self.open(read_header)
        except Exception as exc:
            if not sf.is_fault(exc):
                raise
            self.wfaults.failed(exc)                    # the next write opens it again
        self.thread.start()

    def connect(self, read_only: bool = False, path: Path | None = None) -> sqlite3.Connection:
        conn = sf.connect(path or self.path, busy_timeout=self.busy_timeout, read_only=read_only)
        try:
            if self.on_connect is not None:
                self.on_connect(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    # == opening and the one recovery path ==============================================
    def open(self, read_header: bool = False) -> None:
        """Open the writer connection (wlock held). The usual case — both files there, whole,
        at one sequence — takes no lock; anything else is ``recover``'s."""
        sf.prepare_dir(self.path.parent)
        safefile.check_existing(self.lock.path)     # a link, another user's: refused at open
        unreadable = {}
        if read_header:                             # a newer or foreign file: refused before we write
            for name, p in (("database", self.path), ("copy", self.copy)):
                try:
                    sf.check_header(p)
                except sf.Unreadable as exc:
                    unreadable[name] = str(exc)     # set aside by recover, before SQLite touches it
        if self.path.exists() and self.copy.exists() and not unreadable:
            try:
                # under the lock file: opening may make a new -shm (the old one deleted), whose
                # index must be built after the commit of a process still on the old one
                with self.lock.held(self.lock_wait):
                    self._connect(check=self.check_at_open, compare=True)
                if self.check_at_open:
                    self.checked.set()
                else:
                    self.state = State.UNCHECKED
                    self.wake.set()
                return
            except sf.Unreadable:
                self.drop_writer()
        self.recover(unreadable)
        self.checked.set()                          # recover judged both files' pages

    def recover(self, unreadable: dict | None = None) -> str:
        """Make both files whole and reopen (wlock held). Returns what was done."""
        sf.prepare_dir(self.path.parent)            # gone with its directory: made again
        self.lock.acquire(self.lock_wait)
        try:
            done = self._make_whole(unreadable or {})
            self.drop_writer()                      # only now: for a deleted file it was the only copy
            self._connect(check=False)
            if self.pending:                        # under the lock: another process judging both
                self.remember()                     # must not see this commit in one file only
        finally:
            self.lock.release()
        return "; ".join(done) or "reopened it"

    def _make_whole(self, unreadable: dict) -> list[str]:
        now = Identity.of(self.path)
        files = {"database": self.path, "copy": self.copy}
        full = self.state is State.SUSPECT or (self.state is State.UNSURE and "damaged" in (self.why or ""))
        verdicts, stale = {}, set()
        for i, (name, p) in enumerate(files.items()):
            why = self.ident.stale(now, i) if self.ident is not None else None
            if why:
                verdicts[name] = copies.Verdict(None, why)
                stale.add(name)
            elif name in unreadable and p.exists():
                verdicts[name] = copies.Verdict(None, unreadable[name])
            else:
                verdicts[name] = copies.judge(p, lambda p: self.connect(path=p), full=full)
            why = verdicts[name].why
            if why not in (None, "missing") and name not in stale and p.exists():
                aside = sf.set_aside(p, why)        # kept for the operator; never a source
                log.warning("store file %s could not be read (%s); moved it aside to %s", p, why, aside)
                self.pending.append(f"the {name} could not be read ({why}); moved it aside to {aside}")
        whole = {n: v.seq for n, v in verdicts.items() if v.why is None}
        src = conn = None
        if whole:                                   # the whole file with the higher sequence
            best = max(whole, key=lambda n: (whole[n], n == "database"))
            src, schema, top = f"the {best}", "main", whole[best]
            conn = self.connect(path=files[best])
        elif self.w is not None:                    # neither path holds it: what the writer has open
            held = {s: copies.seq(self.w, s) for s in copies.SCHEMAS if copies.check(self.w, s) is None}
            if held:
                schema = max(held, key=lambda s: (held[s], s == "main"))
                best, src, conn, top = "", "the connection still open", self.w, held[schema]
        if conn is None:                            # a new store (or both damaged: a second fault)
            tmp = copies.new_file(self.path)
            copies.put_in_place(tmp, self.path)
            best, src, schema, top, conn = "database", "a new file", "main", 0, self.connect()
            sf.init_db(conn, self.path, quick_check=False)   # WAL: no super-journal across the two
            if any(v.why != "missing" for v in verdicts.values()):
                log.error("store file %s: neither its database nor its copy can be read (%s); what could not be "
                          "read is kept aside, and the store starts EMPTY (pins in it are lost: their conversations "
                          "route as new ones)", self.path, "; ".join(f"{n}: {v.why}" for n, v in verdicts.items()))
                self.pending.append("neither the database nor its copy could be read: started empty")
        done = []
        try:
            for name, p in files.items():
                v = verdicts[name]
                if name == best or (v.why is None and v.seq == top):
                    continue
                why = v.why or f"it was behind (sequence {v.seq} of {top})"
                n = copies.rebuild(conn, schema, p)
                if name == "copy" and v.why == "missing" and top == 0:
                    log.info("store file %s: made its copy %s (%d keys)", self.path, p, n)  # new, or older
                else:
                    log.warning("store file %s: rebuilt its %s from %s (%s): %d keys", self.path, name, src, why, n)
                    self.pending.append(f"rebuilt the {name} from {src} ({why}): {n} keys")
                    self.last_repair = {"why": why, "action": f"rebuilt the {name} from {src}", "keys": n,
                                        "at": time.time()}
                done.append(f"rebuilt the {name} from {src}")
        finally:
            if conn is not self.w:
                conn.close()
        return done

    def _connect(self, check: bool, compare: bool | None = None) -> None:
        """Open the writer connection over both files. ``check``: every page of both
        (``quick_check``); ``compare`` (default: ``check``): both at one sequence."""
        compare = check if compare is None else compare
        conn = self.connect()
        try:
            for p in (self.copy, Path(f"{self.copy}-wal"), Path(f"{self.copy}-shm")):
                safefile.check_existing(p)
            try:
                found = sf.init_db(conn, self.path, quick_check=check)
                copies.attach(conn, self.copy)
                conn.execute("PRAGMA copy.journal_mode = WAL")
                conn.execute("PRAGMA copy.synchronous = NORMAL")
                for schema in copies.SCHEMAS:       # (so a WAL that grew once does not look full for ever)
                    conn.execute(f"PRAGMA {schema}.journal_size_limit = {WAL_LIMIT}")
                copies.track(conn)
                # BEGIN IMMEDIATE takes two files' write locks: SQLite's busy handler sleeps up to
                # 100 ms between tries, and under contention a writer that sleeps that long
                # rarely finds both free; the txn's own loop tries again every millisecond
                conn.execute(f"PRAGMA busy_timeout = {WRITER_BUSY_MS}")
                why = copies.check(conn, "copy") if check else None
                if why is None and compare and (not found or copies.seq(conn) != copies.seq(conn, "copy")):
                    why = "one is behind the other"
            except sqlite3.DatabaseError as exc:
                if not sf.is_damage(exc):
                    raise
                why = str(exc)
            if why is not None:
                raise sf.Unreadable(why)
            if check or not compare:                # not on pages still unchecked (the sweep does it later)
                sf.txn(conn, lambda c: (copies.start(c), copies.delete_expired(c, self.clock())), durable=False,
                       patience=self.busy_timeout)
            self.repairs = _history(conn)
        except BaseException:
            conn.close()
            raise
        self.w, self.dirty = conn, True
        self.ident = Identity.of(self.path)
        self.gen += 1                               # readers opened meanwhile open afresh

    def drop_writer(self) -> None:
        # its files may have been replaced (or its -shm: another process then has another
        # wal-index over the same -wal): closing must not checkpoint into, and delete, the
        # -wal and -shm of the files now at the paths
        stale = self.state is State.UNSURE or (
            self.ident is not None and self.ident.differs(Identity.of(self.path)) is not None)
        for conn in (self.w, self.parked):
            if conn is not None:
                try:
                    conn.setconfig(sqlite3.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, stale)
                    conn.close()
                except sqlite3.Error:
                    pass
        self.w = self.parked = None

    # == writes =======================================================================
    def write(self, op: Callable, args: tuple, now: float, durable: bool):
        """One write (wlock taken here); raises what SQLite or the disk raised."""
        if self.state is State.UNSURE:              # before the lock: a repair may hold it
            raise Unsure(f"not sure of its file: {self.why}; repairing")
        with self.wlock:
            if self.state is State.CLOSED:
                raise StoreError(f"{self.url}: store is closed")
            if self.state is State.UNCHECKED:        # never write to pages not yet checked
                self.verify(full=False)
                if self.state is State.UNSURE:
                    self.repair()
            if self.state is State.UNSURE:
                raise Unsure(f"not sure of its file: {self.why}; repairing")
            try:
                # every write holds the lock file for its whole transaction (and a reconnect
                # before it, which may make a new -shm): SQLite's own locks live in the -shm,
                # so a process still on a deleted -shm and one on a new -shm do not exclude
                # each other; the identity check before COMMIT only helps if nobody can make
                # a new -shm between it and the commit
                self.lock.acquire(self.busy_timeout)
                try:
                    if self.w is None:
                        self.open() if self.ident is None else self._reconnect()
                    result = sf.txn(self.w, lambda c: _both(c, op, now, args, durable), durable=durable,
                                    before_commit=self.check_identity, schemas=copies.SCHEMAS,
                                    patience=self.busy_timeout)
                finally:
                    self.lock.release()
                self.dirty = self.dirty or not durable
                return result
            except Exception as exc:
                self._failed(exc)
                raise

    def write_now(self, op: Callable, args: tuple, now: float):
        """An ordinary write made on the caller's thread (the event loop's) when nothing would
        make it wait; ``WouldBlock`` otherwise, nothing written, and the caller writes on the
        writer thread. It would wait for: this process's writer (another thread holds
        ``wlock``), the lock file (another process's write or repair), SQLite's write lock
        (busy timeout 0 here), a checkpoint (the autocheckpoint is off for this commit, and a
        WAL past ``WAL_GUARD`` goes to the thread, whose commit checkpoints it), or a store not
        SURE. Faults and damage are handled as ``write`` handles them."""
        if self.state is not State.SURE or self.w is None:
            raise WouldBlock("the store is not sure of its file, or not open")
        if not self.wlock.acquire(blocking=False):
            raise WouldBlock("the writer is busy")
        try:
            if self.state is not State.SURE or self.w is None:
                raise WouldBlock("the store is not sure of its file, or not open")
            if not self.lock.try_acquire():
                raise WouldBlock("the lock file is held")
            try:
                if self._wal_size() >= WAL_GUARD:
                    raise WouldBlock("the WAL waits for its checkpoint")   # the thread's commit makes it
                conn = self.w
                conn.execute("PRAGMA busy_timeout = 0")
                conn.execute("PRAGMA wal_autocheckpoint = 0")
                try:
                    result = sf.txn(conn, lambda c: _both(c, op, now, args, False), durable=False,
                                    before_commit=self.check_identity, schemas=copies.SCHEMAS)
                except sqlite3.OperationalError as exc:
                    if sf.code(exc) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                        raise WouldBlock(str(exc)) from exc
                    raise
                finally:
                    try:
                        conn.execute(f"PRAGMA busy_timeout = {WRITER_BUSY_MS}")
                        conn.execute(f"PRAGMA wal_autocheckpoint = {AUTOCHECKPOINT}")
                    except sqlite3.Error:
                        pass
            finally:
                self.lock.release()
            self.dirty = True
            self.loop_commits += 1              # the background thread checkpoints them, not the loop
            return result
        except WouldBlock:
            raise
        except Exception as exc:
            self._failed(exc)
            raise
        finally:
            self.wlock.release()

    def _wal_size(self) -> int:
        """The larger WAL's size in bytes (0: none)."""
        size = 0
        for wal in (f"{self.path}-wal", f"{self.copy}-wal"):
            try:
                size = max(size, os.stat(wal).st_size)
            except FileNotFoundError:
                continue
        return size

    def checkpoint(self, force: bool = False) -> None:
        """Checkpoint both WALs for the writes made on the event loop (background thread, with
        the flush): those commits' own autocheckpoint is off, so that no commit on the loop
        copies pages and fsyncs. Not at every flush (a checkpoint fsyncs both files: twice a
        second was more disk work than SQLite's own every 1,000 pages) but once
        ``CHECKPOINT_COMMITS`` such commits were made, or ``CHECKPOINT_EVERY`` seconds after the
        last checkpoint if any was. PASSIVE: it waits for no reader and no writer; what it
        cannot copy now, a later one does."""
        if self.state is not State.SURE or not self.loop_commits:
            return
        now = time.monotonic()
        if not force and self.loop_commits < CHECKPOINT_COMMITS and now - self.checkpointed < CHECKPOINT_EVERY:
            return
        self.loop_commits, self.checkpointed = 0, now
        with self.wlock:
            if self.state is not State.SURE or self.w is None:
                return
            try:
                with self.lock.held(self.busy_timeout):
                    self.check_identity()       # never into a file that is no longer the store's
                    for schema in copies.SCHEMAS:
                        self.w.execute(f"PRAGMA {schema}.wal_checkpoint(PASSIVE)").fetchall()
            except (sqlite3.Error, OSError) as exc:
                if not sf.is_fault(exc):
                    raise
                log.debug("store %s: checkpoint failed: %s", self.path, exc)

    def _failed(self, exc: Exception) -> None:
        """What a failed write leaves (wlock held): a fault drops the writer connection (or
        notices the paths changed), damage has the pages checked."""
        if sf.is_fault(exc) and not isinstance(exc, Unsure):
            self._after_fault()
        if sf.is_damage(exc):
            self.suspect()

    def _after_fault(self) -> None:
        """Drop the writer connection (the next write opens a fresh one) — unless the paths
        no longer name its files: then it may hold what the repair rebuilds from. Dropped, it
        stays open (parked) until the fresh one is: closing the process's last connection
        makes SQLite delete the -wal and -shm, and new ones would look like files replaced."""
        why = self.ident.differs(Identity.of(self.path)) if self.ident is not None else None
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
        parked, ident = self.parked, self.ident
        self.parked = None
        self._connect(check=False)
        self.ident = ident
        if parked is not None:                      # the fresh one is open: the -wal stays
            try:
                parked.close()
            except sqlite3.Error:
                pass
        self.check_identity()

    def check_identity(self) -> None:
        why = self.ident.differs(Identity.of(self.path)) if self.ident is not None else None
        if why:
            self.notice(why)
            raise Unsure(f"{why} while it was open; repairing")

    def notice(self, why: str) -> None:
        if self.state in (State.SURE, State.SUSPECT, State.UNCHECKED):
            self.state, self.why = State.UNSURE, why
            log.error("store %s: %s while it was open; reads and writes refuse until it is repaired",
                      self.url, why)
        self.wake.set()

    def suspect(self) -> None:
        if self.state is State.SURE:
            self.state = State.SUSPECT
        self.wake.set()

    # == background ===================================================================
    def _background(self) -> None:
        tick = min(self.flush_interval, self.watch_interval, self.sweep_interval)
        now = time.monotonic()
        next_flush, next_sweep = now + self.flush_interval, now + self.sweep_interval
        self.next_verify = now + 4 * self.watch_interval     # (UNCHECKED: the first tick checks)
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
                    self.checkpoint()
                    self.flush()
                if now >= next_sweep:
                    next_sweep = now + self.sweep_interval
                    self.sweep()
            except Exception:  # never let the thread die: the next tick tries again
                log.exception("store %s: background work failed", self.path)

    def watch(self) -> None:
        if self.state is State.CLOSED or self.ident is None:
            return
        if self.state is not State.UNSURE:
            if why := self.ident.differs(Identity.of(self.path)):
                self.notice(why)
        if self.state in (State.SUSPECT, State.UNCHECKED) or (
                self.state is State.SURE and time.monotonic() >= self.next_verify):
            self.verify(full=self.state is State.SUSPECT)
        if self.state is State.UNSURE:
            self.repair()

    def verify(self, full: bool) -> None:
        """Check both files' pages on connections of their own (the writer's page cache may
        hold good copies of damaged pages)."""
        t0 = time.thread_time()
        for name, p in (("database", self.path), ("copy", self.copy)):
            try:
                conn = self.connect(path=p)
            except (sqlite3.Error, OSError):
                continue                            # the watch sees a file gone
            try:
                why = copies.check(conn, full=full)
            finally:
                conn.close()
            if why is not None:
                if self.state is State.UNCHECKED:
                    self.found = f"its {name}'s pages are damaged ({why})"
                self.notice(f"its {name}'s pages are damaged ({why})")
                self.checked.set()
                return
        if self.state in (State.SUSPECT, State.UNCHECKED):
            self.state = State.SURE
        self.checked.set()
        self.next_verify = time.monotonic() + max(self.watch_interval, VERIFY_SHARE * (time.thread_time() - t0))

    def repair(self) -> None:
        with self.wlock:
            if self.state is not State.UNSURE:
                return
            try:
                action = self.recover()
            except Exception as exc:                # one ERROR per streak; tried every watch_interval
                if self.last_repair is None or self.last_repair.get("failing") is None:
                    log.error("store %s: cannot repair it (%s): %s; reads and writes refuse until it can, trying "
                              "again every %g s", self.url, self.why, cause_of(exc), self.watch_interval)
                else:
                    log.debug("store %s: repair failed again: %s", self.url, exc)
                self.last_repair = {**(self.last_repair or {}), "failing": cause_of(exc)}
                return
            why, self.state, self.why = self.why, State.SURE, None
            self.last_repair = {"why": why, "action": action, "at": time.time()}
            log.warning("store %s repaired: %s (%s); reads and writes go on", self.url, action, why)
            self.pending.append(f"{why} while it was open; {action}")
            try:
                self.lock.acquire(self.lock_wait)   # (as in recover)
            except OSError:
                return                              # recorded with the next repair
            try:
                self.remember()
            finally:
                self.lock.release()

    def remember(self) -> None:
        """Add the pending repairs to the history kept in both files (doctor shows it)."""
        entries = [{"at": time.time(), "what": w} for w in self.pending]
        self.pending.clear()

        def body(c: sqlite3.Connection) -> list:
            kept = (_history(c) + entries)[-HISTORY:]
            copies.set_meta(c, "repairs", json.dumps(kept))
            copies.bump(c)
            return kept
        try:
            self.repairs = sf.txn(self.w, body, durable=True, schemas=copies.SCHEMAS, patience=self.busy_timeout)
        except sqlite3.Error as exc:
            if not sf.is_fault(exc):
                raise
            log.debug("store %s: could not record a repair: %s", self.url, exc)

    def flush(self) -> None:
        """Put ordinary commits on stable storage: fsync both WALs and the directory — never
        a descriptor of a database file (closing it would drop SQLite's POSIX locks)."""
        if not self.dirty:
            return
        self.dirty = False
        try:
            for wal in (f"{self.path}-wal", f"{self.copy}-wal"):
                try:
                    fd = os.open(wal, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue                        # checkpointed (fsync'd) and removed
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
                if self.state not in (State.SURE, State.SUSPECT) or self.w is None:
                    break
                try:
                    with self.lock.held(self.busy_timeout):
                        n = sf.txn(self.w, lambda c: copies.delete_expired(c, now, batch), durable=False,
                                   before_commit=self.check_identity, patience=self.busy_timeout)
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
        """For status and doctor: no file is touched here (the facade calls it on the loop)."""
        faults = {k: {"cause": f.cause, "since": f.since}
                  for k, f in (("write", self.wfaults), ("read", self.rfaults)) if f.cause is not None}
        unsure = self.why if self.state is State.UNSURE else None
        return {"healthy": not faults and unsure is None, "faults": faults, "unsure": unsure,
                "state": self.state.value, "last_repair": self.last_repair, "repairs": list(self.repairs),
                "copy": {"path": str(self.copy)}}

    def close(self) -> None:
        self.stop.set()
        self.wake.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join()
        with self.wlock:
            self.state = State.CLOSED
            self.dirty = True
            self.flush()
            self.drop_writer()
            self.lock.close()


def _both(c: sqlite3.Connection, op: Callable, now: float, args: tuple, durable: bool):
    """One write to both copies. Only a durable one raises the sequence (a row in a page of
    its own: one more page per file and write), so a torn durable commit is always seen at
    open; an ordinary one torn between the two files stays unseen (nothing promised it)."""
    result = op(c, now, *args)
    copies.mirror(c)
    if durable:
        copies.bump(c)
    return result


def _history(c: sqlite3.Connection) -> list:
    try:
        row = c.execute("SELECT value FROM main.meta WHERE name = 'repairs'").fetchone()
        got = json.loads(row[0]) if row else []
    except (sqlite3.Error, ValueError):
        return []
    return got if isinstance(got, list) else []
