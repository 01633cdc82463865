"""The decision journal: a second, append-only copy of every durable write, beside the database.

The database is the store; the journal is what lets an acknowledged durable write survive
the loss or damage of the database file (or its -wal) alone, and the database is what
rebuilds a lost or damaged journal. The store knows nothing of pins: the journal is
generic over durable writes and holds only what they hold.

Format (``<db>.journal``, 0600, beside the database): lines of ``<crc32 hex8> <json>\\n``.
- line 1, the header: ``{"sessionpin_journal": 1, "base": S, "keys": n, "at": t}``;
- then ``n`` snapshot lines, each one key's whole state as of sequence ``S``:
  ``["put", key, kind, value, expires_at]`` (value: the string, ``{field: value}`` or
  ``{member: score}``);
- then one line per durable transaction: ``{"s": seq, "at": t, "w": [entry, ...]}``, each
  entry saying what a key, field or member *is* after the write (``ops.py``): ``put``,
  ``del``, ``exp``, ``hset``, ``hdel``, ``zadd``, ``zrem``, ``zremr``.

Rules it keeps:
- Order: a durable write appends and fsyncs its line inside its database transaction,
  after its changes and before ``COMMIT``, with the store's lock file held (filelock.py)
  from before ``BEGIN`` until after the commit or the rollback. If the append or the commit
  fails, the journal is cut back to its length before the append: a write that raises
  leaves nothing here either. ``seq`` is the database's ``meta.journal_seq`` + 1, bumped
  in the same transaction, so the database knows how much of the journal it holds.
- Replay: a line whose ``seq`` is not above an earlier line's supersedes it (the earlier
  one's transaction never committed: a crash between append and commit, or a cut that
  failed). Lines with ``seq`` above the database's are replayed into it; the snapshot too
  when the database is older than the snapshot (a fresh one after a loss has 0).
- A torn last line (a crash mid-append) is skipped and cut off before the next append,
  never "damage"; a bad line with good lines after it is damage: the journal is set aside
  and rebuilt from the database.
- Compaction rewrites it as a snapshot of the live durable keys (temp file, fsync,
  rename, directory fsync) under the lock file; another process notices the new inode
  and reopens it before its next append.
- While the store runs, ``Verifier`` looks at it now and then without the lock (the
  keeper's background thread): damage (a bad line with good lines after it) is only a
  suspicion until confirmed under the lock file; the keeper then sets it aside and
  rebuilds it from the database, as at open. A compaction that reads damage says so
  (``Verifier.seen``) rather than leaving it for the next open.
"""

from __future__ import annotations

import errno
import json
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .base import StoreVersionError
from .memory import HASH, STRING, ZSET
from . import safefile
from .filelock import same_file
from .sqlitefile import fsync_dir

JOURNAL_VERSION = 1


def encode(obj: Any) -> bytes:
    payload = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


def decode(line: bytes) -> Any:
    """The object of one line (without its newline), or None if it is not a good line."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    payload = line[9:]
    try:
        if int(line[:8], 16) != zlib.crc32(payload):
            return None
        return json.loads(payload)
    except ValueError:
        return None


@dataclass
class Record:
    seq: int
    at: float
    entries: list


@dataclass
class Parsed:
    version: int = 0
    base: int = 0
    at: float | None = None
    snapshot: list = field(default_factory=list)     # [["put", key, kind, value, x], ...]
    records: list[Record] = field(default_factory=list)
    good_bytes: int = 0          # the length up to the end of the last good line
    snapshot_end: int = 0        # the length of the header and the snapshot
    torn: bool = False           # bytes after it (a crash mid-append)
    damaged: str | None = None   # why it cannot be trusted whole

    @property
    def last_seq(self) -> int:
        return self.records[-1].seq if self.records else self.base


def parse(data: bytes) -> Parsed:
    out = Parsed()
    lines = data.split(b"\n")
    lines.pop()                  # after the last newline: empty, or a torn line
    offset, bad_at, want = 0, None, None
    records: list[Record] = []
    for line in lines:
        end = offset + len(line) + 1
        obj = decode(line)
        if obj is None:
            if bad_at is None:
                bad_at = offset
            offset = end
            continue
        if bad_at is not None and out.damaged is None:
            out.damaged = f"bad line at byte {bad_at}"
        bad_at = None
        if offset == 0:
            if not (isinstance(obj, dict) and "sessionpin_journal" in obj):
                out.damaged = out.damaged or "no header"
            else:
                out.version, out.base = int(obj["sessionpin_journal"]), int(obj.get("base", 0))
                out.at, want = obj.get("at"), int(obj.get("keys", 0))
                out.snapshot_end = end
        elif isinstance(obj, list) and not records:
            out.snapshot.append(obj)
            out.snapshot_end = end
        elif isinstance(obj, dict) and "s" in obj:
            if want is not None and len(out.snapshot) != want and out.damaged is None:
                out.damaged = f"snapshot has {len(out.snapshot)} of {want} keys"
            records.append(Record(int(obj["s"]), float(obj["at"]), obj["w"]))
        elif out.damaged is None:
            out.damaged = f"unexpected line at byte {offset}"
        out.good_bytes = end
        offset = end
    if data and out.version == 0 and out.damaged is None:
        out.damaged = "no header"
    if want is not None and not records and len(out.snapshot) != want and out.damaged is None:
        out.damaged = f"snapshot has {len(out.snapshot)} of {want} keys"
    out.torn = len(data) > out.good_bytes
    kept: list[Record] = []
    for r in records:            # a seq not above an earlier one's: that one never committed
        while kept and kept[-1].seq >= r.seq:
            kept.pop()
        if r.seq > out.base:
            kept.append(r)
    out.records = kept
    return out


# == folding entries into states (kind, value, expires_at) ================================

def fold(states: dict, entries: Iterable[list], at: float) -> None:
    """Apply one transaction's entries, made at ``at``, to ``states`` (mutated)."""
    for e in entries:
        op, key = e[0], e[1]
        cur = states.get(key)
        if cur is not None and cur[2] is not None and cur[2] <= at:
            cur = None                           # expired before this write: gone
        new = cur
        if op == "put":
            kind, value = e[2], e[3]
            new = (kind, value if kind == STRING else dict(value), e[4])
        elif op == "del":
            new = None
        elif op == "exp":
            new = None if cur is None else (cur[0], cur[1], e[2])
        elif op in ("hset", "zadd"):
            kind = HASH if op == "hset" else ZSET
            members = cur[1] if cur is not None and cur[0] == kind else {}
            members[e[2]] = e[3]
            new = (kind, members, e[4])
        elif op in ("hdel", "zrem", "zremr") and cur is not None and cur[0] == (HASH if op == "hdel" else ZSET):
            if op == "zremr":
                for m in [m for m, s in cur[1].items() if e[2] <= s <= e[3]]:
                    del cur[1][m]
            else:
                cur[1].pop(e[2], None)
            new = cur if cur[1] else None
        if new is None:
            states.pop(key, None)
        else:
            states[key] = new


def touched(entries: Iterable[list]) -> set[str]:
    return {e[1] for e in entries}


def _last_line(fd: int, size: int) -> tuple[int, bytes]:
    """(offset, bytes without the newline) of the last line of a file ending in a newline."""
    end = size - 1                       # where the final newline is
    pos, buf, chunk = max(end, 0), b"", 4096
    while pos > 0:                       # buf holds the bytes [pos, end)
        take = min(chunk, pos)
        pos -= take
        buf = os.pread(fd, take, pos) + buf
        nl = buf.rfind(b"\n")
        if nl >= 0:
            return pos + nl + 1, buf[nl + 1:]
        chunk *= 2
    return 0, buf


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def header_base(fd: int) -> int:
    first = os.pread(fd, 65536, 0).split(b"\n", 1)[0]
    obj = decode(first)
    return int(obj.get("base", 0)) if isinstance(obj, dict) else 0


class Journal:
    """The journal of one store. Appends, cuts and replacements are made with the store's
    ``FileLock`` held (the caller holds it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self.live_bytes = 0              # its size after the last snapshot we wrote or read
        self.last_compaction: float | None = None
        self.last_rebuild: dict | None = None
        self.verifier = Verifier(path)

    @staticmethod
    def check_version(path: Path) -> None:
        """Refuse a journal of a newer format before anything is written."""
        try:
            with os.fdopen(safefile.open_file(path, os.O_RDONLY), "rb") as f:
                first = f.readline(4096)
        except (FileNotFoundError, NotADirectoryError):
            return
        obj = decode(first.rstrip(b"\n"))
        if isinstance(obj, dict) and int(obj.get("sessionpin_journal", 0)) > JOURNAL_VERSION:
            raise StoreVersionError(
                f"{path} was written by a newer sessionpin (journal format {obj['sessionpin_journal']}, "
                f"this one reads {JOURNAL_VERSION}); upgrade sessionpin or point the store elsewhere. "
                "The files were left untouched.")

    def current(self) -> bool:
        """Make our descriptor name the file at the path (another process may have replaced
        it); False if there is none."""
        if self._fd is not None and same_file(self.path, self._fd):
            return True
        try:
            fd = safefile.open_file(self.path, os.O_RDWR | os.O_APPEND)    # never a link's target
        except (FileNotFoundError, NotADirectoryError):
            return False                 # our descriptor is kept: a deleted journal is restored from it
        had = self._fd is not None
        self.close()
        self._fd = fd
        if had:                          # another process compacted it: it is about this size live
            self.live_bytes = self.size()
        return True

    def read_deleted(self) -> bytes | None:
        """What the journal our descriptor names holds, if our path no longer names that
        file: deleted, or moved away with its directory (``mv``, or a delete that renames
        first: it still has a name, elsewhere, but it is gone from here); None otherwise."""
        if self._fd is None:
            return None
        st = os.fstat(self._fd)
        if st.st_nlink:
            try:
                here = os.stat(self.path)
            except FileNotFoundError:
                here = None
            if here is not None and (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino):
                return None
        return os.pread(self._fd, st.st_size, 0) if st.st_size else b""

    def restore(self, data: bytes) -> None:
        """Put ``data`` (a deleted journal's bytes) in place as the journal: temp file,
        fsync, rename, directory fsync."""
        tmp, fd = self._new_temp()
        try:
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
        except BaseException:
            _unlink(tmp)
            raise
        self.put_in_place(tmp)

    def read_open(self) -> Parsed:
        """The journal our descriptor names (so what we parse is the file whose inode we
        check later, even if another process renames a new one in meanwhile)."""
        size = self.size()
        parsed = parse(os.pread(self._fd, size, 0) if size else b"")
        if parsed.damaged:               # compaction saw it: the keeper rebuilds it at once
            self.verifier.seen = parsed.damaged
        return parsed

    def read(self) -> Parsed | None:
        """The journal as it is on disk (None: there is none)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        parsed = parse(data)
        if parsed.version > JOURNAL_VERSION:
            self.check_version(self.path)
        return parsed

    def inode(self) -> int | None:
        return os.fstat(self._fd).st_ino if self._fd is not None else None

    @staticmethod
    def sync_file(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def size(self) -> int:
        return os.fstat(self._fd).st_size if self._fd is not None else 0

    def append(self, seq: int, at: float, entries: list) -> int:
        """Append one durable transaction's line and fsync it (after ``settle``); return the
        length before, for ``cut``."""
        fd = self._fd
        size = os.fstat(fd).st_size
        line = encode({"s": seq, "at": at, "w": entries})
        written = os.write(fd, line)
        if written != len(line):
            os.ftruncate(fd, size)
            raise OSError(errno.EIO, f"{self.path}: short write to the journal")
        os.fdatasync(fd)
        return size

    def settle(self, db_seq: int) -> int:
        """Before an append: cut a torn tail and the lines of transactions above ``db_seq``
        (they never committed: the caller has checked that the database is the file it has
        open, at ``db_seq``); return the sequence of the last line left."""
        fd = self._fd
        size = end = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            size = parse(self.path.read_bytes()).good_bytes
        last = None
        while size > 0:
            start, line = _last_line(fd, size)
            obj = decode(line)
            if isinstance(obj, dict) and "s" in obj:
                if int(obj["s"]) > db_seq:
                    size = start                 # a dead line: drop it
                    continue
                last = int(obj["s"])
            elif isinstance(obj, dict) and "sessionpin_journal" in obj:
                last = int(obj.get("base", 0))
            break
        if last is None:                         # a snapshot line last: the header's base
            last = header_base(fd)
        if size != end:
            os.ftruncate(fd, size)
            os.fdatasync(fd)
        return last

    def lines_after(self, seq: int) -> bytes:
        """The lines at the end whose sequence is above ``seq``, as they are (a torn
        fragment after them is left out)."""
        fd = self._fd
        end = os.fstat(fd).st_size
        if end and os.pread(fd, 1, end - 1) != b"\n":
            end = parse(self.path.read_bytes()).good_bytes
        pos = end
        while pos > 0:
            start, line = _last_line(fd, pos)
            obj = decode(line)
            if not (isinstance(obj, dict) and "s" in obj and int(obj["s"]) > seq):
                break
            pos = start
        return os.pread(fd, end - pos, pos) if end > pos else b""

    def cut(self, size: int) -> None:
        """Take back what the last append added (its transaction did not commit)."""
        os.ftruncate(self._fd, size)
        os.fdatasync(self._fd)

    def replace(self, base: int, at: float, states: Iterable[tuple[str, tuple]]) -> int:
        """Write a new journal holding ``states`` as of sequence ``base``, atomically in place
        of the old one (temp file, fsync, rename, directory fsync); return how many keys."""
        tmp, n = self.write_snapshot(base, at, states)
        self.put_in_place(tmp)
        return n

    def write_snapshot(self, base: int, at: float, states: Iterable[tuple[str, tuple]]) -> tuple[Path, int]:
        """A new journal file beside this one (not yet in place, not yet fsync'd); its path
        and how many keys it holds."""
        lines = [encode(["put", key, kind, value, x]) for key, (kind, value, x) in states]
        header = encode({"sessionpin_journal": JOURNAL_VERSION, "base": base, "keys": len(lines), "at": at})
        tmp, fd = self._new_temp()
        try:
            try:
                _write_all(fd, header)
                for i in range(0, len(lines), 1000):
                    _write_all(fd, b"".join(lines[i:i + 1000]))
            finally:
                os.close(fd)
        except BaseException:
            _unlink(tmp)
            raise
        return tmp, len(lines)

    def _new_temp(self) -> tuple[Path, int]:
        """A new file beside the journal (0600, a name no other process uses) and its descriptor."""
        n = 0
        while True:
            candidate = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}-{n}")
            try:
                return candidate, os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                n += 1

    def put_in_place(self, tmp: Path, tail: bytes = b"") -> None:
        """Append ``tail`` (lines made since the snapshot) to ``tmp``, fsync it and rename it
        over the journal, then fsync the directory."""
        try:
            fd = safefile.open_file(tmp, os.O_WRONLY | os.O_APPEND)
            try:
                if tail:
                    _write_all(fd, tail)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self.path)
        except BaseException:
            _unlink(tmp)
            raise
        fsync_dir(self.path.parent)
        self.current()
        self.live_bytes = self.size()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# == verifying it while the store runs ====================================================

VERIFY_SHARE = 0.02      # a verification that took t waits t / VERIFY_SHARE before the next
CHUNK = 1 << 20


def _bad(line: bytes) -> bool:
    """Whether one line (without its newline) fails its checksum (no JSON is read)."""
    try:
        return len(line) < 10 or line[8:9] != b" " or int(line[:8], 16) != zlib.crc32(line[9:])
    except ValueError:
        return True


class Verifier:
    """Notices damage to the journal while the store runs (the keeper's background thread,
    no lock taken): the bytes are read, never parsed as JSON.

    The first look at a file (at start, after a compaction or a rebuild: a new inode)
    checks every line's checksum and the header and snapshot count, as ``parse`` does.
    Later looks check that the bytes already verified still have the same CRC-32 (one
    pass over them in C, 1 MiB at a time) and check only the lines appended since. A file
    whose inode, size, mtime and ctime are those of the last look, and whose ctime was
    over a second old then (a write in the same clock tick as a look changes neither),
    is not read again.

    Appends of other processes racing a look are never damage: a line without its
    newline (being written) and bad lines with no good line after them (torn, or a cut
    being made) are left for the next look, as ``parse`` leaves a torn tail. A verdict of
    damage is only a suspicion: the keeper confirms it under the lock file, where nobody
    appends or cuts, before it sets the file aside."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: str | None = None     # damage a reader of the journal (compaction) saw
        self.failing: str | None = None  # why the last rebuild after damage failed (the keeper's)
        self.cost = 0.0                  # the CPU time of the last look
        self.next_at = 0.0               # monotonic time before which no look is due
        self.reset()

    def reset(self) -> None:
        self._sig: tuple | None = None   # (ino, size, mtime, ctime) of a clean, settled look
        self._ino: int | None = None
        self._end = 0                    # the bytes verified: whole good lines up to here
        self._crc = 0                    # their CRC-32
        self._keys: int | None = None    # the header's snapshot count
        self._snap = 0                   # snapshot lines seen
        self._records = False            # a transaction line seen

    def due(self, now: float) -> bool:
        return self.seen is not None or now >= self.next_at

    def check(self) -> str | None:
        """Why the journal at the path is damaged, or None (also when there is none)."""
        started = time.thread_time()
        try:
            return self._check()
        finally:
            self.cost = time.thread_time() - started
            self.next_at = time.monotonic() + self.cost / VERIFY_SHARE

    def _check(self) -> str | None:
        self.seen = None
        try:
            fd = safefile.open_file(self.path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            self.reset()
            return None                  # a missing journal is the keeper's watch's to rebuild
        try:
            st = os.fstat(fd)
            sig = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if sig == self._sig:
                return None
            self._sig = None
            if st.st_ino != self._ino or st.st_size < self._end or self._prefix_crc(fd) != self._crc:
                self.reset()
                self._ino = st.st_ino
            tail = os.pread(fd, st.st_size - self._end, self._end) if st.st_size > self._end else b""
        finally:
            os.close(fd)
        why = self._scan(tail)
        if why is None and self._end == st.st_size and time.time() - st.st_ctime > 1.0:
            self._sig = sig
        elif why is not None:
            self.reset()
        return why

    def _prefix_crc(self, fd: int) -> int:
        crc, pos = 0, 0
        while pos < self._end:
            chunk = os.pread(fd, min(CHUNK, self._end - pos), pos)
            if not chunk:
                return -1                # cut meanwhile
            crc, pos = zlib.crc32(chunk, crc), pos + len(chunk)
        return crc

    def _scan(self, tail: bytes) -> str | None:
        lines = tail.split(b"\n")
        lines.pop()                      # after the last newline: empty, or being written
        pos, good, bad_at = self._end, self._end, None
        for line in lines:
            at, pos = pos, pos + len(line) + 1
            if _bad(line):
                bad_at = at if bad_at is None else bad_at
                continue
            if bad_at is not None:
                return f"bad line at byte {bad_at}"
            kind = line[9:10]
            if at == 0:
                head = decode(line)
                if not (isinstance(head, dict) and "sessionpin_journal" in head):
                    return "no header"
                self._keys = int(head.get("keys", 0))
            elif self._keys is None:
                return "no header"
            elif kind == b"[" and not self._records:
                self._snap += 1
            elif kind == b"{":
                if not self._records and self._snap != self._keys:
                    return f"snapshot has {self._snap} of {self._keys} keys"
                self._records = True
            else:
                return f"unexpected line at byte {at}"
            good = pos
        if good > self._end:
            self._crc = zlib.crc32(memoryview(tail)[:good - self._end], self._crc)
            self._end = good
        if self._keys is not None and not self._records and bad_at is None and self._snap != self._keys:
            return f"snapshot has {self._snap} of {self._keys} keys"
        return None
