"""An answer over HTTP/2 from the server, end to end: real TLS both sides, HTTP/2 both sides
(as Codex speaks it, and mitmproxy then to the server), a fake server speaking h2 on loopback.

What is tested: HTTP/2 lets a server send an empty DATA frame in the middle of a stream (legal,
and a server's choice). mitmproxy hands it to the response's stream callable as an empty chunk
— the very signal it gives at the stream's end — so the usage and lineage readers took it for
the end: the usage event it fell inside was read as two broken halves (the ledger's turn lost
its output tokens), and the lineage reader read nothing after it (the opening's root never
recorded). Now an empty chunk is no data, and the readers' end is when their result is taken.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
import uuid
from typing import Iterator

import h2.config
import h2.connection
import h2.events
import pytest

from .harness import LOOPBACK, Client, Mitmdump, TestCA, toml_config
from .replay import h2_request

OUTPUT = 77


def _sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def answer_parts(model: str) -> list[bytes]:
    """A Claude answer's SSE, each part one DATA frame; an empty one inside ``message_delta``."""
    start = _sse({"type": "message_start", "message": {
        "id": "msg_h2_" + uuid.uuid4().hex[:8], "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "usage": {"input_tokens": 11, "output_tokens": 1}}})
    blocks = (_sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
              + _sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}})
              + _sse({"type": "content_block_stop", "index": 0}))
    delta = _sse({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                  "usage": {"output_tokens": OUTPUT}})
    half = len(delta) // 2
    return [start, blocks, delta[:half], b"", delta[half:], _sse({"type": "message_stop"})]


class H2Fake:
    """A TLS server on loopback speaking HTTP/2 only, answering every request with ``answer_parts``."""

    def __init__(self, ca: TestCA) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(ca.issue("h2-fake"))
        self.context.set_alpn_protocols(["h2"])
        self.listener = socket.socket()
        self.listener.bind((LOOPBACK, 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.requests = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def origin(self) -> str:
        return f"https://{LOOPBACK}:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            tls = self.context.wrap_socket(raw, server_side=True)
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
            conn.initiate_connection()
            tls.sendall(conn.data_to_send())
            while True:
                data = tls.recv(65536)
                if not data:
                    return
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.events.DataReceived):
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    elif isinstance(ev, h2.events.StreamEnded):
                        self.requests += 1
                        conn.send_headers(ev.stream_id, [(":status", "200"), ("content-type", "text/event-stream"),
                                                         ("request-id", "req_h2_" + uuid.uuid4().hex[:8])])
                        tls.sendall(conn.data_to_send())
                        for part in answer_parts("claude-opus-4-5"):
                            conn.send_data(ev.stream_id, part)     # b"": an empty DATA frame
                            tls.sendall(conn.data_to_send())
                            time.sleep(0.02)                      # each its own read at the proxy
                        conn.end_stream(ev.stream_id)
                    tls.sendall(conn.data_to_send())
        except (OSError, ssl.SSLError, h2.exceptions.ProtocolError):
            pass
        finally:
            raw.close()

    def stop(self) -> None:
        self.listener.close()


class Rig:
    def __init__(self, tmp) -> None:
        self.ca = TestCA(tmp / "ca")
        self.fake = H2Fake(self.ca)
        config = toml_config({"anthropic": {"url": self.fake.origin}}, {"claude-code": "anthropic"})
        self.mitm = Mitmdump.router(tmp / "router", self.ca, config)
        self.mitm.start()

    def send(self, session: str) -> object:
        body = json.dumps({"model": "claude-opus-4-5", "max_tokens": 10, "stream": True,
                           "messages": [{"role": "user", "content": "hi " + session}]}).encode()
        headers = [("content-type", "application/json"), ("user-agent", "claude-cli/2.1.332 (external, cli)"),
                   ("x-api-key", "sk-ant-api03-CLIENT"), ("x-claude-code-session-id", session),
                   ("x-claude-code-request-class", "main"), ("anthropic-version", "2023-06-01")]
        return h2_request(self.mitm.port, self.mitm.mitm_ca, LOOPBACK, self.fake.port, "POST", "/v1/messages",
                          headers, body)

    def output_tokens(self) -> int:
        text = Client.via_proxy(self.mitm.port, self.mitm.mitm_ca).request(
            "GET", self.fake.origin.replace("https", "http") + "/__sessionpin/metrics",
            [("Host", "127.0.0.1")]).text
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                   if line.startswith("sessionpin_ledger_tokens_total{") and 'kind="output"' in line)

    def close(self) -> None:
        self.mitm.stop()
        self.fake.stop()


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("e2e-h2"))
    try:
        yield r
    finally:
        r.close()


def test_an_empty_data_frame_mid_answer_is_no_end_of_it(rig: Rig) -> None:
    before = rig.output_tokens()
    reply = rig.send(str(uuid.uuid4()))
    assert reply.status == 200
    assert b'"output_tokens": 77' in reply.body, "the answer reached the agent whole"
    deadline = time.monotonic() + 5
    while rig.output_tokens() - before < OUTPUT and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rig.output_tokens() - before == OUTPUT, "the ledger read the answer's usage whole"
