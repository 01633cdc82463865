"""Which requests are inference: exact paths under a server's prefix, and the paths never routed.

A request the router takes as inference may be sent to another server with that server's
key, so "inference" is read narrowly: the method is POST and the path is exactly one of
the inference endpoints under the server's prefix. ``/v1/threads/x/messages`` or
``/v1/organizations/x/messages`` end like an endpoint and are not one; a path with dot
segments or encoded separators may mean something else to the server than it says to us.

Rules this module keeps:
- ``scope(method, path, prefix)`` -> ``Scope(api, refuse, rest)``:
  * ``refuse`` is set (and ``api`` is "other") for a POST whose path is ambiguous, so it is
    never routed: not starting with ``/``; a control character (0x00-0x1F, 0x7F) or ``#``
    anywhere; in the path part, a backslash, an empty segment (``//``), a dot segment
    (``.``, ``..``), an escape of ``/ . \\ %`` or of a control character (``%2f %2e %5c
    %25 %00``…, any case), or a ``%`` not followed by two hex digits;
  * ``api`` is an inference api when the path part is the prefix followed by ``/v1`` and an
    endpoint (``/messages``, ``/messages/count_tokens``, ``/chat/completions``,
    ``/responses``), or, when the prefix itself ends with ``/v1`` (``…/zen/v1``), the
    prefix followed by the endpoint. Exactly: case, trailing slash and extra segments
    make it "other". The query is not part of the match. ``rest`` is what follows the
    prefix (query included): the part a moved request keeps.
  * anything else, and every method but POST, is "other" (never routed, no refusal: a
    request that is not routed goes where it was addressed, as if the router were not there).
- With the prefix unknown (``prefix=None``: the reader's ``facts.api_of``, or a request to
  an origin no longer configured), the path part must end with ``/v1`` + an endpoint, and
  ``rest`` is ``/v1`` + the endpoint. ``api_of_path(method, path)`` is that api.
- ``/v1/responses/compact`` is not an endpoint here: the recorded Codex (0.171) compacts
  through ``/v1/responses`` (``request_kind: compaction``).
Pure: strings in, a value out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ANTHROPIC_MESSAGES = "anthropic-messages"
ANTHROPIC_COUNT_TOKENS = "anthropic-count-tokens"
OPENAI_CHAT = "openai-chat"
OPENAI_RESPONSES = "openai-responses"
OTHER = "other"

VERSION = "/v1"
ENDPOINTS = {
    "/messages": ANTHROPIC_MESSAGES,
    "/messages/count_tokens": ANTHROPIC_COUNT_TOKENS,
    "/chat/completions": OPENAI_CHAT,
    "/responses": OPENAI_RESPONSES,
}

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# An escape that decodes to a separator, a dot, a backslash, a percent or a control char.
_BAD_ESCAPE = re.compile(r"%(?:2[eEfF5]|5[cC]|[01][0-9a-fA-F]|7[fF])")
_LONE_PERCENT = re.compile(r"%(?![0-9a-fA-F]{2})")


@dataclass(frozen=True)
class Scope:
    api: str                     # an inference api, or "other"
    refuse: str | None = None    # why this path must never be routed (then api is "other")
    rest: str = ""               # inference: the path after the prefix, query included

    @property
    def inference(self) -> bool:
        return self.api != OTHER


def unsafe(path: str) -> str | None:
    """Why a request target (path and query) is ambiguous, or None when it is plain."""
    if not path.startswith("/"):
        return "not an absolute path"
    if _CONTROL.search(path):
        return "a control character in the path"
    if "#" in path:
        return "a fragment in the request target"
    p = path.partition("?")[0]
    if "\\" in p:
        return "a backslash in the path"
    if _BAD_ESCAPE.search(p):
        return "an encoded separator, dot, backslash, percent or control character in the path"
    if _LONE_PERCENT.search(p):
        return "a malformed escape in the path"
    segments = p.split("/")[1:]
    if any(s in (".", "..") for s in segments):
        return "a dot segment in the path"
    if any(s == "" for s in segments[:-1]):
        return "an empty segment (//) in the path"
    return None


def scope(method: str, path: str, prefix: str | None = "") -> Scope:
    """What a request to a server with this path prefix ("" or "/api/anthropic", no
    trailing slash) is: an inference api, "other", or refused (see the module's rules).
    ``prefix=None``: the prefix is unknown (an origin no longer configured), and is
    whatever comes before ``/v1`` + the endpoint."""
    if method.strip().upper() != "POST":
        return Scope(OTHER)
    why = unsafe(path)
    if why:
        return Scope(OTHER, why)
    p, sep, query = path.partition("?")
    if prefix is None:
        for endpoint, api in ENDPOINTS.items():
            if p.endswith(VERSION + endpoint):
                return Scope(api, rest=VERSION + endpoint + sep + query)
        return Scope(OTHER)
    if not p.startswith(prefix):
        return Scope(OTHER)
    rest = p[len(prefix):]
    if rest.startswith(VERSION + "/"):
        api = ENDPOINTS.get(rest[len(VERSION):])
        if api:
            return Scope(api, rest=rest + sep + query)
    if prefix.endswith(VERSION):
        api = ENDPOINTS.get(rest)
        if api:
            return Scope(api, rest=rest + sep + query)
    return Scope(OTHER)


def api_of_path(method: str, path: str) -> str:
    """The inference api of a POST whose path (prefix unknown) ends with ``/v1`` + an
    endpoint, else "other"; an ambiguous path is "other"."""
    return scope(method, path, None).api
