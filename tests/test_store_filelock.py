"""The store's lock file (sessionpin/store/filelock.py), on real files: what processes sharing
a file store hold to open, repair, or make a durable write."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sessionpin.store.filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent


HOLDER = r"""
import sys, time
from pathlib import Path
from sessionpin.store.filelock import FileLock
lock = FileLock(Path(sys.argv[1]))
lock.acquire(5)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
lock.release()
"""


def test_the_lock_file_excludes_other_processes_and_threads_and_bounds_the_wait(tmp_path):
    path = tmp_path / "s.lock"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), "0.6"], text=True, stdout=subprocess.PIPE,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.stdout.readline() == "held\n"
    lock = FileLock(path)
    with pytest.raises(TimeoutError):
        lock.acquire(0.1)                                    # bounded, like busy_timeout
    t0 = time.monotonic()
    lock.acquire(5)
    assert time.monotonic() - t0 > 0.3                       # it waited for the other process
    lock.acquire(1)                                          # the same thread: again
    lock.release()
    got = []
    t = threading.Thread(target=lambda: got.append(_try(lock)))
    t.start()
    t.join()
    assert got == [False]                                    # another thread of this process waits
    lock.release()
    assert _try(lock) is True
    p.wait(timeout=10)
    lock.close()


def _try(lock: FileLock) -> bool:
    try:
        lock.acquire(0.1)
    except TimeoutError:
        return False
    lock.release()
    return True


def test_the_lock_follows_a_replaced_file(tmp_path):
    path = tmp_path / "s.lock"
    a, b = FileLock(path), FileLock(path)
    a.acquire(1)
    os.unlink(path)                                          # deleted (its directory, say) while held
    b.acquire(1)                                             # b locks the file the path names now
    assert path.exists()
    a.release()
    assert not _try(a)                                       # a now finds b's file, held
    b.release()
    assert _try(a)
    a.close()
    b.close()


def test_trying_the_lock_never_waits(tmp_path):
    """``try_acquire`` (a write on the event loop): taken when free, at once False when another
    process or another thread holds it, again by the thread that holds it."""
    path = tmp_path / "s.lock"
    lock = FileLock(path)
    assert lock.try_acquire() is True and lock.try_acquire() is True     # and again, nested
    got = []
    t = threading.Thread(target=lambda: got.append(lock.try_acquire()))
    t.start()
    t.join()
    assert got == [False]                                    # another thread: no wait
    lock.release()
    lock.release()
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), "0.5"], text=True, stdout=subprocess.PIPE,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert p.stdout.readline() == "held\n"
        t0 = time.monotonic()
        assert lock.try_acquire() is False and time.monotonic() - t0 < 0.1   # another process: no wait
        lock.acquire(5)                                      # (the waiting path still works after)
        lock.release()
    finally:
        p.wait(timeout=10)
    assert lock.try_acquire() is True
    lock.release()
    lock.close()


def _holder(path: Path, seconds: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), str(seconds)], text=True, stdout=subprocess.PIPE,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.stdout.readline() == "held\n"
    return p


def _waiters() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sessionpin-lockwait"]


def test_a_waiter_blocks_until_the_lock_is_let_go_rather_than_polling(tmp_path, monkeypatch):
    """A poller found the lock free only by chance while other processes wrote in a loop (they let
    go and take it again within microseconds): waits of 100-480 ms, past busy_timeout under load.
    A waiter tries once, then blocks in the kernel, which wakes it when the lock is let go."""
    import fcntl

    from sessionpin.store import filelock
    tries = []
    real = fcntl.flock

    path = tmp_path / "s.lock"

    def counted(fd, op):
        # (fcntl.flock is the process's: only this lock file's tries count, not those of a store
        # another test of this worker left running)
        if op & fcntl.LOCK_NB and path.exists() and os.fstat(fd).st_ino == os.stat(path).st_ino:
            tries.append(op)
        return real(fd, op)

    monkeypatch.setattr(filelock.fcntl, "flock", counted)
    p = _holder(path, 1.0)                                   # (long: a busy machine may pause this test)
    lock = FileLock(path)
    try:
        t0 = time.monotonic()
        lock.acquire(5)
        assert time.monotonic() - t0 > 0.1                   # it did wait for the other process
        assert len(tries) == 1                               # one try, then no polling
        lock.release()
    finally:
        p.wait(timeout=10)
        lock.close()


def test_a_wait_that_timed_out_leaves_one_waiter_for_the_next_and_it_lets_go_if_unwanted(tmp_path):
    path = tmp_path / "s.lock"
    p = _holder(path, 1.5)                                   # (long: a busy machine may pause this test)
    lock = FileLock(path)
    try:
        for _ in range(4):                                   # a stuck holder: every wait times out
            with pytest.raises(TimeoutError):
                lock.acquire(0.05)
        assert len(_waiters()) == 1                          # one blocked waiter, taken up again each time
        lock.acquire(5)                                      # the next wait takes it up: granted
        assert _waiters() == []
        lock.release()
    finally:
        p.wait(timeout=10)
    p = _holder(path, 1.0)
    try:
        with pytest.raises(TimeoutError):
            lock.acquire(0.05)                               # left waiting; nobody wants it when granted
    finally:
        p.wait(timeout=10)
    for _ in range(200):
        if not _waiters():
            break
        time.sleep(0.01)
    assert _waiters() == []                                  # granted, unwanted: it let go and ended
    other = FileLock(path)
    assert other.try_acquire() is True                       # and nobody holds the lock
    other.release()
    other.close()
    lock.close()


def test_without_a_thread_to_wait_in_it_still_waits(tmp_path, monkeypatch):
    """A process at its thread limit (``Thread.start`` raises): the wait goes on by trying
    again, bounded as before, rather than failing the write that wanted the lock."""
    from sessionpin.store import filelock

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(filelock.threading.Thread, "start", refuse)
    path = tmp_path / "s.lock"
    p = _holder(path, 1.0)
    fds = len(os.listdir("/proc/self/fd"))
    lock = FileLock(path)
    try:
        with pytest.raises(TimeoutError):
            lock.acquire(0.05)
        lock.acquire(5)                                      # held until the other process let go
        lock.release()
    finally:
        p.wait(timeout=10)
        lock.close()
    assert len(os.listdir("/proc/self/fd")) == fds           # no descriptor left behind by a try
