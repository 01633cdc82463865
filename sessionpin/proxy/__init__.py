"""The mitmproxy shell: the only package that imports mitmproxy. Each module's docstring
lists the rules it keeps (the request path's rules are the stepper's, ``sessionpin.decision.route``;
router.py performs its effects).

``make_addons()`` returns one addon (``bundle.Sessionpin``: mitmproxy dispatches each hook
once, not once per part); its hooks call the parts below, each a file to read in one
sitting, in this order:

| part | file | job |
|---|---|---|
| ``Defaults`` | defaults.py | lazy upstream connections, no request streaming, one line per decision |
| ``ConfigWatch`` | configwatch.py | the config file: read at start, watched while running |
| ``StoreRuntime`` | storeruntime.py | the store: open, heartbeat, activity flush, index sweep, close |
| ``ConnectCheck`` | connect.py | name an unreachable server before mitmproxy's HTML 502 would |
| ``BodyLimit`` | limits.py | a 413 for an inference body over the limit, before it is buffered |
| ``PageGuard`` | browsers.py | a 403 for a web page's request (browser fetch metadata) to a server or listener of ours |
| ``StatusEndpoints`` | status.py | ``/__sessionpin/status`` and ``/metrics``, loopback only |
| ``Router`` | router.py | runs the request stepper (``sessionpin.decision.route``) on each flow |
| ``LineageWatch`` | lineagewatch.py | records, from requests and responses, what a fork of a conversation will name it by |
| ``WebSocketModels`` | websocket.py | renames the model in the messages of a WebSocket the router moved |
| ``SocketTurns`` | websocket.py | counts each turn (``response.create``) of a decided socket as a request |
| ``SocketBounds`` | wsbounds.py | a WebSocket message (inflated) over the limit closes its socket; few messages kept |
| ``LedgerWatch`` | ledgerwatch.py | every answered turn's tokens, cache read and miss reason, into the ledger |
| participants | participants.py | ``running``/``done`` of the parts the router and status call (below) |
| ``PoolOptions`` | (sessionpin.opencode_ids) | the OpenCode id pool's options |
| ``Allocations`` | allocations.py | the server pools' option (the pools themselves are a participant) |
| ``HeadBounds`` | headbounds.py | an HTTP/1 head (or chunked body line) past 256 KiB fails its connection, before it is buffered further; HTTP/1 trailers are dropped, not crashed on |

The participants (``participants.Participant``, one interface, every method called as
written): ``LedgerMetrics`` (the ledger's counters, for ``/metrics``), the OpenCode id pool
(``sessionpin.opencode_ids``) and ``Allocations`` (server pools: allocations, member checks, quota
from answers). The router calls them after its decision, the status endpoint for their
status and metrics, the store runtime with each store it opens.

Rules this package keeps:
- Parts share state by reference, handed over here (the decision lines, a ``DecisionLog``
  gathered per turn of the event loop for stdout, are written by ``Router`` and pointed by
  ``Defaults``); per-flow facts pass in ``flow.metadata`` (``bundle`` says how), never in a
  part's dict keyed by flow.
- No state is the process's: everything is built by ``make_addons``; the OpenCode id pool's
  manager is kept on mitmproxy's master by ``PoolOptions.load`` (a script reload builds the
  addon anew on the same master, and finds the same pool: ``sessionpin.opencode_ids`` says why it
  must). ``tests/test_package.py`` checks that the shell and the pool keep no module-level
  state. The changes the process sees are ``wsbounds``' and ``headbounds``': while a
  ``SocketBounds`` (a ``HeadBounds``) is loaded, mitmproxy's WebSocket connection class (its
  HTTP/1 connection classes), themselves the process's, are replaced by bounded ones, and put
  back when the last one is done.
"""

from __future__ import annotations

from mitmproxy import exceptions

from .allocations import Allocations
from .browsers import PageGuard
from .bundle import Idle, Sessionpin
from .configwatch import ConfigWatch
from .connect import ConnectCheck
from .defaults import DecisionLog, Defaults
from .headbounds import HeadBounds
from .limits import BodyLimit
from .offprocess import BodyProcess
from .participants import Participant
from .ledgerwatch import LedgerMetrics, LedgerWatch
from .lineagewatch import LineageWatch
from .websocket import SocketTurns, WebSocketModels
from .wsbounds import SocketBounds
from .router import Metrics, Router
from .status import StatusEndpoints
from .storeruntime import StoreRuntime

__all__ = ["make_addons", "Participant", "Sessionpin", "ConfigWatch", "ConnectCheck", "Defaults", "Metrics", "Router", "StatusEndpoints",
           "StoreRuntime"]


def make_addons(participants: list[Participant] | None = None, env=None, *, without: tuple[str, ...] = ()
                ) -> list[object]:
    """The one addon of a sessionpin proxy, in a list (what ``addons =`` in a mitmproxy script
    holds). ``participants`` default to the OpenCode id pool; pass ``[]`` to leave it out.
    ``without``: "lineage" and/or "ledger", parts left out (``scripts/bench_proxy.py``
    measures what each costs)."""
    pool_options = None
    if participants is None:
        from ..opencode_ids.participant import PoolOptions, PoolParticipant

        pool = PoolParticipant()
        participants = [pool]
        pool_options = PoolOptions(pool, exceptions.OptionsError)
    config = ConfigWatch(env)
    runtime = StoreRuntime(env)
    connect = ConnectCheck(config)
    metrics = Metrics()
    decisions = DecisionLog()
    allocations = Allocations(config, runtime, connect)
    ledger = LedgerWatch(runtime)     # after LineageWatch: it chains onto that part's stream reader
    participants = [LedgerMetrics(ledger), *participants, allocations]
    status = StatusEndpoints(config, runtime, connect, metrics, participants, env)
    router = Router(config, runtime, connect, metrics, participants, env, allocations, decisions)
    # the ledger's body reader is its own: a request's facts (on its path) never wait behind a
    # turn's shape (after its answer; a hostile body's up to the reader's timeout)
    ledger.bodies = BodyProcess()
    watch = LineageWatch(runtime)
    metrics.lineage = watch.counts
    router.lineage = None if "lineage" in without else watch
    runtime.config_path = lambda: str(config.path) if config.path else None
    runtime.token = status.token
    for p in participants:
        runtime.on_store(p.configure_store)
    return [Sessionpin(defaults=Defaults(decisions), config=config, runtime=runtime, connect=connect,
                       limit=BodyLimit(config, metrics), pages=PageGuard(config, metrics), status=status,
                       router=router, lineage=Idle() if "lineage" in without else watch,
                       ws_models=WebSocketModels(), ws_turns=SocketTurns(runtime), ws_bounds=SocketBounds(),
                       ledger=Idle() if "ledger" in without else ledger, participants=participants,
                       pool_options=pool_options, allocations=allocations, heads=HeadBounds())]
