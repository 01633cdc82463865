"""SocketBounds: a WebSocket message costs the proxy at most the message limit, and a socket
keeps at most ``sessionpin_ws_keep_kb`` of its messages (issue 20).

mitmproxy relays a socket's messages whole: wsproto inflates a permessage-deflate frame in one
``decompress`` call (a 261 KB frame became a 256 MiB message: 1.4 GB of RSS, every other client
stalled 3 s), mitmproxy gathers a message's frames until it ends, and keeps every message in
``flow.websocket.messages`` for the socket's life (300 MB streamed over one Codex socket stayed
in memory). No option of mitmproxy's bounds either. So:

- Every socket mitmproxy relays gets two extensions of ours on both of its connections
  (``_BoundedConnection``, put in place of mitmproxy's ``WebsocketConnection`` while this addon
  is loaded): permessage-deflate inflates each frame with ``max_length`` = what is left of the
  limit (``_BoundedDeflate``), and a last extension counts each message's bytes as they arrive,
  inflated (``_MessageLimit``). A message that would grow past ``sessionpin_ws_max_message_mb``
  (default ``MAX_MESSAGE_MB``, 16) stops there: wsproto answers
  "message too big", mitmproxy closes both sides with 1009, and one warning line names the
  socket and the side that sent it. Nothing of that message is sent on. Every socket, not
  only the router's: the cost is the proxy's whichever socket carries it. The default is below
  the body limit (64 MiB) because a message is inflated on the event loop, in one piece: every
  other client waits for it (about 10 ms per MiB on a busy 2-core machine, docs/benchmarks.md),
  while Codex's messages are incremental (the largest recorded: 79 KB).
- A message may come in at most one frame per ``FRAME_BYTES`` of the limit, and one more
  (``max_frames``): each frame costs the proxy whatever its size, and empty ones cost the byte
  limit nothing. One frame more closes the socket the same way (1009, one warning line).
- After each message (and at the socket's end), the socket's older messages beyond
  ``sessionpin_ws_keep_kb`` are dropped from ``flow.websocket.messages``: mitmweb shows the
  newest; the newest message itself stays until the next one arrives (the addons after ours
  read it in their own hook). The running total is kept in the flow (``flow.metadata``,
  ``perflow.WS_KEPT``) and dropped at its end.
"""

from __future__ import annotations

import logging
import zlib

import wsproto.extensions
from mitmproxy import ctx, http
from mitmproxy.proxy.layers import websocket as ws_layer
from wsproto.frame_protocol import CloseReason, Opcode, RsvBits

from . import perflow


log = logging.getLogger("sessionpin")

MIB = 1024 * 1024
MAX_MESSAGE_MB = 16
OVERHEAD = 200            # bytes a kept message costs beyond its content (the object, its fields)
# A message may come in at most one frame per this many bytes of the limit, and one more (16 MiB:
# 4195 frames). A frame costs the proxy ~50 us of CPU with nothing to wait on whatever its size
# (wsproto's parse, mitmproxy's entry in its list of the message's fragments, and one frame sent
# on per frame received), so a message of 2 million empty frames (12 MB on the wire) held the
# event loop for minutes and grew the proxy by hundreds of MB: the byte limit never saw it. The
# size is mitmproxy's own fragment size (a message it changed is sent on in frames of it), so a
# message mitmproxy — this one or another on the way — cut up within the limit passes.
FRAME_BYTES = ws_layer.Fragmentizer.FRAGMENT_SIZE
_SYNC = b"\x00\x00\xff\xff"


def max_message() -> int:
    """The current limit in bytes, read from mitmproxy's options when a message starts (the
    option is the one place it lives: no module state of ours); the default where the option
    is not loaded (a connection made outside a running proxy)."""
    try:
        return max(1, int(ctx.options.sessionpin_ws_max_message_mb)) * MIB
    except (AttributeError, KeyError, ValueError, TypeError):
        return MAX_MESSAGE_MB * MIB


def _where(conn) -> str:
    peer = getattr(conn, "peername", None) or getattr(conn, "address", None)
    return f"{peer[0]}:{peer[1]}" if peer else "?"


def _too_big(side: str, conn, limit: int) -> CloseReason:
    log.warning("sessionpin: a WebSocket message from the %s (%s) grew past %d MiB (sessionpin_ws_max_message_mb); "
                "the socket was closed (1009), nothing of that message was sent on", side, _where(conn), limit // MIB)
    return CloseReason.MESSAGE_TOO_BIG


def max_frames(limit: int) -> int:
    """The frames a message of at most ``limit`` bytes may come in: one per ``FRAME_BYTES``, and one more."""
    return limit // FRAME_BYTES + 1


def _too_many(side: str, conn, limit: int) -> CloseReason:
    log.warning("sessionpin: a WebSocket message from the %s (%s) came in more than %d frames (one per %d bytes of "
                "sessionpin_ws_max_message_mb); the socket was closed (1009), nothing of that message was sent on",
                side, _where(conn), max_frames(limit), FRAME_BYTES)
    return CloseReason.MESSAGE_TOO_BIG


class _MessageLimit(wsproto.extensions.Extension):
    """Counts each inbound message's bytes (after inflation: it comes last) and stops it at the limit."""

    name = "sessionpin-message-limit"      # never offered nor negotiated: ours alone

    def __init__(self, side: str, conn) -> None:
        self.side, self.conn = side, conn
        self.size = 0
        self.frames = 0                 # the current message's frames so far
        self.limit = max_message()
        self.compressed = False         # the current message's first frame had RSV1 (deflated)

    def enabled(self) -> bool:
        return True

    def offer(self) -> bool:
        return False

    def frame_inbound_header(self, proto, opcode: Opcode, rsv: RsvBits, payload_length: int) -> CloseReason | RsvBits:
        if opcode in (Opcode.TEXT, Opcode.BINARY):
            # (only a message's first frame carries RSV1: its continuations are compressed alike)
            self.size, self.frames, self.limit, self.compressed = 0, 0, max_message(), rsv.rsv1
        if opcode.iscontrol():
            return RsvBits(False, False, False)
        self.frames += 1
        if self.frames > max_frames(self.limit):
            return _too_many(self.side, self.conn, self.limit)
        if not self.compressed and self.size + payload_length > self.limit:
            return _too_big(self.side, self.conn, self.limit)     # said at its header: not waited for
        return RsvBits(False, False, False)

    def frame_inbound_payload_data(self, proto, data: bytes) -> bytes | CloseReason:
        self.size += len(data)
        if self.size > self.limit:
            return _too_big(self.side, self.conn, self.limit)
        return data


class _BoundedDeflate(wsproto.extensions.PerMessageDeflate):
    """wsproto's permessage-deflate, inflating no more of a message than the limit."""

    inflated = 0
    limit = MAX_MESSAGE_MB * MIB
    side = "?"
    conn = None

    def frame_inbound_header(self, proto, opcode, rsv, payload_length):
        if opcode in (Opcode.TEXT, Opcode.BINARY):
            self.inflated, self.limit = 0, max_message()
        return super().frame_inbound_header(proto, opcode, rsv, payload_length)

    def _inflate(self, data: bytes) -> bytes | CloseReason:
        assert self._decompressor is not None
        left = max(0, self.limit - self.inflated)
        try:
            out = self._decompressor.decompress(data, left + 1)     # never more than one byte past
        except zlib.error:
            return CloseReason.INVALID_FRAME_PAYLOAD_DATA
        self.inflated += len(out)
        if self.inflated > self.limit:
            self._decompressor = None       # its state is past use: the socket closes
            return _too_big(self.side, self.conn, self.limit)
        return out

    def frame_inbound_payload_data(self, proto, data: bytes) -> bytes | CloseReason:
        if not self._inbound_compressed or not self._inbound_is_compressible:
            return data
        return self._inflate(bytes(data))

    def frame_inbound_complete(self, proto, fin: bool) -> bytes | CloseReason | None:
        # wsproto's, with the end-of-message marker inflated within the limit too
        if not fin:
            return None
        if not self._inbound_is_compressible or not self._inbound_compressed:
            self._inbound_compressed = None
            return None
        data = self._inflate(_SYNC)
        if isinstance(data, CloseReason):
            return data
        try:
            data += self._decompressor.flush()
        except zlib.error:
            return CloseReason.INVALID_FRAME_PAYLOAD_DATA
        no_context_takeover = self.server_no_context_takeover if proto.client else self.client_no_context_takeover
        if no_context_takeover:
            self._decompressor = None
        self._inbound_compressed = None
        return data


class _BoundedConnection(ws_layer.WebsocketConnection):
    """mitmproxy's WebsocketConnection with the bounds of this module (see there)."""

    def __init__(self, connection_type, extensions=None, *args, conn, **kwargs) -> None:
        side = "client" if connection_type == wsproto.ConnectionType.SERVER else "server"
        bounded = []
        for ext in extensions or []:
            if type(ext) is wsproto.extensions.PerMessageDeflate:
                ext.__class__ = _BoundedDeflate
                ext.side, ext.conn = side, conn
            bounded.append(ext)
        super().__init__(connection_type, [*bounded, _MessageLimit(side, conn)], *args, conn=conn, **kwargs)


_ORIGINAL = ws_layer.WebsocketConnection
_installed = 0            # SocketBounds loaded (a reloaded script's new addons load before the old go)


def _install() -> None:
    global _installed
    _installed += 1
    ws_layer.WebsocketConnection = _BoundedConnection


def _uninstall() -> None:
    global _installed
    _installed = max(0, _installed - 1)
    if not _installed:
        ws_layer.WebsocketConnection = _ORIGINAL


class SocketBounds:
    def __init__(self) -> None:
        self.max_message = MAX_MESSAGE_MB * MIB
        self.keep = 1024 * 1024

    def load(self, loader) -> None:
        loader.add_option(
            "sessionpin_ws_max_message_mb", int, MAX_MESSAGE_MB,
            "sessionpin: a WebSocket message (inflated) larger than this many MiB closes its socket (1009). "
            "Inflating it holds every other client up (about 10 ms per MiB).",
        )
        loader.add_option(
            "sessionpin_ws_keep_kb", int, 1024,
            "sessionpin: how much of a WebSocket's messages the proxy keeps for mitmweb (KiB, the newest; "
            "the last message always).",
        )
        _install()

    def configure(self, updated: set[str]) -> None:
        if "sessionpin_ws_max_message_mb" in updated:
            self.max_message = max_message()
        if "sessionpin_ws_keep_kb" in updated:
            self.keep = max(0, ctx.options.sessionpin_ws_keep_kb) * 1024

    def done(self) -> None:
        _uninstall()

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        messages = flow.websocket.messages if flow.websocket is not None else None
        if not messages:
            return
        meta = flow.metadata
        kept = meta.get(perflow.WS_KEPT, 0) + len(messages[-1].content) + OVERHEAD
        meta[perflow.WS_KEPT] = self._trim(messages, kept, 1)       # what the kept messages cost

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        kept = flow.metadata.pop(perflow.WS_KEPT, None)
        if flow.websocket is not None and flow.websocket.messages:
            if kept is None:
                kept = sum(len(m.content) + OVERHEAD for m in flow.websocket.messages)
            self._trim(flow.websocket.messages, kept, 0)

    def error(self, flow: http.HTTPFlow) -> None:
        flow.metadata.pop(perflow.WS_KEPT, None)

    def _trim(self, messages: list, kept: int, newest: int) -> int:
        """Drop the oldest messages while they cost more than ``keep`` (``newest``: how many of the
        last ones stay whatever they cost). Returns what the rest costs."""
        drop = 0
        while kept > self.keep and drop < len(messages) - newest:
            kept -= len(messages[drop].content) + OVERHEAD
            drop += 1
        if drop:
            del messages[:drop]
        return kept
