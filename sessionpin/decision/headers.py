"""What a request sent to another server keeps: an allowlist of headers and query parameters.

When the router sends a request to a server other than the one it addressed, everything
the agent sent for the addressed server stays behind unless it is named here; the target's
own credential is then added by ``rewrite.plan``. A header nobody listed is dropped, so a
credential under a name no one thought of (``x-access``, ``openai-organization``,
``chatgpt-account-id``, a folded header) cannot leave with the request.

Rules this module keeps:
- Kept headers, by name (case-insensitive), derived from every header the recorded clients
  send on inference requests (tests/fixtures/traffic; tests/test_headers.py fails on a
  recorded name that is neither kept nor in ``DROPPED``, so a new client header is a
  decision, not an accident):
  * ``TRANSPORT``: how the body and the answer are framed and negotiated (content type,
    length and encoding, accept…); ``host`` is kept for mitmproxy to set to the target.
  * ``API``: the API version and beta flags the target's API reads.
  * ``AGENT``: the agent's own identifying headers: user agent, app, session/thread/request
    ids, request classes; and the families ``AGENT_PREFIXES`` (``x-claude-code-*``,
    ``x-stainless-*``, ``x-opencode-*``, ``x-codex-*``) except a name in them holding a
    credential word (key, token, auth, secret, …).
- A kept header whose value holds a control character (an obs-folded line) or looks like a
  key (``redact.contains_key``) is dropped too: an allowed name is no licence for its value.
- Query parameters: only ``QUERY`` (``beta``, which Claude Code sends) with a value that
  does not look like a key; the others are dropped, every kept byte as sent.
- Organisation and account headers are dropped: they name the agent's account at the
  server it addressed, and mean nothing (or the wrong thing) anywhere else.
- A web page is told apart by what only a browser's fetch adds (``from_web_page``): an
  ``Origin`` header, or ``Sec-Fetch-Site`` other than ``none`` (``none`` is a navigation
  the user typed). ``Sec-Fetch-Mode`` alone is not a page: pi's SDK sends
  ``sec-fetch-mode: cors`` (and ``anthropic-dangerous-direct-browser-access``) with no
  ``Origin`` and no ``Sec-Fetch-Site``.
"""

from __future__ import annotations

import functools
import re
from typing import Iterable
from urllib.parse import unquote_plus

from ..config.redact import contains_key

TRANSPORT = frozenset({
    "host", "content-type", "content-length", "content-encoding", "transfer-encoding",
    "connection", "accept", "accept-encoding", "accept-language",
    # a WebSocket handshake (Codex's Responses socket, routed at its upgrade)
    "upgrade", "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
    "sec-websocket-protocol",
})
API = frozenset({"anthropic-version", "anthropic-beta", "openai-beta"})
AGENT = frozenset({
    "user-agent", "x-app", "originator", "version",
    # session, thread and request ids (the reader's session headers among them)
    "session-id", "session_id", "thread-id", "x-session-id", "x-session-affinity",
    "x-parent-session-id", "x-client-request-id", "x-conversation-id", "conversation-id",
    "conversation_id",
    # request classes and features
    "x-claude-1p-request-class", "x-cc-compaction-request", "x-cc-context-compacted",
    "x-openai-subagent", "x-openai-internal-codex-responses-lite",
})
AGENT_PREFIXES = ("x-claude-code-", "x-stainless-", "x-opencode-", "x-codex-")
# A name in a prefix family holding one of these is a credential, not an id.
CREDENTIAL_WORDS = ("key", "token", "auth", "cookie", "secret", "password", "passwd", "credential",
                    "jwt", "signature", "sig", "bearer", "access")
# Recorded on inference requests and dropped on purpose (tests/test_headers.py):
DROPPED = {
    "authorization": "the agent's credential for the server it addressed; the target's own is set",
    "x-api-key": "the same",
    "anthropic-dangerous-direct-browser-access": "a browser's CORS opt-in; the proxy is no browser",
    "sec-fetch-mode": "a browser's fetch metadata (pi's SDK runs as if in one)",
}
QUERY = frozenset({"beta"})


@functools.lru_cache(maxsize=1024)     # the same few names on every request (names only: no values)
def allowed(name: str) -> bool:
    """Whether a header of this name may go with a request moved to another server."""
    n = name.strip().lower()
    if n != name.lower() or not n:
        return False   # surrounding space: not a name a client sends, so not one we know
    if n in TRANSPORT or n in API or n in AGENT:
        return True
    return n.startswith(AGENT_PREFIXES) and not any(w in n for w in CREDENTIAL_WORDS)


_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")   # a tab is a value's own


def _clean(value: str) -> bool:
    if _CONTROL.search(value):
        return False   # an obs-folded or smuggled line
    return not contains_key(value)


# An agent sends the same header values on every request (its version, betas, session id):
# judged once. Short values only, a bounded number (what a client's values can hold in memory).
_clean_memo = functools.lru_cache(maxsize=1024)(_clean)


def _clean_value(value: str) -> bool:
    return _clean_memo(value) if len(value) <= 512 else _clean(value)


def dropped_for_move(headers: Iterable[tuple[str, str]], keep: Iterable[str] = ()) -> tuple[str, ...]:
    """The lower-case names to remove (all their values) before a request goes to another
    server: every name not allowed, and every allowed one with a bad value. ``keep``
    names survive whatever their value (the agent's own credential headers, when the
    target is the origin that credential is for)."""
    keep = {k.lower() for k in keep} if keep else ()
    drop: dict[str, None] = {}
    for name, value in headers:
        if keep and name.lower() in keep:
            continue
        if not allowed(name) or not _clean_value(value):
            drop[name.lower()] = None
    return tuple(drop)


def from_web_page(headers: Iterable[tuple[str, str]], allowed_origins: Iterable[str] = ()) -> str | None:
    """Why these headers are a web page's request (None: they are not, or the page's origin
    is one the operator allowed). A page's script can reach a listener on loopback (a
    no-cors ``text/plain`` POST needs no preflight), and a proxy that routes it adds a
    server's key: its origin must be allowed by name."""
    origin = site = None
    for name, value in headers:
        n = name.strip().lower()
        if n == "origin" and origin is None:
            origin = value.strip()
        elif n == "sec-fetch-site" and site is None:
            site = value.strip().lower()
    if origin is not None:
        if normal_origin(origin) in {normal_origin(o) for o in allowed_origins}:
            return None
        return f"Origin: {_shown(origin)}"
    if site is not None and site != "none":
        return f"Sec-Fetch-Site: {_shown(site)}"
    return None


def normal_origin(origin: str) -> str:
    """An origin as browsers send it: lower case, no trailing slash, no default port."""
    o = origin.strip().lower().rstrip("/")
    for scheme, port in (("https://", ":443"), ("http://", ":80")):
        if o.startswith(scheme) and o.endswith(port):
            o = o[: -len(port)]
    return o


def _shown(value: str) -> str:
    """A header value fit for a log line: printable, short."""
    v = "".join(c if c.isprintable() else "?" for c in value)
    return v if len(v) <= 80 else v[:77] + "..."


def query_for_move(path: str) -> str:
    """``path`` with only the allowed query parameters whose value does not look like a key;
    the path and every kept byte as sent."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    kept = []
    for part in query.split("&"):
        name, _, value = part.partition("=")
        try:
            name, value = unquote_plus(name), unquote_plus(value)
        except Exception:   # pragma: no cover - unquote_plus replaces bad escapes
            continue
        if name in QUERY and _clean_value(value):
            kept.append(part)
    return base + ("?" + "&".join(kept) if kept else "")
