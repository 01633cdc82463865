"""Rewriting: the exact changes that send one request to its decided server.

``plan(decision, request, source, config, env)`` is pure (the environment is passed in)
and returns ``Changes``; the addon applies them all or none. Rules it keeps:
- A move maps the endpoint, not the string: scheme, host and port are the target's, and
  the path is the target's API base (``Server.base``: ``/v1``, ``/zen/v1``,
  ``/api/anthropic/v1``…) + the endpoint the request named (``/messages``…), whatever
  prefix the client put before it — Claude Code's ``/v1/messages`` reaches a server written
  ``…/zen/v1`` at ``/zen/v1/messages``, pi's ``/zen/v1/chat/completions`` a bare origin at
  ``/v1/chat/completions``. A target with the source's own URL (pool members sharing one)
  keeps the path as sent. Only an exact inference path moves (``paths.scope``): any other
  path, or an ambiguous one (dot segments, encoded separators…), is refused, never sent
  under another server's key.
- **An agent's credentials never reach a server other than the one it addressed.**
  A request going to another server keeps only the headers and query parameters
  ``headers.py`` allows (what the target's API needs and the agent's own ids, never a
  value that looks like a key) and gets the target's key, read from its ``key_env``, as
  ``x-api-key: K`` or ``authorization: Bearer K`` (the server's ``auth``, else the style
  the agent used, else the api's own).
- A target with no ``key_env`` only receives requests addressed to its own origin
  (the agent's ``x-api-key``/``authorization`` are for it, and stay); anything else is
  refused, never sent with a wrong key. So is a target whose ``key_env`` is unset or
  empty in the proxy's environment. Both are the operator's to fix (``Changes.operator``):
  answered so that no client retries them.
- A request that stays on the server it addressed keeps its headers as they are.
- ``models``: only the top-level ``"model"`` value changes, in place; every other byte
  of the body is the agent's (re-serialising breaks thinking signatures). A body whose
  model cannot be located exactly is refused rather than sent unmapped, and so is a body
  the reader could not read (``unreadable``: unknown content-encoding, too large, too
  deep…) when the target renames models, whether the request moves or stays.
- A refusal's message never carries a key: it names servers and variables, and is
  scrubbed (``redact.scrub``) before it leaves.
"""

from __future__ import annotations

from typing import Mapping

import msgspec

from ..reader import facts as F
from . import headers as H
from ..reader import paths
from ..reader.modelspan import ModelNotFound, _decode_str, _laid_out, _walk, model_span  # noqa: F401 (its API)
from ..config.config import Config, Server
from .ladder import Decision
from ..config.redact import scrub

# The agent's own credential headers: kept when the target is the origin they are for.
AGENT_CREDENTIALS = ("x-api-key", "authorization")


class RequestView(msgspec.Struct, frozen=True):
    """What rewriting needs to know about a request (all plain data)."""
    scheme: str
    host: str
    port: int
    path: str                                   # path and query, as sent
    headers: tuple[tuple[str, str], ...] = ()   # (name, value) as sent
    body: bytes | None = None                   # decoded body (only needed to map the model)
    api: str = F.OTHER
    model: str | None = None                    # the body's top-level model, from the reader
    unreadable: str | None = None               # why the reader could not read the body
    model_span: tuple[int, int] | None = None   # where the reader found the model in ``body``
                                                # (facts.reason when not facts.parsed), else None


class Changes(msgspec.Struct, frozen=True):
    scheme: str
    host: str
    port: int
    path: str
    drop_headers: tuple[str, ...] = ()          # lower-case names to remove (all values)
    set_headers: tuple[tuple[str, str], ...] = ()
    body: bytes | None = None                   # the new decoded body, when the model changed
    model: tuple[str, str] | None = None        # (as sent, as forwarded)
    refuse: str | None = None                   # why the request must not be sent (502)
    # The refusal is the config's or the proxy's environment's (no key for the target): only
    # the operator can change it, so no client may retry it (``answers.NO_RETRY_STATUS``).
    operator: bool = False


def auth_style(server: Server, request: RequestView) -> str:
    if server.auth:
        return server.auth
    names = {n.lower(): v for n, v in request.headers}
    if "x-api-key" in names:
        return "x-api-key"
    if names.get("authorization", "").lower().startswith("bearer "):
        return "bearer"
    return "x-api-key" if request.api in (F.ANTHROPIC_MESSAGES, F.ANTHROPIC_COUNT_TOKENS) else "bearer"


def _refused(request: RequestView, why: str, operator: bool = False) -> Changes:
    return Changes(request.scheme, request.host, request.port, request.path, refuse=scrub(why), operator=operator)


def plan(decision: Decision, request: RequestView, source: Server | None, config: Config,
         env: Mapping[str, str]) -> Changes:
    if decision.target is None:
        raise ValueError("plan() is for a decision with a target")
    target = config.servers.get(decision.target)
    if target is None:
        return _refused(request, f"server {decision.target!r} is not configured")

    # The origin, path and headers of the request as it leaves: its own unless it moves. The
    # Changes are built once, at the end (a request that stays reads none of its headers).
    scheme, host, port, path = request.scheme, request.host, request.port, request.path
    drop: tuple[str, ...] = ()
    add: tuple[tuple[str, str], ...] = ()
    if source is None or target.name != source.name:
        # Only an exact inference path moves (a request to an origin no longer configured,
        # its session pinned elsewhere, too), to the target's own path for that endpoint.
        where = paths.scope("POST", request.path, source.prefix if source else None)
        if where.refuse:
            return _refused(request, f"not sent to server {target.name}: {where.refuse}")
        if not where.inference:
            return _refused(request, f"not sent to server {target.name}: not an inference endpoint"
                                     + (f" of {source.name}'s API" if source else ""))
        # Only the allowed query parameters go (``?key=…``, as some APIs take, is a credential).
        if source is not None and (source.origin, source.prefix) == (target.origin, target.prefix):
            path = H.query_for_move(request.path)     # the same API: the client's path is its own
        else:
            path = target.base_for(where.endpoint) + H.query_for_move(where.endpoint)   # endpoint starts with "/"
        if target.key_env:
            key = env.get(target.key_env, "").strip()
            if not key:
                return _refused(request, f"server {target.name}: {target.key_env} is not set in the proxy's "
                                         f"environment (set it where the proxy runs and restart the proxy: its "
                                         f"environment is read at start)", operator=True)
            drop = H.dropped_for_move(request.headers)
            if auth_style(target, request) == "x-api-key":
                add = (("x-api-key", key),)
            else:
                add = (("authorization", f"Bearer {key}"),)
        elif source is None or target.origin != source.origin:
            addressed = source.origin if source else f"{request.scheme}://{request.host}:{request.port}"
            return _refused(
                request,
                f"server {target.name} has no key_env, so it only takes requests addressed to {target.origin}; "
                f"this one was addressed to {addressed} (set servers.{target.name}.key_env)", operator=True,
            )
        else:
            # Another prefix of the same origin: the agent's key was for this origin and stays;
            # everything else is held to the allowlist like any move.
            drop = H.dropped_for_move(request.headers, keep=AGENT_CREDENTIALS)
        scheme, host, port = target.scheme, target.host, target.port

    body = model = None
    if target.models and request.model is None and request.unreadable:
        # The model may need renaming and cannot be known: never forwarded unmapped.
        return _refused(request, f"cannot rename the model for server {target.name}: the request body "
                                 f"could not be read ({request.unreadable[:120]})")
    if request.model is not None and target.models:
        mapped = target.map_model(request.model)
        if mapped != request.model:
            try:
                body = replace_model(request.body or b"", request.model, mapped, request.model_span)
            except ModelNotFound as e:
                return _refused(request, f"cannot rename model for server {target.name}: {e}")
            model = (request.model, mapped)
    return Changes(scheme, host, port, path, drop, add, body, model)


def replace_model(body: bytes, old: str, new: str, span: tuple[int, int] | None = None) -> bytes:
    """``body`` with its top-level model ``old`` renamed ``new``, every other byte as sent.
    ``span`` is where the reader found the model (facts.model_span: it walked the body's
    top-level members up to the messages, duplicates refused), saving a second read."""
    start, end = span if span is not None else model_span(body)
    try:
        found = _decode_str.decode(body[start:end]) if 0 <= start < end <= len(body) else None
    except msgspec.DecodeError:
        found = None
    if found != old:
        raise ModelNotFound("the body's model is not the one read")
    # One allocation and one copy: ``a + b + c`` would copy the tail twice (a megabyte body
    # costs a fresh buffer, page faults included, per copy).
    view = memoryview(body)
    return b"".join((view[:start], msgspec.json.encode(new), view[end:]))


