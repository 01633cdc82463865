"""What a part keeps about one flow, in ``flow.metadata``: it lives and dies with its flow.

The parts of the addon (``bundle``) share per-flow facts through ``flow.metadata``: the
router's decision under ``"sessionpin"`` (a plain dict: mitmweb shows it, a saved flow keeps
it), and a part's own working state (a stream reader, a prepared answer) under its own
``"sessionpin.*"`` key, taken out when the flow ends (response, error, socket end).

Rules this module keeps:
- A part's working state is a ``FlowState``: a copy of the flow (mitmproxy's ``get_state``,
  used to save, duplicate or replay it) holds None in its place, never a live reader or a
  future, and no part reads another part's key — but the router's ``BODY``, which it makes
  for the readers after it (the body decoded once, issue 22); the bundle removes it once the
  flow's response or error hooks have all run.
- Nothing is kept by flow id anywhere in the shell: what a part knows of a flow goes when
  mitmproxy lets go of the flow, whatever ends it.
"""

from __future__ import annotations

from typing import Any

LINEAGE = "sessionpin.lineage_read"         # lineagewatch: what this flow's answer is read for
LINEAGE_HELD = "sessionpin.lineage_held"    # lineagewatch: a large request's root read, until its body left
LEDGER = "sessionpin.ledger_read"           # ledgerwatch: this flow's usage reader
HELD = "sessionpin.held"            # limits: a body of unknown length, pointed at the sink
SINK = "sessionpin.sink"            # limits: the token of this flow's prepared 413
WS_KEPT = "sessionpin.ws_kept"      # wsbounds: bytes this socket's kept messages cost
BODY = "sessionpin.body"            # router: the request body's top level as the facts read it (``Body``)
PAGE = "sessionpin.page"            # browsers: a web page's request let by (why: the header): never routed


class FlowState:
    """Base of a part's per-flow state (see the module)."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None


class Body(FlowState):
    """The request body's top level as raw members, decoded once by the facts reader (views of
    the body as read), kept for the parts that read the same body after it (the ledger's
    prompt shape). ``sent``: the body as it left (the model renamed: ``members`` says the new
    name); a reader takes the members only while the flow's body is still that object — any
    later change of the body (another addon's) and it decodes the body itself."""

    __slots__ = ("members", "sent")

    def __init__(self, members: dict[str, Any]) -> None:
        self.members = members
        self.sent: bytes | None = None

    def of(self, body: bytes | None) -> dict[str, Any] | None:
        return self.members if body is not None and body is self.sent else None


def sent_members(flow: Any) -> dict[str, Any] | None:
    """The router's raw members of the flow's request body (``BODY``), while the body is still
    the one it sent; else None (the reader decodes the body itself)."""
    body = flow.metadata.get(BODY)
    return body.of(flow.request.raw_content) if body is not None else None
