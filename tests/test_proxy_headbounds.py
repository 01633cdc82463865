"""HeadBounds: an HTTP/1 head, or a chunked body's line, past ``MAX_HEAD`` fails its connection
there, from a server (a protocol error: mitmproxy's 502 to the agent) or a client (431). The
connection classes are driven here as mitmproxy's HTTP layer drives them;
tests/e2e/test_bounds_e2e.py has them in a real mitmdump."""

from __future__ import annotations

import pytest
from mitmproxy import options
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import http as http_layer
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import (RequestData, RequestEndOfMessage, RequestHeaders, ResponseData,
                                                 ResponseEndOfMessage, ResponseHeaders, ResponseProtocolError)
from mitmproxy.test import tflow

from sessionpin.proxy import headbounds
from sessionpin.proxy.headbounds import MAX_HEAD, HeadBounds

GROW = b"a" * 65536


def _client() -> tuple[headbounds._BoundedClient, Context]:
    """The proxy's side facing a server, with one request sent on it."""
    ctx = Context(tflow.tclient_conn(), options.Options())
    ctx.server = tflow.tserver_conn()
    c = headbounds._BoundedClient(ctx)
    list(c.handle_event(events.Start()))
    list(c.handle_event(RequestHeaders(1, tflow.treq(), False)))
    list(c.handle_event(RequestEndOfMessage(1)))
    return c, ctx


def _feed(layer, conn, data: bytes, step: int = 65536) -> list:
    out = []
    for i in range(0, len(data), step):
        out += list(layer.handle_event(events.DataReceived(conn, data[i:i + step])))
    return out


def _received(cmds) -> list:
    return [c.event for c in cmds if isinstance(c, ReceiveHttp)]


def test_the_classes_mitmproxy_makes_are_ours_while_loaded():
    original = (http_layer.Http1Client, http_layer.Http1Server)
    h2 = (http_layer.Http2Client, http_layer.Http2Server)
    a, b = HeadBounds(), HeadBounds()
    a.load(None)
    b.load(None)                # a reloaded script: the new part loads before the old goes
    a.done()
    assert (http_layer.Http1Client, http_layer.Http1Server) == (headbounds._BoundedClient, headbounds._BoundedServer)
    assert (http_layer.Http2Client, http_layer.Http2Server) == (headbounds._QuietHttp2Client,
                                                                headbounds._QuietHttp2Server)
    b.done()
    assert (http_layer.Http1Client, http_layer.Http1Server) == original
    assert (http_layer.Http2Client, http_layer.Http2Server) == h2


def test_a_response_head_that_never_ends_fails_at_the_bound_and_is_dropped():
    c, ctx = _client()
    cmds = _feed(c, ctx.server, b"HTTP/1.1 200 OK\r\nX-Fill: " + GROW * 8)
    errors = [e for e in _received(cmds) if isinstance(e, ResponseProtocolError)]
    assert len(errors) == 1 and "response head" in errors[0].message and "256 KiB" in errors[0].message
    assert any(isinstance(x, commands.CloseConnection) for x in cmds)
    assert len(c.buf) == 0
    # what comes after is dropped as it arrives, never gathered
    assert _feed(c, ctx.server, GROW * 8) == [] and len(c.buf) == 0


def test_a_chunk_size_line_that_never_ends_fails_the_answer_after_its_head():
    c, ctx = _client()
    cmds = _feed(c, ctx.server, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n1;x=" + GROW * 8)
    got = _received(cmds)
    assert isinstance(got[0], ResponseHeaders) and isinstance(got[1], ResponseData)
    assert isinstance(got[-1], ResponseProtocolError) and "response body line" in got[-1].message
    assert len(c.buf) == 0


@pytest.mark.parametrize("chunked", [False, True])
def test_an_answer_of_many_megabytes_and_a_head_within_the_bound_pass_as_ever(chunked: bool):
    c, ctx = _client()
    body = GROW * 64
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(200))
    if chunked:
        wire = head + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(
            b"%x\r\n%s\r\n" % (len(GROW), GROW) for _ in range(64)) + b"0\r\n\r\n"
    else:
        wire = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    got = _received(_feed(c, ctx.server, wire, step=7001))
    assert not any(isinstance(e, ResponseProtocolError) for e in got)
    assert sum(len(e.data) for e in got if isinstance(e, ResponseData)) == len(body)
    assert len(got[0].response.headers) >= 200


def test_a_request_head_that_never_ends_is_answered_431():
    ctx = Context(tflow.tclient_conn(), options.Options())
    s = headbounds._BoundedServer(ctx)
    list(s.handle_event(events.Start()))
    cmds = _feed(s, ctx.client, b"POST /v1/messages HTTP/1.1\r\nX-Fill: " + GROW * 8)
    sent = [x.data for x in cmds if isinstance(x, commands.SendData)]
    assert len(sent) == 1 and sent[0].startswith(b"HTTP/1.1 431 ") and b"request head" in sent[0]
    assert any(isinstance(x, commands.CloseConnection) for x in cmds) and len(s.buf) == 0
    assert MAX_HEAD == 256 * 1024


def test_a_chunked_answer_s_trailers_are_dropped_and_it_ends_whole(caplog):
    """mitmproxy raised NotImplementedError at an HTTP/1 trailer section (its connection torn
    down with the answer's last bytes); the answer now ends as it would have without them."""
    c, ctx = _client()
    wire = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: x-checksum\r\n\r\n"
            b"5\r\nhello\r\n0\r\nX-Checksum: abc\r\n\r\n")
    got = _received(_feed(c, ctx.server, wire, step=9))
    assert type(got[0]) is ResponseHeaders and type(got[-1]) is ResponseEndOfMessage
    assert b"".join(e.data for e in got[1:-1]) == b"hello"
    assert "ended with trailers (x-checksum); they were dropped" in caplog.text


def test_a_chunked_request_s_trailers_are_dropped_and_it_ends_whole(caplog):
    ctx = Context(tflow.tclient_conn(), options.Options())
    s = headbounds._BoundedServer(ctx)
    list(s.handle_event(events.Start()))
    wire = (b"POST /v1/messages HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2\r\n{}\r\n0\r\nX-Sig: 1\r\n\r\n")
    got = _received(_feed(s, ctx.client, wire))
    assert [type(e) for e in got] == [RequestHeaders, RequestData, RequestEndOfMessage]
    assert "request from the client" in caplog.text and "(x-sig)" in caplog.text


@pytest.mark.parametrize("step", [1, 7, 65536])
def test_informational_answers_are_passed_over_and_the_answer_read(step):
    c, ctx = _client()
    wire = (b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    got = _received(_feed(c, ctx.server, wire, step=step))
    assert type(got[0]) is ResponseHeaders and got[0].response.status_code == 200
    assert b"".join(e.data for e in got if isinstance(e, ResponseData)) == b"{}"


def test_a_switching_protocols_answer_is_the_answer():
    c, ctx = _client()
    got = _received(_feed(c, ctx.server, b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n"))
    assert type(got[0]) is ResponseHeaders and got[0].response.status_code == 101


def test_bytes_past_the_answer_are_counted_never_logged(caplog):
    c, ctx = _client()
    got = _received(_feed(c, ctx.server, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"))
    assert type(got[-1]) is ResponseEndOfMessage
    cmds = _feed(c, ctx.server, b"SECRET-ANSWER-TEXT")
    assert any(isinstance(x, commands.CloseConnection) for x in cmds)
    assert not any(isinstance(x, commands.Log) and b"SECRET" in x.message.encode() for x in cmds)
    assert "sent 18 bytes past its answer" in caplog.text and "SECRET" not in caplog.text


def test_a_head_cut_short_is_said_by_its_size_never_its_bytes(caplog):
    ctx = Context(tflow.tclient_conn(), options.Options())
    s = headbounds._BoundedServer(ctx)
    list(s.handle_event(events.Start()))
    cmds = _feed(s, ctx.client, b"POST /v1/messages HTTP/1.1\r\nx-api-key: sk-ant-SECRET\r\n")
    cmds += list(s.handle_event(events.ConnectionClosed(ctx.client)))
    assert any(isinstance(x, commands.CloseConnection) for x in cmds)
    assert not any(isinstance(x, commands.Log) and "SECRET" in x.message for x in cmds)
    assert "within a request head (54 bytes" in caplog.text and "SECRET" not in caplog.text
    c, ctx = _client()
    cmds = _feed(c, ctx.server, b"HTTP/1.1 200 OK\r\nset-cookie: SECRET\r\n")
    cmds += list(c.handle_event(events.ConnectionClosed(ctx.server)))
    [error] = [e for e in _received(cmds) if isinstance(e, ResponseProtocolError)]
    assert "within its answer's head (37 bytes, not shown)" in error.message and "SECRET" not in error.message


@pytest.mark.parametrize("head", [b"POST /v1/messages HTTP/1.1\r\nx-api-key sk-ant-SECRET\r\n\r\n",
                                  b"POST /v1/messages?key=SECRET HTTP/1.1 x\r\n\r\n"])
def test_a_request_head_it_cannot_parse_is_said_by_its_size_never_its_bytes(head: bytes):
    ctx = Context(tflow.tclient_conn(), options.Options())
    s = headbounds._BoundedServer(ctx)
    list(s.handle_event(events.Start()))
    cmds = _feed(s, ctx.client, head)
    logs = [x.message for x in cmds if isinstance(x, commands.Log)]
    assert logs and all("not shown" in m and "SECRET" not in m for m in logs), logs


@pytest.mark.parametrize("answer", [b'{"error": "SECRET"}\r\n\r\n',
                                    b"HTTP/1.1 200 OK\r\nX-Detail SECRET\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\nContent-Length: SECRET\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{\"SECRET\": 1}\r\n"])
def test_an_answer_it_cannot_parse_is_said_by_its_size_never_its_bytes(answer: bytes):
    c, ctx = _client()
    [error] = [e for e in _received(_feed(c, ctx.server, answer)) if isinstance(e, ResponseProtocolError)]
    assert "not shown" in error.message and "SECRET" not in error.message, error.message


def test_the_header_check_of_both_http_versions_says_a_value_by_its_size_while_loaded():
    from mitmproxy import http
    original = http_layer.validate_headers
    bad = http.Request.make("POST", "https://example.com/v1/messages", b"")
    bad.headers["content-length"] = "1SECRET"
    h = HeadBounds()
    h.load(None)
    try:
        with pytest.raises(ValueError) as e:
            http_layer.validate_headers(bad)
        assert "not shown" in str(e.value) and "SECRET" not in str(e.value)
    finally:
        h.done()
    assert http_layer.validate_headers is original
