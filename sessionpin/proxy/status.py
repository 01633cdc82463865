"""StatusEndpoints: ``/__sessionpin/status`` (JSON) and ``/__sessionpin/metrics`` (Prometheus).

Rules it keeps:
- Answered only to a loopback client, never to a web page's script (``Sec-Fetch-Site``
  other than "none"), and only when the request names the proxy itself: its Host is a
  loopback address, or it carries this process's token (``x-sessionpin-token``, from
  the heartbeat in the store — needed on a reverse-mode listener, where mitmproxy has
  replaced the Host before any hook). DNS rebinding makes any site "loopback" through
  the proxy; neither its Host nor the token gets it an answer.
- Never a walk of the pins: counts come from the store's per-server index (one
  ``zcount`` per agent and server, ``pins.counts``), off the event loop — and at most
  once per ``COUNTS_FRESH`` seconds while this proxy wrote no pin, one count at a time
  however many scrapers ask: a count is a scan of the index in SQLite (about 5 ms at
  100k pins) on the reader thread every request's pin read uses, so scrapers would
  otherwise delay every request. Another proxy's new pins show within ``COUNTS_FRESH``.
- The answers are ``documents.Status`` and the Prometheus text format; no key value
  ever appears (only whether each server's variable is set).
- These requests are the CLI's and a scraper's, not traffic: they are taken out of
  mitmweb's flow list.
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import logging
import os
import secrets
import time
from typing import Any, Awaitable, Callable, Mapping

import msgspec
from mitmproxy import ctx, http

from .. import __version__
from ..records import pins
from ..reader import facts as F
from ..records.documents import METRICS_PATH, STATUS_PATH, PinCount, ServerStatus, Status
from .configwatch import ConfigWatch
from .connect import ConnectCheck
from .exposition import family, joined
from .participants import Participant
from .router import INTERNAL_PREFIX, Metrics
from .storeruntime import StoreRuntime

log = logging.getLogger("sessionpin")

TOKEN_HEADER = "x-sessionpin-token"
ACTIVE_WINDOW = 3600.0
COUNTS_FRESH = 2.0       # seconds a count is answered again while this proxy wrote no pin
_encoder = msgspec.json.Encoder()


class StatusEndpoints:
    def __init__(self, config: ConfigWatch, runtime: StoreRuntime, connect: ConnectCheck, metrics: Metrics,
                 participants: list[Participant] | None = None, env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.runtime = runtime
        self.connect = connect
        self.metrics = metrics
        self.participants = list(participants or [])
        self.env = env if env is not None else os.environ
        self.token = secrets.token_urlsafe(24)      # published in the heartbeat only
        self._fresh = Fresh()

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        req = flow.request
        if not req.path.startswith(INTERNAL_PREFIX):
            return
        refusal = self.refusal(flow)
        if refusal:
            flow.response = http.Response.make(403, f"sessionpin: {refusal}\n".encode(), {"content-type": "text/plain"})
        else:
            path = req.path.split("?", 1)[0].rstrip("/")
            if path == STATUS_PATH:
                body = _encoder.encode(await self.status())
                flow.response = http.Response.make(200, body, {"content-type": "application/json"})
            elif path == METRICS_PATH:
                text = await self.render_metrics()
                flow.response = http.Response.make(200, text.encode(), {"content-type": "text/plain; version=0.0.4"})
            else:
                flow.response = http.Response.make(404, f"sessionpin: {STATUS_PATH} or {METRICS_PATH}\n".encode(),
                                                   {"content-type": "text/plain"})
        _out_of_view(flow)

    def refusal(self, flow: http.HTTPFlow) -> str | None:
        """Why this request may not read the status (None: it may)."""
        if not is_loopback(flow.client_conn.peername):
            return "loopback clients only"
        if flow.request.headers.get("sec-fetch-site", "none").strip().lower() != "none":
            return "not for web pages"
        token = flow.request.headers.get(TOKEN_HEADER)
        if token is not None:
            return None if secrets.compare_digest(token, self.token) else "wrong token"
        if not _loopback_host(flow.request.host_header or ""):
            return "the Host must be the proxy's own loopback address (or send the token from its heartbeat)"
        return None

    async def counts(self) -> tuple[dict[str, PinCount] | None, str | None]:
        mark = (self.metrics.pin_writes, id(self.runtime.store))
        return await self._fresh.get(("counts", mark), self._count_now, keep=lambda got: got[0] is not None)

    async def _participant(self, p: Participant, what: str) -> Any:
        """A participant's status or metrics, shared like the counts (the pool's read its spares)."""
        call = p.status if what == "status" else p.metrics
        return await self._fresh.get((what, id(p), id(self.runtime.store)), lambda: _maybe(call()))

    async def _count_now(self) -> tuple[dict[str, PinCount] | None, str | None]:
        store = self.runtime.store
        if store is None:
            return None, "no store is open"
        now = time.time()
        try:
            got = await pins.counts(store, now, now - ACTIVE_WINDOW)
        except Exception as e:
            self.metrics.store_errors += 1
            log.warning("sessionpin: counting pins in %s: %s", store.url, e)
            return None, str(e)
        return {server or pins.NOT_ROUTED: PinCount(pins=n, active=a)
                for server, (n, a) in pins.by_server(got).items()}, None

    async def status(self) -> Status:
        c = self.config.config
        counts, problem = await self.counts()
        store = self.runtime.store
        participants: dict[str, Any] = {}
        for p in self.participants:
            try:
                got = await self._participant(p, "status")
            except Exception as e:
                log.warning("sessionpin: participant %s status: %s", type(p).__name__, e)
                continue
            if got is not None:        # None: it has no status to show
                participants[p.name] = got
        return Status(
            version=__version__, pid=os.getpid(), host=self.runtime.host, started=self.runtime.started,
            config=str(self.config.path) if self.config.path else None, config_error=self.config.problem,
            store=self.runtime.url, store_info=_safe({**store.describe(), "identity": self.runtime.guard.describe()}) if store is not None else {},
            servers={s.name: ServerStatus(url=s.url, origin=s.origin, prefix=s.prefix, key_env=s.key_env,
                                          key_set=bool(s.key_env and self.env.get(s.key_env, "").strip()),
                                          auth=s.auth, models=dict(s.models))
                     for s in c.servers.values()},
            agents={a: c.current(a) for a in F.AGENTS},
            pins=counts, pins_error=problem, unreachable=dict(self.connect.unreachable),
            participants=participants, unrouted=self.metrics.unrouted.listed(c),
        )

    async def render_metrics(self) -> str:
        counts, _ = await self.counts()
        text = metrics_text(counts, self.metrics, self.metrics.store_errors + self.runtime.errors,
                            self.config.reloads, self.config.rejected, self.runtime.guard)
        for p in self.participants:
            try:
                more = await self._participant(p, "metrics")
            except Exception as e:
                log.warning("sessionpin: participant %s metrics: %s", type(p).__name__, e)
                continue
            if more:
                text += more if more.endswith("\n") else more + "\n"
        return text


def metrics_text(counts: Mapping[str, PinCount] | None, m: Metrics, store_errors: int, reloads: int,
                 rejected: int, guard: Any = None) -> str:
    """The router's families, from what was counted (no store read here)."""
    out: list[str] = []
    by_server = sorted((counts or {}).items())
    family(out, "sessionpin_pins", "gauge", 'Live pins by server ("-" = not routed); -1 when the store cannot be read.',
           ("server",), [(s, n.pins) for s, n in by_server])
    if counts is None:
        out.append("sessionpin_pins -1")
    family(out, "sessionpin_active_sessions", "gauge", "Pinned sessions seen in the last hour, by server.",
           ("server",), [(s, n.active) for s, n in by_server])
    family(out, "sessionpin_decisions_total", "counter", "Decisions on inference requests by agent, turn and outcome.",
           ("agent", "turn", "outcome"), sorted(m.decisions.items()))
    family(out, "sessionpin_decisions_by_rule_total", "counter", "Decisions by the ladder rule that made them.",
           ("rule",), sorted(m.rules.items()))
    family(out, "sessionpin_refusals_total", "counter", "Requests answered by the router with an error, by reason.",
           ("reason",), sorted(m.refusals.items()))
    family(out, "sessionpin_store_errors_total", "counter", "Store calls that failed.", (), [((), store_errors)])
    if guard is not None:
        family(out, "sessionpin_store_lost", "gauge", "1 while the store lost what it held (every routed request "
               "is refused until the operator decides).", (), [((), int(guard.lost is not None))])
        family(out, "sessionpin_store_partial_losses_total", "counter", "Sessions whose served pin the store lost.",
               (), [((), guard.partial)])
    family(out, "sessionpin_config_reloads_total", "counter", "Config files reloaded while running.", (),
           [((), reloads)])
    family(out, "sessionpin_config_rejected_total", "counter", "Config texts refused by validation while running.",
           (), [((), rejected)])
    if m.lineage is not None:
        c = m.lineage()
        family(out, "sessionpin_lineage_records_total", "counter",
               "Lineage records (what a fork will name its parent by): written, dropped (store), skipped (reads over "
               "their bound).", ("outcome",), [(k, c[k]) for k in ("written", "dropped", "skipped")])
        family(out, "sessionpin_lineage_pending", "gauge", "Lineage reads and records not yet written.", (),
               [((), c["pending"])])
    return joined(out)


def is_loopback(peer: Any) -> bool:
    try:
        ip = ipaddress.ip_address(peer[0].split("%", 1)[0])
    except (TypeError, ValueError, IndexError, AttributeError):
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _loopback_host(host_header: str) -> bool:
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _safe(info: dict[str, Any]) -> dict[str, Any]:
    """A store's description as JSON-able plain data."""
    return msgspec.json.decode(msgspec.json.encode(info, enc_hook=str))


class Fresh:
    """Values computed at most once at a time, and answered again for ``COUNTS_FRESH``
    seconds while their key stays the same (a key that changes makes a new value)."""

    def __init__(self) -> None:
        self._done: dict[Any, tuple[float, Any]] = {}
        self._running: dict[Any, asyncio.Future] = {}

    async def get(self, key: Any, compute: Callable[[], Awaitable[Any]],
                  keep: Callable[[Any], bool] = lambda _: True) -> Any:
        kind = key[:-1]            # the last part of a key is what makes a value stale
        done = self._done.get(kind)
        if done is not None and done[1][0] == key and time.monotonic() - done[0] < COUNTS_FRESH:
            return done[1][1]
        running = self._running.get(key)
        if running is None or running.done():
            running = self._running[key] = asyncio.ensure_future(self._compute(key, compute, keep))
        return await asyncio.shield(running)

    async def _compute(self, key: Any, compute: Callable[[], Awaitable[Any]], keep: Callable[[Any], bool]) -> Any:
        t0 = time.monotonic()
        try:
            value = await compute()
        finally:
            self._running.pop(key, None)
        if keep(value):
            self._done[key[:-1]] = (t0, (key, value))
        else:
            self._done.pop(key[:-1], None)
        return value


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _out_of_view(flow: http.HTTPFlow) -> None:
    """Take a status request out of mitmweb's/mitmproxy's flow list: it is not traffic."""
    try:
        view = ctx.master.addons.get("view")
        if view is not None and flow.id in getattr(view, "_store", {}):
            view.remove([flow])
    except Exception:
        pass
