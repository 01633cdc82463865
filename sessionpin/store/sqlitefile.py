"""The file store's database file: where it lives, its format, opening it, setting it aside.

Format (docs/store.md has the why): a SQLite database in WAL mode, ``application_id``
0x73706e31 ("spn1"), ``user_version`` = FORMAT_VERSION (2), tables ``entries(key, kind
's'|'h'|'z', value, expires_at)``, ``fields(key, field, value)``, ``zsets(key, member,
score)`` and ``meta(name, value)`` (the sequence number that says which of the two copies is behind:
copies.py); deleting an entry
deletes its fields and members (a trigger).

Rules it keeps:
- Created 0600 (O_CREAT|O_EXCL) in a directory created 0700; SQLite gives -wal/-shm the
  database file's mode. We only chmod a directory we created or our own default one.
- No link is followed and no other user's file or directory is used (``safefile``): the
  database and its -wal/-shm are looked at (``lstat``) before each connection, since SQLite
  follows links.
- We never close a descriptor of the database file while SQLite may hold it open in this
  process (POSIX would drop SQLite's locks with it): the header is read by us only before
  the first connection of the first store of this process on that file (``_open_here``).
  Connections are opened ``mode=rw``, so SQLite never creates a missing file itself
  (it would not be 0600, nor have our schema).
- A version-1 file (the previous release) is upgraded in place in one durable
  transaction, keeping every key; a newer version raises StoreVersionError before
  anything is written; another program's database raises StoreError, untouched.
- A file that is not a database (or fails ``quick_check``) is moved aside to
  ``<name>.corrupt-<utc>-<pid>-<n>`` (never over an earlier one, its -wal/-shm with it).
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

from . import safefile
from .base import StoreError, StoreVersionError

log = logging.getLogger("sessionpin.store.file")

APPLICATION_ID = 0x73706E31  # "spn1"
FORMAT_VERSION = 2
SQLITE_MAGIC = b"SQLite format 3\x00"

_ENTRIES = """CREATE TABLE {name} (
    key        TEXT PRIMARY KEY,
    kind       TEXT NOT NULL CHECK (kind IN ('s', 'h', 'z')),
    value      TEXT,            -- the string; NULL for a hash or a sorted set
    expires_at REAL             -- epoch seconds; NULL: no TTL
) WITHOUT ROWID"""
_AFTER_ENTRIES = [
    "CREATE INDEX entries_expiry ON entries (expires_at) WHERE expires_at IS NOT NULL",
    """CREATE TABLE zsets (
    key    TEXT NOT NULL,
    member TEXT NOT NULL,
    score  REAL NOT NULL,
    PRIMARY KEY (key, member)
) WITHOUT ROWID""",
    "CREATE INDEX zsets_by_score ON zsets (key, score, member)",
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value) WITHOUT ROWID",
    """CREATE TRIGGER entries_drop_members AFTER DELETE ON entries
    BEGIN
        DELETE FROM fields WHERE key = old.key;
        DELETE FROM zsets WHERE key = old.key;
    END""",
]
_FIELDS = """CREATE TABLE fields (
    key   TEXT NOT NULL,
    field TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (key, field)
) WITHOUT ROWID"""
SCHEMA = [_ENTRIES.format(name="entries"), _FIELDS, *_AFTER_ENTRIES]
# Version 1 had entries (kind 's'|'h' only), its expiry index, fields, and this trigger.
V1_TRIGGER = "entries_drop_fields"
OUR_TABLES = {"entries", "fields", "zsets", "meta"}

# SQLite's result codes that mean "the disk or the file failed", not "the code is wrong".
FAULT_CODES = {
    sqlite3.SQLITE_PERM, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_NOMEM,
    sqlite3.SQLITE_READONLY, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_FULL,
    sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PROTOCOL, sqlite3.SQLITE_NOTADB,
}
DAMAGE_CODES = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}


def code(exc: BaseException) -> int:
    return (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF


def is_fault(exc: BaseException) -> bool:
    """A failure of the disk or of the file, not of the caller."""
    if isinstance(exc, sqlite3.Error):
        return code(exc) in FAULT_CODES
    return isinstance(exc, OSError)


def is_damage(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.Error) and code(exc) in DAMAGE_CODES


class Unreadable(Exception):
    """The file is not a database we can read: set it aside."""


# Stores of this process, by file: the header may be read with our own descriptor only
# while no other store here has the file open (see the module's rules).
_open_here: dict[str, int] = {}
_open_here_lock = threading.Lock()


def hold(path: Path, delta: int) -> int:
    """Count a store of this process on ``path`` in (+1) or out (-1); return the new count."""
    key = os.path.realpath(path)
    with _open_here_lock:
        n = _open_here.get(key, 0) + delta
        if n > 0:
            _open_here[key] = n
        else:
            _open_here.pop(key, None)
        return n


def default_dir() -> Path:
    return Path(platformdirs.user_state_dir("sessionpin"))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_dir(d: Path) -> None:
    """Make the store's directory 0700 (missing parents too) if we create it, or it is our
    default one; refuse one another user controls (``safefile.check_dir``)."""
    if d.is_dir():
        safefile.check_dir(d)
        if d == default_dir() and stat.S_IMODE(d.stat().st_mode) != 0o700:
            os.chmod(d, 0o700)
        return
    for made in safefile.make_dirs(d):
        fsync_dir(made.parent)


def check_ids(path: Path, application_id: int, user_version: int) -> None:
    # We set both in the transaction that makes the schema: a version without our id is
    # another program's database.
    if application_id not in (0, APPLICATION_ID) or (application_id == 0 and user_version != 0):
        raise StoreError(f"{path} is a SQLite database of another application "
                         f"(id {application_id:#x}, version {user_version}); not touching it")
    if user_version > FORMAT_VERSION:
        raise StoreVersionError(
            f"{path} was written by a newer sessionpin (store format {user_version}, "
            f"this one reads {FORMAT_VERSION}); upgrade sessionpin or point the store elsewhere. "
            "The file was left untouched.")


def check_header(path: Path) -> None:
    """Refuse or set aside from the header alone, before SQLite touches the file.
    Call only when no connection of this process has the file open."""
    try:
        with os.fdopen(safefile.open_file(path, os.O_RDONLY), "rb") as f:
            head = f.read(100)
    except (FileNotFoundError, NotADirectoryError):
        return
    if not head:
        return  # the empty file we pre-create: a valid, empty database
    if len(head) < 100 or not head.startswith(SQLITE_MAGIC):
        raise Unreadable("not a SQLite database")
    user_version, _, application_id = struct.unpack(">III", head[60:72])
    check_ids(path, application_id, user_version)


def create_file(path: Path) -> bool:
    """Create the empty database file 0600 (True), or fix an existing one's mode (False)."""
    try:   # (O_EXCL: a link at the name is not followed, it is "there")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        safefile.check_existing(path)       # a link, another user's: refused; ours and wider: 0600
        return False
    try:
        os.fchmod(fd, 0o600)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    return True


def connect(path: Path, *, busy_timeout: float, read_only: bool = False) -> sqlite3.Connection:
    """A connection that never creates the file. ``read_only`` on a read-only filesystem
    reads it as immutable (nobody can change it there, and no -shm can be made)."""
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        safefile.check_existing(p, fix=not read_only)   # SQLite follows links: we look first
    uri = "file:" + urllib.parse.quote(str(path)) + ("?mode=ro" if read_only else "?mode=rw")
    if read_only:
        try:
            if os.statvfs(path.parent).f_flag & os.ST_RDONLY:
                uri += "&immutable=1"
        except OSError:
            pass
    conn = sqlite3.connect(uri, uri=True, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
    return conn


def txn(conn: sqlite3.Connection, body: Callable[[sqlite3.Connection], object], *, durable: bool,
        before_commit: Callable[[], None] | None = None, schemas: tuple[str, ...] = ("main",),
        patience: float = 0.0):
    """``body`` in one BEGIN IMMEDIATE transaction; rolled back if anything raises.
    ``durable``: the commit is fsync'd (synchronous=FULL in each of ``schemas``) before this returns.
    ``patience``: how long BEGIN is tried again when it meets SQLITE_BUSY at once — with an
    attached database, another process's commit releases the files one after the other, and
    the second may then be found changed since this transaction's read of it began
    (SQLITE_BUSY_SNAPSHOT, which SQLite's busy handler does not wait out)."""
    for schema in schemas if durable else ():
        conn.execute(f"PRAGMA {schema}.synchronous = FULL")
    try:
        deadline = time.monotonic() + patience
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                break
            except sqlite3.OperationalError as exc:
                if code(exc) != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                    raise
                time.sleep(0.001)
        try:
            result = body(conn)
            if before_commit is not None:
                before_commit()
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            raise
    finally:
        for schema in schemas if durable else ():
            try:
                conn.execute(f"PRAGMA {schema}.synchronous = NORMAL")
            except sqlite3.Error:
                pass
    return result


def verdict(rows: list[str]) -> str | None:
    """SQLite's ``quick_check``/``integrity_check`` rows as one line (None: whole). A row may
    itself span lines ("*** in database main ***\nOn tree page 2 ..."), and a store's log
    line and the refusal a client reads must stay one line each."""
    if rows == ["ok"]:
        return None
    return "; ".join(" ".join(row.split()) for row in rows[:3])


def init_db(conn: sqlite3.Connection, path: Path, *, quick_check: bool) -> int:
    """Check ids, switch to WAL, check pages, make or upgrade the schema. Returns the
    version found before (0: new, 1: upgraded). Unreadable: set the file aside."""
    try:
        application_id = conn.execute("PRAGMA application_id").fetchone()[0] & 0xFFFFFFFF
        user_version = conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        if is_damage(exc):
            raise Unreadable(str(exc)) from None
        raise
    check_ids(path, application_id, user_version)
    if conn.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
        raise OSError(f"{path}: SQLite could not switch the file to WAL mode")
    conn.execute("PRAGMA synchronous = NORMAL")
    if quick_check:
        try:
            rows = [r[0] for r in conn.execute("PRAGMA quick_check")]
        except sqlite3.DatabaseError as exc:
            if is_damage(exc):
                raise Unreadable(str(exc)) from None
            raise
        if (why := verdict(rows)) is not None:
            raise Unreadable(why)
    if user_version < FORMAT_VERSION:
        txn(conn, lambda c: make_schema(c, path), durable=True)
    return user_version


def make_schema(c: sqlite3.Connection, path: Path) -> None:
    found = c.execute("PRAGMA user_version").fetchone()[0]   # again, under the write lock
    tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if found == 0:
        if tables - OUR_TABLES:
            raise StoreError(f"{path} is a database of something else (tables {sorted(tables)}); not touching it")
        for statement in SCHEMA:
            c.execute(statement)
    elif found == 1:
        # Version 1 → 2: entries gains kind 'z' (a CHECK constraint cannot be altered in
        # SQLite: the table is rebuilt, every row copied), zsets and meta are added.
        c.execute(_ENTRIES.format(name="entries_v2"))
        c.execute("INSERT INTO entries_v2 (key, kind, value, expires_at) "
                  "SELECT key, kind, value, expires_at FROM entries")
        c.execute(f"DROP TRIGGER IF EXISTS {V1_TRIGGER}")
        c.execute("DROP INDEX IF EXISTS entries_expiry")
        c.execute("DROP TABLE entries")
        c.execute("ALTER TABLE entries_v2 RENAME TO entries")
        for statement in _AFTER_ENTRIES:
            c.execute(statement)
    elif found >= FORMAT_VERSION:
        return  # another process made or upgraded it first
    c.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    c.execute(f"PRAGMA user_version = {FORMAT_VERSION}")


def move_no_clobber(src: Path, dest: Path) -> bool:
    """Move ``src`` to ``dest`` unless ``dest`` exists (then False). link+unlink: no race."""
    try:
        os.link(src, dest)          # FileNotFoundError: src is gone (another process moved it)
    except FileExistsError:
        return False
    except FileNotFoundError:
        raise
    except OSError:
        if dest.exists():           # no hard links here: fall back to a checked rename
            return False
        os.rename(src, dest)
        return True
    os.unlink(src)
    return True


def set_aside(path: Path, why: str, label: str = "corrupt", src: Path | None = None) -> Path | None:
    """Move ``path`` (and its -wal/-shm) to a new ``<name>.<label>-<utc>-<pid>-<n>``; the
    name taken, or None if the file was gone already (another process set it aside).
    ``src``: move that file (and its -wal/-shm) instead, to a name made from ``path``'s
    (a damaged restored copy is kept under the name of the database it was copied for)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    src = path if src is None else src
    n = 0
    while True:
        dest = path.with_name(f"{path.name}.{label}-{stamp}-{os.getpid()}-{n}")
        try:
            if move_no_clobber(src, dest):
                break
        except FileNotFoundError:
            return None
        n += 1
    for suffix in ("-wal", "-shm"):
        try:
            move_no_clobber(Path(f"{src}{suffix}"), Path(f"{dest}{suffix}"))
        except FileNotFoundError:
            pass
    fsync_dir(path.parent)
    return dest
