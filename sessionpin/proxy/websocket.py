"""Codex's Responses WebSocket: what the router reads at the upgrade, and ``WebSocketModels``,
the model name in the messages of a socket the router decided.

Codex sends its turns as ``response.create`` messages on a Responses WebSocket; the router
decides the socket at its upgrade (``upgrade_facts``, ``router.Router._websocket``) and
opens it to the chosen server with that server's key. Rules kept here:

- The socket's model map is the one its server had as the upgrade was planned (a pool
  pin's snapshot included: ``socket_models``), kept in the flow's metadata for the
  socket's life — like its server and its key, which the handshake fixed. A config edit
  applies from the next socket.
- A message the client sends on a socket with a model map gets its top-level ``model``
  renamed like an HTTPS body: only those bytes change (``rewrite.replace_model``). A
  message whose model cannot be located exactly is not sent on unmapped: it is dropped,
  and the client gets an ``error`` event saying why (the same rule as the HTTPS body's
  502). The server's messages pass as sent.
- A socket's requests in the activity count (``sessions``' REQUESTS) are its turns: each
  ``response.create`` the client sends is one (``SocketTurns``); the upgrade counts none
  (it updates "last seen" only). A message is a turn when its top-level ``type`` says so
  (decoded in C, the rest skipped), never by a search in its content.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import msgspec
from mitmproxy import ctx, http

from ..serverpools import allocate
from ..decision import rewrite
from ..reader import facts as F
from ..config.config import Config, Server, map_model
from ..reader.ids import short
from ..decision.route import State
from ..reader import headerview, paths

log = logging.getLogger("sessionpin")
MODELS = "socket_models"     # the flow metadata's key for a socket's model map
COUNTED = "socket_counted"   # ... for the server a socket's turns are counted on (set when counted)
TURN = "response.create"     # the client message that opens a turn


def is_upgrade(req: http.Request) -> bool:
    return req.method == "GET" and "websocket" in headerview.get(req.headers, "upgrade").lower()


def upgrade_facts(config: Config, req: http.Request) -> tuple[F.Facts, Server | None, str] | None:
    """The facts of an upgrade the router decides (a known agent's, to a Responses endpoint),
    told by its headers (``facts.read_upgrade``), the server it addresses, and — for an
    upgrade at a path sessionpin does not route that ends with ``/responses`` (``paths.named``,
    or ``paths.lookalike``) — that endpoint (the stepper then only guards it: ``Request.unnamed``); else None."""
    source, scope = config.scope("POST", req.scheme, req.host, req.port, req.path)
    if scope.api == F.OPENAI_RESPONSES and scope.endpoint.partition("?")[0] == "/responses":
        unnamed = ""
    elif ((named := paths.named("POST", req.path, source.prefix if source else None)) is not None
          or (named := paths.lookalike("POST", req.path, source.prefix if source else None)) is not None) \
            and named[1] == F.OPENAI_RESPONSES:
        # (a look-alike too: an upgrade of a known agent, with its session headers, to a path
        # ending with /responses is a Responses socket whatever comes before — Cloudflare's
        # /v1/ACCT/GW/openai/responses — and has no body to tell otherwise)
        unnamed = named[0]
    else:
        return None
    facts = F.read_upgrade(req.url, req.headers.fields)
    return (facts, source, unnamed) if facts.agent in F.AGENTS else None


def socket_models(state: State) -> list[list[str]]:
    """The model map of the server a socket is opened to, as its upgrade was planned."""
    d = state.decision
    target = allocate.snapshot(state.request.config, state.loaded.pin).servers.get(d.target) if d else None
    return [list(m) for m in target.models] if target is not None else []


class WebSocketModels:
    def __init__(self) -> None:
        self.renamed = 0
        self.refused = 0

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        meta = flow.metadata.get("sessionpin")
        if not meta or not meta.get(MODELS) or flow.websocket is None:
            return
        msg = flow.websocket.messages[-1]
        if not msg.from_client or not msg.is_text:
            return
        models = [tuple(m) for m in meta[MODELS]]
        data = msg.content
        try:
            start, end = rewrite.model_span(data)
            model = json.loads(data[start:end])
        except (rewrite.ModelNotFound, ValueError):
            if b'"model"' not in data:
                return               # a message without a model (nothing to rename)
            return self._refuse(flow, msg, meta, "its model could not be located exactly")
        mapped = map_model(models, model) if isinstance(model, str) else model
        if mapped == model:
            return
        msg.content = rewrite.replace_model(data, model, mapped, (start, end))
        self.renamed += 1

    def _refuse(self, flow: http.HTTPFlow, msg, meta: dict, why: str) -> None:
        msg.drop()
        self.refused += 1
        text = (f"sessionpin: this message was not sent to server {meta['target']}: {why}, and that server "
                f"renames models (session {meta.get('session')} stays on {meta['target']}).")
        log.warning("sessionpin: websocket message of %s dropped: %s", short(meta.get("session")), why)
        try:
            ctx.master.commands.call("inject.websocket", flow, True,
                                     json.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                                            "message": text}}).encode(), True)
        except Exception as e:   # the client still sees no reply to that message
            log.warning("sessionpin: could not tell the client: %s", e)


class _Type(msgspec.Struct):
    type: Any = None


_decode_type = msgspec.json.Decoder(_Type)


def is_turn(data: bytes) -> bool:
    """Whether a client message opens a turn: its top-level ``type`` is ``response.create``."""
    try:
        return _decode_type.decode(data).type == TURN
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return False


class SocketTurns:
    """Counts each turn of a decided socket as a request of its session (``StoreRuntime.seen``)."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        meta = flow.metadata.get("sessionpin")
        if not meta or COUNTED not in meta or flow.websocket is None:
            return
        msg = flow.websocket.messages[-1]
        if msg.from_client and msg.is_text and is_turn(msg.content):
            self.runtime.seen(meta["session"], meta["agent"], meta[COUNTED], time.time())
