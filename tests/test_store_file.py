"""The file store's own promises (sessionpin/store/file.py), beyond the shared Store rules.

Durable commits are fsync'd before they return and ordinary ones within 2 s and on close;
the files are private from the moment they exist; a garbage file is set aside (never over
an earlier one), a newer format is refused untouched, a torn WAL frame is no corruption;
expired rows are dropped at open and swept while running. Processes and faults have their
own files (test_store_processes.py, test_store_faults.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import platformdirs
import pytest

from sessionpin.store import Store, StoreError, StoreVersionError, default_store_url, open_store, open_sync_store
from sessionpin.store.file import APPLICATION_ID, FORMAT_VERSION, FileStore
from sessionpin.store.memory import MemoryStore

ROOT = Path(__file__).resolve().parent.parent


def child(code: str, *args: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=60, **kw)


def raw_rows(path: Path) -> dict:
    """What is in the file, read by a separate connection (not through the store)."""
    c = sqlite3.connect(path)
    try:
        strings = {k: (v, e) for k, v, e in c.execute("SELECT key, value, expires_at FROM entries WHERE kind = 's'")}
        fields = {(k, f): v for k, f, v in c.execute("SELECT key, field, value FROM fields")}
        return {"strings": strings, "fields": fields}
    finally:
        c.close()


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# == open_store and URLs ==================================================================

async def test_open_store_urls(tmp_path, monkeypatch):
    m = open_store("memory:")
    assert isinstance(m, Store) and m.url == "memory:" and isinstance(m.backend, MemoryStore)
    f = open_store(f"file:{tmp_path}/f.db")
    assert isinstance(f, Store) and isinstance(f.backend, FileStore)
    await f.close()
    monkeypatch.chdir(tmp_path)
    rel = open_sync_store("file:rel/state.db")
    assert rel.path == tmp_path / "rel" / "state.db" and rel.url == "file:rel/state.db"
    rel.close()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = open_sync_store("file:~/s/state.db")
    assert home.path == tmp_path / "home" / "s" / "state.db"
    home.close()
    absolute = open_sync_store(f"file://{tmp_path}/abs.db")
    assert absolute.path == tmp_path / "abs.db"
    absolute.close()


@pytest.mark.parametrize("url, words", [
    ("redis://localhost:6379/0?nope=1", "unknown option 'nope'"),   # redis:// itself is a store now
    ("ftp://x", "unknown scheme"),
    ("state.db", "no scheme"),
    ("file:", "names no file"),
    ("memory:/x", "takes no path"),
])
def test_open_store_refuses(url, words):
    with pytest.raises(StoreError, match=words):
        open_store(url)


def test_default_store_url(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    url = default_store_url()
    assert url == f"file:{platformdirs.user_state_dir('sessionpin')}/state.db"
    assert url == f"file:{tmp_path}/state/sessionpin/state.db"
    s = open_sync_store(url)
    s.set("a", "1", durable=True)
    s.close()
    assert stat.S_IMODE((tmp_path / "state" / "sessionpin").stat().st_mode) == 0o700


# == permissions ==========================================================================

def test_modes(tmp_path):
    d = tmp_path / "new" / "dir"
    s = FileStore(d / "state.db")
    s.set("a", "1")
    for name in ("state.db", "state.db-wal", "state.db-shm"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    s.close()


MODES_CHILD = r"""
import os, sys, stat, threading, time
os.umask(0)                                    # nothing masks: the modes are ours alone
from sessionpin.store.file import FileStore
path = sys.argv[1]
watched = [os.path.dirname(path), path, path + "-wal", path + "-shm", path + ".copy", path + ".lock"]
seen, stop, passes = {}, [], [0]
def watch():
    while not stop:
        for p in watched:
            try:
                seen.setdefault(p, set()).add(stat.S_IMODE(os.stat(p).st_mode))
            except FileNotFoundError:
                pass
        passes[0] += 1
t = threading.Thread(target=watch); t.start()
s = FileStore(path)
s.set("a", "1"); s.set("b", "2", durable=True)
done = passes[0]
while passes[0] < done + 2:                    # two whole passes with every file there
    time.sleep(0.001)
stop.append(1); t.join()
for p in watched:
    print(os.path.basename(p), sorted(seen.get(p, ())))
s.close()
"""


def test_modes_from_creation_under_umask_0(tmp_path):
    path = tmp_path / "private" / "state.db"
    out = child(MODES_CHILD, str(path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:6] == [
        "private [448]", "state.db [384]", "state.db-wal [384]", "state.db-shm [384]",  # 0700, 0600
        "state.db.copy [384]", "state.db.lock [384]",
    ]


def test_existing_dirs_and_files(tmp_path, monkeypatch):
    # a directory we did not create keeps its mode; our default one is made private
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    FileStore(shared / "s.db").close()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    ours = Path(platformdirs.user_state_dir("sessionpin"))
    ours.mkdir(parents=True)
    os.chmod(ours, 0o755)
    open_sync_store(default_store_url()).close()
    assert stat.S_IMODE(ours.stat().st_mode) == 0o700
    # an existing store file that is readable by others is made 0600
    loose = tmp_path / "loose.db"
    FileStore(loose).close()
    os.chmod(loose, 0o644)
    FileStore(loose).close()
    assert stat.S_IMODE(loose.stat().st_mode) == 0o600


# == durable and ordinary writes reach the disk ============================================

STRACE_CHILD = r"""
import os, sys
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1], flush_interval=3600)
def mark(m): os.write(1, (m + "\n").encode())
s.set("warm", "up", durable=True)
mark("MARK durable-start"); s.set("pin:a", "x", durable=True); mark("MARK durable-end")
mark("MARK ordinary-start"); s.set("seen:a", "y"); s.hincr("h", "n"); mark("MARK ordinary-end")
mark("MARK close-start"); s.close(); mark("MARK close-end")
"""


def strace(tmp_path, code: str, *args: str) -> list[str]:
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    trace = tmp_path / "trace"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        ["strace", "-f", "-qq", "-o", str(trace), "-e", "trace=openat,mkdir,close,fsync,fdatasync,write",
         sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "ptrace" in out.stderr:
        pytest.skip(f"strace cannot trace here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr
    return trace.read_text().splitlines()


def calls(lines: list[str]) -> list[tuple[str, str]]:
    """(pid, whole call) per syscall: strace -f splits a call another thread interrupted
    into "<unfinished ...>" and "<... name resumed>" lines; join them."""
    out, partial = [], {}
    for line in lines:
        pid, call = line.split(None, 1)
        if call.endswith("<unfinished ...>"):
            partial[pid] = call[: -len("<unfinished ...>")].rstrip()
            continue
        if m := re.match(r"<\.\.\. \w+ resumed>\s*(.*)", call):
            call = partial.pop(pid, "") + m[1]
        out.append((pid, call))
    return out


def syncs_between(lines: list[str], start: str, end: str) -> list[str]:
    """Paths fsync'd/fdatasync'd between two markers, following fds through openat/close."""
    fds: dict[tuple[str, str], str] = {}
    inside, synced = False, []
    for pid, call in calls(lines):
        if f'"MARK {start}' in call:
            inside = True
        elif f'"MARK {end}' in call:
            inside = False
        elif m := re.match(r'openat\(AT_FDCWD, "([^"]+)", .*\) = (\d+)$', call):
            fds[pid, m[2]] = m[1]
        elif m := re.match(r"close\((\d+)\)", call):
            fds.pop((pid, m[1]), None)
        elif inside and (m := re.match(r"f(?:data)?sync\((\d+)\)\s*= 0", call)):
            synced.append(fds.get((pid, m[1]), "?"))
    return synced


def test_durable_write_is_fsynced_before_it_returns(tmp_path):
    path = tmp_path / "state.db"
    lines = strace(tmp_path, STRACE_CHILD, str(path))
    assert f"{path}-wal" in syncs_between(lines, "durable-start", "durable-end")
    assert syncs_between(lines, "ordinary-start", "ordinary-end") == []   # NORMAL: no fsync inline
    at_close = syncs_between(lines, "close-start", "close-end")
    assert f"{path}-wal" in at_close and str(path) in at_close and str(tmp_path) in at_close


def test_creation_modes_and_directory_fsync_in_the_syscalls(tmp_path):
    # The modes are given to open()/mkdir() themselves (no window with a wider mode), and
    # the directory is fsync'd after the database file is created and after the WAL is.
    path = tmp_path / "d" / "state.db"
    lines = strace(tmp_path, STRACE_CHILD, str(path))
    mkdirs = [c for _, c in calls(lines) if f'mkdir("{path.parent}"' in c]
    assert mkdirs and all(", 0700)" in c for c in mkdirs)
    first_create = {}   # the first open(O_CREAT) of each file is the one that made it
    for _, line in calls(lines):
        if "O_CREAT" in line and (m := re.search(r'"([^"]+)"', line)) and m[1].startswith(str(path)):
            first_create.setdefault(m[1], line)
    # (-journal: SQLite's rollback journal, used while a new file is filled in rollback mode;
    # both files are made as a new file beside them, then renamed into place)
    made = {re.sub(r"\.new-\d+-\d+$", ".new", name) for name in first_create if not name.endswith("-journal")}
    assert made == {f"{path}-wal", f"{path}-shm", f"{path}.lock", f"{path}.new",
                    f"{path}.copy-wal", f"{path}.copy-shm", f"{path}.copy.new"}
    assert all("O_EXCL" in line for name, line in first_create.items() if name.endswith(".new"))
    for line in first_create.values():
        assert re.search(r", 0600\) = \d+$", line), line
    all_syncs = syncs_between(['0 write(1, "MARK all-start\\n", 15) = 15'] + lines + ['0 write(1, "MARK all-end")'],
                              "all-start", "all-end")
    assert str(path.parent) in all_syncs
    assert str(tmp_path) in all_syncs          # the new directory's entry in its parent


# Page-cache state of a file, from the kernel (cachestat(2), Linux >= 6.5): how many of its
# pages are dirty (not yet on stable storage) or being written back.
class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def unsynced_pages(path: Path) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        cs = _CacheStat()
        if libc.syscall(451, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(cs), 0) != 0:
            err = ctypes.get_errno()
            pytest.skip(f"cachestat(2) unavailable: {os.strerror(err)}")
        return cs.dirty + cs.writeback
    finally:
        os.close(fd)


def on_tmpfs(path: Path) -> bool:
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True).stdout.strip() == "tmpfs"


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on a filesystem that has dirty pages to flush (not tmpfs)."""
    if os.uname().machine != "x86_64":
        pytest.skip("cachestat syscall number is for x86_64")
    if not on_tmpfs(tmp_path):
        yield tmp_path
        return
    if not Path("/var/tmp").is_dir() or on_tmpfs(Path("/var/tmp")):
        pytest.skip("no disk-backed temporary directory: tmpfs has no stable storage to flush to")
    d = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="sessionpin-test-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_ordinary_writes_reach_disk_within_2s(disk_dir):
    path = disk_dir / "state.db"
    s = FileStore(path)
    try:
        s.set("warm", "up", durable=True)
        s.set("seen:a", "x" * 20_000)          # several pages, committed with synchronous=NORMAL
        wal = Path(f"{path}-wal")
        before = unsynced_pages(wal)
        if before == 0:
            pytest.skip("the kernel wrote the pages back before we could look")
        t0 = time.monotonic()
        while unsynced_pages(wal) and time.monotonic() - t0 < 2.0:
            time.sleep(0.05)
        assert unsynced_pages(wal) == 0, "WAL still has dirty pages 2 s after an ordinary write"
        # and another connection (another process would be the same) reads it from the file
        assert raw_rows(path)["strings"]["seen:a"][0] == "x" * 20_000
    finally:
        s.close()


def test_ordinary_writes_reach_disk_on_close(disk_dir):
    path = disk_dir / "state.db"
    s = FileStore(path, flush_interval=3600)   # no background flush: only close can do it
    keep = sqlite3.connect(path)               # another connection keeps the WAL from being removed
    keep.execute("SELECT count(*) FROM sqlite_master").fetchone()
    try:
        s.set("warm", "up", durable=True)
        s.set("seen:a", "y" * 20_000)
        wal = Path(f"{path}-wal")
        if unsynced_pages(wal) == 0:
            pytest.skip("the kernel wrote the pages back before we could look")
        s.close()
        assert unsynced_pages(wal) == 0 and unsynced_pages(path) == 0
        assert raw_rows(path)["strings"]["seen:a"][0] == "y" * 20_000
    finally:
        keep.close()


def test_closed_store_refuses_calls(tmp_path):
    s = FileStore(tmp_path / "s.db")
    s.close()
    s.close()  # twice is fine
    with pytest.raises(StoreError, match="closed"):
        s.get("a")


# == format, version, corruption ==========================================================

def test_format(tmp_path):
    path = tmp_path / "s.db"
    s = FileStore(path)
    s.set("a", "1", 10)
    s.hset("h", "f", "v")
    s.close()
    c = sqlite3.connect(path)
    assert c.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert c.execute("PRAGMA user_version").fetchone()[0] == FORMAT_VERSION
    assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} == {
        "entries", "fields", "zsets", "meta"}
    c.close()
    rows = raw_rows(path)
    assert rows["strings"]["a"][0] == "1" and rows["strings"]["a"][1] > time.time()
    assert rows["fields"] == {("h", "f"): "v"}


def make_newer(path: Path) -> None:
    s = FileStore(path)
    s.set("pin:a", "x", durable=True)
    s.close()
    c = sqlite3.connect(path)
    c.execute(f"PRAGMA user_version = {FORMAT_VERSION + 1}")
    c.close()


def test_newer_version_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "s.db"
    make_newer(path)
    before, names, mtime = path.read_bytes(), listing(tmp_path), path.stat().st_mtime_ns
    with pytest.raises(StoreVersionError, match=rf"newer sessionpin \(store format {FORMAT_VERSION + 1}, "
                                                rf"this one reads {FORMAT_VERSION}\)"):
        open_store(f"file:{path}")
    assert path.read_bytes() == before
    assert listing(tmp_path) == names
    assert path.stat().st_mtime_ns == mtime


def test_newer_version_in_the_wal_is_refused(tmp_path):
    # the header on disk still says 1; the newer version is only in the WAL
    path = tmp_path / "s.db"
    s = FileStore(path)
    s.set("a", "1", durable=True)
    c = sqlite3.connect(path)
    c.execute("PRAGMA wal_autocheckpoint = 0")
    c.execute(f"PRAGMA user_version = {FORMAT_VERSION + 1}")
    with pytest.raises(StoreVersionError):
        FileStore(path)
    c.close()
    s.close()


def test_a_database_of_something_else_is_not_touched(tmp_path):
    path = tmp_path / "other.db"
    c = sqlite3.connect(path)
    c.execute("CREATE TABLE songs (title)")
    c.commit()
    c.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="something else"):
        FileStore(path)
    for pragma in ("user_version = 7", "application_id = 42"):
        c = sqlite3.connect(path)
        c.execute(f"PRAGMA {pragma}")
        c.close()
        before = path.read_bytes()
        with pytest.raises(StoreError, match="another application") as refused:
            FileStore(path)
        assert not isinstance(refused.value, StoreVersionError)
        assert path.read_bytes() == before


def test_garbage_is_set_aside_twice_never_overwritten(tmp_path, caplog):
    path = tmp_path / "state.db"
    asides = []
    for round_, garbage in enumerate([b"not a database at all\n" * 10, b"\x00\xff" * 3000]):
        path.write_bytes(garbage)
        Path(f"{path}-wal").write_bytes(b"wal junk %d" % round_)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sessionpin.store.file"):
            s = open_sync_store(f"file:{path}")
        # the first starts empty; the second is rebuilt from the copy the first wrote
        assert s.keys() == ([] if round_ == 0 else ["fresh"])
        s.set("fresh", str(round_), durable=True)
        s.close()
        new = sorted(set(tmp_path.glob("state.db.corrupt-*")) - set(asides) - {Path(f"{a}-wal") for a in asides})
        aside = [p for p in new if not p.name.endswith("-wal")]
        assert len(aside) == 1
        assert re.fullmatch(r"state\.db\.corrupt-\d{8}T\d{6}Z-\d+-\d+", aside[0].name)
        assert aside[0].read_bytes() == garbage            # moved, not rewritten
        assert Path(f"{aside[0]}-wal").read_bytes() == b"wal junk %d" % round_
        [record] = [r for r in caplog.records if "moved it aside" in r.getMessage()]
        assert str(path) in record.getMessage() and str(aside[0]) in record.getMessage()
        asides.append(aside[0])
    assert asides[0] != asides[1]
    assert asides[0].read_bytes() != asides[1].read_bytes()
    assert FileStore(path).get("fresh") == "1"


def test_set_aside_does_not_overwrite_a_same_second_name(tmp_path, monkeypatch):
    # Same second, same pid: the counter moves on instead of overwriting.
    monkeypatch.setattr(time, "strftime", lambda fmt, t=None: "20260101T000000Z")
    path = tmp_path / "state.db"
    for i in range(3):
        path.write_bytes(b"garbage %d" % i * 20)
        FileStore(path).close()
    names = sorted(p.name for p in tmp_path.glob("state.db.corrupt-*"))
    pid = os.getpid()
    assert names == [f"state.db.corrupt-20260101T000000Z-{pid}-{n}" for n in range(3)]
    assert {(tmp_path / n).read_bytes() for n in names} == {b"garbage %d" % i * 20 for i in range(3)}


def test_damaged_pages_are_set_aside(tmp_path, caplog):
    path = tmp_path / "state.db"
    s = FileStore(path)
    for i in range(2000):
        s.set(f"k{i}", "v" * 50)
    s.close()
    data = bytearray(path.read_bytes())
    assert len(data) > 8 * 4096
    data[4096 * 3: 4096 * 6] = os.urandom(4096 * 3)    # pages 4-6: keep the header valid
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="sessionpin.store.file"):
        s = FileStore(path)
    got = {k: s.get(k) for k in s.keys()}                # ordinary writes too: the copy has them all
    assert got == {f"k{i}": "v" * 50 for i in range(2000)}
    s.close()
    assert any("moved it aside" in r.getMessage() for r in caplog.records)
    assert any("rebuilt its database from the copy" in r.getMessage() for r in caplog.records)
    assert len(list(tmp_path.glob("state.db.corrupt-*"))) == 1


TORN_CHILD = r"""
import os, signal, sys
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
for i in range(40):
    s.set(f"k{i}", str(i), durable=True)
os.kill(os.getpid(), signal.SIGKILL)              # a crash: no close, no checkpoint
"""


@pytest.mark.parametrize("which", ["database", "copy"])
@pytest.mark.parametrize("tear", ["truncate", "scribble"])
def test_torn_wal_frame_loses_no_acknowledged_commit(tmp_path, caplog, tear, which):
    path = tmp_path / "state.db"
    out = child(TORN_CHILD, str(path))
    assert out.returncode == -signal.SIGKILL, out.stderr
    wal = Path(f"{path}-wal" if which == "database" else f"{path}.copy-wal")
    size = wal.stat().st_size
    assert size > 40 * 4096                                # the commits are in the WAL only
    if tear == "truncate":
        os.truncate(wal, size - 1000)                      # the last frame is cut mid-page
    else:
        with open(wal, "r+b") as f:                        # the last frame's bytes are half written
            f.seek(size - 1000)
            f.write(os.urandom(500))
    with caplog.at_level(logging.WARNING, logger="sessionpin.store.file"):
        s = FileStore(path)
    # SQLite drops the torn commit; the other file still holds it (it was acknowledged), and
    # the store rebuilds the torn one from it, saying so
    assert [s.get(f"k{i}") for i in range(40)] == [str(i) for i in range(40)]
    s.set("after", "1", durable=True)
    s.close()
    assert not list(tmp_path.glob("*.corrupt-*"))
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    other = "copy" if which == "database" else "database"
    assert f"rebuilt its {which} from the {other}" in warning and "behind (sequence 39 of 40)" in warning
    assert FileStore(path).get("after") == "1"


# == expiry ==============================================================================

class Clock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t


def count_rows(path: Path) -> tuple[int, int]:
    c = sqlite3.connect(path)
    try:
        return (c.execute("SELECT count(*) FROM entries").fetchone()[0],
                c.execute("SELECT count(*) FROM fields").fetchone()[0])
    finally:
        c.close()


def test_expired_rows_are_dropped_on_load(tmp_path):
    clock = Clock()
    path = tmp_path / "s.db"
    s = FileStore(path, clock=clock, sweep_interval=3600)
    for i in range(300):
        s.set(f"short{i}", "x", 10)
        s.hset(f"hash{i}", "f", "v")
        s.expire(f"hash{i}", 10)
    s.set("long", "x", 1000)
    s.set("forever", "x")
    s.close()
    assert count_rows(path) == (602, 300)
    clock.t += 10
    s = FileStore(path, clock=clock, sweep_interval=3600)
    assert count_rows(path) == (2, 0)                      # gone from the file, not just hidden
    assert s.keys() == ["forever", "long"]
    s.close()


def test_expired_rows_are_swept_while_running(tmp_path):
    clock = Clock()
    path = tmp_path / "s.db"
    s = FileStore(path, clock=clock, sweep_interval=0.05, sweep_batch=100)
    try:
        for i in range(1000):
            s.set(f"short{i}", "x", 5)
        s.hset("h", "f", "v")
        s.expire("h", 5)
        s.set("keep", "x")
        clock.t += 5
        assert s.keys() == ["keep"]                        # absent at once...
        t0 = time.monotonic()
        while count_rows(path) != (1, 0) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert count_rows(path) == (1, 0)                  # ...and deleted soon after, in batches
    finally:
        s.close()


def test_sweep_is_bounded(tmp_path):
    clock = Clock()
    s = FileStore(tmp_path / "s.db", clock=clock, sweep_interval=3600, sweep_batch=50)
    for i in range(120):
        s.set(f"k{i}", "x", 1)
    clock.t += 1
    assert s.sweep(limit=70) == 70
    assert s.sweep() == 50                                 # 50, then the last batch of 0 ends it
    assert s.sweep() == 0
    s.close()


def test_memory_store_sweeps_too():
    clock = Clock()
    m = MemoryStore(clock=clock)
    for i in range(100):
        m.set(f"k{i}", "x", 1)
    clock.t += 11
    m.set("new", "x")
    assert len(m._data) == 1


def test_text_that_is_not_unicode_is_a_store_error(tmp_path):
    s = FileStore(tmp_path / "s.db")
    with pytest.raises(StoreError, match="Unicode"):
        s.set("pin:\ud800", "x")
    with pytest.raises(StoreError, match="Unicode"):
        s.get("pin:\ud800")
    assert s.describe()["healthy"]
    s.close()


# == upgrade from the previous release's format ===========================================

V1_SCHEMA = [   # sessionpin's store format 1, as the previous release wrote it
    """CREATE TABLE entries (
    key        TEXT PRIMARY KEY,
    kind       TEXT NOT NULL CHECK (kind IN ('s', 'h')),
    value      TEXT,            -- the string; NULL for a hash
    expires_at REAL             -- epoch seconds; NULL: no TTL
) WITHOUT ROWID""",
    "CREATE INDEX entries_expiry ON entries (expires_at) WHERE expires_at IS NOT NULL",
    """CREATE TABLE fields (
    key   TEXT NOT NULL,
    field TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (key, field)
) WITHOUT ROWID""",
    """CREATE TRIGGER entries_drop_fields AFTER DELETE ON entries
    BEGIN
        DELETE FROM fields WHERE key = old.key;
    END""",
]


def make_v1(path: Path, n: int = 500) -> dict:
    """A version-1 store holding ``n`` pins and ``n // 10`` hashes; what it holds."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))     # that release made it 0600 too
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("PRAGMA journal_mode = WAL")
    c.execute("BEGIN IMMEDIATE")
    for statement in V1_SCHEMA:
        c.execute(statement)
    c.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    c.execute("PRAGMA user_version = 1")
    later = time.time() + 86_400
    strings = {f"pin:{i}": (f"server-{i % 3}", later if i % 2 else None) for i in range(n)}
    c.executemany("INSERT INTO entries VALUES (?, 's', ?, ?)", ((k, v, x) for k, (v, x) in strings.items()))
    hashes = {f"seen:{i}": {"requests": str(i), "last": "x"} for i in range(n // 10)}
    c.executemany("INSERT INTO entries VALUES (?, 'h', NULL, ?)", ((k, later) for k in hashes))
    c.executemany("INSERT INTO fields VALUES (?, ?, ?)",
                  ((k, f, v) for k, fs in hashes.items() for f, v in fs.items()))
    c.execute("COMMIT")
    c.close()
    return {"strings": strings, "hashes": hashes}


def test_a_version_1_file_is_upgraded_in_place_keeping_every_key(tmp_path, caplog):
    path = tmp_path / "state.db"
    held = make_v1(path)
    inode = path.stat().st_ino
    with caplog.at_level(logging.WARNING, logger="sessionpin.store.file"):
        s = FileStore(path)
    try:
        assert path.stat().st_ino == inode and not list(tmp_path.glob("*.corrupt-*"))   # in place
        for k, (v, x) in held["strings"].items():
            assert s.get(k) == v, k
            assert (s.ttl(k) is None) == (x is None), k
        for k, fields in held["hashes"].items():
            assert s.hgetall(k) == fields
        assert len(s.keys()) == len(held["strings"]) + len(held["hashes"])
        s.zadd("index:server-0", "pin:0", 1.0, durable=True)     # the new type works
        s.delete("seen:3")                                       # the new trigger takes fields
        assert s.zrange("index:server-0", 0, 2) == [("pin:0", 1.0)]
    finally:
        s.close()
    c = sqlite3.connect(path)
    assert c.execute("PRAGMA user_version").fetchone()[0] == FORMAT_VERSION
    assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert c.execute("SELECT count(*) FROM fields WHERE key = 'seen:3'").fetchone()[0] == 0
    assert {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")} == {
        "entries_drop_members"}
    c.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    s = FileStore(path)                                          # and opens again as version 2
    assert s.get("pin:7") == "server-1" and s.zcount("index:server-0", 0, 2) == 1
    s.close()


UPGRADE_RACE_CHILD = r"""
import sys
from sessionpin.store.file import FileStore
s = FileStore(sys.argv[1])
print(len(s.keys()), s.get("pin:5"), flush=True)
s.close()
"""


def test_processes_upgrading_at_once_keep_every_key(tmp_path):
    path = tmp_path / "state.db"
    make_v1(path, 2000)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", UPGRADE_RACE_CHILD, str(path)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.split() == ["2200", "server-2"]


def test_describe(tmp_path):
    s = FileStore(tmp_path / "s.db")
    d = s.describe()
    assert d["kind"] == "file" and d["path"] == str(tmp_path / "s.db") and d["url"] == f"file:{tmp_path}/s.db"
    assert d["durable"] is True and d["format"] == FORMAT_VERSION and d["healthy"] is True
    s.close()


def test_a_damage_verdict_is_one_line() -> None:
    """SQLite's integrity_check rows span lines; the store's log lines and the refusal a
    client reads quote them, so each must stay one line (an operator's grep and the e2e
    tests read them line by line)."""
    from sessionpin.store import sqlitefile as sf
    assert sf.verdict(["ok"]) is None
    rows = ["*** in database main ***\nOn tree page 2 cell 10: invalid page number -8\nOn tree page 2 cell 8: x",
            "Multiple uses for byte 1794 of page 2", "third", "fourth"]
    said = sf.verdict(rows)
    assert said is not None and "\n" not in said
    assert said.startswith("*** in database main *** On tree page 2 cell 10") and "fourth" not in said


def test_a_set_over_a_string_or_nothing_is_one_statement(tmp_path):
    """A lineage anchor's or root's SET: one upsert, no read of the row first (fails before:
    a SELECT, then the upsert); over another type the row goes with its fields."""
    s = FileStore(tmp_path / "state.db")
    try:
        seen: list[str] = []
        s._w.set_trace_callback(lambda sql: seen.append(sql) if "entries" in sql else None)
        s.set("a", "1", 60)
        s.set("a", "2", 60)
        # (the copy's mirror statements come after each: what the set itself ran is upserts only)
        ours = [q for q in seen if "copy." not in q]
        assert ours and all(q.startswith("INSERT INTO entries") and "ON CONFLICT" in q for q in ours)
        assert len(set(ours)) == 2
        s._w.set_trace_callback(None)
        s.hset("h", "f", "v")
        assert s.set("h", "s", 5) is True and s.get("h") == "s"
        assert s._w.execute("SELECT count(*) FROM fields WHERE key = 'h'").fetchone() == (0,)
    finally:
        s.close()


# == check_at_open=False: the pages checked on the background thread (the CLI's listings) ====

def _filled_and_closed(path: Path, n: int) -> dict[str, str]:
    s = FileStore(path)
    for i in range(n):
        s.set(f"pin:{i:05d}", f"server-{i % 7}")
    s.close()                                   # both files checkpointed: every page in them
    return {f"pin:{i:05d}": f"server-{i % 7}" for i in range(n)}


def _damage_the_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 4096 // 2 * 4096
    data[middle: middle + 4096 * 3] = os.urandom(4096 * 3)
    path.write_bytes(bytes(data))


def test_opened_unchecked_reads_at_once_and_the_check_finds_it_whole(tmp_path):
    path = tmp_path / "state.db"
    pins = _filled_and_closed(path, 500)
    s = FileStore(path, check_at_open=False, watch_interval=0.05)
    try:
        assert s.get("pin:00007") == "server-0"     # reads do not wait for the check
        assert s.verdict(10) is None
        assert s.describe()["state"] == "sure"
        assert {k: s.get(k) for k in s.keys("pin:")} == pins
    finally:
        s.close()


def test_opened_unchecked_on_damaged_pages_says_so_and_rebuilds_from_the_copy(tmp_path):
    path = tmp_path / "state.db"
    pins = _filled_and_closed(path, 3000)
    _damage_the_middle(path)                    # pages the open does not read
    s = FileStore(path, check_at_open=False, watch_interval=0.05)
    try:
        found = s.verdict(10)
        assert found is not None and "database's pages are damaged" in found
        deadline = time.monotonic() + 10
        while s.describe()["state"] != "sure" or s.describe()["last_repair"] is None:
            assert time.monotonic() < deadline, s.describe()
            time.sleep(0.02)
        assert {k: s.get(k) for k in s.keys("pin:")} == pins     # every pin, from the copy
    finally:
        s.close()
    assert list(tmp_path.glob("state.db.corrupt-*"))


def test_a_write_to_a_store_opened_unchecked_waits_for_the_check_and_never_meets_damage(tmp_path, monkeypatch):
    path = tmp_path / "state.db"
    pins = _filled_and_closed(path, 3000)
    _damage_the_middle(path)                    # pages the open does not read
    # the background thread's watch (which checks an unchecked store at once) held back:
    # the write itself must check first
    from sessionpin.store import writer
    monkeypatch.setattr(writer.Writer, "watch", lambda self: None)
    s = FileStore(path, check_at_open=False)
    try:
        assert s.describe()["state"] == "unchecked"
        s.set("new", "glm", durable=True)
        assert s.describe()["state"] == "sure" and s.describe()["last_repair"] is not None
        assert s.verdict(0) is not None
    finally:
        s.close()
    again = FileStore(path)
    try:
        assert again.get("new") == "glm"
        assert {k: again.get(k) for k in again.keys("pin:")} == pins
    finally:
        again.close()
