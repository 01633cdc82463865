"""The file store's two copies: ``state.db`` and ``state.db.copy``, two SQLite databases of the
same format, written in the same transaction. Each can rebuild the other, so no single fault
(a file deleted, its pages damaged, its -wal deleted or torn) loses an acknowledged write.

Rules they keep:
- The writer connection opens the database as ``main`` and ATTACHes the copy as ``copy``.
  Every write changes ``main`` through ``ops``; TEMP triggers note each key, field and
  member it touched (``track``); ``mirror`` puts each of those rows into ``copy`` as it is
  in ``main`` now; a durable write's ``bump`` raises the sequence number in both meta
  tables. One transaction, one COMMIT (fsync'd in both WALs when durable). In WAL mode that
  commit is atomic per file, not across them: a crash between the two leaves one file one
  commit behind, and for a durable write its ``seq`` says so.
- A file is judged on a connection of its own (``judge``): there, whole (``quick_check``,
  or ``integrity_check`` after a call met damage) and its ``seq`` — or why not.
- A file is rebuilt from a whole one with one ``INSERT … SELECT`` per table, into a new file
  beside it that is put in place by rename (``rebuild``); the source may be a file at its
  path or what the writer connection still has open (a deleted file is read through it).
- Identity: the inodes of both files and their -wal/-shm, as the writer opened them. A path
  that names another file (or none) means the files it writes are not the ones the next
  process reads.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import urllib.parse
from pathlib import Path
from typing import Callable, NamedTuple

from . import sqlitefile as sf

TABLES = ("entries", "fields", "zsets", "meta")
SCHEMAS = ("main", "copy")


def copy_path(path: Path) -> Path:
    return path.with_name(path.name + ".copy")


def uri(path: Path) -> str:
    return "file:" + urllib.parse.quote(str(path)) + "?mode=rw"


# == identity ==============================================================================

def _inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_dev, st.st_ino)


@functools.lru_cache(maxsize=64)
def _names(path: Path) -> tuple[str, ...]:
    """The six paths an identity names (``Identity.of`` runs before every commit: pathlib's
    ``with_name`` and the f-strings were 0.6 % of the router's CPU under load, issue 22)."""
    c = str(copy_path(path))
    return (str(path), f"{path}-wal", f"{path}-shm", c, f"{c}-wal", f"{c}-shm")


class Identity(NamedTuple):
    inodes: tuple   # database, -wal, -shm, copy, copy -wal, copy -shm

    NAMES = ("database file", "-wal", "-shm", "copy", "copy's -wal", "copy's -shm")

    @classmethod
    def of(cls, path: Path) -> "Identity":
        return cls(tuple(_inode(p) for p in _names(path)))

    def differs(self, now: "Identity") -> str | None:
        """Why ``now`` (what the paths name) is not this (what we opened), or None."""
        for name, mine, there in zip(self.NAMES, self.inodes, now.inodes):
            if mine != there:
                return f"its {name} was {'deleted' if there is None else 'replaced'}"
        return None

    def stale(self, now: "Identity", which: int) -> str | None:
        """File ``which`` (0: database, 1: copy) is still the one we opened but its -wal or
        -shm is not: what the path reads is not what we wrote (a deleted -wal takes commits
        with it; a second -shm is a second index over one WAL). It is rebuilt, never judged."""
        i = 3 * which
        if self.inodes[i] == now.inodes[i] and self.inodes[i:i + 3] != now.inodes[i:i + 3]:
            return self.differs(now)
        return None


# == writing both =========================================================================

# What a write touched, recorded by SQLite itself: TEMP triggers on main's tables (a TEMP
# trigger may write a TEMP table; it could not write ``copy``'s, whose names it cannot
# qualify) note every key, field and member inserted, updated or deleted — also those that
# ``entries``' own trigger deletes with a key, and an expired key dropped when touched.
# ``touched(t, key, sub)``: t 0 a key (entries), 1 a field (fields), 2 a member (zsets).
_TRACKED = (("entries", "NULL"), ("fields", "field"), ("zsets", "member"))


def track(c: sqlite3.Connection) -> None:
    """Make ``c`` (the writer, with ``copy`` attached) note what each write touches."""
    c.execute("PRAGMA temp_store = MEMORY")
    # no key on it: the statement that fires a trigger imposes its conflict policy on the
    # trigger's own INSERT (an upsert's would fail it); a note twice is harmless
    c.execute("CREATE TEMP TABLE IF NOT EXISTS touched (t INTEGER, key TEXT, sub TEXT)")
    for t, (table, sub) in enumerate(_TRACKED):
        for event, row in (("INSERT", "new"), ("UPDATE", "new"), ("DELETE", "old")):
            col = "NULL" if sub == "NULL" else f"{row}.{sub}"
            c.execute(f"CREATE TEMP TRIGGER IF NOT EXISTS track_{table}_{event.lower()} AFTER {event} "
                      f"ON main.{table} BEGIN INSERT INTO touched VALUES ({t}, {row}.key, {col}); END")


def mirror(c: sqlite3.Connection) -> None:
    """Put every row the write touched into ``copy`` as it is in ``main`` now (inside the
    write's transaction), then forget the notes. Only the tables it touched are visited."""
    kinds = {t for (t,) in c.execute("SELECT DISTINCT t FROM temp.touched")}
    if 0 in kinds:
        keys = "(SELECT key FROM temp.touched WHERE t = 0)"
        c.execute(f"DELETE FROM copy.entries WHERE key IN {keys} "
                  "AND key NOT IN (SELECT key FROM main.entries)")      # copy's trigger takes their members
        c.execute(f"INSERT INTO copy.entries SELECT * FROM main.entries WHERE key IN {keys} "
                  "ON CONFLICT (key) DO UPDATE SET kind = excluded.kind, value = excluded.value, "
                  "expires_at = excluded.expires_at")                    # an upsert: it keeps the key's members
    for t, (table, sub) in enumerate(_TRACKED):
        if t and t in kinds:
            rows = f"(key, {sub}) IN (SELECT key, sub FROM temp.touched WHERE t = {t})"
            c.execute(f"DELETE FROM copy.{table} WHERE {rows}")
            c.execute(f"INSERT INTO copy.{table} SELECT * FROM main.{table} WHERE {rows}")
    if kinds:
        c.execute("DELETE FROM temp.touched")


def delete_expired(c: sqlite3.Connection, now: float, limit: int = -1) -> int:
    """Drop expired keys from both (the triggers take their fields and members)."""
    n = c.execute("DELETE FROM main.entries WHERE key IN "
                  "(SELECT key FROM main.entries WHERE expires_at <= ? LIMIT ?)", (now, limit)).rowcount
    if n:
        mirror(c)
    return n


def set_meta(c: sqlite3.Connection, name: str, value) -> None:
    for schema in SCHEMAS:
        c.execute(f"INSERT INTO {schema}.meta (name, value) VALUES (?, ?) "
                  "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (name, value))


def bump(c: sqlite3.Connection) -> None:
    """Raise the sequence number in both (``start`` made the rows)."""
    c.execute("UPDATE main.meta SET value = value + 1 WHERE name = 'seq'")
    c.execute("UPDATE copy.meta SET value = (SELECT value FROM main.meta WHERE name = 'seq') WHERE name = 'seq'")


def start(c: sqlite3.Connection) -> None:
    """The sequence rows, where a file has none yet (new, or of the previous release)."""
    for schema in SCHEMAS:
        c.execute(f"INSERT INTO {schema}.meta (name, value) VALUES ('seq', 0) ON CONFLICT (name) DO NOTHING")


def seq(c: sqlite3.Connection, schema: str = "main") -> int:
    row = c.execute(f"SELECT value FROM {schema}.meta WHERE name = 'seq'").fetchone()
    return int(row[0]) if row else 0


def attach(c: sqlite3.Connection, path: Path, as_: str = "copy") -> None:
    c.execute("ATTACH DATABASE ? AS " + as_, (uri(path),))


# == judging and rebuilding ===============================================================

class Verdict(NamedTuple):
    seq: int | None       # None: not whole
    why: str | None       # None: whole; "missing"; or what is wrong


def check(c: sqlite3.Connection, schema: str = "main", full: bool = False) -> str | None:
    """None if the pages are whole; what is wrong otherwise. ``full``: also that every index
    agrees with its table (``integrity_check``: slower; an index that disagrees passes
    ``quick_check`` and raises "malformed" on the keys it covers)."""
    try:
        rows = [r[0] for r in c.execute(f"PRAGMA {schema}.{'integrity_check(3)' if full else 'quick_check'}")]
    except sqlite3.DatabaseError as exc:
        if sf.is_damage(exc):
            return str(exc)
        raise
    return sf.verdict(rows)


def judge(path: Path, connect: Callable[[Path], sqlite3.Connection], full: bool = False) -> Verdict:
    """A file at its path, on a connection of its own: made WAL and upgraded like any open
    (a newer format raises StoreVersionError, another program's StoreError), checked, and
    its sequence read."""
    if not path.exists():
        return Verdict(None, "missing")
    try:
        conn = connect(path)
    except sqlite3.DatabaseError as exc:
        if sf.is_damage(exc):
            return Verdict(None, str(exc))
        raise
    try:
        try:
            sf.init_db(conn, path, quick_check=False)
            why = check(conn, full=full)
            return Verdict(seq(conn), None) if why is None else Verdict(None, why)
        except sf.Unreadable as exc:
            return Verdict(None, str(exc))
        except sqlite3.DatabaseError as exc:
            if sf.is_damage(exc):
                return Verdict(None, str(exc))
            raise
    finally:
        conn.close()


def rebuild(src: sqlite3.Connection, schema: str, dest: Path) -> int:
    """Make ``dest`` anew from ``schema`` of ``src`` (a whole file): a new file beside it,
    filled with one INSERT … SELECT per table in one transaction (which also holds the
    source's write lock, so no commit slips between the copy and the rename), fsync'd, put
    in place of whatever is at ``dest``. Returns how many keys it holds."""
    tmp = new_file(dest)
    try:
        attach(src, tmp, "fresh")
        try:
            def fill(c: sqlite3.Connection) -> int:
                for t in TABLES:
                    c.execute(f"INSERT OR REPLACE INTO fresh.{t} SELECT * FROM {schema}.{t}")
                return c.execute("SELECT count(*) FROM fresh.entries").fetchone()[0]
            n = sf.txn(src, fill, durable=True)
        finally:
            src.execute("DETACH DATABASE fresh")
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)   # no SQLite connection has it now
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        put_in_place(tmp, dest)
    except BaseException:
        for p in (tmp, Path(f"{tmp}-journal")):
            p.unlink(missing_ok=True)
        raise
    return n


def new_file(beside: Path) -> Path:
    """A new, empty database of our format (rollback-journal mode: one file to rename),
    0600, under a name of its own beside ``beside``."""
    n = 0
    while True:
        tmp = beside.with_name(f"{beside.name}.new-{os.getpid()}-{n}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600))
            break
        except FileExistsError:
            n += 1
    conn = sqlite3.connect(uri(tmp), uri=True, isolation_level=None)
    try:
        sf.txn(conn, lambda c: sf.make_schema(c, tmp), durable=True)
    finally:
        conn.close()
    return tmp


def put_in_place(tmp: Path, path: Path) -> None:
    """Replace whatever is at ``path`` with ``tmp``. Its -wal/-shm (which belong to the file
    that was there) go first, so no connection can pair the new file with them."""
    for stale in (Path(f"{path}-wal"), Path(f"{path}-shm"), path):
        stale.unlink(missing_ok=True)
    os.rename(tmp, path)
    sf.fsync_dir(path.parent)
