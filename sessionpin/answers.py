"""Answers the proxy gives itself, in the agent's own API error format.

Rules it keeps:
- An agent shows an error it can parse: Anthropic's ``{"type":"error","error":{…}}`` for
  messages and count_tokens, OpenAI's ``{"error":{"message","type","param","code"}}`` for
  chat/completions and responses (and anything else). Never mitmproxy's HTML page.
- The message names what the operator needs: the session, the server and its address,
  the store — never a key, never prompt content (callers build it from ids and names).
- Retry hints are honest: ``retry_after`` given (the cause is passing: a store busy, a
  server down) → ``retry-after`` and ``x-should-retry: true``; otherwise
  ``x-should-retry: false`` (the Anthropic and OpenAI SDKs then do not retry).
"""

from __future__ import annotations

import json

from . import facts as F

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    529: "overloaded_error"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def refusal(api: str, status: int, kind: str, message: str,
            retry_after: int | None = None) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of an error answer in ``api``'s format."""
    if api in (F.ANTHROPIC_MESSAGES, F.ANTHROPIC_COUNT_TOKENS):
        body = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    else:
        body = {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "server_error"),
                          "param": None, "code": kind}}
    headers = {"content-type": "application/json", "x-sessionpin-refused": kind}
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
        headers["x-should-retry"] = "true"
    else:
        headers["x-should-retry"] = "false"
    return json.dumps(body).encode(), headers
