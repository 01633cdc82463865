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
