"""Answers the proxy gives itself, in the agent's own API error format.

Rules it keeps:
- An agent shows an error it can parse: Anthropic's ``{"type":"error","error":{…}}`` for
  messages and count_tokens, OpenAI's ``{"error":{"message","type","param","code"}}`` for
  chat/completions and responses (and anything else). Never mitmproxy's HTML page.
- The message names what the operator needs: the session, the server and its address,
  the store — never a key, never prompt content (callers build it from ids and names).
- Retry hints are honest: ``retry_after`` given (the cause is passing within seconds: a
  store busy writing) → ``retry-after`` and ``x-should-retry: true``; otherwise
  ``x-should-retry: false`` (the Anthropic and OpenAI SDKs then do not retry).
- A refusal no agent may retry for minutes (a pinned server down, removed or re-pointed, a store
  that cannot be read, once the proxy rode out a blip itself; a target whose key the proxy's
  environment lacks) is ``NO_RETRY_STATUS``: 424 with
  ``x-should-retry: false`` and no ``retry-after`` — a 4xx none of the four clients retries
  (not 401, 408, 409, 429 nor a 5xx: opencode's AI SDK and Codex go by the status alone),
  and its body's types and words are none their retry rules read as passing
  (docs/traffic.md, "What makes each client retry").
- Codex is the exception (``no_retry``): its turn loop retries any status it does not know,
  424 too (five more POSTs over ~7 s), and stops at once at a 400 (its ``InvalidRequest``),
  showing the body as it came. So Codex's no-retry answer is a 400 whose body is the
  message as plain text (JSON would be shown raw); its refused WebSocket upgrade is a 426.
"""

from __future__ import annotations

import json
import re

from ..reader import facts as F

# 424 Failed Dependency: the request depended on a server (or the pin store) that failed.
NO_RETRY_STATUS = 424
# Codex's WebSocket upgrade refused so: 426 makes Codex fall back to HTTPS at once (where the
# POST gets the 424); any other status cost seven upgrades first (measured, docs/traffic.md).
NO_RETRY_UPGRADE_STATUS = 426

# Codex's no-retry answer to an HTTPS request: the one status its turn loop does not retry and
# whose body it shows as it came (codex-rs: a 400 is ``CodexErr::InvalidRequest(body)``, not
# retryable; any other unexpected status is retried five times). Measured with Codex 0.171:
# docs/traffic.md.
CODEX_NO_RETRY_STATUS = 400

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    529: "overloaded_error"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 413: "invalid_request_error", 424: "failed_dependency", 429: "rate_limit_error"}


# pi retries any error whose text matches its pattern (pi-coding-agent's _isRetryableError:
# "overloaded|rate.?limit|too many requests|429|500|502|503|504|service.?unavailable|server
# error|internal error|connection.?error|connection.?refused|…|timed? out|timeout|terminated"),
# whatever the status: a no-retry answer says the same in other words.
_CALM = [(re.compile(p, re.IGNORECASE), w) for p, w in (
    (r"connection.?refused", "refused to connect"), (r"connection.?(?:error|reset|lost)", "lost its link"),
    (r"timed? ?out|timeout", "took too long"), (r"server.?error|internal.?error", "failure"),
    (r"service.?unavailable", "not available"), (r"overloaded", "busy"), (r"rate.?limit", "limit"),
    (r"too many requests", "many requests"), (r"terminated", "ended"), (r"fetch failed", "request failed"),
    (r"other side closed", "closed"), (r"socket hang up", "hung up"), (r"network.?error", "network fault"),
    (r"upstream.?connect", "upstream link"), (r"retry delay", "wait"))]


# pi's rule also reads the numbers 429, 500, 502, 503 and 504 anywhere in the text, inside a
# longer one too: a local server's port (``127.0.0.1:5000``), a short id (``…a5003f…``), a
# count. A word joiner (U+2060, drawn as nothing) goes inside each such run in what pi is told,
# so its rule reads no status there; the CLI drops it from an id pasted back (``ids.typed``).
_STATUS_NUMBERS = re.compile(r"(?<=4)(?=29)|(?<=5)(?=0[0234])")
WORD_JOINER = "\u2060"


def unnumbered(message: str) -> str:
    """``message`` with no run of digits pi's retry rule reads as a status (see above)."""
    return _STATUS_NUMBERS.sub(WORD_JOINER, message)


def calm(message: str) -> str:
    """``message`` without the words an agent's retry rule reads as "passing" (pi's)."""
    for pattern, words in _CALM:
        message = pattern.sub(words, message)
    return message


def refusal(api: str, status: int, kind: str, message: str,
            retry_after: int | None = None) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of an error answer in ``api``'s format."""
    if status == NO_RETRY_STATUS:
        message = calm(message)
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


def no_retry(agent: str, api: str, kind: str, message: str,
             upgrade: bool = False) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers) of a refusal no client may retry (``NO_RETRY_STATUS``), as the
    agent shows it at once: a WebSocket upgrade's 426 (Codex goes to HTTPS now); Codex's 400
    with the message as plain text; everyone else's 424 in its API's error format."""
    if agent == F.PI:
        message = unnumbered(message)
    body, headers = refusal(api, NO_RETRY_STATUS, kind, message)
    if upgrade:
        return NO_RETRY_UPGRADE_STATUS, body, headers
    if agent == F.CODEX:
        headers["content-type"] = "text/plain; charset=utf-8"
        return CODEX_NO_RETRY_STATUS, calm(message).encode(), headers
    return NO_RETRY_STATUS, body, headers
