"""HeadBounds: an HTTP/1 message's head, and a line of its chunked body, cost the proxy at most
``MAX_HEAD`` bytes before mitmproxy has parsed them; a chunked message's trailers are dropped
rather than crash its connection.

mitmproxy's HTTP/1 connections gather a peer's bytes in one buffer until the head's blank line
comes (its own ``FIXME: protect against header size DoS``), and its chunked body reader waits
for each chunk-size line (and the trailer's lines) likewise, with no bound: no hook sees any of
it before it ends. A server that answered with a header line growing without end (96 MiB, then a
blank line) grew the proxy's peak RSS by 537 MB, and every other client of the proxy shared what
was left. No option of mitmproxy's bounds it. So, while this part is loaded, the HTTP/1
connection classes mitmproxy makes are ours (``_BoundedClient``, ``_BoundedServer``, put in place of
``Http1Client`` and ``Http1Server`` in ``mitmproxy.proxy.layers.http``, as ``wsbounds`` does for
WebSocket connections):

- After each read, a connection still reading a head or a body whose buffer holds more than
  ``MAX_HEAD`` is holding one unfinished line or head (a body's data are handed on as they
  come: what stays is a line not yet ended) and is failed there: its buffer is dropped, its
  connection closed, one warning line names the side and its address.
- From a server: the answer fails with a protocol error, which mitmproxy answers the agent
  with a 502 naming the limit (or, once the answer's head has left, ends its stream); nothing
  of the head is sent on. From a client: a head that long is answered 431 and the
  connection closed.
- A chunked message's trailer section (legal HTTP/1.1) is dropped, with one warning line naming
  its fields: mitmproxy cannot relay trailers over HTTP/1 and raised there ("mitmproxy has
  crashed!"), tearing the connection down with the message's last bytes: the agent read an
  answer cut short with no error to say why. Dropped, the message ends as it would have
  without them (no agent reads an HTTP/1 trailer; the inference APIs send none).
- From a server, an informational answer (1xx but 101: a 103 Early Hints, as CDNs send) is
  passed over: mitmproxy took it for the answer (the agent got a bodiless 103) and the real
  answer then for stray bytes. Bytes a server sends with no request outstanding (past its
  answer's length) close its connection with one warning line saying how many, never what they
  were: mitmproxy logged them as they came ("Unexpected data from server: b'…'"), the answer's
  content among them.
- A peer that closes its connection within a head is said with a count of bytes, never the
  bytes: mitmproxy logged a client's partial head verbatim ("Client closed connection before
  completing request headers: b'…'"), the agent's key among them, and put a server's into the
  flow's error (logged by the router, and in the agent's 502).
- A peer's bytes that mitmproxy or h11 quote in a parse error are said by their size, never
  shown (``redact.unquoted``): a request line (``?key=…``) or a header line without a colon
  (``x-api-key sk-…``) from a client, a server's first line that is no status line (an answer
  written without its head), a header line or length it cannot read, a chunk-size line that
  is the answer's content. mitmproxy logged the client's (``127.0.0.1:…: Invalid header line:
  b'x-api-key sk-…'``, whatever ``flow_detail``) and put the server's into the flow's error,
  which the router logged and the agent's 502 showed. The same for the header checks both
  HTTP versions run on a message's head (``validate_headers``: ``Received invalid header name:
  b'…'``), whose message goes into the flow's error and the peer's 400 or 502, and for
  mitmproxy's HTTP/2 connections (``_QuietHttp2Client``, ``_QuietHttp2Server``, in place of
  ``Http2Client`` and ``Http2Server``: nothing else of theirs changes), where h2 quotes a header
  value it refuses ("HTTP/2 protocol error: Received header value surrounded by whitespace
  b' sk-…'", logged with the peer's address).
- ``MAX_HEAD`` (256 KiB) is sixteen times what Node's HTTP client (Claude Code, OpenCode, pi)
  accepts for a whole head, and four times Python's line limit: no server an agent can read
  sends more.
"""

from __future__ import annotations

import logging
import re

import h11
from h11._receivebuffer import ReceiveBuffer
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.layers import http as http_layer
from mitmproxy.proxy.layers.http import _http1, _http2
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import ErrorCode, RequestProtocolError, ResponseProtocolError

from ..config.redact import unquoted

log = logging.getLogger("sessionpin")

MAX_HEAD = 256 * 1024
_INFORMATIONAL = re.compile(rb"HTTP/1\.[01] 1(?!01)\d\d[ \r\n]")


def _where(conn) -> str:
    peer = getattr(conn, "peername", None) or getattr(conn, "address", None)
    return f"{peer[0]}:{peer[1]}" if peer else "?"


def _unfinished(conn: _http1.Http1Connection) -> str | None:
    """What ``conn`` is gathering past the bound ("head", "body line"), or None."""
    if len(conn.buf) <= MAX_HEAD:
        return None
    if conn.state == conn.read_headers:
        return "head"
    if conn.state == conn.read_body:
        return "body line"
    return None


def _message(side: str, what: str, conn) -> str:
    kind = "response" if side == "server" else "request"
    return (f"sessionpin: the {kind} {what} from the {side} ({_where(conn)}) grew past {MAX_HEAD // 1024} KiB "
            f"without ending; the connection was closed, nothing of it was sent on")


class _NoTrailers:
    """A body reader of h11's that ends its message without the trailers it read (see the module)."""

    __slots__ = ("reader", "side", "conn")

    def __init__(self, reader, side: str, conn) -> None:
        self.reader, self.side, self.conn = reader, side, conn

    def __call__(self, buf):
        event = self.reader(buf)
        if isinstance(event, h11.EndOfMessage) and event.headers:
            names = ", ".join(sorted({n.decode("ascii", "replace").lower() for n, _ in event.headers}))[:200]
            kind = "response" if self.side == "server" else "request"
            log.warning("sessionpin: the %s from the %s (%s) ended with trailers (%s); they were dropped (mitmproxy "
                        "cannot pass trailers on over HTTP/1)", kind, self.side, _where(self.conn), names)
            return h11.EndOfMessage()
        return event

    def read_eof(self):
        return self.reader.read_eof()


def _without_trailers(conn: _http1.Http1Connection, side: str) -> None:
    reader = getattr(conn, "body_reader", None)     # (set with each message's head)
    if reader is not None and not isinstance(reader, _NoTrailers):
        conn.body_reader = _NoTrailers(reader, side, conn.conn)


def _unquoted(command):
    """A command of mitmproxy's HTTP/1 connection with the peer's bytes it quotes said by their
    size: its log lines and its protocol errors (the flow's error, the agent's 502). Everything
    else (the data, the heads, the peer's own 400) passes as it is: one type check each."""
    if isinstance(command, ReceiveHttp):
        event = command.event
        if isinstance(event, (RequestProtocolError, ResponseProtocolError)):
            event.message = unquoted(event.message)
    elif isinstance(command, commands.Log):
        command.message = unquoted(command.message)
    return command


def _validate_headers(message) -> None:
    """mitmproxy's ``validate_headers``, its error saying the value by its size."""
    try:
        _VALIDATE(message)
    except ValueError as e:
        raise ValueError(unquoted(str(e))) from None


def _drop(conn: _http1.Http1Connection) -> None:
    conn.buf = ReceiveBuffer()
    conn.state = conn._dropped


class _BoundedClient(_http1.Http1Client):
    """mitmproxy's Http1Client (its side facing a server) with the bound of this module."""

    def _handle_event(self, event: events.Event):
        for command in super()._handle_event(event):
            yield _unquoted(command)
        if isinstance(event, events.DataReceived) and (what := _unfinished(self)) is not None:
            message = _message("server", what, self.conn)
            log.warning(message)
            stream = self.stream_id
            _drop(self)
            yield commands.CloseConnection(self.conn)
            if stream is not None:
                yield ReceiveHttp(ResponseProtocolError(stream, message, ErrorCode.GENERIC_SERVER_ERROR))

    def read_headers(self, event: events.Event):
        if isinstance(event, events.DataReceived):
            if not self.request:
                log.warning("sessionpin: the server (%s) sent %d bytes past its answer (with no request "
                            "outstanding); its connection was closed (the bytes are not shown: they may hold "
                            "an answer's content)", _where(self.conn), len(self.buf))
                _drop(self)
                yield commands.CloseConnection(self.conn)
                return
            while _INFORMATIONAL.match(bytes(self.buf)[:16]) and self.buf.maybe_extract_lines() is not None:
                pass        # an informational answer, whole: not the answer (RFC 9110, 15.2)
        elif isinstance(event, events.ConnectionClosed) and self.stream_id and self.buf:
            n = len(self.buf)
            _drop(self)
            if self.conn.state & ConnectionState.CAN_WRITE:
                yield commands.CloseConnection(self.conn)
            yield ReceiveHttp(ResponseProtocolError(
                self.stream_id, f"the server ({_where(self.conn)}) closed its connection within its answer's head "
                                f"({n} bytes, not shown)", ErrorCode.GENERIC_SERVER_ERROR))
            return
        yield from super().read_headers(event)

    def read_body(self, event: events.Event):
        _without_trailers(self, "server")
        yield from super().read_body(event)

    def _dropped(self, event: events.Event):
        self.buf = ReceiveBuffer()
        yield from ()


class _BoundedServer(_http1.Http1Server):
    """mitmproxy's Http1Server (its side facing a client) with the bound of this module, for a
    head (a body line of a request already on its way is mitmproxy's to end)."""

    def _handle_event(self, event: events.Event):
        for command in super()._handle_event(event):
            yield _unquoted(command)
        if isinstance(event, events.DataReceived) and _unfinished(self) == "head":
            message = _message("client", "head", self.conn)
            log.warning(message)
            _drop(self)
            yield commands.SendData(self.conn, _http1.make_error_response(431, message))
            yield commands.CloseConnection(self.conn)

    def read_headers(self, event: events.Event):
        if isinstance(event, events.ConnectionClosed) and bytes(self.buf).strip():
            log.warning("sessionpin: the client (%s) closed its connection within a request head (%d bytes, not "
                        "shown: they may hold its key)", _where(self.conn), len(self.buf))
            _drop(self)
            yield commands.CloseConnection(self.conn)
            return
        yield from super().read_headers(event)

    def read_body(self, event: events.Event):
        _without_trailers(self, "client")
        yield from super().read_body(event)

    def _dropped(self, event: events.Event):
        self.buf = ReceiveBuffer()
        yield from ()


class _QuietHttp2Client(_http2.Http2Client):
    """mitmproxy's Http2Client (its side facing a server), its errors quoting nothing."""

    def _handle_event(self, event: events.Event):
        for command in super()._handle_event(event):
            yield _unquoted(command)


class _QuietHttp2Server(_http2.Http2Server):
    """mitmproxy's Http2Server (its side facing a client), its errors quoting nothing."""

    def _handle_event(self, event: events.Event):
        for command in super()._handle_event(event):
            yield _unquoted(command)


_ORIGINAL = (http_layer.Http1Client, http_layer.Http1Server)
_ORIGINAL_H2 = (http_layer.Http2Client, http_layer.Http2Server)
_VALIDATE = http_layer.validate_headers    # mitmproxy's check of a head (HTTP/1 and HTTP/2), by name in its layer
_installed = 0            # HeadBounds loaded (a reloaded script's new addons load before the old go)


class HeadBounds:
    def load(self, loader) -> None:
        global _installed
        _installed += 1
        http_layer.Http1Client, http_layer.Http1Server = _BoundedClient, _BoundedServer
        http_layer.validate_headers = _validate_headers
        http_layer.Http2Client, http_layer.Http2Server = _QuietHttp2Client, _QuietHttp2Server

    def done(self) -> None:
        global _installed
        _installed = max(0, _installed - 1)
        if not _installed:
            http_layer.Http1Client, http_layer.Http1Server = _ORIGINAL
            http_layer.validate_headers = _VALIDATE
            http_layer.Http2Client, http_layer.Http2Server = _ORIGINAL_H2
