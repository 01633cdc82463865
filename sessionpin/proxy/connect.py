"""ConnectCheck: is a server the router moves requests to reachable? Ask before connecting.

mitmproxy answers a failed upstream connect with an HTML 502 that names only the address
the request went to, and no hook can change that answer. A server the agent never
addressed must be named, in the agent's own error format — so before a request is sent
to a server the router moved requests to, and when no connection to it is open, the
router asks ``reachable()``: a TCP connect, closed at once. It fails → the router
answers the agent itself (a 502 naming the session, the server and its address).

Rules it keeps:
- Only for addresses requests were moved to (``moved``); only when no connection to
  that address is open (an open connection means it is up; a server that went down
  closes its connections).
- The check starts early, when a client opens a tunnel to a configured server or sends
  the headers of a request the router takes as inference (``config.Config.scope``, the
  router's own rule), so it runs while the client finishes sending —
  not between the request and the upstream connect. A check of the same client
  connection, started less than ``FRESH`` seconds before and successful, stands once.
- A client connection's checks are dropped when it closes.
- ``server_connect`` is the fallback for connections the router did not check (another
  path to the same address): it sets mitmproxy's error message to name the server.
- A server that refuses is tried again every ``RETRY_STEP`` for ``sessionpin_connect_retry_ms``
  (default 2000 ms): a server restarting, a blip, is ridden out here and the request goes
  through. Past that budget the agent is answered at once (the router's refusal is one no
  client retries: docs/traffic.md), and for ``DOWN_FOR`` seconds the address is known down:
  a request then makes one attempt of at most ``DOWN_TIMEOUT``, not the whole budget again
  (an agent's own retries must not each wait it).
- The cause is said in words, without errno numbers or the address (``why``): it reaches
  the agent's screen, where pi's own retry reads the text (docs/traffic.md).
- Not for a client of an ``upstream:`` listener, nor a connection made through an
  upstream proxy: mitmproxy reaches the server through that proxy, so a direct TCP connect
  tells nothing (behind a corporate firewall it always fails). There the proxy's own answer
  to mitmproxy's CONNECT is the check.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from mitmproxy import ctx, http
from mitmproxy.proxy import mode_specs

from .configwatch import ConfigWatch

log = logging.getLogger("sessionpin")

TIMEOUT = 10.0      # a server that does not accept TCP within this is unreachable
FRESH = 1.0         # an early check of the same client connection this recent stands
RETRY_STEP = 0.2    # seconds between connects while riding out a blip
DOWN_FOR = 10.0     # seconds an address that failed a whole budget is known down
DOWN_TIMEOUT = 2.0  # a known-down address's one attempt waits at most this

Address = tuple[str, int]


class ConnectCheck:
    def __init__(self, config: ConfigWatch) -> None:
        self.config = config
        self.moved: dict[Address, str] = {}          # addresses requests were moved to -> server name
        self.open: Counter[Address] = Counter()      # upstream connections open now
        self.unreachable: dict[str, str] = {}        # server name -> last error
        self.failures = 0
        # (client connection id, address) -> (started, check task)
        self._checks: dict[tuple[str, Address], tuple[float, asyncio.Task]] = {}
        self.via_proxy: set[str] = set()             # clients of an upstream: listener
        self.down: dict[Address, float] = {}         # address -> when it failed a whole budget (monotonic)
        # ``sessionpin_connect_check`` as ``configure`` last saw it (reading ``ctx.options``
        # deep-copies the value: ~1 µs, twice a request); None until then (a bare part in a test)
        self._on: bool | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "sessionpin_connect_check", bool, True,
            "sessionpin: before a new connection to a server requests were moved to (and none to it is open), "
            "try a TCP connect, so that an unreachable server is named in the agent's error.",
        )
        loader.add_option(
            "sessionpin_connect_retry_ms", int, 2000,
            "sessionpin: how long a server requests were moved to may refuse connections (a restart, a blip) "
            "before the agent is told it cannot be reached; 0: tell at once.",
        )

    def configure(self, updated: set[str]) -> None:
        if "sessionpin_connect_check" in updated:
            self._on = bool(ctx.options.sessionpin_connect_check)

    def _checking(self) -> bool:
        return self._on if self._on is not None else bool(ctx.options.sessionpin_connect_check)

    def done(self) -> None:
        for _, task in self._checks.values():
            task.cancel()
        self._checks.clear()

    def client_connected(self, client) -> None:
        if isinstance(getattr(client, "proxy_mode", None), mode_specs.UpstreamMode):
            self.via_proxy.add(client.id)

    def client_disconnected(self, client) -> None:
        self.via_proxy.discard(client.id)
        # its checks go with it (an early check no request took, one kept for a connection
        # mitmproxy never made): nothing of a connection outlives it
        for key in [k for k in self._checks if k[0] == client.id]:
            self._checks.pop(key)[1].cancel()

    def moved_to(self, address: Address, server: str) -> None:
        self.moved[(address[0].lower(), address[1])] = server

    # ---- the early start ------------------------------------------------------------------
    def http_connect(self, flow: http.HTTPFlow) -> None:
        req = flow.request      # a CONNECT has no scheme: host and port say which server
        if self.moved and self.config.config.server_at(req.host, req.port) is not None:
            self._start(flow.client_conn.id)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        # the router's own scope rule (``config.Config.scope``): a server written
        # ``…/api/paas/v4`` has its requests checked early as it has them routed
        if self.moved and self.config.config.scope(req.method, req.scheme, req.host, req.port,
                                                   req.path)[1].inference:
            self._start(flow.client_conn.id)

    def _start(self, client: str) -> None:
        if not self.moved or not self._checking() or client in self.via_proxy:
            return
        now = time.monotonic()
        for key in [k for k, (t, task) in self._checks.items() if now - t > FRESH and task.done()]:
            del self._checks[key]
        for addr in list(self.moved):
            if self.open[addr] > 0:
                continue
            early = self._checks.get((client, addr))
            if early is not None and (now - early[0] < FRESH or not early[1].done()):
                continue
            self._checks[(client, addr)] = (now, asyncio.get_running_loop().create_task(_connect(addr)))

    # ---- the check ------------------------------------------------------------------------
    async def reachable(self, client: str, address: Address, ride_out: bool = True) -> str | None:
        """None when ``address`` is up (or need not be checked), else why it is not.
        ``ride_out=False``: no budget for a blip (a soft pool's member: another one takes it)."""
        addr = (address[0].lower(), address[1])
        if not self._checking() or self.open[addr] > 0 or client in self.via_proxy:
            return None
        err = await self._check(client, addr, keep=True)
        if err is not None and ride_out:
            err = await self._ride_out(addr, err)
        name = self.moved.get(addr)
        if err is None:
            self.down.pop(addr, None)
            if name:
                self.unreachable.pop(name, None)
        else:
            self.failures += 1
            if name:
                self.unreachable[name] = err
        return err

    async def _ride_out(self, addr: Address, err: str) -> str | None:
        """Connect again every ``RETRY_STEP`` until the budget is spent (None: it is back),
        unless the address is known down: then one short attempt."""
        now = time.monotonic()
        if now - self.down.get(addr, -DOWN_FOR) < DOWN_FOR:
            return await _connect(addr, DOWN_TIMEOUT)
        budget = max(0, ctx.options.sessionpin_connect_retry_ms) / 1000
        deadline = now + budget
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(RETRY_STEP, left))
            again = await _connect(addr, max(0.05, min(TIMEOUT, deadline - time.monotonic())))
            if again is None:
                return None
            err = again
        self.down[addr] = time.monotonic()
        return err

    async def _check(self, client: str, addr: Address, keep: bool) -> str | None:
        early = self._checks.pop((client, addr), None)
        if early is not None and time.monotonic() - early[0] < FRESH:
            finished = early[1].done()
            err = await early[1]
            if err is not None and finished:
                err = await _connect(addr)   # it failed before it was asked for: it may be back
        else:
            started = time.monotonic()
            task = asyncio.get_running_loop().create_task(_connect(addr))
            err = await task
            early = (started, task)
        if keep and err is None:
            # the connection mitmproxy makes right after may take this check (once)
            self._checks[(client, addr)] = (time.monotonic(), early[1])
        return err

    # ---- mitmproxy's connections ------------------------------------------------------------
    async def server_connect(self, data) -> None:
        server = data.server
        if not server.address or server.error or server.via is not None or not self._checking():
            return
        addr = (str(server.address[0]).lower(), server.address[1])
        name = self.moved.get(addr)
        if name is None or self.open[addr] > 0:
            return
        err = await self._check(data.client.id, addr, keep=False)
        if err is None:
            self.unreachable.pop(name, None)
            return
        s = self.config.config.servers.get(name)
        origin = s.origin if s else f"{addr[0]}:{addr[1]}"
        server.error = (f"sessionpin: server {name} ({origin}) cannot be reached: {err}. "
                        f"The conversation stays on {name}; try again when it is back.")
        self.unreachable[name] = err
        self.failures += 1

    def server_connected(self, data) -> None:
        if data.server.address:
            self.open[(str(data.server.address[0]).lower(), data.server.address[1])] += 1

    def server_disconnected(self, data) -> None:
        if data.server.address:
            addr = (str(data.server.address[0]).lower(), data.server.address[1])
            if self.open[addr] <= 1:
                self.open.pop(addr, None)
            else:
                self.open[addr] -= 1

    def server_connect_error(self, data) -> None:
        addr = data.server.address
        if not addr:
            return
        s = self.config.config.server_at(str(addr[0]), addr[1])
        if s is not None:
            self.unreachable[s.name] = data.server.error or ""
            log.warning("sessionpin: server %s (%s) cannot be reached: %s", s.name, s.origin, data.server.error)


async def _connect(address: Address, timeout: float = TIMEOUT) -> str | None:
    """None when ``address`` accepts a TCP connection (closed at once), else why not."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout)
        writer.close()
        return None
    except (OSError, asyncio.TimeoutError) as e:
        return why(e, timeout)


def why(e: BaseException, timeout: float) -> str:
    """A failed connect's cause in words: no errno number, no address (the message naming
    the server says where), nothing an agent's retry rule reads as passing."""
    if isinstance(e, ConnectionRefusedError):
        return "it refuses connections: nothing listens there"
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return f"no answer within {timeout:g} s"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror[0].lower() + e.strerror[1:]
    return type(e).__name__
