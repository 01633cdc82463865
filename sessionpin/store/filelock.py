"""The lock file of one store (``<db>.lock``, 0600): what processes sharing the store hold to
open, repair, or make a durable write.

Rules it keeps:
- ``flock`` on its own file, never on the database: taking and dropping it leaves the
  POSIX locks SQLite holds on the database alone.
- One holder across processes and across the threads of this one; the thread that holds
  it may take it again (a repair reopens the store, which takes it too).
- If the file is replaced or deleted while we wait (its directory deleted, say), we lock
  the one the path names now, so two processes never hold "the" lock on two files.
- The file is opened without following a link, and must be ours (``safefile``).
- Waiting is bounded: past ``timeout`` it raises ``TimeoutError`` (a fault: the write
  that wanted it raises NotDurable, as for SQLite's own ``busy_timeout``).
- A waiter blocks in the kernel (``flock`` without ``LOCK_NB``, in a thread of its own so the
  wait can end at ``timeout``), and is woken when the lock is let go. Polling starved: a
  process writing in a loop lets go and takes the lock again within microseconds, so a
  poller sleeping between tries found it free only by chance. Three processes writing
  together, the longest wait was 100-480 ms polling against 3-9 ms blocked, and past the
  2 s ``busy_timeout`` on a loaded CI machine.
- The thread is kept until the kernel answers: a wait that timed out leaves it blocked, and
  the next wait of this lock takes it up again (one such thread per lock, however often a
  stuck holder makes waits time out); if nobody wants the lock when it comes, it lets go.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from pathlib import Path
from typing import Iterator

from . import safefile


class FileLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._threads = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._waiter: _Waiter | None = None     # a blocked wait left by one that timed out

    def acquire(self, timeout: float) -> None:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return
        deadline = time.monotonic() + timeout
        if not self._threads.acquire(timeout=max(timeout, 0.001)):
            raise TimeoutError(errno.EWOULDBLOCK, f"{self.path} held by another thread too long")
        try:
            self._lock_file(deadline)
        except BaseException:
            self._threads.release()
            raise
        self._owner, self._depth = me, 1

    def _lock_file(self, deadline: float) -> None:
        while True:
            if self._fd is None:
                self._fd = safefile.open_file(self.path, os.O_RDWR | os.O_CREAT)   # no link, ours, 0600
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
            except BlockingIOError:
                held = False
            if not held and not self._wait(deadline):
                continue                  # no waiter could wait: try again
            if same_file(self.path, self._fd):
                return
            os.close(self._fd)            # the path names another file now: lock that one
            self._fd = None

    def _wait(self, deadline: float) -> bool:
        """Wait, blocked in the kernel, until ``deadline``; whether ``self._fd`` now holds it
        (False: no waiter could wait — no thread to be had, or its ``flock`` failed — try again)."""
        waiter = self._waiter
        if waiter is None or not waiter.wanted_again():
            try:
                waiter = self._waiter = _Waiter(self.path)
            except RuntimeError:          # no thread to be had (a process at its limit)
                waiter = self._waiter = None
        got = waiter.take(deadline - time.monotonic()) if waiter is not None else None
        if got is None:
            if time.monotonic() >= deadline:
                raise self._too_long()
            time.sleep(0.001)
            return False
        if not got:
            raise self._too_long()
        self._waiter = None
        os.close(self._fd)                # never held: the waiter's descriptor holds it now
        self._fd = waiter.fd
        return True

    def _too_long(self) -> TimeoutError:
        return TimeoutError(errno.EWOULDBLOCK, f"{self.path} held by another process too long")

    def try_acquire(self) -> bool:
        """Take it if nobody holds it (no waiting at all); whether it was taken."""
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return True
        if not self._threads.acquire(blocking=False):
            return False
        try:
            if self._fd is None:
                self._fd = safefile.open_file(self.path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._threads.release()
                return False
            if not same_file(self.path, self._fd):      # replaced: the waiting path sorts it out
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                self._threads.release()
                return False
        except BaseException:
            self._threads.release()
            raise
        self._owner, self._depth = me, 1
        return True

    @contextlib.contextmanager
    def held(self, timeout: float) -> Iterator[None]:
        self.acquire(timeout)
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        self._depth -= 1
        if self._depth:
            return
        self._owner = None
        try:
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._threads.release()

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.give_up()
            self._waiter = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _Waiter:
    """One blocking ``flock`` on a descriptor of its own, in a daemon thread: the kernel wakes
    it when the lock is let go. Whoever waits on it may stop waiting (``take`` times out); then
    it stays blocked, for the next wait to take up, and lets go at once if nobody wants it by
    the time it is granted."""

    def __init__(self, path: Path) -> None:
        self.fd = safefile.open_file(path, os.O_RDWR | os.O_CREAT)
        self._mu = threading.Lock()
        self._granted = threading.Event()
        self._wanted = True
        self._gone = False                 # let go (nobody wanted it) or failed: fd closed
        try:
            threading.Thread(target=self._run, name="sessionpin-lockwait", daemon=True).start()
        except BaseException:
            os.close(self.fd)
            raise

    def _run(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            failed = False
        except OSError:
            failed = True
        with self._mu:
            if failed or not self._wanted:
                self._gone = True
                os.close(self.fd)           # closing the descriptor lets go of its lock
            self._granted.set()

    def wanted_again(self) -> bool:
        """Take this waiter up again; False when it is gone (make a new one)."""
        with self._mu:
            if self._gone:
                return False
            self._wanted = True
            return True

    def take(self, timeout: float) -> bool | None:
        """Whether the lock was granted to ``fd`` within ``timeout``; None if the waiter is gone."""
        self._granted.wait(max(timeout, 0.0))
        with self._mu:
            if self._gone:
                return None
            if self._granted.is_set():
                return True
            self._wanted = False
            return False

    def give_up(self) -> None:
        with self._mu:
            self._wanted = False
            if self._granted.is_set() and not self._gone:
                self._gone = True
                os.close(self.fd)


def same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` itself (a link there is not followed) names the file ``fd`` is open on."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)
