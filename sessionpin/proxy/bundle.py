"""Sessionpin: the one addon mitmproxy loads; its hooks call the small parts, in order.

mitmproxy dispatches every hook of every flow to each addon it holds (``_iter_hooks``,
``traverse``, a ``safecall`` per addon per hook: +0.09 ms of CPU per request for the 13
addons this bundle used to be, issue 22). Here mitmproxy sees one object; each hook below
calls the parts that take it, as plain method calls, in the order of ``ORDER`` (the order
the parts were registered in when each was an addon). The parts keep their own files and
know nothing of this one.

Rules this module keeps:
- A hook exists here only if some part takes it (``tests/test_proxy_bundle.py`` compares
  the two sets); each calls exactly the parts written for it — its row in ``__init__``, or,
  for a hook one part takes, the call in the hook itself — never looked up by name.
- A part's exception is logged with the part's name and the hook's, and the hook goes on
  with the next part (mitmproxy's ``safecall`` logged it too, but then skipped every later
  addon of the script for that hook: a failing ``BodyLimit`` sent the request on unrouted).
  A flow is never dropped by a part's failure: the router still decides it. ``OptionsError`` (an option refused: mitmproxy undoes the update)
  and ``AddonHalt`` go through, as mitmproxy lets them.
- ``load`` reaches every part, so every option is registered; ``configure`` reaches every
  part (an ``OptionsError`` stops it, as it stopped mitmproxy's chain).
- A part's flow hook that returns an awaitable (the ledger's ``response`` for a large
  request) is awaited before the next part's hook runs, as mitmproxy awaited it. The hooks
  mitmproxy may call from synchronous code (``load``, ``configure``, ``running``, ``done``)
  call every part at once and hand what is to be awaited (``StoreRuntime.done``'s task on
  Redis, already scheduled) back to mitmproxy: the parts after the store's ``done`` no
  longer wait for its last words (they never depended on them).
- A clean stop loses no record a watch holds back for its batch (``LineageWatch``'s roots
  and anchors, ``LedgerWatch``'s turns): when mitmproxy is stopping and one has work
  pending, ``done`` first lets it finish and write while the store is still open — in a task
  handed to mitmproxy, which awaits it at exit; at most ``DRAIN_TIMEOUT``, then what is left
  is dropped with one warning — and only then calls every part's ``done``, the store's close
  among them. A script reload's ``done`` (synchronous, not awaited) calls them at once.
- Per-flow facts pass between parts in ``flow.metadata`` (``"sessionpin"``: the decision;
  ``"sessionpin.*"``: a part's own, removed when its flow ends): no part keeps a dict keyed
  by flow.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Awaitable, Callable, Sequence

from mitmproxy import exceptions

from . import perflow

log = logging.getLogger("sessionpin")

_THROUGH = (exceptions.OptionsError, exceptions.AddonHalt)

DRAIN_TIMEOUT = 2.0     # seconds a clean stop waits for the watches' pending records, at most

# the parts, in the order each hook calls them (a hook skips the parts that do not take it)
ORDER = ("defaults", "config", "runtime", "connect", "limit", "pages", "status", "router", "lineage",
         "ws_models", "ws_turns", "ws_bounds", "ledger", "participants", "pool_options", "allocations", "heads")


class Sessionpin:
    """The addon. ``parts`` maps the names of ``ORDER`` to the part objects
    (``participants``: a list; ``pool_options``: None when the OpenCode id pool is left out)."""

    name = "sessionpin"

    def __init__(self, **parts: Any) -> None:
        self.defaults = d = parts["defaults"]
        self.config = c = parts["config"]
        self.runtime = rt = parts["runtime"]
        self.connect = cc = parts["connect"]
        self.limit = bl = parts["limit"]
        self.pages = pg = parts["pages"]
        self.status = st = parts["status"]
        self.router = r = parts["router"]
        self.lineage = lw = parts["lineage"]
        self.ws_models = wm = parts["ws_models"]
        self.ws_turns = wt = parts["ws_turns"]
        self.ws_bounds = wb = parts["ws_bounds"]
        self.ledger = lg = parts["ledger"]
        self.participants: list[Any] = list(parts["participants"])
        self.pool_options = po = parts.get("pool_options")
        self.allocations = al = parts["allocations"]
        self.heads = hb = parts["heads"]
        ps = self.participants
        opt = (po,) if po is not None else ()

        # hook -> the parts' methods it calls, in order
        self._load = (d.load, c.load, rt.load, cc.load, bl.load, pg.load, r.load, wb.load, lg.load,
                      *(p.load for p in opt), al.load, hb.load)
        self._configure = (d.configure, c.configure, rt.configure, cc.configure, bl.configure, pg.configure,
                           wb.configure, lg.configure, *(p.configure for p in opt))
        # (the defaults' last: what it freezes out of the collector is what the others made ready)
        self._running = (c.running, rt.running, bl.running, *(p.running for p in ps), d.running)
        self._done = (d.done, c.done, rt.done, cc.done, bl.done, r.done, lw.done, wb.done, lg.done,
                      *(p.done for p in ps), hb.done)
        self._requestheaders = (cc.requestheaders, bl.requestheaders)
        self._request = (bl.request, pg.request, st.request, r.request)
        self._responseheaders = (r.responseheaders, lw.responseheaders, lg.responseheaders)
        self._response = (bl.response, r.response, lw.response, lg.response)
        self._error = (bl.error, r.error, lw.error, wb.error, lg.error)
        self._websocket_message = (wm.websocket_message, wt.websocket_message, wb.websocket_message,
                                   lg.websocket_message)
        self._websocket_end = (wb.websocket_end, lg.websocket_end)

    @property
    def parts(self) -> list[Any]:
        """The part objects, in ``ORDER`` (each once)."""
        out: list[Any] = []
        for n in ORDER:
            got = getattr(self, n)
            for p in (got if isinstance(got, list) else [got]):
                if p is not None and all(p is not q for q in out):
                    out.append(p)
        return out

    # ---- lifecycle (mitmproxy may call these from synchronous code) ----------------------------
    def load(self, loader) -> None:
        _every(self._load, "load", loader)

    def configure(self, updated: set[str]) -> None:
        _every(self._configure, "configure", updated)

    def running(self) -> None:
        _every(self._running, "running")

    def done(self) -> Awaitable[Any] | None:
        """Every part's ``done``; first, when mitmproxy is stopping and a watch has records not yet
        written (a stop inside their batching window), those are written while the store is open:
        a task that drains them (``DRAIN_TIMEOUT`` at most) and then calls the parts, handed to
        mitmproxy, which awaits it. A script reload's ``done`` (synchronous) calls them at once."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        busy = [w for w in (self.lineage, self.ledger) if _busy(w)] if loop is not None and _exiting() else []
        if not busy:
            return _every(self._done, "done")
        return loop.create_task(self._drained_then_done(busy))

    async def _drained_then_done(self, busy: list[Any]) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(w.drain() for w in busy)), DRAIN_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning("sessionpin: at exit: lineage records and ledger turns not written within %g s: "
                        "dropped (forks of those conversations may be left alone)", DRAIN_TIMEOUT)
        except Exception:
            log.exception("sessionpin: at exit: cannot write the pending records")
        got = _every(self._done, "done")
        if got is not None:
            await got

    # ---- connections ---------------------------------------------------------------------------
    def client_connected(self, client) -> None:
        _one(self.connect.client_connected, "client_connected", client)

    def client_disconnected(self, client) -> None:
        _one(self.connect.client_disconnected, "client_disconnected", client)

    def http_connect(self, flow) -> None:
        _one(self.connect.http_connect, "http_connect", flow)

    async def server_connect(self, data) -> None:
        try:
            await self.connect.server_connect(data)
        except _THROUGH:
            raise
        except Exception:
            _failed(self.connect.server_connect, "server_connect")

    def server_connected(self, data) -> None:
        _one(self.connect.server_connected, "server_connected", data)

    def server_disconnected(self, data) -> None:
        _one(self.connect.server_disconnected, "server_disconnected", data)

    def server_connect_error(self, data) -> None:
        _one(self.connect.server_connect_error, "server_connect_error", data)

    # ---- a flow ------------------------------------------------------------------------------
    def requestheaders(self, flow) -> None:
        for fn in self._requestheaders:
            try:
                fn(flow)
            except _THROUGH:
                raise
            except Exception:
                _failed(fn, "requestheaders")

    async def request(self, flow) -> None:
        for fn in self._request:
            try:
                got = fn(flow)
                if got is not None and inspect.isawaitable(got):
                    await got
            except _THROUGH:
                raise
            except Exception:
                _failed(fn, "request")

    def responseheaders(self, flow) -> None:
        for fn in self._responseheaders:
            try:
                fn(flow)
            except _THROUGH:
                raise
            except Exception:
                _failed(fn, "responseheaders")

    def response(self, flow) -> Awaitable[None] | None:
        return _dropping_body(_sync(self._response, "response", flow), flow)

    def error(self, flow) -> Awaitable[None] | None:
        return _dropping_body(_sync(self._error, "error", flow), flow)

    def websocket_start(self, flow) -> None:
        _one(self.ledger.websocket_start, "websocket_start", flow)

    def websocket_message(self, flow) -> None:
        for fn in self._websocket_message:
            try:
                fn(flow)
            except _THROUGH:
                raise
            except Exception:
                _failed(fn, "websocket_message")

    def websocket_end(self, flow) -> None:
        for fn in self._websocket_end:
            try:
                fn(flow)
            except _THROUGH:
                raise
            except Exception:
                _failed(fn, "websocket_end")


class Idle:
    """A part left out (``make_addons(without=...)``): every hook of it does nothing."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("__"):
            raise AttributeError(name)
        return _nothing


def _nothing(*args: Any) -> None:
    return None


def _exiting() -> bool:
    """mitmproxy is stopping (SIGTERM, SIGINT, ``q``: its master's exit is set), as opposed to a
    script reload, whose ``done`` is called from synchronous code and is not awaited."""
    try:
        from mitmproxy import ctx
        return ctx.master.should_exit.is_set()
    except Exception:
        return False


def _busy(part: Any) -> bool:
    """A watch with work a stop would lose (``busy()``); a part left out (``Idle``) has none."""
    try:
        return not isinstance(part, Idle) and bool(part.busy())
    except Exception:
        _failed(_busy, "done")
        return False


def _one(fn: Callable[..., Any], hook: str, *args: Any) -> None:
    try:
        fn(*args)
    except _THROUGH:
        raise
    except Exception:
        _failed(fn, hook)


def _every(fns: Sequence[Callable[..., Any]], hook: str, *args: Any) -> Awaitable[Any] | None:
    """Call every one of ``fns`` now, in order (mitmproxy may call these hooks from synchronous
    code: a script reload's ``done``). What they return to be awaited (``StoreRuntime.done``'s
    task on Redis: already scheduled, so it runs either way) is handed back to mitmproxy."""
    pending = []
    for fn in fns:
        try:
            got = fn(*args)
        except _THROUGH:
            raise
        except Exception:
            _failed(fn, hook)
            continue
        if got is not None and inspect.isawaitable(got):
            pending.append(got)
    if not pending:
        return None
    return pending[0] if len(pending) == 1 else asyncio.gather(*pending)


def _sync(fns: Sequence[Callable[..., Any]], hook: str, *args: Any) -> Awaitable[None] | None:
    """Call ``fns`` in order; once one returns an awaitable, the rest run after it is awaited
    (the returned coroutine: mitmproxy awaits it, or, from synchronous code, drops it as it
    dropped the part's own)."""
    for i, fn in enumerate(fns):
        try:
            got = fn(*args)
        except _THROUGH:
            raise
        except Exception:
            _failed(fn, hook)
            continue
        if got is not None and inspect.isawaitable(got):
            return _rest(got, fns[i], fns[i + 1:], hook, args)
    return None


def _dropping_body(got: Awaitable[None] | None, flow) -> Awaitable[None] | None:
    """The router's body members (``perflow.BODY``: for the parts after it) go once every part
    took the flow's response or error — at once, or after what is awaited."""
    if got is None:
        flow.metadata.pop(perflow.BODY, None)
        return None

    async def then() -> None:
        try:
            await got
        finally:
            flow.metadata.pop(perflow.BODY, None)
    return then()


async def _rest(first: Awaitable[Any], owner: Callable[..., Any], fns: Sequence[Callable[..., Any]], hook: str,
                args: tuple) -> None:
    try:
        await first
    except _THROUGH:
        raise
    except Exception:
        _failed(owner, hook)
    for fn in fns:
        try:
            got = fn(*args)
            if got is not None and inspect.isawaitable(got):
                await got
        except _THROUGH:
            raise
        except Exception:
            _failed(fn, hook)


def _failed(fn: Callable[..., Any], hook: str) -> None:
    part = getattr(fn, "__self__", None)
    log.exception("sessionpin: %s.%s failed", type(part).__name__ if part is not None else fn, hook)
