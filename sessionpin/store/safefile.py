"""How the file store opens and makes its files and directories (issue 20).

A store lives beside files other users may reach: its directory may be one others can write,
a name may be taken by a link planted there, a file may be pre-created by someone else. So:

- Every file of the store (database, its copy, their -wal/-shm, lock file, temp files) is opened
  with ``O_NOFOLLOW``: a symbolic link at its name is refused (``UnsafeFile``), never followed
  — a link in place of the journal (now: the copy) once had durable lines appended to whatever
  file it points at. Opened files must be regular files (a FIFO would block the reader).
- A file owned by another user is refused with a line saying so (that user can change it under
  us); a file of ours wider than 0600 is made 0600 (``fchmod`` on the descriptor, or ``chmod``
  after ``lstat`` showed it is no link). New files are created 0600, whatever the umask (the
  mode asked for at creation can only lose bits to the umask, never gain them).
- Directories the store makes are 0700, missing parents included, whatever the umask. An
  existing directory is refused when it is owned by another user (other than root), or when
  every user may write in it without the sticky bit (``/tmp`` has the sticky bit: others
  cannot rename or delete our files there, and the checks above catch what they plant).
  A directory writable by our group is accepted (user private groups, umask 002).

``UnsafeFile`` is a ``StoreError``: at open it stops the store from opening (mitmdump exits
with its line); while running, the write that met it fails and nothing is written.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from .base import StoreError

log = logging.getLogger("sessionpin.store.file")

FILE_MODE = 0o600
DIR_MODE = 0o700


class UnsafeFile(StoreError):
    """A store file or directory sessionpin will not use (a link, another user's, …)."""


def _uid() -> int:
    return os.geteuid()


def _link(path: Path) -> UnsafeFile:
    return UnsafeFile(f"{path} is a symbolic link; sessionpin does not follow links to its store files "
                      "(its writes would go wherever the link points): remove the link")


def _foreign(path: Path, uid: int, what: str = "file") -> UnsafeFile:
    return UnsafeFile(f"store {what} {path} is owned by another user (uid {uid}; sessionpin runs as uid "
                      f"{_uid()}), who could change it under sessionpin: refusing it; move it away or "
                      "point the store elsewhere")


def _check(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _link(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{path} is not a regular file; sessionpin uses only regular files for its store")
    if st.st_uid != _uid():
        raise _foreign(path, st.st_uid)


def open_file(path: Path, flags: int, mode: int = FILE_MODE) -> int:
    """``os.open`` for a store file: no link followed, regular, ours, 0600 (see the module).
    ``FileNotFoundError`` (and the like) pass through as from ``os.open``."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link(path) from None
        raise
    try:
        st = os.fstat(fd)
        _check(path, st)
        if stat.S_IMODE(st.st_mode) & 0o077:
            log.warning("store file %s was mode %o; made it 0600", path, stat.S_IMODE(st.st_mode))
            os.fchmod(fd, FILE_MODE)
        if flags & os.O_NONBLOCK == 0:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_existing(path: Path, fix: bool = True) -> bool:
    """Refuse the file at ``path`` if it is a link, not a regular file or another user's; make
    it 0600 if it is wider. Without opening it (the database's descriptors are SQLite's: closing
    one of ours would drop its locks). False: there is none."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    _check(path, st)
    if fix and stat.S_IMODE(st.st_mode) & 0o077:
        log.warning("store file %s was mode %o; made it 0600", path, stat.S_IMODE(st.st_mode))
        os.chmod(path, FILE_MODE)       # lstat just showed it is no link (Linux has no lchmod)
    return True


def check_dir(d: Path) -> None:
    """Refuse a store directory another user controls (see the module)."""
    st = os.stat(d)
    if st.st_uid not in (_uid(), 0):
        raise _foreign(d, st.st_uid, "directory")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise UnsafeFile(f"store directory {d} may be written by every user (mode {stat.S_IMODE(st.st_mode):o}, "
                         "no sticky bit), who could replace the store's files: refusing it; "
                         f"`chmod o-w {d}` or point the store elsewhere")


def make_dirs(d: Path) -> list[Path]:
    """Make ``d`` and its missing parents, each 0700 whatever the umask; the ones made."""
    missing: list[Path] = []
    p = d
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    made = []
    for p in reversed(missing):
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(p, DIR_MODE)       # mkdir's mode loses the umask's bits (umask 0700 would leave 0000)
        made.append(p)
    return made
