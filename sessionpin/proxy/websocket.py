"""WebSocketModels: the model name in the messages of a WebSocket the router moved.

Codex sends its turns as ``response.create`` messages on a Responses WebSocket; the router
decided the socket at its upgrade (``router.Router._websocket``). A message that goes to a
server with model renames gets its top-level ``model`` renamed like an HTTPS body: only
those bytes change (``rewrite.replace_model``). A message whose model cannot be located
exactly is not sent on unmapped: it is dropped, and the client gets an ``error`` event
saying why (the same rule as the HTTPS body's 502).
"""

from __future__ import annotations

import json
import logging

from mitmproxy import ctx, http

from .. import rewrite
from ..ids import short
from .configwatch import ConfigWatch

log = logging.getLogger("sessionpin")


class WebSocketModels:
    def __init__(self, config: ConfigWatch) -> None:
        self.config = config
        self.renamed = 0
        self.refused = 0

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        meta = flow.metadata.get("sessionpin")
        if not meta or not meta.get("target") or flow.websocket is None:
            return
        msg = flow.websocket.messages[-1]
        if not msg.from_client or not msg.is_text:
            return
        server = self.config.config.servers.get(meta["target"])
        if server is None or not server.models:
            return
        data = msg.content
        try:
            start, end = rewrite.model_span(data)
            model = json.loads(data[start:end])
        except (rewrite.ModelNotFound, ValueError):
            if b'"model"' not in data:
                return               # a message without a model (nothing to rename)
            return self._refuse(flow, msg, meta, "its model could not be located exactly")
        mapped = server.map_model(model) if isinstance(model, str) else model
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
