"""Issue 10's store faults, end to end: a real ``mitmdump -s addons/route.py`` on a real
SQLite store file (and its second copy), fake TLS servers, Claude Code-shaped requests.

Every test pins conversations to ``glm`` (the agent addresses ``anthropic``), injects one
fault into the store's files, then sends their continuations. Each continuation must reach
glm, or be refused with a 503 that names the store — never reach anthropic, the server the
agent addresses, which would reject its history. Afterwards (after the repair, and after a
restart) ``sessionpin sessions`` shows every pin on glm: none lost, none written over as
"not routed".

What each test met on the code before issue 10 (commit c33fb11, no journal, no watch of the
files), as the issue's table reports it and as the mechanisms of that code give:

- pages damaged while running, then a commit from another connection: the read error was
  taken as "degraded", answered "no pin": the continuations went to anthropic and "not
  routed" pins were written over their real ones;
- damaged at start (truncated to half; three pages overwritten): set aside with a warning
  and started EMPTY: every continuation went to anthropic;
- files deleted while running (the db; db+wal+shm; the directory; the -wal then kill -9):
  not noticed; new "durable" pins went into the unlinked file (or the deleted WAL) and
  were gone at the restart: continuations went to anthropic;
- the -shm deleted while two proxies share the store: a proxy (re)started afterwards made a
  second -shm, two wal-indexes over one WAL: pins made through one proxy were not seen by
  the other, whose continuations went to anthropic;
- a store of a newer format at start: a RecursionError cascade of ~2,500 lines, a
  "listening" line, exit 1;
- the second copy (damaged at start or while running, deleted while running) did not
  exist: after losing the database, nothing was left to rebuild from.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from .harness import Client, Connection, FakeServer, Mitmdump, MitmdumpError, Reply, TestCA, toml_config
from .test_router_e2e import GLM_ENV, GLM_KEY, SESSION_HEADER, Req, cc, new_session

PAGE = 4096


class Fakes:
    def __init__(self, tmp: Path) -> None:
        self.ca = TestCA(tmp / "ca")
        self.anthropic = FakeServer("anthropic", self.ca).start()
        self.glm = FakeServer("glm", self.ca, prefix="/api/anthropic").start()
        self.config = toml_config({"anthropic": {"url": self.anthropic.url},
                                   "glm": {"url": self.glm.url, "key_env": GLM_ENV}}, {"claude-code": "glm"})

    def close(self) -> None:
        self.anthropic.stop()
        self.glm.stop()

    def at_anthropic(self, sessions: set[str]) -> list[str]:
        """Requests of these sessions that reached the server the agent addresses (must be none)."""
        return [r.header(SESSION_HEADER) or "" for r in self.anthropic.received()
                if r.header(SESSION_HEADER) in sessions]


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fakes]:
    f = Fakes(tmp_path_factory.mktemp("e2e-store-faults"))
    try:
        yield f
    finally:
        f.close()


class Proxy:
    """One router on the store file ``db``."""

    def __init__(self, fakes: Fakes, workdir: Path, db: Path) -> None:
        self.fakes, self.db = fakes, db
        self.mitm = Mitmdump.router(workdir, fakes.ca, fakes.config, env={GLM_ENV: GLM_KEY},
                                    options={"sessionpin_store": f"file:{db}"})
        self.conn: Connection | None = None

    def start(self) -> "Proxy":
        self.mitm.start()
        return self

    def send(self, req: Req) -> Reply:
        """One request on a kept-alive connection through the proxy (a new one after a restart)."""
        for attempt in (1, 2):
            if self.conn is None:
                self.conn = Client.via_proxy(self.mitm.port, self.mitm.mitm_ca).connect(self.fakes.anthropic.origin)
            try:
                return self.conn.request(req.method, req.path, req.headers, req.body)
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def judge(self, r: Reply) -> bool:
        """True if glm answered; False for a refusal that names the store; anything else fails."""
        if r.status == 200:
            assert r.header("x-fake-server") == "glm", r.text[:300]
            return True
        assert r.status in (424, 503), (r.status, r.text[:300])   # 424: a pin read, 503: a pin write
        message = r.json()["error"]["message"]
        assert self.db.name in message, message
        return False

    def open(self, n: int, timeout: float = 20.0) -> list[str]:
        """``n`` new conversations, each pinned to glm (an opening refused with 503 is retried,
        as the agent would)."""
        sessions = [new_session() for _ in range(n)]
        self.until_glm("opening", sessions, timeout)
        return sessions

    def until_glm(self, kind: str, sessions: list[str], timeout: float = 20.0) -> int:
        """Send each session a turn until glm answers it; every reply is glm's or a refusal
        naming the store. Returns how many were refused on the way."""
        pending, refused = list(sessions), 0
        deadline = time.monotonic() + timeout
        while pending:
            left = []
            for s in pending:
                if not self.judge(self.send(cc(kind, s, stream=False))):
                    left.append(s)
                    refused += 1
            pending = left
            if pending:
                assert time.monotonic() < deadline, f"{len(pending)} still refused after {timeout} s"
                time.sleep(0.2)
        return refused

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        self.mitm.stop(sig)

    def wait_log(self, pattern: str, since: int = 0, timeout: float = 10.0) -> str:
        m = self.mitm.wait_output(pattern, timeout=timeout, since=since)
        assert m is not None, f"no line matching {pattern!r}:\n{self.mitm.tail(40)}"
        return m.group(0)


def cli(db: Path, config: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "sessionpin"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "sessionpin.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONPIN_") or k == "SESSIONPIN_STORE_MEMORY"}
    return subprocess.run([*cmd, "--config", str(config), "--store", f"file:{db}", *argv],
                          capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=60)


def pins(p: Proxy) -> dict[str, str | None]:
    """Every pinned conversation and its server, as ``sessionpin sessions`` shows them."""
    out = cli(p.db, p.mitm.config_path, "sessions", "--json")
    assert out.returncode == 0, out.stderr
    return {row["session"]: row["server"] for row in json.loads(out.stdout)}


def all_on_glm(p: Proxy, sessions: list[str]) -> None:
    """No pin lost, none invented: the store holds exactly these conversations, each on glm."""
    assert pins(p) == {s: "glm" for s in sessions}
    assert p.fakes.at_anthropic(set(sessions)) == []


def checkpoint(db: Path, settle: float = 0.3, timeout: float = 15.0) -> None:
    """Every committed page into the main file, and the WAL empty and staying empty for
    ``settle`` seconds (so damage to the main file reaches the pins: the router's own
    background writes, batched after the turns, would otherwise put whole copies of the
    pins' pages in the WAL, where its reads find them first). A checkpoint that a writer
    kept busy is tried again: the condition is waited for, not assumed."""
    wal = Path(f"{db}-wal")
    deadline = time.monotonic() + timeout
    while True:
        run("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
            "busy = c.execute('PRAGMA wal_checkpoint(TRUNCATE)').fetchone()[0]; c.close(); sys.exit(busy)", str(db),
            check=False)
        if not wal.exists() or wal.stat().st_size == 0:
            time.sleep(settle)
            if not wal.exists() or wal.stat().st_size == 0:
                return
        assert time.monotonic() < deadline, f"{wal} never stayed empty for {settle} s"
        time.sleep(0.05)


def run(code: str, *args: str, check: bool = True) -> None:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 or not check, out.stderr


def scribble(path: Path, offset: int, data: bytes) -> None:
    scribble_all(path, [(offset, data)])


def scribble_all(path: Path, writes: list[tuple[int, bytes]]) -> None:
    """Every write in one open by another process: a running store that meets the first damaged
    page repairs at once (the file moved aside), so damage done one process at a time raced it
    (a later write found no file: it failed so in a fresh-clone run of .ci/run)."""
    run("import sys; f = open(sys.argv[1], 'r+b')\n"
        "for w in sys.argv[2:]:\n"
        "    at, data = w.split(':'); f.seek(int(at)); f.write(bytes.fromhex(data))\n"
        "f.close()", str(path), *(f"{offset}:{data.hex()}" for offset, data in writes))


def entries_pages(db: Path) -> list[int]:
    """The page numbers of the ``entries`` table's B-tree (where the pins are), read with
    sqlite's dbstat if it has it, else every page but the first two."""
    try:
        c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            return [r[0] for r in c.execute("SELECT pageno FROM dbstat WHERE name = 'entries'")]
        finally:
            c.close()
    except sqlite3.OperationalError:
        return list(range(3, db.stat().st_size // PAGE + 1))


# == 1. pages damaged while running ========================================================

def test_pages_damaged_while_running_then_a_commit_from_another_connection(fakes: Fakes, tmp_path: Path) -> None:
    p = Proxy(fakes, tmp_path / "router", tmp_path / "router" / "state.db").start()
    try:
        sessions = p.open(12)
        checkpoint(p.db)                                     # the pins are in the main file now
        pages = entries_pages(p.db)
        mark = p.mitm.line_count                             # before the damage: the router's own background
        # writes may meet it before our commit does
        scribble_all(p.db, [((page - 1) * PAGE + 100, os.urandom(PAGE - 200)) for page in pages])
        # one commit from another connection: the router's page cache is stale, it reads the disk
        # (the header's user_version set to what it is: a commit that touches no damaged page).
        # The router may have met the damage first and be moving the file aside: then this commit
        # fails (disk I/O error, seen on a loaded machine) and is not needed — what follows checks
        # that the damage was found and repaired either way.
        # (mode=rw: a file moved aside is not made anew at the path by this connection)
        run("import sqlite3, sys; c = sqlite3.connect(f'file:{sys.argv[1]}?mode=rw', uri=True, isolation_level=None); "
            "v = c.execute('PRAGMA user_version').fetchone()[0]; c.execute(f'PRAGMA user_version = {v}'); c.close()",
            str(p.db), check=False)
        p.until_glm("continuation", sessions)                # glm, or 503 naming the store: never anthropic
        # the damage is found (a read met it, or the verification on a connection of its own),
        # not hidden, and the database rebuilt from the copy
        p.wait_log(r"database's pages are damaged", since=mark)
        p.wait_log(r"repaired: rebuilt the database from the copy", since=mark)
        assert p.until_glm("continuation", sessions) == 0    # and after the repair, straight to glm
        all_on_glm(p, sessions)
        assert list(p.db.parent.glob("state.db.corrupt-*"))  # the damaged file, kept
    finally:
        p.stop()


# == 2. damaged at start ===================================================================

@pytest.mark.parametrize("damage", ["truncated to half", "three pages overwritten"])
def test_damaged_at_start_is_rebuilt_from_the_copy(fakes: Fakes, tmp_path: Path, damage: str) -> None:
    p = Proxy(fakes, tmp_path / "router", tmp_path / "router" / "state.db").start()
    try:
        sessions = p.open(12)
        p.stop()                                             # the last connection checkpoints
        size = p.db.stat().st_size
        if damage == "truncated to half":
            os.truncate(p.db, size // 2)
        else:
            scribble_all(p.db, [((page - 1) * PAGE, os.urandom(PAGE)) for page in entries_pages(p.db)[:3]])
        p.start()
        rebuilt = p.wait_log(r"rebuilt its database from the copy .*: \d+ keys")
        p.wait_log(r"moved it aside to")
        keys = int(rebuilt.rsplit(":", 1)[1].split()[0])
        assert keys >= 12                                    # the pins (and their index)
        p.until_glm("continuation", sessions)
        assert p.until_glm("continuation", sessions) == 0
        all_on_glm(p, sessions)
        doctor = cli(p.db, p.mitm.config_path, "doctor")      # another process: it reads the store's history
        said = [line for line in doctor.stdout.splitlines() if line.startswith("warn  store repair")]
        assert any("moved it aside" in line for line in said), doctor.stdout
        assert any("rebuilt the database from the copy" in line and f": {keys} keys" in line for line in said), \
            doctor.stdout
    finally:
        p.stop()


# == 3. files deleted while running ========================================================

@pytest.mark.parametrize("what", ["db", "db+wal+shm", "directory"])
def test_files_deleted_while_running_are_restored_and_lose_no_pin(fakes: Fakes, tmp_path: Path, what: str) -> None:
    d = tmp_path / "state"
    p = Proxy(fakes, tmp_path / "router", d / "state.db").start()
    try:
        before = p.open(10)
        mark = p.mitm.line_count
        if what == "directory":
            shutil.rmtree(d)
        else:
            for suffix in ([""] if what == "db" else ["", "-wal", "-shm"]):
                os.unlink(f"{p.db}{suffix}")
        during = p.open(10)                                  # new durable pins, right after the deletion
        p.wait_log(r"was deleted while it was open", since=mark, timeout=5)
        p.wait_log(r"repaired: rebuilt the database from the (copy|connection still open)", since=mark, timeout=10)
        after = p.open(10)
        p.until_glm("continuation", before + during)
        assert p.db.exists()
        p.stop(signal.SIGKILL)                               # nothing flushed at exit
        p.start()
        sessions = before + during + after
        assert p.until_glm("continuation", sessions) == 0
        all_on_glm(p, sessions)
    finally:
        p.stop()


def test_wal_deleted_then_kill_9_loses_no_pin(fakes: Fakes, tmp_path: Path) -> None:
    p = Proxy(fakes, tmp_path / "router", tmp_path / "router" / "state.db").start()
    try:
        sessions = p.open(12)                                # in the WAL: no checkpoint yet
        assert Path(f"{p.db}-wal").stat().st_size > 0
        os.unlink(f"{p.db}-wal")
        p.stop(signal.SIGKILL)                               # at once: before it can notice
        mark = p.mitm.line_count
        p.start()
        assert p.until_glm("continuation", sessions) == 0
        all_on_glm(p, sessions)
        # the database was behind its copy (the WAL's commits): rebuilt from it at the start
        p.wait_log(r"rebuilt its database from the copy \(it was behind", since=mark)
    finally:
        p.stop()


# == 4. -shm deleted while two proxies share the store ====================================

def test_shm_deleted_while_two_proxies_share_the_store_is_no_split_brain(fakes: Fakes, tmp_path: Path) -> None:
    db = tmp_path / "shared" / "state.db"
    a = Proxy(fakes, tmp_path / "a", db).start()
    b = Proxy(fakes, tmp_path / "b", db).start()
    try:
        before = a.open(10) + b.open(10)
        mark_a, mark_b = a.mitm.line_count, b.mitm.line_count
        os.unlink(f"{db}-shm")
        # each notices (the one that repairs first: its -shm deleted; the other: its database replaced)
        a.wait_log(r"was (deleted|replaced) while it was open", since=mark_a, timeout=5)
        b.wait_log(r"was (deleted|replaced) while it was open", since=mark_b, timeout=5)
        b.stop()                                             # a proxy started after the deletion
        b.start()
        later_b = b.open(15)                                 # pins made through b ...
        later_a = a.open(15)
        a.until_glm("continuation", before + later_b)        # ... continued through a
        b.until_glm("continuation", before + later_a)        # and the other way
        all_on_glm(a, before + later_a + later_b)
    finally:
        a.stop()
        b.stop()


# == 5. a store of a newer format ==========================================================

def test_a_newer_format_store_is_one_line_and_a_nonzero_exit_nothing_served(fakes: Fakes, tmp_path: Path) -> None:
    db = tmp_path / "router" / "state.db"
    db.parent.mkdir(parents=True)
    c = sqlite3.connect(db)
    c.execute("PRAGMA application_id = 1936748081")          # "spn1", ours
    c.execute("PRAGMA user_version = 3")
    c.execute("CREATE TABLE future (x)")
    c.commit()
    c.close()
    before = db.read_bytes()
    p = Proxy(fakes, tmp_path / "router", db)
    with pytest.raises(MitmdumpError):
        p.start()
    code = p.mitm.wait_exit(10)
    out = p.mitm.output
    assert code not in (0, None), out
    assert "listening at" not in out and "Traceback" not in out and "RecursionError" not in out, out
    said = [line for line in out.splitlines() if "newer sessionpin" in line]
    assert len(said) == 1 and "store format 3, this one reads 2" in said[0], out   # one line
    assert len([line for line in out.splitlines() if not line.startswith("----")]) <= 5, out
    assert db.read_bytes() == before                         # left untouched


# == the copy's side =======================================================================

def _the_database_lost_every_pin_comes_back(p: Proxy, sessions: list[str]) -> None:
    """The copy is whole again: kill the router, delete the database, and every pin comes
    back from the copy alone."""
    p.stop(signal.SIGKILL)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{p.db}{suffix}").unlink(missing_ok=True)
    mark = p.mitm.line_count
    p.start()
    p.wait_log(r"rebuilt its database from the copy", since=mark)
    assert p.until_glm("continuation", sessions) == 0
    all_on_glm(p, sessions)


@pytest.mark.parametrize("while_running", [False, True], ids=["at start", "while running"])
def test_a_damaged_copy_is_rebuilt_from_the_database(fakes: Fakes, tmp_path: Path, while_running: bool) -> None:
    p = Proxy(fakes, tmp_path / "router", tmp_path / "router" / "state.db").start()
    copy = Path(f"{p.db}.copy")
    try:
        sessions = p.open(10)
        if not while_running:
            p.stop()
        else:
            checkpoint(copy)                                 # the pins in the copy's main file
        mark = p.mitm.line_count
        page = entries_pages(copy)[0]                        # in place, as a bad disk would (one write:
        scribble(copy, (page - 1) * PAGE, os.urandom(PAGE))  # a running store may repair at once)
        if not while_running:
            p.start()
        p.wait_log(r"rebuilt (its|the) copy from the database", since=mark, timeout=20)
        assert p.until_glm("continuation", sessions) == 0
        assert list(p.db.parent.glob("state.db.copy.corrupt-*"))
        _the_database_lost_every_pin_comes_back(p, sessions)
    finally:
        p.stop()


def test_a_copy_deleted_while_running_is_rebuilt(fakes: Fakes, tmp_path: Path) -> None:
    p = Proxy(fakes, tmp_path / "router", tmp_path / "router" / "state.db").start()
    copy = Path(f"{p.db}.copy")
    try:
        before = p.open(15)
        mark = p.mitm.line_count
        copy.unlink()
        during = p.open(10)                                  # refused until it is back, then pinned
        p.wait_log(r"its copy was deleted while it was open", since=mark, timeout=5)
        p.wait_log(r"repaired: rebuilt the copy from the database", since=mark, timeout=10)
        assert copy.exists()
        _the_database_lost_every_pin_comes_back(p, before + during)
    finally:
        p.stop()
