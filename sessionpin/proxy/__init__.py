"""The mitmproxy shell: the only package that imports mitmproxy. Each module's docstring
lists the rules it keeps (the request path's rules are the stepper's, ``sessionpin.route``;
router.py performs its effects).

``make_addons()`` lists its addons, each a file to read in one sitting, in the order
mitmproxy runs their hooks:

| addon | file | job |
|---|---|---|
| ``Defaults`` | defaults.py | lazy upstream connections, no request streaming, one line per decision |
| ``ConfigWatch`` | configwatch.py | the config file: read at start, watched while running |
| ``StoreRuntime`` | storeruntime.py | the store: open, heartbeat, activity flush, index sweep, close |
| ``ConnectCheck`` | connect.py | name an unreachable server before mitmproxy's HTML 502 would |
| ``StatusEndpoints`` | status.py | ``/__sessionpin/status`` and ``/metrics``, loopback only |
| ``BodyLimit`` | limits.py | a 413 for an inference body over the limit, before it is buffered |
| ``PageGuard`` | browsers.py | a 403 for a web page's request (browser fetch metadata) to a server or listener of ours |
| ``Router`` | router.py | runs the request stepper (``sessionpin.route``) on each flow |
| ``LineageWatch`` | lineagewatch.py | records, from requests and responses, what a fork of a conversation will name it by |
| ``WebSocketModels`` | websocket.py | renames the model in the messages of a WebSocket the router moved |
| ``SocketTurns`` | websocket.py | counts each turn (``response.create``) of a decided socket as a request |
| ``LedgerWatch`` | ledgerwatch.py | every answered turn's tokens, cache read and miss reason, into the ledger |
| ``SocketBounds`` | wsbounds.py | a WebSocket message (inflated) over the limit closes its socket; few messages kept |
| ``Allocations`` | allocations.py | server pools: allocations, member checks, quota from answers (a participant) |
| ``PoolOptions`` | (sessionpin.pool) | the OpenCode id pool's options; the pool is a router participant |

They share state by reference, handed over here: the decision lines (a ``DecisionLog``,
gathered per turn of the event loop for stdout) are the tree's, written by ``Router`` and
pointed by ``Defaults``. No state is the process's: the OpenCode id pool's manager is kept
on mitmproxy's master by ``PoolOptions.load`` (a script reload builds the addons anew on
the same master, and finds the same pool: ``sessionpin.pool`` says why it must).
``tests/test_package.py`` checks that the shell and the pool keep no module-level state.
"""

from __future__ import annotations

from typing import Any

from mitmproxy import exceptions

from .allocations import Allocations
from .browsers import PageGuard
from .configwatch import ConfigWatch
from .connect import ConnectCheck
from .defaults import DecisionLog, Defaults
from .limits import BodyLimit
from .ledgerwatch import LedgerMetrics, LedgerWatch
from .lineagewatch import LineageWatch
from .websocket import SocketTurns, WebSocketModels
from .wsbounds import SocketBounds
from .router import Metrics, Router
from .status import StatusEndpoints
from .storeruntime import StoreRuntime

__all__ = ["make_addons", "ConfigWatch", "ConnectCheck", "Defaults", "Metrics", "Router", "StatusEndpoints",
           "StoreRuntime"]


def make_addons(participants: list[Any] | None = None, env=None) -> list[object]:
    """The addons of one sessionpin proxy. ``participants`` default to the OpenCode id pool;
    pass ``[]`` to leave it out."""
    extra: list[object] = []
    if participants is None:
        from ..pool.participant import PoolOptions, PoolParticipant

        pool = PoolParticipant()
        participants = [pool]
        extra = [PoolOptions(pool, exceptions.OptionsError)]
    config = ConfigWatch(env)
    runtime = StoreRuntime(env)
    connect = ConnectCheck(config)
    metrics = Metrics()
    decisions = DecisionLog()
    allocations = Allocations(config, runtime, connect)
    ledger = LedgerWatch(runtime)     # after LineageWatch: it chains onto that addon's stream reader
    participants = [LedgerMetrics(ledger), *participants, allocations]
    status = StatusEndpoints(config, runtime, connect, metrics, participants, env)
    router = Router(config, runtime, connect, metrics, participants, env, allocations, decisions)
    ledger.bodies = router.bodies     # one body reader process: the router's facts, the ledger's shapes
    router.lineage = watch = LineageWatch(runtime)
    metrics.lineage = watch.counts
    runtime.config_path = lambda: str(config.path) if config.path else None
    runtime.token = status.token
    for p in participants:
        if hasattr(p, "configure_store"):
            runtime.on_store(p.configure_store)
    lifecycle = [_Lifecycle(participants)] if participants else []
    return [Defaults(decisions), config, runtime, connect, BodyLimit(config, metrics), PageGuard(config, metrics), status, router,
            watch, WebSocketModels(), SocketTurns(runtime), SocketBounds(), ledger, *lifecycle, *extra, _Options(allocations)]


class _Options:
    """Registers the server pools' option (``Allocations`` itself is a router participant,
    whose hooks the router calls)."""

    def __init__(self, allocations: Allocations) -> None:
        self.allocations = allocations

    def load(self, loader) -> None:
        self.allocations.load(loader)


class _Lifecycle:
    """Hands mitmproxy's running/done to the router's participants (a participant's
    exception is logged, never raised)."""

    def __init__(self, participants: list[Any]) -> None:
        self.participants = participants

    def running(self) -> None:
        self._call("running")

    def done(self) -> None:
        self._call("done")

    def _call(self, name: str) -> None:
        import logging

        for p in self.participants:
            fn = getattr(p, name, None)
            if fn is None:
                continue
            try:
                fn()
            except Exception:
                logging.getLogger("sessionpin").exception("sessionpin: participant %s.%s failed",
                                                          type(p).__name__, name)
