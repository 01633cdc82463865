"""A fake OpenAI Responses WebSocket server over TLS, and a WebSocket client, for end-to-end tests.

Real sockets, real TLS, real RFC 6455 framing (``wsproto``, which mitmproxy itself uses): nothing
is mocked, so a test built on these sees what Codex would.

``WsFake(name, ca)`` (a context manager; ``start()`` / ``stop()``)
    A TLS server on 127.0.0.1 (random port) that accepts a WebSocket upgrade on ``/v1/responses``
    (any other path: 404) and speaks OpenAI's Responses WebSocket as Codex 0.171.0 was recorded
    speaking it (docs/traffic.md, "Lineage"; tests/fixtures/traffic/codex/websocket-*): each client
    text message ``{"type": "response.create", ...}`` is answered with one text message per
    Responses event — ``response.created``, ``response.in_progress``, then (unless ``"generate":
    false``, Codex's warm-up) an assistant message's ``output_item.added``,
    ``response.output_text.delta`` × ``deltas``, ``output_item.done`` — and ``response.completed``.
    The events name the model the message asked for and the server (``resp_<name>_<n>`` ids).
    A ``previous_response_id`` that this socket did not issue is answered with an ``error`` event
    (``previous_response_not_found``), as a server that never made that response would.
    Other messages (``response.processed``) get no answer; ping → pong; close → close.
    Test messages (never sent by Codex): ``{"type": "test.bomb", "size": N}`` is answered with
    one permessage-deflate frame that inflates to N spaces (``deflate_frame``: a few hundred KB
    on the wire for 256 MiB), ``{"type": "test.stream", "count": C, "size": S}`` with C text
    messages of about S bytes each, then a ``response.completed``; ``{"type": "test.fragments",
    "count": N}`` with one uncompressed text message ``{"type":"test.fragments"}`` in N + 2 frames,
    N of them empty (``fragmented``: 2 bytes on the wire each).
    ``permessage-deflate`` is accepted when offered (``deflate=False``: declined), so messages
    cross the proxy compressed. ``sockets`` is every upgrade received (``WsSocket``: path, host,
    headers as a list of pairs, offered extensions, ``received`` and ``sent`` message texts in
    order); ``wait_for(n)``; ``stop()`` also closes every open socket.

``WsClient.via_proxy(proxy_port, mitm_ca, host, port, path, headers)`` /
``WsClient.reverse(port, path, headers)``
    Opens a WebSocket through the proxy's CONNECT tunnel (TLS with the proxy's CA) or to a
    reverse-mode port (plain ``ws://``). ``headers`` as a client sends them; the handshake's own
    (Host, Connection, Upgrade, Sec-WebSocket-Key/-Version/-Extensions) are made by wsproto and
    left out of ``headers``; ``permessage-deflate`` is offered, as Codex offers it. After the
    handshake: ``accepted``, ``status``, ``response_headers``, ``reject_body``, ``extensions``
    (negotiated). ``turn(text)`` sends one message and returns the messages received until a
    terminal event (``response.completed`` / ``failed`` / ``incomplete``, ``error``);
    ``received`` is every message text in order; ``wait_closed()``; ``close()``; ``close_code``
    (the code of the peer's close frame, once it came). ``send_raw(frame)`` writes bytes as they are
    (``deflate_frame(n, masked=True)``: a client's compressed frame of n spaces).

``fragmented(text, empty, masked)``
    One uncompressed text message of ``text`` in ``empty + 2`` frames: its first half, ``empty``
    empty continuation frames, its second half (masked as a client's must be).

``deflate_frame(size, masked)``
    One final permessage-deflate text frame (RSV1) whose payload inflates to ``size`` spaces,
    compressed 1 MiB at a time (the test never holds the inflated message), masked as a client's
    must be. Valid as a socket's first compressed message in that direction.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import ssl
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wsproto import ConnectionType, WSConnection
from wsproto.events import (AcceptConnection, BytesMessage, CloseConnection, Message, Ping, RejectConnection,
                            RejectData, Request, TextMessage)
from wsproto.extensions import PerMessageDeflate
from wsproto.utilities import RemoteProtocolError

from .harness import LOOPBACK, TestCA

PATH = "/v1/responses"
TERMINAL = ("response.completed", "response.failed", "response.incomplete", "error")
HANDSHAKE = {"host", "connection", "upgrade", "sec-websocket-key", "sec-websocket-version",
             "sec-websocket-extensions"}


def responses_events(server: str, model: str, n: int, generate: bool = True, deltas: int = 3) -> list[dict[str, Any]]:
    """The events of one Responses turn, shaped as the recorded ones (a warm-up makes no output)."""
    rid, mid = f"resp_{server}_{n}", f"msg_{server}_{n}"
    resp = {"id": rid, "object": "response", "created_at": 1796033470, "model": model, "status": "in_progress",
            "output": [], "usage": None}
    events: list[dict[str, Any]] = [{"type": "response.created", "response": resp},
                                    {"type": "response.in_progress", "response": resp}]
    output = []
    if generate:
        text = "".join(f"reply {i} from {server}. " for i in range(deltas))
        item = {"id": mid, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        events.append({"type": "response.output_item.added", "output_index": 0, "item": item})
        for i in range(deltas):
            events.append({"type": "response.output_text.delta", "item_id": mid, "output_index": 0,
                           "content_index": 0, "delta": f"reply {i} from {server}. "})
        done = {**item, "status": "completed", "content": [{"type": "output_text", "text": text, "annotations": []}]}
        events.append({"type": "response.output_item.done", "output_index": 0, "item": done})
        output = [done]
    events.append({"type": "response.completed",
                   "response": {**resp, "status": "completed", "output": output,
                                "usage": {"input_tokens": 12, "output_tokens": 6 if generate else 0}}})
    for i, e in enumerate(events):
        e["sequence_number"] = i
    return events


@functools.lru_cache(maxsize=4)
def _deflated(size: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = b" " * (1 << 20)
    parts = [c.compress(chunk) for _ in range(size >> 20)]
    parts.append(c.compress(b" " * (size & ((1 << 20) - 1))))
    return (b"".join(parts) + c.flush(zlib.Z_SYNC_FLUSH))[:-4]     # without 00 00 ff ff (RFC 7692)


def deflate_frame(size: int, masked: bool) -> bytes:
    """A final compressed text frame inflating to ``size`` spaces (see the module)."""
    payload = _deflated(size)
    n = len(payload)
    head = bytes([0x80 | 0x40 | 0x1])
    mask_bit = 0x80 if masked else 0
    if n < 126:
        head += bytes([mask_bit | n])
    elif n < 1 << 16:
        head += bytes([mask_bit | 126]) + n.to_bytes(2, "big")
    else:
        head += bytes([mask_bit | 127]) + n.to_bytes(8, "big")
    if not masked:
        return head + payload
    key = os.urandom(4)
    stream = (key * (n // 4 + 1))[:n]
    return head + key + (int.from_bytes(payload, "big") ^ int.from_bytes(stream, "big")).to_bytes(n, "big")


def _frame(opcode: int, payload: bytes, fin: bool, masked: bool) -> bytes:
    """One uncompressed frame (payload under 64 KiB)."""
    n = len(payload)
    head = bytes([(0x80 if fin else 0) | opcode])
    mask_bit = 0x80 if masked else 0
    head += bytes([mask_bit | n]) if n < 126 else bytes([mask_bit | 126]) + n.to_bytes(2, "big")
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def fragmented(text: str, empty: int, masked: bool) -> bytes:
    """``text`` as one message in ``empty + 2`` frames (see the module)."""
    data = text.encode()
    half = len(data) // 2
    return (_frame(0x1, data[:half], False, masked) + _frame(0x0, b"", False, masked) * empty
            + _frame(0x0, data[half:], True, masked))


def _text(value: bytes | str) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value


@dataclass
class WsSocket:
    """One WebSocket upgrade as the fake received it, and what went over it."""

    path: str
    host: str
    headers: list[tuple[str, str]]     # lower-case names (wsproto's), without Host and the extensions
    offered: list[str]                 # Sec-WebSocket-Extensions offers
    received: list[str] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)   # the response ids it issued
    close_code: int | None = None                          # the code of the close frame it received

    def raw(self) -> bytes:
        """Everything that reached the server, for "does this secret appear anywhere" checks."""
        head = "\n".join(f"{k}: {v}" for k, v in self.headers)
        return f"GET {self.path}\n{head}\n\n{chr(10).join(self.received)}".encode()


class WsFake:
    """A fake Responses WebSocket server over TLS on 127.0.0.1 that records what reached it."""

    def __init__(self, name: str, ca: TestCA, deflate: bool = True, deltas: int = 3) -> None:
        self.name = name
        self.deflate = deflate
        self.deltas = deltas
        self.port = 0
        self.sockets: list[WsSocket] = []
        self._n = 0
        self._cond = threading.Condition()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(ca.issue(f"ws-{name}"))
        self._context.set_alpn_protocols(["http/1.1"])

    @property
    def origin(self) -> str:
        return f"https://{LOOPBACK}:{self.port}"

    def start(self) -> WsFake:
        if self._listener is not None:
            return self
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((LOOPBACK, self.port))
        s.listen(64)
        s.settimeout(0.05)
        self.port = s.getsockname()[1]
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), name=f"wsfake-{self.name}", daemon=True).start()
        return self

    def stop(self) -> None:
        s, self._listener = self._listener, None
        if s is not None:
            s.close()
        with self._cond:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                c.close()

    def __enter__(self) -> WsFake:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_for(self, count: int, timeout: float = 10.0) -> list[WsSocket]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.sockets) < count and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            return list(self.sockets)

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                raw, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                self._conns.add(raw)
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            tls = self._context.wrap_socket(raw, server_side=True)
            self._speak(tls)
        except (OSError, ssl.SSLError, RemoteProtocolError):
            pass        # a peer that went away (the proxy killed -9) is not the server's problem
        finally:
            with self._cond:
                self._conns.discard(raw)
            with contextlib.suppress(OSError):
                raw.close()

    def _speak(self, tls: ssl.SSLSocket) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        sock: WsSocket | None = None
        parts: list[str] = []
        while True:
            data = tls.recv(65536)
            ws.receive_data(data or None)
            try:
                events = list(ws.events())
            except RemoteProtocolError as e:        # not an upgrade at all
                tls.sendall(ws.send(e.event_hint or RejectConnection()))
                return
            for ev in events:
                if isinstance(ev, Request):
                    sock = WsSocket(ev.target, ev.host, [(_text(k), _text(v)) for k, v in ev.extra_headers],
                                    [_text(x) for x in ev.extensions])
                    with self._cond:
                        self.sockets.append(sock)
                        self._cond.notify_all()
                    if ev.target.split("?", 1)[0] != PATH:
                        body = json.dumps({"error": {"message": f"fake {self.name}: no socket at {ev.target}"}})
                        tls.sendall(ws.send(RejectConnection(status_code=404, has_body=True,
                                                             headers=[(b"content-type", b"application/json")]))
                                    + ws.send(RejectData(data=body.encode())))
                        return
                    tls.sendall(ws.send(AcceptConnection(
                        extensions=[PerMessageDeflate()] if self.deflate else [],
                        extra_headers=[(b"x-fake-server", self.name.encode()),
                                       (b"x-request-id", f"req_ws_{self.name}_{len(self.sockets)}".encode())])))
                elif isinstance(ev, TextMessage) and sock is not None:
                    parts.append(ev.data)
                    if ev.message_finished:
                        text, parts = "".join(parts), []
                        sock.received.append(text)
                        if self._test(tls, ws, text):
                            continue
                        for out in self._answer(sock, text):
                            sock.sent.append(out)
                            tls.sendall(ws.send(Message(data=out)))
                elif isinstance(ev, Ping):
                    tls.sendall(ws.send(ev.response()))
                elif isinstance(ev, CloseConnection):
                    if sock is not None:
                        sock.close_code = ev.code
                    with contextlib.suppress(Exception):
                        tls.sendall(ws.send(ev.response()))
                    return
            if not data:
                return

    def _test(self, tls: ssl.SSLSocket, ws: WSConnection, text: str) -> bool:
        """The test messages of the module docstring (True: it was one, answered)."""
        if not text.startswith('{"type": "test.') and not text.startswith('{"type":"test.'):
            return False
        body = json.loads(text)
        if body["type"] == "test.bomb":
            tls.sendall(deflate_frame(int(body["size"]), masked=False))
        elif body["type"] == "test.stream":
            filler = "x" * int(body["size"])
            for i in range(int(body["count"])):
                tls.sendall(ws.send(Message(data=f'{{"type":"response.output_text.delta","n":{i},"delta":"{filler}"}}')))
            tls.sendall(ws.send(Message(data=json.dumps({"type": "response.completed", "response": {}}))))
        elif body["type"] == "test.fragments":
            tls.sendall(fragmented('{"type":"test.fragments"}', int(body["count"]), masked=False))
        return True

    def _answer(self, sock: WsSocket, text: str) -> list[str]:
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return [json.dumps({"type": "error", "status": 400, "error": {
                "type": "invalid_request_error", "message": f"fake {self.name}: not a JSON object"}})]
        if body.get("type") != "response.create":
            return []
        prev = body.get("previous_response_id")
        if prev is not None and prev not in sock.responses:
            return [json.dumps({"type": "error", "status": 400, "error": {
                "type": "invalid_request_error", "code": "previous_response_not_found",
                "message": f"fake {self.name}: previous response {prev} not found"}})]
        with self._cond:
            self._n += 1
            n = self._n
        sock.responses.append(f"resp_{self.name}_{n}")
        events = responses_events(self.name, str(body.get("model")), n, body.get("generate") is not False,
                                  self.deltas)
        return [json.dumps(e, separators=(",", ":")) for e in events]


class WsClient:
    """One client WebSocket (see the module docstring)."""

    def __init__(self, sock: socket.socket, host: str, path: str, headers: list[tuple[str, str]],
                 timeout: float = 10.0) -> None:
        self.sock = sock
        self.timeout = timeout
        self.received: list[str] = []
        self.accepted = False
        self.status = 0
        self.response_headers: list[tuple[str, str]] = []
        self.reject_body = b""
        self.extensions: list[str] = []
        self.closed = False
        self.close_code: int | None = None
        self._parts: list[str] = []
        self._ws = WSConnection(ConnectionType.CLIENT)
        extra = [(k, v) for k, v in headers if k.lower() not in HANDSHAKE]
        sock.settimeout(timeout)
        sock.sendall(self._ws.send(Request(host=host, target=path, extra_headers=extra,
                                           extensions=[PerMessageDeflate()])))
        self._handshake()

    @classmethod
    def via_proxy(cls, proxy_port: int, mitm_ca: str | Path, host: str, port: int, path: str,
                  headers: list[tuple[str, str]], timeout: float = 10.0) -> WsClient:
        sock = socket.create_connection((LOOPBACK, proxy_port), timeout=timeout)
        sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError("the proxy closed the CONNECT")
            head += chunk
        if head.split(b"\r\n", 1)[0].split()[1] != b"200":
            raise ConnectionError(f"CONNECT refused: {head[:200]!r}")
        ctx = ssl.create_default_context(cafile=str(mitm_ca))
        ctx.set_alpn_protocols(["http/1.1"])
        return cls(ctx.wrap_socket(sock, server_hostname=host), f"{host}:{port}", path, headers, timeout)

    @classmethod
    def reverse(cls, port: int, path: str, headers: list[tuple[str, str]], timeout: float = 10.0) -> WsClient:
        sock = socket.create_connection((LOOPBACK, port), timeout=timeout)
        return cls(sock, f"{LOOPBACK}:{port}", path, headers, timeout)

    def _pump(self) -> list[Any]:
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            raise
        except OSError:            # reset, TLS torn down: the peer is gone
            data = b""
        if not data:
            self.closed = True
        self._ws.receive_data(data or None)
        return list(self._ws.events())

    def _handshake(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and not self.closed:
            try:
                events = self._pump()
            except TimeoutError:
                continue
            for ev in events:
                if isinstance(ev, AcceptConnection):
                    self.accepted, self.status = True, 101
                    self.response_headers = [(_text(k), _text(v)) for k, v in ev.extra_headers]
                    self.extensions = [e.name for e in ev.extensions]
                    return
                if isinstance(ev, RejectConnection):
                    self.status = ev.status_code
                    self.response_headers = [(_text(k), _text(v)) for k, v in ev.headers]
                    if not ev.has_body:
                        return
                elif isinstance(ev, RejectData):
                    self.reject_body += ev.data
                    if ev.body_finished:
                        return
        if not self.status:
            raise ConnectionError("no answer to the WebSocket upgrade")

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.response_headers if k.lower() == name.lower()), None)

    def send(self, text: str) -> None:
        self.sock.sendall(self._ws.send(Message(data=text)))

    def read_until(self, done, timeout: float | None = None) -> list[str]:
        """Messages received from now until ``done(message dict)`` is true for one of them."""
        start = len(self.received)
        deadline = time.monotonic() + (timeout or self.timeout)
        self.sock.settimeout(0.2)
        while time.monotonic() < deadline and not self.closed:
            try:
                events = self._pump()
            except TimeoutError:
                continue
            for ev in events:
                if isinstance(ev, TextMessage):
                    self._parts.append(ev.data)
                    if ev.message_finished:
                        text, self._parts = "".join(self._parts), []
                        self.received.append(text)
                        if done(json.loads(text)):
                            return self.received[start:]
                elif isinstance(ev, BytesMessage):
                    self.received.append(repr(ev.data))
                elif isinstance(ev, Ping):
                    self.sock.sendall(self._ws.send(ev.response()))
                elif isinstance(ev, CloseConnection):
                    self.closed, self.close_code = True, ev.code
        raise TimeoutError(f"no terminal event (closed: {self.closed}); got {self.received[start:]}")

    def turn(self, text: str, timeout: float | None = None) -> list[str]:
        self.send(text)
        return self.read_until(lambda e: e.get("type") in TERMINAL, timeout)

    def wait_closed(self, timeout: float = 5.0) -> bool:
        """True once the peer has closed the socket (the proxy went away)."""
        deadline = time.monotonic() + timeout
        self.sock.settimeout(0.2)
        while not self.closed and time.monotonic() < deadline:
            try:
                for ev in self._pump():
                    if isinstance(ev, CloseConnection):
                        self.closed, self.close_code = True, ev.code
            except RemoteProtocolError:
                self.closed = True
            except TimeoutError:
                continue
        return self.closed

    def send_raw(self, frame: bytes) -> None:
        self.sock.sendall(frame)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if not self.closed:
                self.sock.sendall(self._ws.send(CloseConnection(code=1000)))
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> WsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
