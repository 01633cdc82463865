"""The pool's side of the participant seam (``sessionpin.proxy.participants.Participant``).

``PoolParticipant`` has every method of that interface (the shell calls each as written;
this package may not import the shell, so it does not subclass it: a test checks it).
Duck-typed over mitmproxy's objects, so this module does not import mitmproxy: it reads
``flow.request.method/url/headers``, sets one request header, keeps its decision in
``flow.metadata["sessionpin_pool"]`` (and a line of ``flow.comment``) and reads
``flow.response.status_code/headers``.

Hooks, in the order mitmproxy drives them:
- ``PoolOptions.load(loader)``: registers every option of ``pool.options.OPTIONS``; it
  keeps ``loader.master.options`` to read values from (no ``mitmproxy.ctx``).
- ``PoolOptions.configure(updated)`` -> ``PoolParticipant.configure(values)``: parse the
  options (``ValueError`` -> the addon's OptionsError). The values are every
  ``sessionpin_pool_*`` option plus mitmproxy's upstream options
  (``upstream.UPSTREAM_OPTIONS``: mode, upstream_auth, ssl_insecure,
  ssl_verify_upstream_trusted_ca/confdir), so probes go out the way mitmproxy's upstream
  connections go. A shell that drives the participant without ``PoolOptions`` passes the
  same values.
- ``configure_store(store)`` (called by the store runtime when its store opens): with both a
  config and a store, attach to the proxy's ``pool.Manager`` (``PoolOptions.load`` takes it
  from mitmproxy's master: the same service after a reload; a participant driven without
  it makes its own).
- ``running()``: start the refresh loop (sync). ``done()``: detach (sync). ``wants(method,
  url)``: is the request in the pool's scope (the router reads its facts only then).
- ``request(flow, facts, decision)``: after the router decided; the request's *current*
  URL decides the scope, so a request the router sent elsewhere is left alone. A
  conversation named by the fingerprint of its opening (pi) is keyed by the session the
  router resolved and pinned (``conversation``), never by the fingerprint: two conversations
  that opened alike share it. One the router did not resolve (the gateway is not a server
  it routes) is keyed by its fingerprint, as before, and the log says once that conversations
  that opened alike then share an id. When the
  pool's store failed twice it returns the service's ``Refuse`` (and changes nothing): the
  router answers the flow with it, as it answers its own refusals.
- ``responseheaders(flow)``: starts the observation as a task of its own (on the running
  loop; the async store keeps SQLite off it) and returns at once, so the stream is never
  held up (seeds/002 §7: observe is not awaited). ``done()`` lets running observations
  finish in the background.
- ``status()`` is synchronous (in-memory counters); ``await metrics()`` reads the store.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

from . import Manager, manager_of, report
from .options import OPTIONS, PoolConfig, parse
from .service import HEADER, PoolService, Route, scope_of
from .upstream import UPSTREAM_OPTIONS
from ..reader import headerview
from ..decision import ladder
from ..decision.steps import Refuse

log = logging.getLogger(__name__)
META = "sessionpin_pool"
FINGERPRINT = "fingerprint"     # a session the reader made of a conversation's opening (``Facts.session_source``)


class PoolParticipant:
    name = "pool"        # its key under "participants" in /__sessionpin/status

    def __init__(self, manager: Manager | None = None) -> None:
        self._manager = manager     # None: the proxy's, from PoolOptions.load (else its own, on first use)
        self.cfg: PoolConfig | None = None
        self.store = None
        self.service: PoolService | None = None
        self._running = False
        self._observing: set[asyncio.Task] = set()   # referenced until done, so none is collected mid-way
        self._hosts: tuple[PoolConfig, frozenset[str]] | None = None   # the gateways' hosts, for that config

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def manager(self) -> Manager:
        if self._manager is None:
            self._manager = Manager()
        return self._manager

    def adopt(self, manager: Manager) -> None:
        """Use the proxy's manager (``PoolOptions.load``), unless one was given or already used."""
        if self._manager is None:
            self._manager = manager

    def configure(self, values: dict[str, Any]) -> None:
        self.cfg = parse(values)
        self._attach()

    def configure_store(self, store) -> None:
        self.store = store
        self._attach()

    def _attach(self) -> None:
        if self.cfg is not None and self.store is not None:
            self.service = self.manager.attach(self, self.cfg, self.store)
            if not self.cfg.enabled:
                self.service.stop()
            elif self._running:   # configured while running: (re)start
                self.manager.start(self)

    def running(self) -> None:
        self._running = True
        self.manager.start(self)

    def done(self) -> None:
        self._running = False
        self.manager.detach(self)

    # ---- flows -------------------------------------------------------------------------------

    def wants(self, method: str, url: str) -> bool:
        """Is this request in the pool's scope? Cheap; lets the router skip reading facts."""
        svc = self.service
        return svc is not None and scope_of(svc.cfg, method, url) is not None

    async def request(self, flow, facts=None, decision=None) -> Refuse | None:
        svc = self.service
        if svc is None or not svc.cfg.enabled or flow.response is not None:
            return None
        req = flow.request
        host = getattr(req, "host", None)     # (a request of its own tests' may carry just a url)
        if isinstance(host, str) and not self._gateway_host(svc.cfg, host):
            return None         # (the scope's test below builds the URL and parses it: ~10 µs a request)
        if facts is None:
            from ..reader import facts as F
            facts = F.read(req.method, req.url, req.headers.fields, req.raw_content,
                           headerview.get(req.headers, "content-encoding", None))
        session = conversation(flow, facts, decision)
        unresolved = session is None and facts.session_source == FINGERPRINT
        route = await svc.route(req.method, req.url, req.headers, session=facts.session if unresolved else session,
                                model=facts.model, opening=not facts.has_history, unresolved=unresolved)
        if route is None:
            return None
        if isinstance(route, Refuse):
            return route
        if headerview.get(req.headers, HEADER, None) != route.routed_id:
            req.headers[HEADER] = route.routed_id
        flow.metadata[META] = {"key": route.key, "id": route.routed_id, "how": route.how,
                               "provider": route.provider, "model": route.model, "origin": route.origin,
                               "client_id": route.client_id}
        note = f"pool: {route.how} {route.routed_id[:8]}"   # shown in mitmweb next to the router's note
        flow.comment = f"{flow.comment}\n{note}" if flow.comment else note
        log.info("sessionpin pool: %s %s -> %s (%s)", route.provider, route.model, route.routed_id[:8], route.how)
        return None

    def _gateway_host(self, cfg: PoolConfig, host: str) -> bool:
        """Could a request to ``host`` be in the pool's scope? (a gateway's origin names its
        host: ``scope_of`` decides the rest)."""
        known = self._hosts
        if known is None or known[0] is not cfg:
            names = set()
            for origin in cfg.gateways:
                try:
                    name = urlsplit(origin).hostname
                except ValueError:
                    name = None
                if name is None:
                    return True           # an origin we cannot name a host of: ask scope_of
                names.add(name)
            known = self._hosts = (cfg, frozenset(names))
        return host.lower().strip("[]") in known[1]

    def responseheaders(self, flow) -> asyncio.Task | None:
        """Start observing a pooled response; returns the task (None when nothing is observed)."""
        meta = flow.metadata.get(META)
        svc = self.service
        if not meta or svc is None or flow.response is None:
            return None
        route = Route(meta["key"], meta["id"], meta["how"], meta["provider"], meta["model"], meta["origin"],
                      meta["client_id"])
        if not route.observed:
            return None
        headers = {k.lower(): v for k, v in flow.response.headers.items()}
        task = asyncio.get_running_loop().create_task(_observe(svc, route, flow.response.status_code, headers),
                                                      name="sessionpin-pool-observe")
        self._observing.add(task)
        task.add_done_callback(self._observing.discard)
        return task

    # ---- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        svc = self.service
        if svc is None:
            return {"enabled": False, "refresh_running": False, "counters": {}}
        return report.status(svc.counters, running=svc.running, enabled=svc.cfg.enabled, loops=svc.loops_alive)

    async def metrics(self) -> str:
        svc = self.service
        if svc is None:
            return ""
        try:
            snap = await report.snapshot(svc.store, svc.clock.now_ms(), svc.cfg.ttl_ms)
        except Exception:
            snap = None
        return report.metrics(svc.counters, snap)


class PoolOptions:
    """A tiny addon that only owns the pool's options (load/configure), feeding the participant."""

    def __init__(self, participant: PoolParticipant, error: type[Exception] = ValueError) -> None:
        self.participant = participant
        self.error = error       # the addon passes mitmproxy's OptionsError
        self._options = None

    def load(self, loader) -> None:
        for o in OPTIONS:
            loader.add_option(o.name, o.type, o.default, o.help)
        self._options = loader.master.options
        self.participant.adopt(manager_of(loader.master))

    def configure(self, updated: set[str]) -> None:
        if self._options is None or not any(n.startswith("sessionpin_pool") or n in UPSTREAM_OPTIONS
                                            for n in updated):
            return
        values = {o.name: getattr(self._options, o.name) for o in OPTIONS}
        for name in UPSTREAM_OPTIONS:     # mitmproxy's; upstream_auth belongs to an addon that may be absent
            values[name] = getattr(self._options, name, None)
        try:
            self.participant.configure(values)
        except ValueError as e:
            raise self.error(str(e)) from None


def conversation(flow, facts, decision) -> str | None:
    """The conversation a request's binding is keyed by (the client's own ``x-opencode-session``
    comes first, in the service): the reader's session, but for a conversation named by the
    fingerprint of its opening (pi, which sends no id) the session the router resolved it to
    (``flow.metadata["sessionpin"]["session"]``: the fingerprint, a nonce and its lineage), and
    only when the router holds a pin for it (its decision creates or renews one) — two
    conversations that opened alike share the fingerprint, so the fingerprint alone, or a
    session the router resolved without pinning it (an opening's fresh nonce, which no later
    turn finds), would give two conversations one id, or one conversation two. None: no
    conversation the pool may key by."""
    if facts.session_source != FINGERPRINT:
        return facts.session
    resolved = (flow.metadata.get("sessionpin") or {}).get("session")
    if (decision is None or decision.refuse is not None or decision.pin_action not in (ladder.CREATE, ladder.RENEW)
            or not isinstance(resolved, str) or not resolved or resolved == facts.session):
        return None
    return resolved


async def _observe(svc: PoolService, route: Route, status: int, headers: dict[str, str]) -> str:
    """``svc.observe`` once mitmproxy has sent on what the hook let go. Its loop starts tasks
    eagerly: the observation's store read and write ran inside ``responseheaders``, ahead of the
    stream (seeds/002 §7: not held up). Two turns of the loop: mitmproxy sends a hook's message
    one turn after the hook returns (as the shell's ``later.after_hook``, which the pool does
    not import: the shell drives the pool)."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    return await svc.observe(route, status, headers)
