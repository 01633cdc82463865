#!/usr/bin/env python3
"""What each part of the router costs a request in the running proxy, by thread (issue 22).

    .venv/bin/python scripts/bench_parts.py [--seconds 6] [--rounds 3] [--clients 8] [--size 10KB]
                                            [--variants full,nolin,noledger,bare,quiet] [--spy DIR]
                                            [--spy-rate 250]

Plain mitmdump and the router with parts left out, each its own mitmdump on one local TLS
upstream (the router's clients address another configured origin: the full rewrite, as in
``bench_proxy.py``), under ``--clients`` keep-alive clients sending pinned turns back to back.
The proxies take turns in phases of ``--seconds`` (the order reversed every round). Reported per
variant, the median over the rounds: requests per second, and the proxy's CPU per request (user +
system, from ``/proc/<pid>/task/*/stat``) split into the event loop's thread ("main": mitmproxy
and every hook) and all other threads and processes (the store's writer, reader and background
threads, the lineage reads' thread, the body reader process). Linux only.

Why not py-spy alone: py-spy counts a thread waiting in a queue or for the GIL as busy, so the
store's threads looked like a third of the router's CPU; ``/proc`` says what each thread used.
``--spy DIR`` also records each variant's first phase with ``py-spy record --gil`` (only the
thread holding the GIL is sampled: CPU spent in Python) for ``scripts/profile_router.py
--summarise``; py-spy is not a dependency (``.venv/bin/pip install py-spy``).

Variants (``make_addons(without=...)``, options):
  full       the router as ``addons/route.py`` loads it
  nolin      without the lineage watch       noledger  without the ledger watch
  bare       without both and without the OpenCode id pool
  quiet      full, ``sessionpin_decision_log=off``
  noop       plain mitmdump with a script whose ``request`` hook does nothing (the cost of a script)
  nooplimit  noop with ``stream_large_bodies`` as the router sets it (``sessionpin_max_body_mb``):
             mitmproxy's own body-size check on every chunk of a body
  floor      not sessionpin: the least any Python router must do for a pinned turn, in one plain
             ``request`` hook (``FLOOR``: the body's top level decoded, one SQLite read, the host,
             path, key and model rewritten); what is above it is sessionpin's own
  plainmalloc, fullmalloc  plain mitmdump and the full router with glibc told to keep freed
             memory (``MALLOC``: a large body's pages reused, not faulted in anew)
  noopgc, fullgc  noop and the full router with Python's collector run less often (``GC``)
  fullgcstats, noopgcstats, fullfreezegcstats  the proxy's collections counted and timed by
             generation, with its responses, in ``GCSTATS_FILE`` in the temp directory (``GCSTATS``)
  fullfreeze the full router with what is alive once it is loaded frozen (``gc.freeze``: ``FREEZE``;
             the router does it itself since issue 22's twelfth round: ``sessionpin_gc_freeze``)
  thawed, thawedgcstats  the full router with ``sessionpin_gc_freeze=false`` (as before that round)
  noophooks  a script taking every hook the bundle takes, each doing nothing (mitmproxy's dispatch)
  floorspin  the floor and ~0.27 ms of one small loop (``SPIN``): does CPU spent in a hook cost
             the proxy more than itself?
  floorwide  the floor and as much CPU spread over ``WIDE_N`` distinct small functions (``WIDE``)
  floorawait the floor as an async hook that lets the loop turn once first (``AWAIT``)
  floorheap  the floor with sessionpin's modules loaded and its addon made, never loaded, then
             frozen out of the collector (``HEAP``): does the router's heap alone cost the proxy?
  floorsys   the floor and ``SYS_N`` times the system calls bare makes a request beyond it (``SYS``)
  floorwake  the floor and a call handed to a thread and awaited, each request (``WAKE``)
  barehops, fullhops  bare and the full router with their hand-offs between threads counted
             by kind, with their responses, in ``HOPS_FILE`` in the temp directory (``HOPS``)
  nopool     the full router without the OpenCode id pool (``make_addons([])``)
  barepool   bare with the OpenCode id pool (``bare`` leaves it out)
  barequiet  bare, ``sessionpin_decision_log=off``
One piece of the full router taken out (a monkeypatch in the variant's script: to measure it,
never a way to run):
  threadwrites    every store write on the writer thread (``FileStore.now_writes`` empty: as before
                  issue 22's writes on the loop)
  threadreads     every store read on the reader thread (``FileStore.now_reads`` empty: as before
                  issue 22's reads on the loop)
  noroot          no lineage root read per request with history
  rootinline      a small request's lineage root read on the loop, not gathered for the reads' thread
  noshape         no prompt shape per answered turn (the ledger)
  noledgerwrites  the ledger's turns not written
  nolinwrites     the lineage's records (roots, anchors) not written
  afteranswer     the lineage and ledger watches' ``response`` run by ``call_soon`` (meant: after
                  the answer left; it runs before: mitmproxy sends it a loop turn after the hook,
                  ``bench_after_answer.py``; the router itself now waits for the send, ``later``)
  batched         those ``response`` calls held and run together every 50 ms
  slowflush       the ledger's and the lineage's records flushed after 1 s (not 0.2 and 0.1 s)
The difference between two variants' CPU per request, in one run, is what the part costs.
``--against DIR`` adds the variant ``against``: the full router of DIR's ``sessionpin`` (a
``git worktree`` of an earlier commit), so a change is measured before/after in one run.
``--syscalls DIR`` counts each variant's system calls in its first phase (``strace -c -f``).
``--callgrind N`` counts instructions instead of timing: each proxy runs under ``valgrind
--tool=callgrind`` (instrumented only once warmed up, ``callgrind_control -i on``), takes ``N``
steps (a turn on each of ``--clients`` connections), and says its instructions per request, every
thread of it included. A count, not a time: the same for the same code and inputs whatever else
the machine does, so a change of a few percent shows in one run, where the timed phases here
vary by ±0.3 ms a request between runs. (Instructions are not seconds: a cache miss or a system
call's wait costs time the count does not see; the timed phases stay the figure the issue
asks for.) Each proxy runs ~55 times slower under valgrind: ``N`` of 100 at 10 KB takes about
half a minute a variant. The router's intervals are slowed with it (``SLOWED``, ``--callgrind-clock``),
so what it does once per interval is shared by as many requests as at full speed.
``--floor-in-process N`` only times the floor's hooks (``floor``, ``floorspin``, ``floorwide``) in
this process, as ``bench_turn.py --hooks`` times the router's: what their figures here are for.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_proxy as BP  # noqa: E402
from sessionpin.reader import facts as F  # noqa: E402
from e2e.harness import Client, FakeServer, Mitmdump, TestCA, toml_config  # noqa: E402

_FULL = "from sessionpin.proxy import make_addons\naddons = make_addons()\n"
GC = (10_000, 20, 20)         # ``fullgc``/``noopgc``: Python's collector run less often (tried, issue 22)
# the lineage's and the ledger's ``response`` taken out of the bundle's, to be run later by
# ``_later(flow, body)`` (``afteranswer``, ``batched``)
_LATE = "import asyncio\nfrom sessionpin.proxy import perflow\n" + _FULL + (
    "_b = addons[0]\n_late = (_b.lineage.response, _b.ledger.response)\n"
    "_b._response = tuple(f for f in _b._response if f not in _late)\n"
    "_orig = _b.response\n"
    "def _later(flow, body):\n"
    "    if body is not None:\n"
    "        flow.metadata[perflow.BODY] = body\n"
    "    for f in _late:\n"
    "        f(flow)\n"
    "    flow.metadata.pop(perflow.BODY, None)\n")
# ``*gcstats``: the proxy's garbage collections counted and timed by generation, with the
# responses it answered, from its 500th response on (start-up's collections are not a request's),
# written every second to ``GCSTATS_FILE`` (the proxy's pid in its name)
GCSTATS_FILE = "sessionpin-gcstats-{pid}.json"
GCSTATS = """
import gc as _gc, json as _json, os as _os, tempfile as _tf, threading as _th, time as _t
_gcs = {"requests": 0, "gen": [[0, 0.0], [0, 0.0], [0, 0.0]]}
_gc_t0 = [0.0]
WARM = 500     # responses before anything is counted (start-up's collections are not a request's)
def _gc_cb(phase, info):
    if _gcs["requests"] < 0:
        return
    if phase == "start":
        _gc_t0[0] = _t.perf_counter()
    else:
        g = _gcs["gen"][info["generation"]]
        g[0] += 1
        g[1] += _t.perf_counter() - _gc_t0[0]
_gc.callbacks.append(_gc_cb)
def _gc_write():
    path = _os.path.join(_tf.gettempdir(), %r.format(pid=_os.getpid()))
    while True:
        _t.sleep(1)
        with open(path, "w") as f:
            _json.dump(_gcs, f)
_th.Thread(target=_gc_write, daemon=True).start()
_gcs["requests"] = -WARM
def response(flow):
    _gcs["requests"] += 1
""" % GCSTATS_FILE
# ``fullfreeze``: the full router with every object alive once the script is loaded (mitmproxy's,
# sessionpin's modules) moved out of the collector's reach (``gc.freeze``): a full collection
# then walks only what was made since
FREEZE = "import gc as _gcf\n_gcf.collect()\n_gcf.freeze()\n"
SCRIPTS = {
    "nolin": "from sessionpin.proxy import make_addons\naddons = make_addons(without=('lineage',))\n",
    "noledger": "from sessionpin.proxy import make_addons\naddons = make_addons(without=('ledger',))\n",
    "bare": "from sessionpin.proxy import make_addons\naddons = make_addons([], without=('lineage', 'ledger'))\n",
    "nopool": "from sessionpin.proxy import make_addons\naddons = make_addons([])\n",
    "barepool": "from sessionpin.proxy import make_addons\naddons = make_addons(without=('lineage', 'ledger'))\n",
    # one piece taken out of the full router, to measure it (never how it should run)
    "threadwrites": "from sessionpin.store.file import FileStore\nFileStore.now_writes = frozenset()\n" + _FULL,
    "threadreads": "from sessionpin.store.file import FileStore\nFileStore.now_reads = frozenset()\n" + _FULL,
    "noroot": "from sessionpin.proxy import lineagewatch\n"
              "lineagewatch.LineageWatch._request_root = lambda self, flow, state: None\n" + _FULL,
    "rootinline": "from sessionpin.proxy import lineagewatch\n"
                  "_orig_root = lineagewatch.LineageWatch._request_root\n"
                  "def _inline(self, flow, state):\n"
                  "    if state.lineage is not None or not flow.request.raw_content or "
                  "len(flow.request.raw_content) >= lineagewatch.HOLD_FROM:\n"
                  "        return _orig_root(self, flow, state)\n"
                  "    from sessionpin.reader import headerview\n"
                  "    from sessionpin.proxy import perflow\n"
                  "    f = state.request.facts\n"
                  "    return self._proofs.root((f.agent, state.session or ''), flow.request.raw_content, f.api, "
                  "headerview.get(flow.request.headers, 'content-encoding'), perflow.sent_members(flow))\n"
                  "lineagewatch.LineageWatch._request_root = _inline\n" + _FULL,
    "noshape": "from sessionpin.reader import promptshape\npromptshape.shape = lambda *a, **k: None\n" + _FULL,
    "afteranswer": _LATE + (
        "def _resp(flow):\n"
        "    body = flow.metadata.get(perflow.BODY)\n"
        "    got = _orig(flow)\n"
        "    asyncio.get_running_loop().call_soon(_later, flow, body)\n"
        "    return got\n"
        "_b.response = _resp\n"),
    "batched": _LATE + (
        "_held = []\n"
        "def _flush():\n"
        "    held = _held[:]\n    _held.clear()\n"
        "    for flow, body in held:\n"
        "        _later(flow, body)\n"
        "def _resp(flow):\n"
        "    body = flow.metadata.get(perflow.BODY)\n"
        "    got = _orig(flow)\n"
        "    if not _held:\n"
        "        asyncio.get_running_loop().call_later(0.05, _flush)\n"
        "    _held.append((flow, body))\n"
        "    return got\n"
        "_b.response = _resp\n"),
    "fullgc": f"import gc\ngc.set_threshold(*{GC!r})\n" + _FULL,
    "barequiet": "from sessionpin.proxy import make_addons\naddons = make_addons([], without=('lineage', 'ledger'))\n",
    "slowflush": "from sessionpin.proxy import ledgerwatch, lineagewatch\n"
                 "ledgerwatch.FLUSH_DELAY = lineagewatch.FLUSH_DELAY = 1.0\n" + _FULL,
    "fullgcstats": _FULL + GCSTATS,
    "fullfreeze": _FULL + FREEZE,
    "fullfreezegcstats": _FULL + FREEZE + GCSTATS,
    "thawedgcstats": _FULL + GCSTATS,
    "noopgcstats": "def request(flow):\n    pass\n" + GCSTATS,
    "noledgerwrites": "from sessionpin.proxy import ledgerwatch\n"
                      "ledgerwatch.LedgerWatch._queue = lambda self, *a, **k: None\n" + _FULL,
    "nolinwrites": "from sessionpin.proxy import lineagewatch\n"
                   "lineagewatch.LineageWatch._record = lambda self, writes: None\n" + _FULL,
}
# ``*hops``: the router's hand-offs between threads counted by kind — calls queued to a store
# lane, answers sent to the loop from another thread (``call_soon_threadsafe``), calls given to
# an executor, reads the store could answer on the loop sent to its thread by a cool-off —
# with its responses, written every second to ``HOPS_FILE`` in the temp directory
HOPS_FILE = "sessionpin-hops-{pid}.json"
HOPS = """
import asyncio as _aio, collections as _col, concurrent.futures as _cf, json as _json, os as _os
import tempfile as _tf, threading as _th, time as _t
from sessionpin.store import aio as _saio
_hops = _col.Counter()
def _count(kind, fn):
    _hops[kind + " " + getattr(fn, "__qualname__", type(fn).__name__) + " from " + _th.current_thread().name] += 1
def _wrap(cls, name):
    orig = getattr(cls, name)
    def counted(self, fn, *a, **k):
        _count(name, fn if name != "run_in_executor" else (a[0] if a else fn))
        return orig(self, fn, *a, **k)
    setattr(cls, name, counted)
_wrap(_saio.Lane, "call")
_read0 = _saio.Threaded._read
async def _read(self, name, *a, **k):       # a read the store could answer on the loop, cooling off
    if name in self._now_reads and not k and _t.monotonic() < self._now_after:
        _hops["read in a cool-off " + name] += 1
    return await _read0(self, name, *a, **k)
_saio.Threaded._read = _read
_wrap(_aio.BaseEventLoop, "call_soon_threadsafe")
_wrap(_aio.BaseEventLoop, "run_in_executor")
_wrap(_cf.ThreadPoolExecutor, "submit")
def _hops_write():
    path = _os.path.join(_tf.gettempdir(), %r.format(pid=_os.getpid()))
    while True:
        _t.sleep(1)
        with open(path, "w") as f:
            _json.dump(dict(_hops), f)
_th.Thread(target=_hops_write, daemon=True).start()
def response(flow):
    _hops["responses"] += 1
""" % HOPS_FILE
SCRIPTS["barehops"] = HOPS + SCRIPTS["bare"]
SCRIPTS["fullhops"] = HOPS + _FULL
OPTIONS = {"quiet": {"sessionpin_decision_log": "off"}, "barequiet": {"sessionpin_decision_log": "off"},
           "thawed": {"sessionpin_gc_freeze": "false"}, "thawedgcstats": {"sessionpin_gc_freeze": "false"}}
# The least a router must do for a pinned turn, written plainly (not sessionpin): the body's top
# level decoded (msgspec, as the facts do), the session from its header, its pin read from SQLite
# (one indexed SELECT on a file in WAL mode), then the host, path, key and model rewritten. What
# any Python addon doing this work costs, against which sessionpin's own extra is measured.
FLOOR = """\
import sqlite3, msgspec
from mitmproxy import http
_db = sqlite3.connect({db!r}, isolation_level=None, check_same_thread=False)
_raw = msgspec.json.Decoder(dict[str, msgspec.Raw])
_NEW = b'"glm-4.6"'

def request(flow: http.HTTPFlow) -> None:
    req = flow.request
    session = req.headers.get("x-claude-code-session-id", "")
    raw = req.raw_content or b""
    members = _raw.decode(raw)
    row = _db.execute("SELECT value FROM pins WHERE key = ?", (session,)).fetchone()
    if row is None or row[0] != "up":
        _db.execute("INSERT OR REPLACE INTO pins VALUES (?, ?)", (session, "up"))
    model = bytes(members["model"])
    at = raw.find(model)
    req.scheme, req.host, req.port = "https", {host!r}, {port}
    req.path = {prefix!r} + req.path
    req.headers["x-api-key"] = {key!r}
    req.content = raw[:at] + _NEW + raw[at + len(model):]
"""
# ``floorspin``: the floor and a fixed ~0.25 ms of a small pure-Python loop: does any CPU a hook
# spends cost the proxy more than itself (mitmproxy's own code then slower), or only a wide one?
SPIN = ("\ndef _spin(n=5400):\n    x = 0\n    for i in range(n):\n        x += i\n    return x\n"
        "\n_floor = request\n\ndef request(flow):\n    _spin()\n    _floor(flow)\n")
# ``floorwide``: the floor and about as much CPU as ``floorspin``'s, spread over ``WIDE_N`` distinct
# small functions, each building a dict and a list of its own (code and data as wide as a router's turn)
WIDE_N = 830
WIDE = "".join(f"def _w{i}(x):\n    d = {{'a{i}': x, 'b': [x, {i}]}}\n    return (x * {i % 7 + 3} + len(d)) % {1000 + i}\n"
               for i in range(WIDE_N)) + "_WIDE = (" + ", ".join(f"_w{i}" for i in range(WIDE_N)) + ",)\n" + (
    "\ndef _wide():\n    x = 1\n    for f in _WIDE:\n        x = f(x)\n    return x\n"
    "\n_floor = request\n\ndef request(flow):\n    _wide()\n    _floor(flow)\n")
# ``floorawait``: the floor as an async hook that lets the event loop turn once before its work
AWAIT = "\nimport asyncio\n_sync = request\n\nasync def request(flow):\n    await asyncio.sleep(0)\n    _sync(flow)\n"
# ``floorheap``: the floor with sessionpin's modules loaded and its addon made but not loaded
# (no hook of it runs), what is alive then frozen out of the collector as the router's is: does
# the router's heap alone make the proxy's own work dearer?
HEAP = ("\nfrom sessionpin.proxy import make_addons as _make\n_unused = _make()\n"
        "import gc as _g\n_g.collect()\n_g.freeze()\n")
# ``floorsys``: the floor and the system calls a pinned turn of the router without its watches
# makes beyond it (strace -c -f, ``--syscalls``: two getrusage, a stat, a pread, an fcntl),
# ``SYS_N`` times over: does a system call cost the proxy more than itself (its caches, its TLB)?
SYS_N = 4
SYS = ("\nimport os as _os, resource as _res\n_fd = _os.open({db!r}, _os.O_RDONLY)\n"
       "import fcntl as _fcntl\n"
       "def _sys():\n"
       f"    for _ in range({SYS_N}):\n"
       "        _res.getrusage(_res.RUSAGE_THREAD)\n        _res.getrusage(_res.RUSAGE_THREAD)\n"
       "        _os.stat({db!r})\n        _os.pread(_fd, 4096, 0)\n        _fcntl.fcntl(_fd, _fcntl.F_GETFL)\n"
       "\n_floor0 = request\n\ndef request(flow):\n    _sys()\n    _floor0(flow)\n")
# ``floorwake``: the floor and, per request, a call handed to a thread that answers on the loop
# (``call_soon_threadsafe``), awaited: a thread hop's futexes and the loop's wake-up
WAKE = ("\nimport asyncio as _aio, concurrent.futures as _cf\n_pool = _cf.ThreadPoolExecutor(1)\n"
        "_floor1 = request\n\nasync def request(flow):\n"
        "    await _aio.get_running_loop().run_in_executor(_pool, int)\n    _floor1(flow)\n")
NOOP = "def request(flow):\n    pass\n"
# ``noophooks``: every flow and connection hook the bundle takes, each doing nothing (``request``
# and ``server_connect`` async, as the bundle's): what mitmproxy's dispatch of them costs
NOOPHOOKS = "".join(f"def {h}(x):\n    pass\n" for h in (
    "client_connected", "client_disconnected", "http_connect", "server_connected", "server_disconnected",
    "server_connect_error", "requestheaders", "responseheaders", "response", "error")) + (
    "async def request(flow):\n    pass\nasync def server_connect(data):\n    pass\n")
NOOPGC = f"import gc\ngc.set_threshold(*{GC!r})\n" + NOOP
# glibc's malloc told to keep its freed memory (a large body's pages reused, not faulted in anew)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
# the floor's variants: what each adds to its script (``{db}``: the floor's database)
FLOORS = {"floor": "", "floorspin": SPIN, "floorwide": WIDE, "floorawait": AWAIT, "floorheap": HEAP,
          "floorsys": SYS, "floorwake": WAKE}
KNOWN = ("full", *SCRIPTS, *OPTIONS, "noop", "nooplimit", "noopgc", "noophooks", *FLOORS, "plainmalloc", "fullmalloc")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid`` so far, and under the key 0 those of
    the processes it started (the router's body reader: counted with the proxy's work)."""
    out: dict[int, float] = {0: BP.children_cpu(pid)}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue          # the thread ended meanwhile
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


# ``--callgrind``: the router's clocks, slowed with it. Under valgrind one client's requests come
# ~55 times less often (6-8 a second against ~350), so work done per interval (the ledger's and
# the lineage's batched writes, the activity flush, the store's checks and heartbeat) would fall
# on a handful of requests, not on the dozens it is shared by at full speed: every interval
# ``--callgrind-clock`` times longer (default 50). The table says each proxy's rate under
# valgrind. The count moves with the factor: full over plain +2.21 M at 25, +2.02-2.06 M at 100
# (a batch's transaction: 0.12-0.2 ms of CPU, ``bench_batches.py``); compare variants at one factor.
SLOWED = (("sessionpin.proxy.ledgerwatch", "FLUSH_DELAY"), ("sessionpin.proxy.lineagewatch", "FLUSH_DELAY"),
          ("sessionpin.proxy.lineagewatch", "GATHER"), ("sessionpin.proxy.storeruntime", "FLUSH_EVERY"),
          ("sessionpin.proxy.storeruntime", "ROUND"), ("sessionpin.proxy.storeruntime", "HEARTBEAT_EVERY"),
          ("sessionpin.proxy.storeguard", "CHECK_EVERY"), ("sessionpin.proxy.storeguard", "COUNT_EVERY"),
          ("sessionpin.store.writer", "CHECKPOINT_EVERY"))


def slowed_clock(factor: float) -> str:
    """A script's first lines: every interval of ``SLOWED`` ``factor`` times longer."""
    lines = ["import importlib as _il"]
    for module, name in SLOWED:
        lines.append(f"_il.import_module({module!r}).{name} *= {factor!r}")
    return "\n".join(lines) + "\n"


def _under_callgrind(m: Mitmdump, tmp: Path) -> None:
    """Run ``m`` under callgrind, not instrumented until ``callgrind_count`` turns it on."""
    command = m.command
    out = tmp / f"callgrind-{m.workdir.name}.%p"
    m.command = lambda: ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                         sys.executable, *command()]          # type: ignore[method-assign]


RATES: dict[str, float] = {}     # requests a second under valgrind, by proxy (``callgrind_count``)


def callgrind_count(m: Mitmdump, clients: "BP.Clients", steps: int, tmp: Path, keep: Path | None = None) -> int:
    """Instructions ``m``'s process (every thread) executes over ``steps`` steps of ``clients``."""
    pid = str(m.proc.pid if m.proc else "")
    subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
    for _ in range(2):
        clients.step()              # the code instrumented anew: not counted
    subprocess.run(["callgrind_control", "-z", pid], check=True, capture_output=True)
    t = time.monotonic()
    for _ in range(steps):
        clients.step()
    RATES[m.workdir.name] = steps * len(clients.conns) / (time.monotonic() - t)
    # what the last turns set going ends (a root read, a decision line); the slowed batches
    # fall where they fall, in the window as at its ends
    time.sleep(1.0)
    subprocess.run(["callgrind_control", "-d", "measured", pid], check=True, capture_output=True)
    subprocess.run(["callgrind_control", "-i", "off", pid], check=True, capture_output=True)
    total = 0
    for f in tmp.glob(f"callgrind-{m.workdir.name}.{pid}*"):
        head = f.read_text(errors="replace").split("\nfl=", 1)[0]
        if "desc: Trigger: dump measured" in head:
            total += int(head.split("\nsummary:", 1)[1].split()[0])
            if keep is not None:        # one dump a process (callgrind writes threads together)
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, keep / f"{m.workdir.name}.callgrind")
    if not total:
        raise SystemExit(f"no callgrind dump of {m.workdir.name} found")
    return total


def floor_in_process(n: int, size: int, shape: str) -> None:
    """The floor's ``request`` hook (and ``floorspin``'s, ``floorwide``'s) called on pinned turns
    in this process, as ``bench_turn.py`` calls the router's: thread CPU per call, median µs."""
    import bench_hook as BH
    with tempfile.TemporaryDirectory(prefix="sessionpin-floor-") as tmp:
        db = Path(tmp) / "floor.db"
        with sqlite3.connect(db) as c:
            c.execute("PRAGMA journal_mode = WAL")
            c.execute("CREATE TABLE pins (key TEXT PRIMARY KEY, value TEXT) WITHOUT ROWID")
        payloads = [BP.body("continuation", f"s{i}", size, shape=shape) for i in range(8)]
        for name, extra in (("floor", ""), ("floorspin", SPIN), ("floorwide", WIDE)):
            ns: dict = {}
            exec(FLOOR.format(db=str(db), host="127.0.0.1", port=9, prefix="/api", key="k") + extra, ns)
            times = []
            for i in range(n):
                f = BH.make_flow(f"s{i % 8}", payloads[i % 8])
                t = time.thread_time_ns()
                ns["request"](f)
                times.append(time.thread_time_ns() - t)
            print(f"{name:10} {statistics.median(times[n // 8:]) / 1000:8.1f} µs a call (median of {n - n // 8})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="length of one phase")
    ap.add_argument("--rounds", type=int, default=3, help="phases per variant")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--size", default="10KB", choices=sorted(BP.SIZES))
    ap.add_argument("--shape", default="opening", choices=BP.SHAPES)
    ap.add_argument("--variants", default="full,nolin,noledger,bare,quiet", help=f"from {', '.join(KNOWN)}")
    ap.add_argument("--spy", type=Path, help="record each variant's first phase with py-spy --gil into DIR")
    ap.add_argument("--against", type=Path, help="add a variant 'against': the full router of another tree's "
                                                 "sessionpin (e.g. a git worktree of an earlier commit), side by side")
    ap.add_argument("--spy-rate", type=int, default=250, help="py-spy's samples per second (--spy)")
    ap.add_argument("--syscalls", type=Path, help="count each variant's first-phase system calls (strace -c -f) "
                                                  "into DIR/VARIANT.strace, with its request count")
    ap.add_argument("--callgrind", type=int, metavar="N",
                    help="count each proxy's instructions per request over N steps under valgrind's callgrind "
                         "(deterministic; no timed phases)")
    ap.add_argument("--callgrind-clock", type=float, default=50.0, metavar="K",
                    help="--callgrind: the router's intervals (batched writes, flushes, checks) K times longer, "
                         "as the proxy is slowed")
    ap.add_argument("--callgrind-keep", type=Path, metavar="DIR",
                    help="--callgrind: copy each proxy's measured dump into DIR/VARIANT.callgrind "
                         "(for callgrind_annotate: which C functions, of which library, take the instructions)")
    ap.add_argument("--floor-in-process", type=int, metavar="N",
                    help="only time the floor's hook in this process, N calls on --size/--shape turns "
                         "(thread CPU, median µs): the work the floor's figure through the proxy is for")
    args = ap.parse_args()
    if args.floor_in_process:
        floor_in_process(args.floor_in_process, BP.SIZES[args.size], args.shape)
        return
    variants = [v for v in args.variants.split(",") if v]
    if args.against:
        SCRIPTS["against"] = f"import sys\nsys.path.insert(0, {str(args.against.resolve())!r})\n" + _FULL
        variants.append("against")
    if not set(variants) <= set(KNOWN) | {"against"}:
        ap.error(f"--variants: choose from {', '.join(KNOWN)}")
    size = BP.SIZES[args.size]

    with tempfile.TemporaryDirectory(prefix="sessionpin-parts-") as tmp_:
        tmp = Path(tmp_)
        ca = TestCA(tmp / "ca")
        upstream = FakeServer("upstream", ca, prefix="/api/anthropic").start()
        origin = FakeServer("origin", ca).start()
        upstream.keep_bodies = origin.keep_bodies = False
        trust = {"ssl_verify_upstream_trusted_ca": str(ca.pem)}
        config = toml_config(
            {"anthropic": {"url": origin.url},
             "up": {"url": upstream.url, "key_env": BP.KEY_ENV, "models": {"claude-opus-*": "glm-4.6"}}},
            {"claude-code": "up"},
        )
        procs: dict[str, tuple[Mitmdump, str]] = {"plain": (Mitmdump(tmp / "plain", script=None, options=trust),
                                                            upstream.url)}
        for name in variants:
            if name == "plainmalloc":
                procs[name] = (Mitmdump(tmp / name, script=None, options=trust, env=MALLOC), upstream.url)
                continue
            if name in FLOORS:
                db = tmp / f"{name}.db"
                with sqlite3.connect(db) as c:
                    c.execute("PRAGMA journal_mode = WAL")
                    c.execute("CREATE TABLE pins (key TEXT PRIMARY KEY, value TEXT) WITHOUT ROWID")
                up = urllib.parse.urlsplit(upstream.url)
                (tmp / f"{name}.py").write_text(FLOOR.format(db=str(db), host=up.hostname, port=up.port,
                                                             prefix=up.path.rstrip("/"), key=BP.UPSTREAM_KEY)
                                                + FLOORS[name].replace("{db!r}", repr(str(db))))
                procs[name] = (Mitmdump(tmp / name, script=tmp / f"{name}.py", options=trust), origin.origin)
                continue
            if name in ("noop", "nooplimit", "noopgc", "noophooks"):
                (tmp / f"{name}.py").write_text({"noopgc": NOOPGC, "noophooks": NOOPHOOKS}.get(name, NOOP))
                limit = {"stream_large_bodies": f"{F.MAX_REQUEST_BODY // (1024 * 1024)}m"} if name == "nooplimit" else {}
                procs[name] = (Mitmdump(tmp / name, script=tmp / f"{name}.py", options={**trust, **limit}),
                               upstream.url)
                continue
            m = Mitmdump.router(tmp / name, ca, config,
                                env={BP.KEY_ENV: BP.UPSTREAM_KEY, **(MALLOC if name == "fullmalloc" else {})},
                                options=OPTIONS.get(name))
            if name in SCRIPTS or args.callgrind:
                clock = slowed_clock(args.callgrind_clock) if args.callgrind else ""
                text = SCRIPTS.get(name, _FULL)
                if text.startswith("import sys\nsys.path.insert"):      # ``against``: its tree's clocks
                    first, _, rest = text.partition("\n")
                    second, _, rest = rest.partition("\n")
                    text = f"{first}\n{second}\n{clock}{rest}"
                else:
                    text = clock + text
                (tmp / f"{name}.py").write_text(text)
                m.script = tmp / f"{name}.py"
            procs[name] = (m, origin.origin)
        if args.callgrind:
            for m, _ in procs.values():
                _under_callgrind(m, tmp)
        try:
            for m, _ in procs.values():
                m.start(timeout=600 if args.callgrind else 30)
            clients = {}
            for name, (m, target) in procs.items():
                clients[name] = BP.Clients(Client.via_proxy(m.port, m.mitm_ca, timeout=120), target, n=args.clients)
                clients[name].load(size, args.shape)
                for _ in range(5):
                    clients[name].step()        # warm-up, not counted
            for name in ("full", *FLOORS):      # routing? (else nothing is measured)
                if name not in procs:
                    continue
                upstream.keep_bodies = True
                before = len(upstream.received())
                clients[name].step()
                got = upstream.received()[before:]
                upstream.keep_bodies = False
                if not got or dict((k.lower(), v) for k, v in got[-1].headers).get("x-api-key") != BP.UPSTREAM_KEY:
                    raise SystemExit(f"{name} did not route to the upstream with its key")
            if args.callgrind:
                counts = {name: callgrind_count(m, clients[name], args.callgrind, tmp, args.callgrind_keep)
                          for name, (m, _) in procs.items()}
            rows: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in procs}
            for r in range(0 if args.callgrind else args.rounds):
                order = list(procs) if r % 2 == 0 else list(procs)[::-1]
                for name in order:
                    m = procs[name][0]
                    pid = m.proc.pid if m.proc else None
                    assert pid is not None
                    spy = None
                    if args.spy and r == 0:
                        args.spy.mkdir(parents=True, exist_ok=True)
                        spy = subprocess.Popen(
                            [str(Path(sys.executable).with_name("py-spy")), "record", "--gil", "-r", str(args.spy_rate),
                             "--format", "raw", "-o", str(args.spy / f"{name}.raw"), "-d", str(int(args.seconds)),
                             "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        time.sleep(0.3)
                    tracer = None
                    if args.syscalls and r == 0:
                        args.syscalls.mkdir(parents=True, exist_ok=True)
                        tracer = subprocess.Popen(
                            ["strace", "-c", "-f", "-p", str(pid), "-o", str(args.syscalls / f"{name}.strace")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        time.sleep(0.5)
                    before_cpu = thread_cpu(pid)
                    n = clients[name].run_for(args.seconds)
                    after_cpu = thread_cpu(pid)
                    if tracer is not None:
                        tracer.terminate()
                        tracer.wait()
                        (args.syscalls / f"{name}.requests").write_text(str(n))
                    if spy is not None:
                        spy.wait()
                        (args.spy / f"{name}.requests").write_text(str(n))
                    used = {t: after_cpu[t] - before_cpu.get(t, 0.0) for t in after_cpu}
                    total, loop = sum(used.values()), used.get(pid, 0.0)
                    rows[name].append((n / args.seconds, total / n * 1000, loop / n * 1000, used.get(0, 0.0) / n * 1000))
            for c in clients.values():
                c.close()
            for name, (m, _) in procs.items():       # a body reader failing is work redone: say so
                lost = sum("body reader process did not read" in line for line in m._lines)
                if lost:
                    print(f"{name}: the body reader process failed {lost} times")
        finally:
            for m, _ in procs.values():
                m.stop()

    if args.callgrind:
        n = args.callgrind * args.clients
        print(f"{args.clients} clients, {args.size} {args.shape} turns, {n} requests per proxy under callgrind")
        print(f"{'proxy':14} {'instructions/req':>17} {'vs plain':>12} {'ratio':>6} {'req/s under valgrind':>21}")
        for name, ir in counts.items():
            print(f"{name:14} {ir / n:17,.0f} {(ir - counts['plain']) / n:+12,.0f} {ir / counts['plain']:6.3f} "
                  f"{RATES.get(name, 0.0):21.1f}")
        return
    print(f"{args.clients} clients, {args.size} {args.shape} turns, {args.rounds} phases of {args.seconds:g} s "
          f"per proxy; medians")
    print(f"{'proxy':14} {'req/s':>7} {'cpu/req ms':>11} {'main':>6} {'others':>7} {'of them, processes':>19} "
          f"{'vs plain':>9}")
    plain = statistics.median(x[1] for x in rows["plain"])
    for name, got in rows.items():
        rate = statistics.median(x[0] for x in got)
        cpu = statistics.median(x[1] for x in got)
        main_ms = statistics.median(x[2] for x in got)
        kids = statistics.median(x[3] for x in got)
        print(f"{name:14} {rate:7.0f} {cpu:11.2f} {main_ms:6.2f} {cpu - main_ms:7.2f} {kids:19.2f} {cpu - plain:+9.2f}")


if __name__ == "__main__":
    main()
