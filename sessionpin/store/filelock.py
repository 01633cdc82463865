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
        pause = 0.0005
        while True:
            if self._fd is None:
                self._fd = safefile.open_file(self.path, os.O_RDWR | os.O_CREAT)   # no link, ours, 0600
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(errno.EWOULDBLOCK, f"{self.path} held by another process too long") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
                continue
            if same_file(self.path, self._fd):
                return
            os.close(self._fd)            # the path names another file now: lock that one
            self._fd = None

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
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` itself (a link there is not followed) names the file ``fd`` is open on."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)
