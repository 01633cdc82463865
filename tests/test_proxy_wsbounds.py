"""SocketBounds: a WebSocket message (inflated) over the limit closes its socket with 1009, and a
socket keeps only the newest of its messages (issue 20). The extensions are driven here with
wsproto, as mitmproxy's WebSocket layer drives them; tests/e2e/test_websocket_e2e.py has them
in a real mitmdump."""

from __future__ import annotations

import resource

import pytest
import wsproto
from mitmproxy import websocket
from mitmproxy.proxy.layers import websocket as ws_layer
from mitmproxy.test import tflow
from wsproto.events import CloseConnection, Message, Ping, TextMessage
from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import Opcode

from e2e.wsfake import deflate_frame
from sessionpin.proxy import perflow, wsbounds
from sessionpin.proxy.wsbounds import OVERHEAD, SocketBounds
from shellkit import start

MIB = 1024 * 1024


@pytest.fixture
def proxy(tmp_path):
    p = start(tmp_path / "none.toml")
    yield p
    p.close()


def _bounds(proxy) -> SocketBounds:
    return next(a for a in proxy.addons if isinstance(a, SocketBounds))


def _deflate() -> PerMessageDeflate:
    d = PerMessageDeflate()
    d.finalize("permessage-deflate")
    return d


def _pair(deflate: bool = True):
    """(the client's wsproto connection, the proxy's side facing it) as mitmproxy's layer makes it."""
    client = wsproto.Connection(wsproto.ConnectionType.CLIENT, [_deflate()] if deflate else [])
    proxy_side = ws_layer.WebsocketConnection(wsproto.ConnectionType.SERVER, [_deflate()] if deflate else [],
                                              conn=tflow.tclient_conn())
    return client, proxy_side


def _receive(side, data: bytes) -> tuple[int, list]:
    """Feed ``data`` in 64 KiB reads (as mitmproxy reads a socket); the bytes of message data seen."""
    got, events = 0, []
    for i in range(0, len(data), 65536):
        side.receive_data(data[i:i + 65536])
        for ev in side.events():
            if isinstance(ev, Message):
                got += len(ev.data)
            events.append(ev)
    return got, events


def test_mitmproxy_s_websocket_connection_is_ours_while_loaded(proxy):
    assert ws_layer.WebsocketConnection is wsbounds._BoundedConnection
    assert _bounds(proxy).max_message == 16 * MIB
    proxy.tctx.configure(_bounds(proxy), sessionpin_ws_max_message_mb=2)
    assert wsbounds.max_message() == 2 * MIB


def test_a_deflate_bomb_is_inflated_no_further_than_the_limit_then_closed_1009(proxy):
    proxy.tctx.configure(_bounds(proxy), sessionpin_ws_max_message_mb=1)
    _, side = _pair()
    frame = deflate_frame(256 * MIB, masked=True)
    assert len(frame) < 300_000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got, events = _receive(side, frame)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert got <= 1 * MIB                               # nothing past the limit was handed on
    closes = [e for e in events if isinstance(e, CloseConnection)]
    assert closes and closes[0].code == 1009
    assert grew < 64 * 1024, f"peak RSS grew {grew} KiB"     # 256 MiB never inflated


def test_an_uncompressed_message_over_the_limit_is_closed_at_its_header_or_as_it_grows(proxy):
    proxy.tctx.configure(_bounds(proxy), sessionpin_ws_max_message_mb=1)
    client, side = _pair(deflate=False)
    # one frame saying it is 2 MiB: refused at its header, before its payload arrives
    got, events = _receive(side, client.send(Message(data=b"x" * (2 * MIB))))
    assert got == 0 and [e.code for e in events if isinstance(e, CloseConnection)] == [1009]
    # a message of many small frames, growing past the limit
    client, side = _pair(deflate=False)
    data = b"".join(client.send(Message(data=b"y" * 65536, message_finished=False)) for _ in range(20))
    got, events = _receive(side, data)
    assert got <= 1 * MIB and [e.code for e in events if isinstance(e, CloseConnection)] == [1009]


def test_messages_within_the_limit_pass_as_ever_compressed_or_not(proxy):
    proxy.tctx.configure(_bounds(proxy), sessionpin_ws_max_message_mb=1)
    for deflate in (True, False):
        client, side = _pair(deflate)
        text = '{"type":"response.create","model":"gpt-6.2-sol"}' + " " * (MIB - 100)
        out = b"".join(client.send(Message(data=text)) for _ in range(5))
        received = [e for e in _receive(side, out)[1] if isinstance(e, TextMessage)]
        assert "".join(e.data for e in received) == text * 5
        assert not any(isinstance(e, CloseConnection) for e in _receive(side, b"")[1])


def _socket_flow():
    f = tflow.twebsocketflow(messages=False)
    f.websocket.messages = []
    return f


def _message(bounds, f, size: int) -> None:
    f.websocket.messages.append(websocket.WebSocketMessage(Opcode.TEXT, False, b"z" * size))
    bounds.websocket_message(f)


def test_a_socket_keeps_only_its_newest_messages_and_nothing_after_it_ends(proxy):
    b = _bounds(proxy)
    proxy.tctx.configure(b, sessionpin_ws_keep_kb=64)
    f = _socket_flow()
    for _ in range(3000):                 # 30 MB over one socket
        _message(b, f, 10_000)
    kept = f.websocket.messages
    assert 1 <= len(kept) <= 7 and sum(len(m.content) + OVERHEAD for m in kept) <= 64 * 1024
    assert f.metadata[perflow.WS_KEPT] == sum(len(m.content) + OVERHEAD for m in kept)   # kept in the flow
    # one message larger than the whole allowance stays while it is the newest (the addons
    # after this one read it), and goes when the next one comes
    _message(b, f, 200_000)
    assert len(f.websocket.messages[-1].content) == 200_000
    _message(b, f, 10)
    assert [len(m.content) for m in f.websocket.messages] == [10]
    b.websocket_end(f)
    assert perflow.WS_KEPT not in f.metadata


def test_the_per_socket_count_goes_when_the_socket_ends_however_it_ends(proxy):
    b = _bounds(proxy)
    flows = [_socket_flow() for _ in range(100)]
    for f in flows:
        _message(b, f, 100)
    assert all(perflow.WS_KEPT in f.metadata for f in flows)
    for i, f in enumerate(flows):
        (b.websocket_end if i % 2 else b.error)(f)
    assert not any(perflow.WS_KEPT in f.metadata for f in flows)


def test_at_its_end_a_socket_keeps_no_more_than_the_allowance(proxy):
    b = _bounds(proxy)
    proxy.tctx.configure(b, sessionpin_ws_keep_kb=1)
    f = _socket_flow()
    _message(b, f, 100_000)
    b.websocket_end(f)
    assert f.websocket.messages == []


def test_a_compressed_message_of_many_frames_is_judged_by_its_inflated_size(proxy):
    """Only its first frame carries RSV1: its continuations' sizes on the wire are compressed
    sizes, never compared with the limit as if they were the message's."""
    proxy.tctx.configure(_bounds(proxy), sessionpin_ws_max_message_mb=1)
    client, side = _pair()
    text = "".join(f"{i:07d}" for i in range(100_000))[: MIB - 1000]      # little to compress
    out = client.send(Message(data=text[:400_000], message_finished=False))
    out += client.send(Message(data=text[400_000:], message_finished=True))
    got, events = _receive(side, out)
    assert got == len(text) and not any(isinstance(e, CloseConnection) for e in events)
    client, side = _pair()
    out = b"".join(client.send(Message(data=text[:400_000], message_finished=False)) for _ in range(3))
    got, events = _receive(side, out)
    assert got <= MIB and [e.code for e in events if isinstance(e, CloseConnection)] == [1009]


def _frames(client, text: bytes, count: int) -> bytes:
    """``text`` as one message in ``count`` frames: its bytes in the first, then empty ones."""
    out = client.send(Message(data=text, message_finished=False))
    out += b"".join(client.send(Message(data=b"", message_finished=False)) for _ in range(count - 2))
    return out + client.send(Message(data=b"", message_finished=True))


def test_a_message_of_more_frames_than_the_limit_allows_is_closed_1009_whatever_its_bytes(proxy):
    """Empty frames cost the byte limit nothing but cost the proxy per frame: a message may come
    in one frame per ``FRAME_BYTES`` of the limit, compressed or not; one more closes the socket."""
    proxy.tctx.configure(_bounds(proxy), sessionpin_ws_max_message_mb=1)
    allowed = wsbounds.max_frames(MIB)
    assert wsbounds.FRAME_BYTES == 4000 and allowed == MIB // 4000 + 1 == 263
    for deflate in (True, False):
        client, side = _pair(deflate)
        got, events = _receive(side, _frames(client, b"{}", allowed))
        assert got == 2 and not any(isinstance(e, CloseConnection) for e in events)
        client, side = _pair(deflate)
        got, events = _receive(side, _frames(client, b"{}", allowed + 1))
        assert [e.code for e in events if isinstance(e, CloseConnection)] == [1009]
        assert not any(isinstance(e, Message) and e.message_finished for e in events)


def test_the_frame_count_is_per_message_and_control_frames_do_not_count(proxy):
    """Pings between a message's frames are not its frames; every message starts its count afresh."""
    proxy.tctx.configure(_bounds(proxy), sessionpin_ws_max_message_mb=1)
    client, side = _pair(deflate=False)
    allowed = wsbounds.max_frames(MIB)
    one = client.send(Message(data=b"{", message_finished=False))
    for _ in range(allowed - 2):
        one += client.send(Ping(b"p")) + client.send(Message(data=b"", message_finished=False))
    one += client.send(Message(data=b"}", message_finished=True))
    got, events = _receive(side, one * 3)
    assert got == 6 and not any(isinstance(e, CloseConnection) for e in events)


def test_a_message_as_mitmproxy_refragments_it_within_the_limit_passes(proxy):
    """mitmproxy sends a message it changed in 4000-byte frames: one of the limit passes."""
    proxy.tctx.configure(_bounds(proxy), sessionpin_ws_max_message_mb=1)
    client, side = _pair(deflate=False)
    text = b"x" * MIB
    out = b"".join(client.send(Message(data=text[i:i + 4000], message_finished=i + 4000 >= len(text)))
                   for i in range(0, len(text), 4000))
    got, events = _receive(side, out)
    assert got == len(text) and not any(isinstance(e, CloseConnection) for e in events)
