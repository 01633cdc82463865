"""End-to-end harness: a test CA, fake inference servers over TLS, a real mitmdump, a client.

Everything here is real: real sockets on 127.0.0.1, real TLS, a real ``mitmdump`` subprocess.
Nothing is mocked, so a test built on it can fail for the reasons a user would see.

API (import with ``from e2e.harness import ...`` from tests/, or ``from .harness import ...`` in tests/e2e):

``TestCA(dir)``
    A throwaway CA (EC P-256). ``ca.pem`` is its certificate file (give it to
    ``ssl_verify_upstream_trusted_ca``); ``ca.issue("name")`` returns a PEM file holding a server
    certificate and key for 127.0.0.1 and localhost (IP and DNS SANs).

``FakeServer(name, ca, prefix="")`` (a context manager; ``start()`` / ``stop()`` / ``start()`` again)
    An HTTPS server on 127.0.0.1 (random port, kept across restarts) that speaks, under ``prefix``:
    Anthropic ``POST /v1/messages`` (SSE with the real event names when ``"stream": true``, JSON
    otherwise), ``POST /v1/messages/count_tokens``, OpenAI ``POST /v1/chat/completions`` and
    ``POST /v1/responses`` (SSE or JSON), and any other path (``GET /api/claude_code/settings`` …)
    with a small JSON body. A path outside ``prefix`` gets 404. The answer text names the server.
    ``url`` is ``https://127.0.0.1:PORT<prefix>``, ``origin`` the same without the prefix.
    ``requests`` is every request received, in order (``Received``: method, path with query,
    headers as a list of pairs, body bytes, arrival time; ``header(name)``, ``json()``, ``raw()``);
    ``received(path_contains)``, ``clear()``, ``wait_for(n)``.
    Behaviour knobs (plain attributes, or ``with fake.behave(pause_ms=1000): ...`` to restore them):
    ``pause_ms`` between SSE events, ``pause_after_first_ms`` after the first event only,
    ``status`` (answer every request with this status and an error JSON), ``headers`` (extra response
    headers on every answer: ``retry-after``, rate-limit headers), ``deltas`` (text deltas
    per stream), ``reply_bytes`` (pad non-streamed message replies to about this size), ``keep_bodies``
    (False: log bodies as b"", for benchmarks).
    ``stop()`` closes the listener *and* every open connection: the server is unreachable.

``Mitmdump(workdir, script=ROUTE_SCRIPT, options={...}, env={...}, modes=[...])``
    ``start()`` runs ``<venv>/bin/mitmdump --listen-host 127.0.0.1 -p 0 -s SCRIPT --set confdir=...``
    plus ``--set k=v`` for each option (a list value repeats the option), waits for the
    "listening at" line(s) and returns the port (``port``; ``ports`` for several modes).
    ``stop(signal.SIGTERM | signal.SIGKILL)``, ``restart(sig)`` (same confdir and options, a new
    port), ``alive``, ``output`` (all of its stdout+stderr, every run), ``tail(n)``,
    ``wait_output(regex, since=line_count)``. ``mitm_ca`` is ``<confdir>/mitmproxy-ca-cert.pem``. ``script=None``
    starts plain mitmdump. A failed start raises ``MitmdumpError`` carrying the output; every
    instance is in ``LIVE`` (tests/e2e/conftest.py shows the running ones' output when a test
    fails; any left running are killed at exit).
    ``Mitmdump.router(workdir, ca, config_text, env=...)`` is the sessionpin router set-up:
    ``-s addons/route.py``, ``sessionpin_config=<workdir>/config.toml``,
    ``sessionpin_store=file:<workdir>/state.db``, ``ssl_verify_upstream_trusted_ca=<ca.pem>``;
    ``write_config(text)`` rewrites the config file in place.

``Client.via_proxy(port, mitm_ca)`` / ``Client.direct(ca)`` / ``Client.reverse(port)``
    ``request(method, url, headers=[...], body=b"")`` -> ``Reply`` (status, headers, body,
    ``events``: SSE events parsed as they arrive, each with its arrival time ``at``; ``t_sent``,
    ``t_first_byte``, ``t_done``; ``json()``, ``header(name)``). Through a proxy it tunnels with
    HTTP CONNECT (``https://`` urls) or uses absolute-form (``http://``); reverse mode sends the
    path to the proxy port over plain HTTP. ``connect(url)`` returns a keep-alive ``Connection``
    with the same ``request(method, path, ...)`` (the benchmark uses it).

``running_rig(tmp, make_fakes, make_rig)`` (a context manager) is the one way a module builds its
rig: a ``TestCA`` in ``tmp/ca``, the fake servers ``make_fakes(ca)`` returns (a dict), started, then
``make_rig(tmp, ca, fakes)`` and its ``mitm`` started; on exit the mitmdump stops, then the fakes.

Every ``Mitmdump`` confdir starts with one mitmproxy CA made once per test process (mitmdump
would make an RSA-2048 CA in each new confdir; the tests only need it trusted by their client).

``free_port()`` for a second mode (``--mode reverse:URL@PORT``: two modes cannot both take -p 0).
``toml_config(servers, agents)`` writes the config format of issue 4; ``anthropic_sse_events()``
and friends give the exact bytes the fake servers stream.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import http.client
import ipaddress
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Any, Iterable, Iterator

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import ports  # tests/ports.py: a port that is free again at a restart

REPO = Path(__file__).resolve().parents[2]
ROUTE_SCRIPT = REPO / "addons" / "route.py"
MITMDUMP = Path(sys.executable).parent / "mitmdump"
LOOPBACK = "127.0.0.1"

Headers = list[tuple[str, str]]


def free_port() -> int:
    """A port that was free a moment ago (for a second mitmdump mode: two modes cannot both use -p 0),
    outside the ephemeral range, so that a restart finds it free (``tests/ports.py``)."""
    return ports.free_port()


# --------------------------------------------------------------------------- test CA


class TestCA:
    """A private CA whose certificates the fake servers present and the proxy is told to trust."""

    __test__ = False  # not a pytest test class

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sessionpin test CA")])
        now = datetime.datetime.now(datetime.timezone.utc)
        ski = x509.SubjectKeyIdentifier.from_public_key(self._key.public_key())
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(ski, critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.pem = self.dir / "test-ca.pem"
        self.pem.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, label: str = "server", hosts: Iterable[str] = (LOOPBACK, "localhost")) -> Path:
        """A PEM file with a server certificate (SANs: ``hosts``) followed by its key."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = []
        for h in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fake {label}")]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        path = self.dir / f"{label}-cert-and-key.pem"
        path.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM)
            + key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return path


# --------------------------------------------------------------------------- wire shapes


def sse(event: str | None, data: Any) -> bytes:
    """One SSE event as bytes (``data`` is JSON-encoded unless it is already a str)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


def anthropic_message(server: str, model: str, n: int, text: str) -> dict[str, Any]:
    return {
        "id": f"msg_fake_{server}_{n}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 6},
    }


def anthropic_sse_events(server: str, model: str, n: int, deltas: int = 3) -> list[bytes]:
    """The events of a streamed Anthropic message, named as the real API names them."""
    start = anthropic_message(server, model, n, "")
    start.update(content=[], stop_reason=None)
    start["usage"] = {"input_tokens": 12, "output_tokens": 1}
    events = [
        sse("message_start", {"type": "message_start", "message": start}),
        sse("content_block_start", {"type": "content_block_start", "index": 0,
                                    "content_block": {"type": "text", "text": ""}}),
        sse("ping", {"type": "ping"}),
    ]
    for i in range(deltas):
        events.append(sse("content_block_delta", {
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": f"reply {i} from {server}. "},
        }))
    events += [
        sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        sse("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                               "usage": {"output_tokens": 6}}),
        sse("message_stop", {"type": "message_stop"}),
    ]
    return events


def openai_chat_sse_events(server: str, model: str, n: int, deltas: int = 3) -> list[bytes]:
    base = {"id": f"chatcmpl-{server}-{n}", "object": "chat.completion.chunk", "created": 0, "model": model}
    events = [sse(None, {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    for i in range(deltas):
        events.append(sse(None, {**base, "choices": [{"index": 0, "delta": {"content": f"reply {i} from {server}. "}}]}))
    events.append(sse(None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    events.append(sse(None, "[DONE]"))
    return events


def openai_responses_sse_events(server: str, model: str, n: int, deltas: int = 3) -> list[bytes]:
    resp = {"id": f"resp_{server}_{n}", "object": "response", "model": model, "status": "in_progress", "output": []}
    events = [
        sse("response.created", {"type": "response.created", "sequence_number": 0, "response": resp}),
        sse("response.in_progress", {"type": "response.in_progress", "sequence_number": 1, "response": resp}),
    ]
    for i in range(deltas):
        events.append(sse("response.output_text.delta", {
            "type": "response.output_text.delta", "sequence_number": 2 + i, "item_id": "msg_1",
            "output_index": 0, "content_index": 0, "delta": f"reply {i} from {server}. ",
        }))
    done = {**resp, "status": "completed"}
    events.append(sse("response.completed", {"type": "response.completed", "sequence_number": 2 + deltas, "response": done}))
    return events


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 429: "rate_limit_error", 529: "overloaded_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# --------------------------------------------------------------------------- fake server


@dataclass(frozen=True)
class Received:
    """One request as a fake server received it."""

    method: str
    path: str                 # with the query string, exactly as sent
    headers: Headers          # in order, duplicates kept
    body: bytes
    at: float                 # time.monotonic() when the body was complete

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def header_all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    def json(self) -> Any:
        return json.loads(self.body)

    def raw(self) -> bytes:
        """Everything the request carried, for "does this secret appear anywhere" checks."""
        head = "\n".join(f"{k}: {v}" for k, v in self.headers)
        return f"{self.method} {self.path}\n{head}\n\n".encode() + self.body


class _TLSServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, fake: FakeServer, address: tuple[str, int], context: ssl.SSLContext) -> None:
        self.fake = fake
        self.context = context
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = self.socket.accept()
        # Headers and body go out in separate writes: without this, Nagle + delayed ACK add 40 ms.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The handshake happens on first read, in the handler's thread: a slow client
        # never blocks the accept loop.
        tls = self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        with self.lock:
            self.connections.add(tls)
        return tls, addr

    def shutdown_request(self, request: Any) -> None:
        with self.lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away is not the server's problem

    def drop_all(self) -> None:
        with self.lock:
            conns = list(self.connections)
            self.connections.clear()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                c.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _TLSServer
    timeout = 60

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _any(self) -> None:
        try:
            body = self._read_body()
        except (ValueError, OSError):
            self.close_connection = True
            return
        fake = self.server.fake
        rec = Received(self.command, self.path, list(self.headers.items()), body, time.monotonic())
        n = fake._record(rec if fake.keep_bodies else dataclasses.replace(rec, body=b""))
        try:
            fake._answer(self, rec, n)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _any

    # writing helpers
    def send_json(self, status: int, obj: Any, extra: Headers = ()) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_raw(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        """A recorded response: its status, its headers (but the framing ones), its body."""
        self.send_response(status)
        for k, v in headers:
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_stream(self, events: list[bytes], pause_ms: int, pause_after_first_ms: int, extra: Headers = ()) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        for i, ev in enumerate(events):
            if i == 1 and pause_after_first_ms:
                time.sleep(pause_after_first_ms / 1000)
            elif i > 0 and pause_ms:
                time.sleep(pause_ms / 1000)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
        self.wfile.write(b"0\r\n\r\n")


class FakeServer:
    """A fake HTTPS inference server on 127.0.0.1 that records what reached it."""

    def __init__(self, name: str, ca: TestCA, prefix: str = "", port: int = 0) -> None:
        self.name = name
        self.prefix = prefix.rstrip("/")
        self.port = port
        self.requests: list[Received] = []
        self.pause_ms = 0
        self.pause_after_first_ms = 0
        self.status: int | None = None
        self.headers: Headers = []
        self.deltas = 3
        self.reply_bytes = 0
        self.keep_bodies = True     # False: record bodies as b"" (benchmarks send many megabytes)
        # canned(received) -> (status, headers, body) or None: answer with a recorded response
        self.canned: Callable[[Received], tuple[int, list[tuple[str, str]], bytes] | None] | None = None
        self._cond = threading.Condition()
        self._server: _TLSServer | None = None
        self._thread: threading.Thread | None = None
        cert = ca.issue(f"fake-{name}")
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(cert)
        self._context.set_alpn_protocols(["http/1.1"])

    # lifecycle
    def start(self) -> FakeServer:
        if self._server is not None:
            return self
        # kept across restarts: drawn below the ephemeral range, so it is still free at one
        for _ in range(20 if not self.port else 0):
            try:
                self._server = _TLSServer(self, (LOOPBACK, ports.free_port()), self._context)
                break
            except OSError:             # taken since it was found free: another
                continue
        if self._server is None:
            self._server = _TLSServer(self, (LOOPBACK, self.port), self._context)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
            name=f"fake-{self.name}", daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and every open connection: the server becomes unreachable."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.drop_all()
        if self._thread:
            self._thread.join(5)

    @property
    def running(self) -> bool:
        return self._server is not None

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # addresses
    @property
    def origin(self) -> str:
        return f"https://{LOOPBACK}:{self.port}"

    @property
    def url(self) -> str:
        return self.origin + self.prefix

    # log
    def _record(self, rec: Received) -> int:
        with self._cond:
            self.requests.append(rec)
            self._cond.notify_all()
            return len(self.requests)

    def clear(self) -> None:
        with self._cond:
            self.requests.clear()

    def wait_for(self, count: int, timeout: float = 10.0) -> list[Received]:
        """Wait until at least ``count`` requests arrived; return the log (possibly short)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.requests) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return list(self.requests)

    def received(self, path_contains: str = "") -> list[Received]:
        with self._cond:
            return [r for r in self.requests if path_contains in r.path]

    @contextlib.contextmanager
    def behave(self, **knobs: Any) -> Iterator[FakeServer]:
        """Set behaviour knobs (pause_ms, pause_after_first_ms, status, deltas, reply_bytes) for a block."""
        old = {k: getattr(self, k) for k in knobs}
        for k, v in knobs.items():
            if k not in ("pause_ms", "pause_after_first_ms", "status", "headers", "deltas", "reply_bytes"):
                raise AttributeError(k)
            setattr(self, k, v)
        try:
            yield self
        finally:
            for k, v in old.items():
                setattr(self, k, v)

    # answers
    def _answer(self, h: _Handler, rec: Received, n: int) -> None:
        if self.canned is not None:
            answer = self.canned(rec)
            if answer is not None:
                h.send_raw(*answer)
                return
        extra = [("x-fake-server", self.name), ("request-id", f"req_fake_{self.name}_{n}"), *self.headers]
        path = rec.path.split("?", 1)[0]
        if self.prefix:
            if not (path == self.prefix or path.startswith(self.prefix + "/")):
                h.send_json(404, anthropic_error(404, f"fake {self.name}: {path} is outside {self.prefix}"), extra)
                return
            path = path[len(self.prefix):]
        if self.status is not None:
            h.send_json(self.status, anthropic_error(self.status, f"fake {self.name} answers {self.status}"), extra)
            return
        if rec.method == "POST" and path in ("/v1/messages", "/v1/chat/completions", "/v1/responses",
                                            "/v1/messages/count_tokens"):
            try:
                req = json.loads(rec.body)
                if not isinstance(req, dict):
                    raise ValueError("not an object")
            except ValueError:
                h.send_json(400, anthropic_error(400, f"fake {self.name}: body is not a JSON object"), extra)
                return
            model = str(req.get("model", ""))
            if path == "/v1/messages/count_tokens":
                h.send_json(200, {"input_tokens": 42}, extra)
                return
            if req.get("stream") is True:
                make = {"/v1/messages": anthropic_sse_events, "/v1/chat/completions": openai_chat_sse_events,
                        "/v1/responses": openai_responses_sse_events}[path]
                h.send_stream(make(self.name, model, n, self.deltas), self.pause_ms, self.pause_after_first_ms, extra)
                return
            if path == "/v1/messages":
                msg = anthropic_message(self.name, model, n, f"reply from {self.name}.")
                if self.reply_bytes:
                    msg["content"][0]["text"] += " " + "x" * self.reply_bytes
                h.send_json(200, msg, extra)
            elif path == "/v1/chat/completions":
                h.send_json(200, {"id": f"chatcmpl-{self.name}-{n}", "object": "chat.completion", "model": model,
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": f"reply from {self.name}."}}]},
                            extra)
            else:
                h.send_json(200, {"id": f"resp_{self.name}_{n}", "object": "response", "model": model,
                                  "status": "completed",
                                  "output": [{"type": "message", "role": "assistant",
                                              "content": [{"type": "output_text", "text": f"reply from {self.name}."}]}]},
                            extra)
            return
        h.send_json(200, {"server": self.name, "method": rec.method, "path": path}, extra)


# --------------------------------------------------------------------------- mitmdump


class MitmdumpError(RuntimeError):
    pass


_LISTENING = re.compile(r"listening at \[?([0-9a-fA-F.:]+?)\]?:(\d+)")
LIVE: list[Mitmdump] = []  # every Mitmdump started in this process (conftest shows their output on failure)


@atexit.register
def _stop_leftovers() -> None:
    """A test that forgot to stop its mitmdump must not leave it running after the process ends."""
    for m in LIVE:
        if m.alive:
            m.stop(signal.SIGKILL, timeout=5)


_MITM_CA: Path | None = None   # a confdir holding the mitmproxy CA every Mitmdump of this process starts with


def _seed_confdir(confdir: Path) -> None:
    """Give a new confdir this process's mitmproxy CA (made once, as mitmdump makes it)."""
    global _MITM_CA
    if any(confdir.glob("mitmproxy-ca*")):
        return
    if _MITM_CA is None:
        import shutil
        import tempfile

        from mitmproxy import certs

        template = Path(tempfile.mkdtemp(prefix="sessionpin-mitm-ca-"))
        atexit.register(shutil.rmtree, template, True)
        certs.CertStore.from_store(template, "mitmproxy", 2048)
        _MITM_CA = template
    for f in _MITM_CA.iterdir():
        (confdir / f.name).write_bytes(f.read_bytes())
        os.chmod(confdir / f.name, 0o600)


class Mitmdump:
    """A mitmdump subprocess with a private confdir, restartable with the same state."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        script: str | os.PathLike[str] | None = ROUTE_SCRIPT,
        options: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        modes: list[str] | None = None,
        args: Iterable[str] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.confdir = self.workdir / "confdir"
        self.confdir.mkdir(parents=True, exist_ok=True)
        _seed_confdir(self.confdir)
        self.script = Path(script) if script else None
        self.options = dict(options or {})
        self.env = dict(env or {})
        self.modes = list(modes or [])
        self.args = list(args)
        self.config_path: Path | None = None
        self.port = 0
        self.ports: list[int] = []
        self.proc: subprocess.Popen[str] | None = None
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    @classmethod
    def router(
        cls,
        workdir: str | os.PathLike[str],
        ca: TestCA | Path | None,
        config_text: str,
        *,
        env: dict[str, str] | None = None,
        options: dict[str, Any] | None = None,
        modes: list[str] | None = None,
    ) -> Mitmdump:
        """mitmdump -s addons/route.py with a config file, a file store and the test CA trusted."""
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        opts: dict[str, Any] = {
            "sessionpin_config": str(workdir / "config.toml"),
            "sessionpin_store": f"file:{workdir / 'state.db'}",
        }
        if ca is not None:
            opts["ssl_verify_upstream_trusted_ca"] = str(ca.pem if isinstance(ca, TestCA) else ca)
        opts.update(options or {})
        m = cls(workdir, script=ROUTE_SCRIPT, options=opts, env=env, modes=modes)
        m.config_path = workdir / "config.toml"
        m.write_config(config_text)
        return m

    def write_config(self, text: str) -> None:
        """Rewrite the config file in place (as an editor that saves in place would)."""
        assert self.config_path is not None
        self.config_path.write_text(text)

    @property
    def mitm_ca(self) -> Path:
        return self.confdir / "mitmproxy-ca-cert.pem"

    def command(self) -> list[str]:
        cmd = [str(MITMDUMP), "--listen-host", LOOPBACK, "-p", "0"]
        for mode in self.modes:
            cmd += ["--mode", mode]
        if self.script:
            cmd += ["-s", str(self.script)]
        cmd += ["--set", f"confdir={self.confdir}"]
        for k, v in self.options.items():
            for item in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(item, bool):
                    item = "true" if item else "false"
                cmd += ["--set", f"{k}={item}"]
        return cmd + self.args

    def start(self, timeout: float = 30.0) -> int:
        if self.alive:
            raise MitmdumpError("already running")
        env = {**os.environ, **self.env}
        # what the proxy remembers of its store (issue 18): the test run's (tests/conftest.py),
        # else this rig's own — never the user's config dir (scripts and benches use the harness)
        env.setdefault("SESSIONPIN_STORE_MEMORY", str(self.workdir / "store-memory"))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        env["PYTHONUNBUFFERED"] = "1"
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
            env.pop(k, None)
        with self._lock:
            self._lines.append(f"---- start: {' '.join(self.command())}\n")
            first = len(self._lines)
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, errors="replace", env=env, cwd=str(self.workdir),
        )
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True, name="mitmdump-output")
        self._reader.start()
        if self not in LIVE:
            LIVE.append(self)
        want = max(1, len(self.modes))
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                ports = [int(m.group(2)) for line in self._lines[first:] if (m := _LISTENING.search(line))]
            if len(ports) >= want:
                self.ports = ports
                self.port = ports[0]
                return self.port
            if self.proc.poll() is not None:
                if self._reader:
                    self._reader.join(2)
                raise MitmdumpError(f"mitmdump exited with {self.proc.returncode} before listening:\n{self.tail(80)}")
            if time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                raise MitmdumpError(f"mitmdump did not listen within {timeout}s:\n{self.tail(80)}")
            time.sleep(0.02)

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._lock:
                self._lines.append(line)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        """Send ``sig``; SIGKILL after ``timeout``. Returns the exit code (None if never started)."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self._reader:
            self._reader.join(2)
        with self._lock:
            self._lines.append(f"---- stopped with signal {int(sig)}, exit code {proc.returncode}\n")
        return proc.returncode

    def restart(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        self.stop(sig)
        return self.start(timeout)

    def wait_exit(self, timeout: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        if self._reader:
            self._reader.join(2)
        return code

    @property
    def output(self) -> str:
        with self._lock:
            return "".join(self._lines)

    def tail(self, n: int = 60) -> str:
        with self._lock:
            return "".join(self._lines[-n:])

    def wait_output(self, pattern: str, timeout: float = 5.0, since: int = 0) -> re.Match[str] | None:
        """Wait for a line matching ``pattern`` (among output lines from index ``since``)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                for line in self._lines[since:]:
                    if m := rx.search(line):
                        return m
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    @property
    def line_count(self) -> int:
        with self._lock:
            return len(self._lines)

    def __enter__(self) -> Mitmdump:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_rig(tmp: Path, make_fakes: Callable[[TestCA], dict[str, Any]],
                make_rig: Callable[[Path, TestCA, dict[str, Any]], Any]) -> Iterator[Any]:
    """A module's rig, running: a test CA, its fake servers started, the rig made and its
    mitmdump started; the mitmdump stops first on exit, then the fakes."""
    ca = TestCA(tmp / "ca")
    fakes = make_fakes(ca)
    started: list[Any] = []
    rig = None
    try:
        for f in fakes.values():
            f.start()
            started.append(f)
        rig = make_rig(tmp, ca, fakes)
        rig.mitm.start()
        yield rig
    finally:
        if rig is not None:
            rig.mitm.stop()
        for f in started:
            f.stop()


# --------------------------------------------------------------------------- client


@dataclass
class Event:
    """One SSE event as the client received it."""

    at: float                 # time.monotonic() when its last byte arrived
    name: str | None
    data: str
    raw: bytes

    def json(self) -> Any:
        return json.loads(self.data)


@dataclass
class Reply:
    status: int
    reason: str
    headers: Headers
    body: bytes
    events: list[Event] = field(default_factory=list)
    t_sent: float = 0.0
    t_headers: float = 0.0
    t_first_byte: float | None = None
    t_done: float = 0.0

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def event_names(self) -> list[str | None]:
        return [e.name for e in self.events]

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


_EVENT_END = re.compile(rb"\r?\n\r?\n")


def _parse_event(raw: bytes, at: float) -> Event:
    name = None
    data: list[str] = []
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    return Event(at, name, "\n".join(data), raw)


class Connection:
    """One keep-alive connection (through the proxy's tunnel, or direct, or to a reverse proxy)."""

    def __init__(self, conn: http.client.HTTPConnection, host_header: str | None, absolute: str | None) -> None:
        self._conn = conn
        self._host_header = host_header
        self._absolute = absolute  # scheme://host:port for absolute-form requests to a plain proxy

    def request(self, method: str, path: str, headers: Iterable[tuple[str, str]] = (), body: bytes = b"") -> Reply:
        headers = list(headers)
        names = {k.lower() for k, _ in headers}
        target = (self._absolute + path) if self._absolute else path
        c = self._conn
        t_sent = time.monotonic()
        c.putrequest(method, target, skip_host="host" in names, skip_accept_encoding=True)
        for k, v in headers:
            c.putheader(k, v)
        if "content-length" not in names and "transfer-encoding" not in names and (body or method in ("POST", "PUT", "PATCH")):
            c.putheader("Content-Length", str(len(body)))
        c.endheaders(body or None)
        resp = c.getresponse()
        reply = Reply(resp.status, resp.reason, list(resp.getheaders()), b"", t_sent=t_sent, t_headers=time.monotonic())
        is_sse = "text/event-stream" in (resp.getheader("content-type") or "")
        chunks: list[bytes] = []
        pending = b""
        while True:
            chunk = resp.read1(65536) if not resp.isclosed() else b""
            now = time.monotonic()
            if not chunk:
                break
            if reply.t_first_byte is None:
                reply.t_first_byte = now
            chunks.append(chunk)
            if is_sse:
                pending += chunk
                while m := _EVENT_END.search(pending):
                    reply.events.append(_parse_event(pending[: m.start()], now))
                    pending = pending[m.end():]
        if not resp.isclosed():
            # Python 3.12.1's read1() does not close a response whose length it read to the
            # end (fixed in 3.12.2, gh-113199); read() does, so the connection can carry
            # the next request instead of raising ResponseNotReady.
            rest = resp.read()
            if rest:
                chunks.append(rest)
                pending += rest
        if is_sse and pending.strip():
            reply.events.append(_parse_event(pending, time.monotonic()))
        reply.body = b"".join(chunks)
        reply.t_done = time.monotonic()
        return reply

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """An HTTP client that goes through a mitmproxy (regular or reverse mode) or straight to a server."""

    def __init__(
        self,
        *,
        proxy_port: int | None = None,
        reverse_port: int | None = None,
        ca: str | os.PathLike[str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.proxy_port = proxy_port
        self.reverse_port = reverse_port
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=str(ca)) if ca else ssl.create_default_context()
        self.context.set_alpn_protocols(["http/1.1"])

    @classmethod
    def via_proxy(cls, port: int, mitm_ca: str | os.PathLike[str], timeout: float = 30.0) -> Client:
        return cls(proxy_port=port, ca=mitm_ca, timeout=timeout)

    @classmethod
    def direct(cls, ca: TestCA | str | os.PathLike[str], timeout: float = 30.0) -> Client:
        return cls(ca=ca.pem if isinstance(ca, TestCA) else ca, timeout=timeout)

    @classmethod
    def reverse(cls, port: int, timeout: float = 30.0) -> Client:
        return cls(reverse_port=port, timeout=timeout)

    def connect(self, url: str) -> Connection:
        """A keep-alive connection for requests to ``url``'s origin (the path of ``url`` is ignored)."""
        u = urllib.parse.urlsplit(url)
        host = u.hostname or LOOPBACK
        port = u.port or (443 if u.scheme == "https" else 80)
        if self.reverse_port is not None:
            return Connection(http.client.HTTPConnection(LOOPBACK, self.reverse_port, timeout=self.timeout), None, None)
        if self.proxy_port is not None:
            if u.scheme == "https":
                c = http.client.HTTPSConnection(LOOPBACK, self.proxy_port, timeout=self.timeout, context=self.context)
                c.set_tunnel(host, port)
                return Connection(c, f"{host}:{port}", None)
            c = http.client.HTTPConnection(LOOPBACK, self.proxy_port, timeout=self.timeout)
            return Connection(c, None, f"http://{host}:{port}")
        if u.scheme == "https":
            return Connection(http.client.HTTPSConnection(host, port, timeout=self.timeout, context=self.context), None, None)
        return Connection(http.client.HTTPConnection(host, port, timeout=self.timeout), None, None)

    def request(
        self, method: str, url: str, headers: Iterable[tuple[str, str]] = (), body: bytes = b""
    ) -> Reply:
        """One request on a fresh connection. ``url`` is absolute (``https://127.0.0.1:PORT/path?q``)."""
        u = urllib.parse.urlsplit(url)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        with self.connect(url) as conn:
            return conn.request(method, path, headers, body)


# --------------------------------------------------------------------------- config


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string for the plain ASCII used in tests
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def toml_config(servers: dict[str, dict[str, Any]], agents: dict[str, str | None] | None = None) -> str:
    """The config file of issue 4: ``[servers.NAME]`` tables and ``[agents.NAME] server = ...``."""
    out: list[str] = []
    for name, table in servers.items():
        out.append(f"[servers.{name}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        out.append("")
    for agent, server in (agents or {}).items():
        out.append(f"[agents.{agent}]")
        if server is not None:
            out.append(f"server = {_toml_value(server)}")
        out.append("")
    return "\n".join(out)


class StoreLock:
    """Another process holds a SQLite store's write lock (``BEGIN IMMEDIATE``) until the
    block ends, at most ``seconds`` (``until``: that deadline, monotonic)."""

    def __init__(self, db: Path | str, seconds: float) -> None:
        code = ("import select, sqlite3, sys\n"
                "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
                "c.execute('BEGIN IMMEDIATE')\n"
                "print('locked', flush=True)\n"
                "select.select([sys.stdin], [], [], float(sys.argv[2]))\n"
                "c.execute('ROLLBACK')\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(db), str(seconds)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "locked"
        self.until = time.monotonic() + seconds

    def __enter__(self) -> "StoreLock":
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
