"""The fake upstream's WebSocket side: a local server that speaks OpenAI's Responses WebSocket.

Codex opens ``GET /v1/responses`` with ``Upgrade: websocket`` before any HTTPS POST. With
``FAKE_WEBSOCKET=1`` the fake addon (fake_upstream.py) sends that upgrade to this server instead of
answering 426, so mitmproxy relays the WebSocket and the flow file records every message both ways.

Rules it keeps (the protocol as Codex speaks it: codex-rs/codex-api, endpoint/responses_websocket.rs):
- the upgrade is accepted without extensions (Codex offers permessage-deflate; declining keeps the
  recorded messages plain text);
- a client text message ``{"type": "response.create", ...}`` carries a Responses request body (model,
  input, tools, ...; ``generate: false`` asks for a warm-up that produces nothing); the answer is one
  text message per Responses stream event, the same JSON as the SSE ``data:`` lines, ending with
  ``response.completed``;
- ``{"type": "response.processed", "response_id": ...}`` (the client's acknowledgement) gets no answer;
- ping -> pong, close -> close.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable

from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Message, Ping, Request, TextMessage

log = logging.getLogger(__name__)


class FakeResponsesWebSocket:
    """``answer(body) -> list of event dicts`` makes the events for one ``response.create``."""

    def __init__(self, answer: Callable[[dict], list[dict]], accept_headers: Callable[[], list[tuple[bytes, bytes]]]):
        self.answer = answer
        self.accept_headers = accept_headers
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        text: list[str] = []
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                ws.receive_data(data)
                for event in ws.events():
                    if isinstance(event, Request):
                        writer.write(ws.send(AcceptConnection(extra_headers=self.accept_headers())))
                    elif isinstance(event, TextMessage):
                        text.append(event.data)
                        if not event.message_finished:
                            continue
                        message, text = "".join(text), []
                        for out in self._answer(message):
                            writer.write(ws.send(Message(data=json.dumps(out, separators=(",", ":")))))
                    elif isinstance(event, Ping):
                        writer.write(ws.send(event.response()))
                    elif isinstance(event, CloseConnection):
                        writer.write(ws.send(event.response()))
                        await writer.drain()
                        return
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:  # a recording tool: say what broke, keep serving other connections
            log.exception("fake websocket")
        finally:
            writer.close()

    def _answer(self, message: str) -> list[dict]:
        try:
            body = json.loads(message)
        except ValueError:
            return [{"type": "error", "status": 400, "error": {"type": "invalid_request_error",
                                                              "message": "not JSON"}}]
        if not isinstance(body, dict) or body.get("type") != "response.create":
            return []  # response.processed and anything else: no answer
        return self.answer(body)
