"""Which requests are inference: a server is the base URL of an API, and the paths never routed.

A request the router takes as inference may be sent to another server with that server's
key, so "inference" is read narrowly: the method is POST and the path names one inference
endpoint exactly, after an API version segment. ``/v1/threads/x/messages`` or
``/v1/organizations/x/messages`` end like an endpoint and are not one; a path with dot
segments or encoded separators may mean something else to the server than it says to us.

A server's URL is the base URL of its API, as the clients take one: ``https://api.anthropic.com``,
``https://api.openai.com/v1``, ``https://opencode.ai/zen/v1``, ``https://api.z.ai/api/anthropic``.
Its endpoints are at ``api_base(prefix)`` + the endpoint: the prefix itself when its last
segment is an API version (``/zen/v1``, ``/v1``, ``/api/paas/v4``), else the prefix + ``/v1``
(``""`` -> ``/v1``, ``/api/anthropic`` -> ``/api/anthropic/v1``). A move maps the endpoint:
the request arrives at the target's base + the same endpoint (``rewrite.plan``).

Rules this module keeps:
- ``scope(method, path, prefix)`` -> ``Scope(api, refuse, endpoint)``:
  * ``refuse`` is set (and ``api`` is "other") for a POST whose path is ambiguous, so it is
    never routed: not starting with ``/``; a control character (0x00-0x1F, 0x7F) or ``#``
    anywhere; in the path part, a backslash, an empty segment (``//``), a dot segment
    (``.``, ``..``), an escape of ``/ . \\ %`` or of a control character (``%2f %2e %5c
    %25 %00``…, any case), or a ``%`` not followed by two hex digits;
  * ``api`` is an inference api when the path part is
    - the server's base + an endpoint (``/messages``, ``/messages/count_tokens``,
      ``/chat/completions``, ``/responses``), or
    - any prefix the client chose + ``/v1`` + an endpoint (``/zen/v1/messages``,
      ``/zen/go/v1/chat/completions``, ``/api/anthropic/v1/messages`` at a server written as
      a bare origin), as long as that prefix holds no version segment of its own (``v1``,
      ``v2``, ``v1beta``…: ``/v1/threads/x/v1/messages`` is a look-alike) — or is exactly
      the server's own prefix.
    Exactly: extra segments make it "other" (case, a trailing slash, an escaped letter or a
    ``;parameter`` make it refused, below). The query is not part
    of the match. ``endpoint`` is the endpoint and the query (``/messages?beta=true``): what
    a moved request keeps.
  * anything else, and every method but POST, is "other" (never routed, no refusal: a
    request that is not routed goes where it was addressed, as if the router were not there).
- With no server at the request's origin (``prefix=None``: the reader's ``facts.api_of``, or
  a request to an origin no longer configured), only the second form counts.
  ``api_of_path(method, path)`` is that api.
- ``unrouted(method, path)``: a plain POST whose path ends with an endpoint but that
  ``scope`` does not take (``/api/paas/v4/chat/completions`` at a bare origin), minus the
  look-alikes (a version segment before the last one): the path before the endpoint, so
  the router can say once which server URL would route it.
- A path that a lenient server reads as an endpoint it routes, but spelled otherwise (an
  escape of a letter or digit, ``;parameters``, another case, a trailing slash:
  ``/v1/mess%61ges``, ``/V1/Messages``, ``/v1/messages/``, ``/v1;x=1/messages``) is refused like
  the ambiguous paths above: uvicorn and Go decode the escape, Express matches case-blind and
  ignores the slash, Java servers drop the parameters, so it may well be served as inference.
- ``named(method, path, prefix)``: the endpoint and api a POST's path ends with, read as a
  lenient server reads it, under any plain prefix or the server's own (``/chat/completions``
  at a server whose base is ``/v1``, ``/api/paas/v4/chat/completions`` at an origin no longer
  configured) — not a look-alike (``/v1/threads/x/messages``, as ``unrouted``): a request
  sessionpin does not route that a server may serve as inference. The router reads its
  session's pin, so a conversation pinned elsewhere never reaches the server it addressed
  this way (``route``'s "unnamed path" rule). Other APIs' inference endpoints are named too
  (``_other_api``: Bedrock's ``…/model/{id}/invoke``, Vertex's and Gemini's
  ``…/models/{m}:streamRawPredict``/``:generateContent``, the legacy ``/v1/complete`` and
  ``/v1/completions``, ``/v1/responses/input_tokens``), never scoped: sessionpin routes none of them.
- ``lookalike(method, path, prefix)``: what ``named`` leaves out that still ends with an
  endpoint (a version segment before: ``/v1/threads/x/messages``, or a gateway's
  ``/v1/ACCT/GW/anthropic/v1/messages``); the router guards it when its body is an inference
  request (a model), or cannot be read.
- ``/responses/compact`` is an endpoint (of the Responses api): Codex on OpenAI's provider
  compacts a thread there (codex-rs ``compact.rs``); the recorded Codex (0.171, on a custom
  provider) compacts through ``/v1/responses`` (``request_kind: compaction``).
Pure: strings in, a value out.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from urllib.parse import unquote

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
    "/responses/compact": OPENAI_RESPONSES,
}

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# An escape that decodes to a separator, a dot, a backslash, a percent or a control char.
_BAD_ESCAPE = re.compile(r"%(?:2[eEfF5]|5[cC]|[01][0-9a-fA-F]|7[fF])")
_LONE_PERCENT = re.compile(r"%(?![0-9a-fA-F]{2})")


# An API version segment: ``v1``, ``v4``, ``v1beta`` (a client's own prefix holds none).
_VERSION_SEGMENT = re.compile(r"^v[0-9]+[a-z0-9]*$", re.IGNORECASE)
# A segment of a client's prefix: a plain name (no ``;`` parameters, escapes, ``:`` or ``@``).
_NAME_SEGMENT = re.compile(r"^[A-Za-z0-9_~-][A-Za-z0-9_.~-]*$")
# The endpoints, longest first: ``/messages/count_tokens`` before ``/messages``.
_BY_LENGTH = sorted(ENDPOINTS.items(), key=lambda kv: -len(kv[0]))


@dataclass(frozen=True)
class Scope:
    api: str                     # an inference api, or "other"
    refuse: str | None = None    # why this path must never be routed (then api is "other")
    endpoint: str = ""           # inference: the endpoint and the query ("/messages?beta=true")

    @property
    def inference(self) -> bool:
        return self.api != OTHER


def is_version(segment: str) -> bool:
    return bool(_VERSION_SEGMENT.match(segment))


# The endpoints an OpenAI client appends to its base URL, which holds the version itself
# (``…/v1``, ``…/api/paas/v4``, Gemini's ``…/v1beta/openai``); an Anthropic client appends
# ``/v1/messages`` to a base without one.
_OPENAI_FLAVOURED = frozenset({"/chat/completions", "/responses", "/responses/compact"})


def api_base(prefix: str, endpoint: str = "") -> str:
    """Where a server written with this path prefix (no trailing slash) has its endpoints:
    the prefix when its last segment is a version (``/zen/v1``), else the prefix + ``/v1``
    — except for an OpenAI endpoint (``endpoint``, the query aside) at a prefix that holds a
    version segment anywhere (``/v1beta/openai``, Cloudflare's ``/v1/ACCT/GW/openai``): the
    base its clients take is the prefix itself."""
    last = prefix.rpartition("/")[2]
    if is_version(last):
        return prefix
    if endpoint and endpoint.partition("?")[0] in _OPENAI_FLAVOURED \
            and any(is_version(s) for s in prefix.split("/")):
        return prefix
    return prefix + VERSION


def _plain(prefix: str) -> bool:
    """A client's prefix before ``/v1`` ("" or "/zen/go"): plain names, no version segment."""
    if not prefix:
        return True
    if not prefix.startswith("/"):
        return False
    return all(_NAME_SEGMENT.match(s) and not is_version(s) for s in prefix[1:].split("/"))


def _split_endpoint(p: str) -> tuple[str, str, str] | None:
    """(what comes before the endpoint, the endpoint, its api) of a path part that ends
    with one, else None."""
    for endpoint, api in _BY_LENGTH:
        if p.endswith(endpoint):
            return p[: len(p) - len(endpoint)], endpoint, api
    return None


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
    ``prefix=None``: no server is known at the request's origin.

    Remembered for the last ``MEMO`` short targets: a request is scoped by the connect check,
    the body limit, the router and its rewrite plan (four times, ~5 µs each), and an agent
    sends the same few targets all day. A long target is worked out each time (a hostile
    client's paths must not fill memory)."""
    if len(path) <= MEMO_PATH:
        return _memo(method, path, prefix)
    return _scope(method, path, prefix)


MEMO, MEMO_PATH = 1024, 512


def _scope(method: str, path: str, prefix: str | None) -> Scope:
    if method.strip().upper() != "POST":
        return Scope(OTHER)
    why = unsafe(path)
    if why:
        return Scope(OTHER, why)
    p, sep, query = path.partition("?")
    found = _split_endpoint(p)
    if found is not None and _takes(found[0], found[1], prefix):
        before, endpoint, api = found
        return Scope(api, endpoint=endpoint + sep + query)
    normal = normalised(p)
    if normal != p and (again := _split_endpoint(normal)) is not None \
            and _takes(again[0], again[1], None if prefix is None else normalised(prefix)):
        return Scope(OTHER, "a path spelled unlike the inference endpoint it names "
                            "(an escaped letter, a ;parameter, another case or a trailing slash)")
    return Scope(OTHER)


def _takes(before: str, endpoint: str, prefix: str | None) -> bool:
    """Whether what comes before ``endpoint`` is a base sessionpin routes: the server's own
    base, whatever it holds; or a client's plain prefix + /v1; or the server's own prefix +
    /v1 (a base that ends with a version, taken as a prefix)."""
    return (prefix is not None and before == api_base(prefix, endpoint)) or (
        before.endswith(VERSION) and (_plain(before[: -len(VERSION)])
                                      or (prefix is not None and before[: -len(VERSION)] == prefix)))


def normalised(p: str) -> str:
    """A path part as a lenient server reads it: escapes decoded, ``;parameters`` dropped
    from each segment, lower case, no trailing slash."""
    if "%" in p:
        p = unquote(p)
    if ";" in p:
        p = "/".join(s.partition(";")[0] for s in p.split("/"))
    p = p.lower()
    while len(p) > 1 and p.endswith("/"):
        p = p[:-1]
    return p


_memo = functools.lru_cache(maxsize=MEMO)(_scope)


def api_of_path(method: str, path: str) -> str:
    """The inference api of a POST whose path (no server known) is a plain prefix + ``/v1``
    + an endpoint, else "other"; an ambiguous path is "other"."""
    return scope(method, path, None).api


def named(method: str, path: str, prefix: str | None = None) -> tuple[str, str] | None:
    """(endpoint, api) of a POST whose path part, read as a lenient server reads it
    (``normalised``), ends with an inference endpoint under any plain prefix, or under
    ``prefix`` (the server's own, as written); else None. A look-alike — a version segment
    before the last segment of what precedes the endpoint (``/v1/threads/x/messages``,
    another API's resource) — is not named."""
    if method.strip().upper() != "POST":
        return None
    normal = normalised(path.partition("?")[0])
    found = _split_endpoint(normal)
    if found is None:
        if (other := _other_api(normal)) is not None:
            return other
        found = next(((normal[: -len(e)], e, api) for e, api in _NAMED_ONLY.items() if normal.endswith(e)), None)
        if found is None:
            return None
    before = found[0]
    if prefix is not None and before == normalised(prefix):
        return found[1], found[2]
    head, _, last = before.rpartition("/")
    if not (_plain(head) and (last == "" or _NAME_SEGMENT.match(last))):
        return None
    return found[1], found[2]


# Other APIs' inference endpoints, which sessionpin never routes but a server may well serve
# (``named``): Bedrock's InvokeModel and Converse (``…/model/{id}/invoke``: Claude Code on
# Bedrock, or a gateway's prefix before it), Vertex's and Gemini's model methods
# (``…/models/{m}:streamRawPredict``: Claude Code on Vertex; ``:generateContent``: Gemini CLI),
# and the legacy completions (``/v1/complete``, ``/v1/completions``). Each with the api its
# body is read as: Claude's for Bedrock's and Vertex's (the Messages body less the model),
# chat's for the rest (their session, if any, is in the headers); Bedrock's CountTokens too
# (``…/model/{id}/count-tokens``). Matched on the path read as a
# lenient server reads it (``normalised``: an ARN's ``%2F`` decoded, lower case). A batch
# (``/v1/messages/batches``) is not: it holds many requests, none of them one conversation's turn.
_BEDROCK = frozenset({"invoke", "invoke-with-response-stream", "converse", "converse-stream", "count-tokens"})
_GOOGLE = frozenset({"streamrawpredict", "rawpredict", "streamgeneratecontent", "generatecontent", "counttokens"})
# ... and endpoints under a plain prefix as the routed ones: the legacy completions, and the
# Responses API's token count (``/v1/responses/input_tokens``: a conversation's whole input,
# as Anthropic's ``/messages/count_tokens``, which is routed).
_NAMED_ONLY = {"/complete": ANTHROPIC_MESSAGES, "/completions": OPENAI_CHAT,
               "/responses/input_tokens": OPENAI_RESPONSES}


def _other_api(normal: str) -> tuple[str, str] | None:
    """(endpoint, api) of a normalised path part that ends with another API's inference
    endpoint (``/invoke``, ``:streamrawpredict``…), else None. String scans, no regex: a
    hostile path costs one pass."""
    head, _, last = normal.rpartition("/")
    if last in _BEDROCK:
        at = head.find("/model/")        # the model id after it may hold a decoded ARN's ``/``
        if at != -1 and len(head) > at + len("/model/"):
            return "/" + last, ANTHROPIC_MESSAGES
        return None
    model, colon, method = last.rpartition(":")
    if colon and model and method in _GOOGLE and head.endswith("/models"):
        return ":" + method, ANTHROPIC_MESSAGES if method.endswith("rawpredict") else OPENAI_CHAT
    return None


def lookalike(method: str, path: str, prefix: str | None = None) -> tuple[str, str] | None:
    """(endpoint, api) of a POST whose path part, read as a lenient server reads it, ends with
    an inference endpoint that ``named`` leaves out: a version segment before the last segment
    of what precedes it, or a segment that is not a plain name (``/models/m@2025/messages``).
    Another API's resource (``/v1/threads/x/messages``), or a gateway's
    own versioned path before the agent's base (Cloudflare's ``/v1/ACCT/GW/anthropic/v1/messages``,
    Vertex's ``/v1/projects/P/locations/L/endpoints/openapi/chat/completions``): only the body
    tells them apart (the router's rule), never the path."""
    if method.strip().upper() != "POST":
        return None
    found = _split_endpoint(normalised(path.partition("?")[0]))
    if found is None or named(method, path, prefix) is not None:
        return None
    return found[1], found[2]


def guarded(method: str, path: str, prefix: str | None = None) -> str | None:
    """The api of a POST that the router guards without routing it (``named``, ``lookalike``),
    else None: its body must reach the router whole, for the router to read its pin."""
    found = named(method, path, prefix) or lookalike(method, path, prefix)
    return found[1] if found is not None else None


def endpoint_api(path: str) -> str:
    """The api of the endpoint a path ends with, read as a lenient server reads it, whatever
    comes before (``/../../v1/messages``: Anthropic's), else "other": the error format an
    ambiguous path's refusal is answered in."""
    found = _split_endpoint(normalised(path.partition("?")[0].replace("\\", "/")))
    return found[2] if found is not None else OTHER


def unrouted(method: str, path: str, prefix: str | None = None) -> str | None:
    """The part before the endpoint of a plain POST that ends with an inference endpoint and
    that ``scope`` does not take (and is no look-alike: no version segment before its last
    segment), else None."""
    if method.strip().upper() != "POST" or unsafe(path):
        return None
    p = path.partition("?")[0]
    found = _split_endpoint(p)
    if found is None or scope(method, path, prefix).inference:
        return None
    before = found[0]
    if prefix is not None and before == prefix:
        return before           # the server's own URL + an endpoint: never a look-alike
    head, _, last = before.rpartition("/")
    return before if _plain(head) and (last == "" or _NAME_SEGMENT.match(last)) else None
