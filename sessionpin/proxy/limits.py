"""BodyLimit: an inference request whose body is over the limit gets a clear 413 — unbuffered.

mitmproxy buffers a request's whole body before the ``request`` hook (the router needs it
there), and an addon cannot answer a request before its body is read; ``body_size_limit``
would cut every kind of body, responses included. So a request whose ``Content-Length``
says it is over the limit (``encodings.body_too_large``) is sent, as a stream that is
never buffered, to a sink of our own on loopback, which reads the body, drops it, and
answers the 413 this addon prepared in the agent's API error format.

Rules it keeps:
- Only the POSTs the router would take as inference are checked, by the router's own rule
  (``config.Config.scope``: the configured server the request addresses and its API base,
  so ``/api/paas/v4/chat/completions`` to a server written ``…/api/paas/v4`` is bounded as
  it is routed) — and the POSTs it guards (``paths.guarded``: a path it does not route that
  ends with an endpoint, another API's inference endpoint, a look-alike): a body over the
  limit would be streamed to the server it addressed before the router could read its
  conversation's pin, so one pinned elsewhere would reach it. Other traffic passes as
  mitmproxy passes it.
- Nothing of the request reaches any server: its credentials are removed before it is
  sent to the sink, and the sink keeps nothing.
- Each 413 is counted in the router's metrics (``sessionpin_refusals_total{reason="too-large"}``).
- Nothing of a request outlives it: its prepared answer (by a token the flow keeps in
  ``flow.metadata``) and what was held for it (in the flow too) are dropped when its flow ends, however it ends (answered, the client gone, an error), and by
  the sink when the request it reads breaks off.
- A body with no length (chunked, HTTP/2 without ``content-length``) cannot be judged at
  its headers. Such a request is pointed at the sink while its body arrives, and mitmproxy's
  ``stream_large_bodies`` is set to the same limit: a body that grows past it is streamed,
  and so goes to the sink (a 413, nothing kept); one that ends within it is buffered as
  usual, and the ``request`` hook (before the router's) puts its destination and headers
  back, so the router decides it as any other. ``stream_large_bodies`` is ours: another
  value would stream inference bodies below the limit to the addressed server before the
  router read them, so it is refused.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import h11
from mitmproxy import ctx, exceptions, http

from ..decision import answers, headers
from ..reader import facts as F
from . import perflow
from ..reader import headerview, paths
from .configwatch import ConfigWatch
from .perflow import FlowState

log = logging.getLogger("sessionpin")

TOKEN_HEADER = "x-sessionpin-sink"
MIB = 1024 * 1024


class _Held(FlowState):
    """Where a request of unknown length was going, put back if its body ends within the limit."""
    __slots__ = ("scheme", "host", "port", "headers")

    def __init__(self, scheme: str, host: str, port: int, headers: http.Headers) -> None:
        self.scheme, self.host, self.port, self.headers = scheme, host, port, headers


class BodyLimit:
    def __init__(self, config: ConfigWatch, metrics=None) -> None:
        self.config = config            # the router's scope rule reads the configured servers
        self.metrics = metrics          # the router's Metrics: a 413 is a refusal like the others
        self._server: asyncio.AbstractServer | None = None
        self._port = 0
        # the answers prepared for the sink: token -> (status, body, headers). The flow keeps
        # its token (``perflow.SINK``), so that the answer goes when the flow ends whatever
        # ends it (the sink answered, the client went away, an error); a request of unknown
        # length keeps what to put back if it ends within the limit (``perflow.HELD``)
        self._answers: dict[str, tuple[int, bytes, dict[str, str]]] = {}
        self.refused = 0
        # bytes: ``sessionpin_max_body_mb`` as ``configure`` last saw it (reading ``ctx.options``
        # deep-copies the value: ~1 µs on every request); None until then (a bare part in a test)
        self._limit: int | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "sessionpin_max_body_mb", int, F.MAX_REQUEST_BODY // MIB,
            "sessionpin: an inference request whose body is larger than this many MiB gets a 413 "
            "before it is buffered.",
        )

    def configure(self, updated: set[str]) -> None:
        if "sessionpin_max_body_mb" in updated:
            self._limit = max(1, ctx.options.sessionpin_max_body_mb) * MIB
        if not ({"sessionpin_max_body_mb", "stream_large_bodies"} & updated) \
                or "stream_large_bodies" not in ctx.options:
            return
        want = f"{max(1, ctx.options.sessionpin_max_body_mb)}m"
        have = ctx.options.stream_large_bodies
        if have == want:
            return
        if "stream_large_bodies" in updated and "sessionpin_max_body_mb" not in updated and have:
            raise exceptions.OptionsError(
                f"sessionpin: stream_large_bodies is set by sessionpin to sessionpin_max_body_mb ({want}): "
                "another value would send request bodies upstream before the router can read and route "
                "them; set sessionpin_max_body_mb instead")
        if have:
            log.warning("sessionpin: stream_large_bodies set to %s (sessionpin_max_body_mb), not %s: a smaller "
                        "value would send request bodies upstream before the router can route them", want, have)
        ctx.options.stream_large_bodies = want

    def running(self) -> None:
        if self._server is None:
            asyncio.get_running_loop().create_task(self._start())

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._answer, "127.0.0.1", 0)
        self._port = self._server.sockets[0].getsockname()[1]

    def done(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        if req.method != "POST":
            return
        limit = self._limit_bytes()
        length = headerview.get(req.headers, "content-length", None)
        if length is not None and not F.body_too_large(length, limit):
            return                          # the common case: judged by its length, nothing more
        source, scope = self.config.config.scope(req.method, req.scheme, req.host, req.port, req.path)
        api = scope.api if scope.inference else paths.guarded(req.method, req.path,
                                                               source.prefix if source else None)
        if api is None:
            return
        if length is None:
            self._hold(flow, api, limit)
            return
        message = _message(flow, limit)
        self._refuse(flow, message)
        if not self._port:      # not running yet: drop it rather than buffer it
            flow.kill()
            return
        self._to_sink(flow, self._prepare(flow, api, message))
        req.stream = True

    def request(self, flow: http.HTTPFlow) -> None:
        held = flow.metadata.pop(perflow.HELD, None)
        if held is None:
            return
        if flow.request.stream:     # it grew past the limit: mitmproxy streamed it to the sink
            self._refuse(flow, _message(flow, self._limit_bytes()))
            return
        self._forget(flow)              # it ended within the limit: as it came, for the router
        req = flow.request
        req.scheme, req.host, req.port = held.scheme, held.host, held.port
        req.headers = held.headers

    def _limit_bytes(self) -> int:
        if self._limit is not None:
            return self._limit
        return max(1, ctx.options.sessionpin_max_body_mb) * MIB

    def response(self, flow: http.HTTPFlow) -> None:
        self._forget(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._forget(flow)      # the client went away, the sink could not be reached, …

    def _forget(self, flow: http.HTTPFlow) -> None:
        """Nothing of a flow's stays once it has ended (issue 20: 5,000 abandoned requests
        over the limit kept 5,000 prepared 413s)."""
        flow.metadata.pop(perflow.HELD, None)
        token = flow.metadata.pop(perflow.SINK, None)
        if token is not None:
            self._answers.pop(token, None)

    def _hold(self, flow: http.HTTPFlow, api: str, limit: int) -> None:
        """Point a request of unknown length at the sink until its body ends (see the module)."""
        if not self._port or "stream_large_bodies" not in ctx.options or not ctx.options.stream_large_bodies:
            return
        req = flow.request
        token = self._prepare(flow, api, _message(flow, limit))
        flow.metadata[perflow.HELD] = _Held(req.scheme, req.host, req.port, req.headers.copy())
        self._to_sink(flow, token)

    def _prepare(self, flow: http.HTTPFlow, api: str, message: str) -> str:
        token = secrets.token_hex(8)
        self._answers[token] = (413, *answers.refusal(api, 413, "too-large", message))
        flow.metadata[perflow.SINK] = token
        return token

    def _to_sink(self, flow: http.HTTPFlow, token: str) -> None:
        req = flow.request
        for name in headers.dropped_for_move(req.headers.items(multi=True)):
            req.headers.pop(name, None)
        req.headers[TOKEN_HEADER] = token
        req.scheme, req.host, req.port = "http", "127.0.0.1", self._port

    def _refuse(self, flow: http.HTTPFlow, message: str) -> None:
        """Mark, count and log one 413 (the sink answers it)."""
        req = flow.request
        flow.metadata.setdefault("sessionpin", {}).update({"refused": 413, "refusal": "too-large",
                                                           "message": message})
        flow.comment = "refused 413: body over the limit"
        self.refused += 1
        if self.metrics is not None:
            self.metrics.refusals["too-large"] += 1
        log.warning("sessionpin: refused 413 (too-large) %s %s: %s", req.pretty_host, req.path.split("?")[0],
                    message)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The sink: read one request, drop its body, answer what was prepared for it."""
        conn = h11.Connection(h11.SERVER)
        token = None
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(256 * 1024)
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    token = dict(event.headers).get(TOKEN_HEADER.encode(), b"").decode()
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
            status, body, headers = self._answers.pop(token or "", (404, b"", {}))
            token = None
            hs = [(k, v) for k, v in headers.items()] + [("content-length", str(len(body))), ("connection", "close")]
            writer.write(conn.send(h11.Response(status_code=status, headers=hs)))
            writer.write(conn.send(h11.Data(data=body)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
        except (h11.RemoteProtocolError, h11.LocalProtocolError, ConnectionError, OSError):
            pass
        finally:
            if token:       # the request never ended (its client went away): its answer goes
                self._answers.pop(token, None)
            writer.close()


def _message(flow: http.HTTPFlow, limit: int) -> str:
    size = headerview.get(flow.request.headers, "content-length", None)
    if size is not None and not (size.strip().isascii() and size.strip().isdigit() and len(size.strip()) <= 20):
        # a length that is no number is refused as too large; the header's value is the
        # client's, not a thing to copy into the log and the answer
        what = "body (sent with a length that is not a number) is over"
    else:
        what = f"body ({size.strip()} bytes) is over" if size is not None else \
            "body (sent without a length) grew past"
    return (f"sessionpin: this request's {what} the proxy's limit of {limit // MIB} MiB "
            f"(sessionpin_max_body_mb); it was not sent anywhere.")
