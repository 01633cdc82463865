"""Bounded work and exact scope, end to end (issue 10's rows about bodies and paths):

- a request body over the limit gets a clear 413 in the agent's format and is never
  buffered whole nor sent to any server;
- paths with dot segments or encoded slashes addressed to a configured server are
  refused (400), never forwarded under another server's key;
- look-alike paths (``/v1/threads/x/messages``) are not inference: never routed;
- a redirect from a server a request was moved to is a 502 whose headers replace the
  redirect's before any leave, also when its body is past ``stream_large_bodies`` (1 MiB
  here: the body limit), sized or chunked: its ``Location`` never reaches the agent;
- a compressed answer made to inflate far (a brotli bomb: 809 bytes, 512 MiB) or into a flood
  of lines or usage events costs the proxy a bounded amount of memory and of CPU (the CPU
  time of the mitmdump process, not wall time: what the event loop spent on it, which other
  clients would have waited for).
"""

from __future__ import annotations

import json
import os
import time
import uuid
import zlib
from pathlib import Path
from typing import Iterator

import pytest

from .harness import Client, FakeServer, Mitmdump, TestCA, toml_config

KEY_ENV = "SESSIONPIN_E2E_GLM_KEY"
GLM_KEY = "glm-SENTINEL-" + uuid.uuid4().hex[:8]
CLIENT_KEY = "sk-ant-api03-CLIENT-SENTINEL-" + uuid.uuid4().hex[:8]


class Rig:
    def __init__(self, tmp) -> None:
        self.ca = TestCA(tmp / "ca")
        self.anthropic = FakeServer("anthropic", self.ca).start()
        self.glm = FakeServer("glm", self.ca, prefix="/api/anthropic").start()
        config = toml_config({"anthropic": {"url": self.anthropic.url},
                              "glm": {"url": self.glm.url, "key_env": KEY_ENV}}, {"claude-code": "glm"})
        self.mitm = Mitmdump.router(tmp / "router", self.ca, config, env={KEY_ENV: GLM_KEY},
                                    options={"sessionpin_max_body_mb": 1})
        self.mitm.start()

    def send(self, path: str, body: bytes, session: str | None = None) -> object:
        session = session or str(uuid.uuid4())
        headers = [("Content-Type", "application/json"), ("User-Agent", "claude-cli/2.1.332 (external, cli)"),
                   ("x-api-key", CLIENT_KEY), ("X-Claude-Code-Session-Id", session),
                   ("x-claude-code-request-class", "main"), ("anthropic-version", "2023-06-01")]
        client = Client.via_proxy(self.mitm.port, self.mitm.mitm_ca)
        return client.request("POST", self.anthropic.origin + path, headers, body)

    def close(self) -> None:
        self.mitm.stop()
        self.anthropic.stop()
        self.glm.stop()


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("e2e-bounds"))
    try:
        yield r
    finally:
        r.close()


def opening(size: int = 0) -> bytes:
    return json.dumps({"model": "claude-opus-4-5", "max_tokens": 10, "stream": False,
                       "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
                       "messages": [{"role": "user", "content": "hi " + "x" * size}]}).encode()


def _answered(rig: Rig, answer, may_fail: bool = False):
    """An opening sent while glm answers with ``answer`` (written on its socket as it is): the
    reply, or with ``may_fail`` the exception the agent's read ended with."""
    rig.glm._answer = answer
    try:
        return rig.send("/v1/messages", opening())
    except Exception as e:
        if not may_fail:
            raise
        return e
    finally:
        del rig.glm._answer


def test_a_body_over_the_limit_gets_a_413_and_reaches_no_server(rig: Rig) -> None:
    before = (len(rig.anthropic.received()), len(rig.glm.received()))
    r = rig.send("/v1/messages?beta=true", opening(3 * 1024 * 1024))
    assert r.status == 413, r.text[:300]
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "request_too_large"
    assert "1 MiB" in err["error"]["message"] and "sessionpin_max_body_mb" in err["error"]["message"]
    assert (len(rig.anthropic.received()), len(rig.glm.received())) == before
    # a body under the limit is routed as ever
    r = rig.send("/v1/messages?beta=true", opening(1000))
    assert r.status == 200 and len(rig.glm.received()) == before[1] + 1


@pytest.mark.parametrize("path", ["/../../v1/messages", "/v1/%2e%2e/v1/messages", "/v1%2fmessages",
                                  "//v1/messages", "/v1/./messages"])
def test_an_ambiguous_path_to_a_configured_server_is_refused(rig: Rig, path: str) -> None:
    before = (len(rig.anthropic.received()), len(rig.glm.received()))
    r = rig.send(path, opening())
    assert r.status == 400, (path, r.status, r.text[:200])
    assert "ambiguous" in r.json()["error"]["message"]
    assert (len(rig.anthropic.received()), len(rig.glm.received())) == before


@pytest.mark.parametrize("path", ["/v1/threads/x/messages", "/v1/organizations/x/messages", "/v2/messages"])
def test_a_look_alike_path_is_not_inference_and_is_left_alone(rig: Rig, path: str) -> None:
    glm_before = len(rig.glm.received())
    r = rig.send(path, opening())
    assert r.status == 200
    got = rig.anthropic.received()[-1]
    assert got.path == path and got.header("x-api-key") == CLIENT_KEY
    assert len(rig.glm.received()) == glm_before


@pytest.mark.parametrize("code", [307, 302])
def test_a_redirect_with_a_body_past_the_stream_limit_never_reaches_the_agent(rig: Rig, code: int) -> None:
    """mitmproxy marks a response whose Content-Length passes ``stream_large_bodies`` streamed
    before the ``responseheaders`` hook; before the fix the router left it so, and the 3xx
    and its Location went to the agent."""
    big = b"x" * (2 * 1024 * 1024)
    rig.glm.canned = lambda rec: (code, [("Location", "https://evil.example/v1/messages"),
                                         ("Content-Type", "text/plain")], big)
    try:
        r = rig.send("/v1/messages", opening())
    finally:
        rig.glm.canned = None
    assert r.header("location") is None, f"the agent got {r.status} Location: {r.header('location')}"
    assert r.status == 502 and r.header("x-sessionpin-refused") == "redirect"
    assert "evil.example" in r.json()["error"]["message"]


def test_a_chunked_redirect_growing_past_the_stream_limit_never_reaches_the_agent(rig: Rig) -> None:
    """Without Content-Length mitmproxy buffers the body and switches to streaming once it
    passes ``stream_large_bodies``, sending the headers then."""
    def answer(h, rec, n):
        h.send_response(307)
        h.send_header("Location", "https://evil.example/v1/messages")
        h.send_header("Content-Type", "text/plain")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        chunk = b"x" * (256 * 1024)
        for _ in range(12):
            h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        h.wfile.write(b"0\r\n\r\n")
    r = _answered(rig, answer)
    assert r.header("location") is None, f"the agent got {r.status} Location: {r.header('location')}"
    assert r.status == 502 and r.header("x-sessionpin-refused") == "redirect"
    assert "evil.example" in r.json()["error"]["message"]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _compressed(coding: str, piece: bytes, size: int) -> bytes:
    """``piece`` repeated to ``size`` bytes, compressed a mebibyte at a time (never held whole)."""
    block = piece * ((1 << 20) // len(piece))
    if coding == "br":
        import brotli
        c = brotli.Compressor(quality=5)
        out = b"".join(c.process(block) for _ in range(size // len(block)))
        return out + c.finish()
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    return b"".join(c.compress(block) for _ in range(size // len(block))) + c.flush()


@pytest.mark.parametrize("what,content_type", [
    ("br 512 MiB of zeros", "text/event-stream"), ("br 512 MiB of zeros", "application/json"),
    ("gzip 16 MiB of blank lines", "text/event-stream"), ("gzip 24 MiB of usage events", "text/event-stream")])
def test_a_compressed_answer_inflating_far_costs_the_proxy_bounded_memory_and_cpu(rig: Rig, what: str,
                                                                                  content_type: str) -> None:
    """Before: br was inflated with no limit (+1 GB of peak RSS, 2-4 s of the event loop);
    16 MiB of newlines from 16 KB of gzip took a Python step per line (9 s); 24 MiB of
    ``data:{"usage":{}}`` from 61 KB had every event parsed (2-4 s). Every other client
    waited that long. The bounds are twenty times what the fixed proxy spends (0.05 s, +12 MB at most)."""
    coding, piece, size = {"br 512 MiB of zeros": ("br", b"\0", 512 << 20),
                           "gzip 16 MiB of blank lines": ("gzip", b"\n", 16 << 20),
                           "gzip 24 MiB of usage events": ("gzip", b'data:{"usage":{}}\n\n', 24 << 20)}[what]
    body = _compressed(coding, piece, size)
    pid = rig.mitm.proc.pid
    assert rig.send("/v1/messages", opening()).status == 200          # warm: the same path, answered plainly
    rig.glm.canned = lambda rec: (200, [("Content-Type", content_type), ("Content-Encoding", coding)], body)
    try:
        peak, cpu = _peak_mb(pid), _cpu_s(pid)
        r = rig.send("/v1/messages", opening())
    finally:
        rig.glm.canned = None
    time.sleep(0.5)                              # a buffered answer's usage is read once it has left
    assert rig.send("/v1/messages", opening()).status == 200
    cpu, grew = _cpu_s(pid) - cpu, _peak_mb(pid) - peak
    print(f"\n{what} ({len(body)} B, {content_type}): proxy CPU {cpu:.2f} s, peak RSS +{grew:.0f} MB")
    assert r.status == 200 and r.body == body and rig.mitm.alive
    assert grew < 200, f"a {len(body)}-byte answer grew the proxy's peak RSS by {grew:.0f} MB"
    assert cpu < 1.0, f"a {len(body)}-byte answer took {cpu:.2f} s of the proxy's CPU"


HEAD_FILL = 96 << 20        # bytes of a response head that never ends (a header line growing)


def test_a_response_head_that_never_ends_costs_the_proxy_bounded_memory(rig: Rig) -> None:
    """A server that answers with a header line growing without end (here 96 MiB, then a
    blank line): mitmproxy buffered the whole head before any hook could see it (its own
    ``FIXME: protect against header size DoS``): the proxy's peak RSS grew by the head's size,
    and it was then parsed, passed to every addon and sent on. Now a head past
    ``httpbounds.MAX_HEAD`` fails the answer there: the agent gets a 502 naming the limit, the
    server's connection is closed, and the proxy goes on."""
    def answer(h, rec, n):
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Fill: ")
        chunk = b"a" * (1 << 20)
        try:
            for _ in range(HEAD_FILL >> 20):
                h.wfile.write(chunk)
            h.wfile.write(b"\r\nContent-Length: 2\r\n\r\n{}")
        except OSError:
            pass                  # the proxy hung up: what the fixed proxy does
        h.close_connection = True
    pid = rig.mitm.proc.pid
    assert rig.send("/v1/messages", opening()).status == 200          # warm
    lines = rig.mitm.line_count
    peak = _peak_mb(pid)
    r = _answered(rig, answer, may_fail=True)    # (before: the head reached the agent, unreadable)
    grew = _peak_mb(pid) - peak
    assert grew < 48, f"a never-ending response head grew the proxy's peak RSS by {grew:.0f} MB"
    assert not isinstance(r, Exception) and r.status == 502, r
    assert "256 KiB" in r.text and "response head" in r.text, r.text[:300]
    assert rig.mitm.wait_output(r"sessionpin: the response head from the server \(127\.0\.0\.1:\d+\) grew past "
                                r"256 KiB without ending", since=lines)
    assert rig.send("/v1/messages", opening()).status == 200 and rig.mitm.alive


def test_a_chunk_size_line_that_never_ends_costs_the_proxy_bounded_memory(rig: Rig) -> None:
    """The same inside a chunked answer: mitmproxy's chunked reader waited for the end of a
    chunk-size line (a chunk extension growing without end) with no bound. Now the answer's
    stream ends there (its head had left: the agent's read fails), the server's connection is
    closed, and the proxy goes on."""
    def answer(h, rec, n):
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"2\r\n{}\r\n1;x=")
        chunk = b"a" * (1 << 20)
        try:
            for _ in range(HEAD_FILL >> 20):
                h.wfile.write(chunk)
            h.wfile.write(b"\r\n \r\n0\r\n\r\n")
        except OSError:
            pass
        h.close_connection = True
    pid = rig.mitm.proc.pid
    assert rig.send("/v1/messages", opening()).status == 200          # warm
    lines = rig.mitm.line_count
    peak = _peak_mb(pid)
    r = _answered(rig, answer, may_fail=True)    # its stream cut (fixed), or its read failed (before)
    grew = _peak_mb(pid) - peak
    assert grew < 48, f"a never-ending chunk-size line grew the proxy's peak RSS by {grew:.0f} MB"
    assert rig.mitm.wait_output(r"sessionpin: the response body line from the server \(127\.0\.0\.1:\d+\) grew "
                                r"past 256 KiB without ending", since=lines)
    assert rig.send("/v1/messages", opening()).status == 200 and rig.mitm.alive


def test_an_answer_with_trailers_reaches_the_agent_whole(rig: Rig) -> None:
    """A chunked answer ending with a trailer section (legal HTTP/1.1; here after SSE events):
    mitmproxy cannot relay trailers over HTTP/1 and raised there ("mitmproxy has crashed!"):
    the connection was torn down with the answer's last bytes, and the agent read a body cut
    short with no error to tell it why. Now the trailers are dropped, one warning line says
    so, and the answer reaches the agent whole."""
    events = b"".join(b'event: e\ndata: {"n": %d}\n\n' % i for i in range(3))

    def answer(h, rec, n):
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                      b"Trailer: x-checksum\r\n\r\n")
        h.wfile.write(b"%x\r\n%s\r\n" % (len(events), events) + b"0\r\nx-checksum: abc\r\n\r\n")
        h.close_connection = True
    lines = rig.mitm.line_count
    r = _answered(rig, answer, may_fail=True)        # (before: IncompleteRead)
    assert not isinstance(r, Exception) and r.status == 200 and r.body == events, r
    assert rig.mitm.wait_output(r"sessionpin: the response from the server \(127\.0\.0\.1:\d+\) ended with "
                                r"trailers \(x-checksum\); they were dropped", since=lines)
    assert "has crashed" not in rig.mitm.tail(rig.mitm.line_count - lines)
    assert rig.send("/v1/messages", opening()).status == 200


def test_an_early_hints_answer_before_the_answer_is_passed_over(rig: Rig) -> None:
    """A 103 Early Hints (legal HTTP/1.1, as CDNs send) before the answer: mitmproxy took it for
    the answer (the agent got a bodiless 103), then logged the real answer as "Unexpected data
    from server: b'…'" — its content in the proxy's log — and closed the connection. Now an
    informational answer is passed over and the answer reaches the agent."""
    sentinel = "ANSWER-CONTENT-" + uuid.uuid4().hex[:8]
    body = json.dumps({"type": "message", "content": [{"type": "text", "text": sentinel}]}).encode()

    def answer(h, rec, n):
        h.wfile.write(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
                      b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(body), body))
        h.close_connection = True
    lines = rig.mitm.line_count
    r = _answered(rig, answer)
    time.sleep(0.3)
    assert r.status == 200 and r.body == body, (r.status, r.body[:200])
    assert sentinel not in rig.mitm.tail(rig.mitm.line_count - lines)


def test_bytes_a_server_sends_past_its_answer_never_reach_the_log(rig: Rig) -> None:
    """A server that sends more than its answer's Content-Length: mitmproxy logged the rest as
    "Unexpected data from server: b'…'" (up to a read, the answer's content among it). Now the
    line says how many bytes, not what they were."""
    sentinel = "PAST-THE-ANSWER-" + uuid.uuid4().hex[:8]

    def answer(h, rec, n):
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
                      + sentinel.encode() * 10)
        h.close_connection = True
    lines = rig.mitm.line_count
    r = _answered(rig, answer)
    assert r.status == 200 and r.body == b"{}"
    said = rig.mitm.wait_output(r"sessionpin: the server \(127\.0\.0\.1:\d+\) sent \d+ bytes past its answer",
                                since=lines)
    assert sentinel not in rig.mitm.tail(rig.mitm.line_count - lines)
    assert said


def test_a_request_head_cut_short_never_writes_its_key_to_the_log(rig: Rig) -> None:
    """An agent whose connection drops inside its request's head (its key already sent):
    mitmproxy logged the partial head verbatim ("Client closed connection before completing
    request headers: b'…x-api-key: …'"). Now the line says how many bytes, not what they were."""
    import socket
    import ssl
    sock = socket.create_connection(("127.0.0.1", rig.mitm.port), timeout=10)
    host = f"127.0.0.1:{rig.anthropic.port}"
    sock.sendall(f"CONNECT {host} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    ctx = ssl.create_default_context(cafile=str(rig.mitm.mitm_ca))
    tls = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
    lines = rig.mitm.line_count
    tls.sendall(f"POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nx-api-key: {CLIENT_KEY}\r\n".encode())
    time.sleep(0.3)
    tls.close()
    said = rig.mitm.wait_output(r"sessionpin: the client \(127\.0\.0\.1:\d+\) closed its connection within a "
                                r"request head \(\d+ bytes", since=lines)
    assert CLIENT_KEY not in rig.mitm.tail(rig.mitm.line_count - lines)
    assert said


def _tunnel(rig: Rig, h2: bool = False):
    """A TLS connection through the proxy to the anthropic fake, for bytes no client library
    sends (``h2``: speaking HTTP/2, ALPN h2)."""
    import socket
    import ssl
    sock = socket.create_connection(("127.0.0.1", rig.mitm.port), timeout=10)
    host = f"127.0.0.1:{rig.anthropic.port}"
    sock.sendall(f"CONNECT {host} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    ctx = ssl.create_default_context(cafile=str(rig.mitm.mitm_ca))
    if h2:
        ctx.set_alpn_protocols(["h2"])
    tls = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
    assert not h2 or tls.selected_alpn_protocol() == "h2"
    return tls, host


UNREADABLE_ANSWERS = {
    # an answer written without its head: its first line is no status line
    "no-status-line": b'{"type": "error", "error": {"message": "%s"}}\r\n\r\n',
    "header-line-without-colon": b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nX-Detail %s\r\n\r\n",
    "length-not-a-number": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %s\r\n\r\n{}",
    "bad-header-name": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n%s x: y\r\n\r\n{}",
    # chunked said, the content written as it is: the first line of content read as a chunk size
    "content-as-chunk-size": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b'{"type": "message", "content": "%s"}\r\n\r\n',
}


@pytest.mark.parametrize("shape", sorted(UNREADABLE_ANSWERS))
def test_an_answer_the_proxy_cannot_parse_never_writes_its_bytes_to_the_log(rig: Rig, shape: str) -> None:
    """A server whose answer mitmproxy cannot parse: mitmproxy quoted the bytes it could not read
    in the flow's error ("Cannot parse HTTP response: Bad HTTP response line: b'{"type": …'",
    "illegal chunk header: bytearray(b'…')", "invalid content-length header: '…'"), which the
    router logged (`opening … → glm failed: …`) and the agent's 502 showed: the answer's
    content in the proxy's log. Now the error says how many bytes, not what they were; the
    proxy goes on."""
    sentinel = "ANSWER-CONTENT-" + uuid.uuid4().hex[:8]
    raw = UNREADABLE_ANSWERS[shape].replace(b"%s", sentinel.encode())

    def answer(h, rec, n):
        h.wfile.write(raw)
        h.wfile.flush()
        time.sleep(0.2)
        h.close_connection = True
    lines = rig.mitm.line_count
    r = _answered(rig, answer, may_fail=True)        # the answer's head had left (chunked): its stream is cut
    if not isinstance(r, Exception):
        assert r.status == 502 and sentinel not in r.text, (r.status, r.text[:300])
    assert rig.mitm.wait_output(r"POST https://127\.0\.0\.1:\d+/api/anthropic/v1/messages", since=lines)
    time.sleep(0.3)
    said = rig.mitm.tail(rig.mitm.line_count - lines)
    assert "not shown" in said, said
    assert sentinel not in said, said
    assert rig.send("/v1/messages", opening()).status == 200 and rig.mitm.alive


UNREADABLE_REQUESTS = {
    "header-line-without-colon": "POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nx-api-key {key}\r\n\r\n",
    "request-line": "POST /v1/messages?key={key} HTTP/1.1 x\r\nHost: {host}\r\n\r\n",
    "bad-header-name": "POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nx-api-key: {key}\r\n{key} x: y\r\n\r\n",
    "length-not-a-number": "POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nContent-Length: 1{key}\r\n\r\n",
    "content-as-chunk-size": "POST /v1/messages HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                             "Transfer-Encoding: chunked\r\n\r\n{{\"model\": \"claude-opus-4-5\", \"x\": \"{key}\"}}\r\n\r\n",
}


@pytest.mark.parametrize("shape", sorted(UNREADABLE_REQUESTS))
def test_a_request_the_proxy_cannot_parse_never_writes_its_bytes_to_the_log(rig: Rig, shape: str) -> None:
    """A request head (or chunk line) mitmproxy cannot parse: it logged the line it could not
    read verbatim, whatever flow_detail ("127.0.0.1:…: Invalid header line: b'x-api-key sk-…'",
    "Bad HTTP request line: b'POST /v1/messages?key=…'"), and put the others into the flow's
    error (a header name, a length, the body's first line); sessionpin's 413 copied a length
    that is no number into its line. Now each says how many bytes, not what they were."""
    key = CLIENT_KEY + "-" + uuid.uuid4().hex[:8]
    tls, host = _tunnel(rig)
    lines = rig.mitm.line_count
    tls.sendall(UNREADABLE_REQUESTS[shape].format(host=host, key=key).encode())
    got = b""
    try:
        while chunk := tls.recv(65536):
            got += chunk
    except OSError:
        pass
    tls.close()
    if shape == "content-as-chunk-size":
        assert got == b"", got[:200]    # mitmproxy closes the connection (its head had gone on to the hooks)
    else:
        assert got.startswith((b"HTTP/1.1 400", b"HTTP/1.1 413")), got[:200]   # the client is told
    time.sleep(0.5)
    said = rig.mitm.tail(rig.mitm.line_count - lines)
    assert key not in said, said
    assert rig.send("/v1/messages", opening()).status == 200 and rig.mitm.alive


@pytest.mark.parametrize("value", ["surrounded-by-whitespace", "with-a-newline"])
def test_an_http2_header_the_proxy_refuses_never_writes_its_value_to_the_log(rig: Rig, value: str) -> None:
    """An HTTP/2 client's header value mitmproxy's h2 refuses (surrounded by whitespace, holding
    a newline): h2 quoted the value in its error, which mitmproxy logged with the client's
    address whatever flow_detail ("HTTP/2 protocol error: Received header value surrounded by
    whitespace b' sk-ant-…'"): the agent's key in the proxy's log. Now the line says how many
    bytes, not what they were."""
    import h2.config
    import h2.connection
    key = CLIENT_KEY + "-" + uuid.uuid4().hex[:8]
    sent = " " + key if value == "surrounded-by-whitespace" else key + "\n"
    tls, host = _tunnel(rig, h2=True)
    lines = rig.mitm.line_count
    conn = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, header_encoding="utf-8", validate_outbound_headers=False, normalize_outbound_headers=False))
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":scheme", "https"), (":authority", host),
                            (":path", "/v1/messages"), ("x-api-key", sent)], end_stream=True)
    tls.sendall(conn.data_to_send())
    try:
        while tls.recv(65536):
            pass
    except OSError:
        pass
    tls.close()
    # (h2 quotes a newline as it is: that error is two lines, the value on the second)
    said = rig.mitm.wait_output(r"(HTTP/2 protocol error: |' in header value: ).*\(\d+ bytes, not shown\)", since=lines)
    assert key not in rig.mitm.tail(rig.mitm.line_count - lines)
    assert said
    assert rig.send("/v1/messages", opening()).status == 200 and rig.mitm.alive
