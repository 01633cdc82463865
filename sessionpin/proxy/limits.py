"""BodyLimit: an inference request whose body is over the limit gets a clear 413 — unbuffered.

mitmproxy buffers a request's whole body before the ``request`` hook (the router needs it
there), and an addon cannot answer a request before its body is read; ``body_size_limit``
would cut every kind of body, responses included. So a request whose ``Content-Length``
says it is over the limit (``encodings.body_too_large``) is sent, as a stream that is
never buffered, to a sink of our own on loopback, which reads the body, drops it, and
answers the 413 this addon prepared in the agent's API error format.

Rules it keeps:
- Only inference-shaped POSTs (an inference endpoint path, ``paths.api_of_path``) are
  checked; other traffic passes as mitmproxy passes it.
- Nothing of the request reaches any server: its credentials are removed before it is
  sent to the sink, and the sink keeps nothing.
- Each 413 is counted in the router's metrics (``sessionpin_refusals_total{reason="too-large"}``).
- A body with no length (chunked, HTTP/2 without ``content-length``) is buffered as
  mitmproxy does; the reader then refuses it as "too large" (docs/router.md).
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import h11
from mitmproxy import ctx, http

from .. import answers, headers, paths
from .. import facts as F

log = logging.getLogger("sessionpin")

TOKEN_HEADER = "x-sessionpin-sink"
MIB = 1024 * 1024


class BodyLimit:
    def __init__(self, metrics=None) -> None:
        self.metrics = metrics          # the router's Metrics: a 413 is a refusal like the others
        self._server: asyncio.AbstractServer | None = None
        self._port = 0
        self._answers: dict[str, tuple[int, bytes, dict[str, str]]] = {}
        self.refused = 0

    def load(self, loader) -> None:
        loader.add_option(
            "sessionpin_max_body_mb", int, F.MAX_REQUEST_BODY // MIB,
            "sessionpin: an inference request whose body is larger than this many MiB gets a 413 "
            "before it is buffered.",
        )

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
        limit = max(1, ctx.options.sessionpin_max_body_mb) * MIB
        if not F.body_too_large(req.headers.get("content-length"), limit) \
                or paths.api_of_path(req.method, req.path) == paths.OTHER:
            return
        api = paths.api_of_path(req.method, req.path)
        message = (f"sessionpin: this request's body ({req.headers.get('content-length', '?')} bytes) is over the "
                   f"proxy's limit of {limit // MIB} MiB (sessionpin_max_body_mb); it was not sent anywhere.")
        status, body = 413, answers.refusal(api, 413, "too-large", message)
        flow.metadata.setdefault("sessionpin", {}).update({"refused": 413, "refusal": "too-large",
                                                           "message": message})
        flow.comment = "refused 413: body over the limit"
        self.refused += 1
        if self.metrics is not None:
            self.metrics.refusals["too-large"] += 1
        log.warning("sessionpin: refused 413 (too-large) %s %s: %s", req.pretty_host, req.path.split("?")[0],
                    message)
        if not self._port:      # not running yet: drop it rather than buffer it
            flow.kill()
            return
        token = secrets.token_hex(8)
        self._answers[token] = (status, *body)
        for name in headers.dropped_for_move(req.headers.items(multi=True)):
            req.headers.pop(name, None)
        req.headers[TOKEN_HEADER] = token
        req.scheme, req.host, req.port = "http", "127.0.0.1", self._port
        req.stream = True

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
            hs = [(k, v) for k, v in headers.items()] + [("content-length", str(len(body))), ("connection", "close")]
            writer.write(conn.send(h11.Response(status_code=status, headers=hs)))
            writer.write(conn.send(h11.Data(data=body)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
        except (h11.RemoteProtocolError, h11.LocalProtocolError, ConnectionError, OSError):
            pass
        finally:
            writer.close()
