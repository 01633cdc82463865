"""A turn as OpenTelemetry's GenAI semantic conventions name it: the attributes of its span.

Pure: plain data in, a dict of attribute values out (the shell's ``proxy/otelspans.py`` hands
them to the SDK). Rules it keeps:
- Names from the GenAI conventions where they have one: ``gen_ai.operation.name`` ("chat"),
  ``gen_ai.provider.name`` ("anthropic" for Anthropic's Messages API, "openai" for chat and
  Responses — the wire format; the server that answered is ``sessionpin.server``),
  ``gen_ai.request.model``, ``gen_ai.response.model``, ``gen_ai.response.id``,
  ``gen_ai.conversation.id`` (the session), ``gen_ai.usage.input_tokens`` (inclusive of the
  cache, as the conventions say it SHOULD be, unlike Anthropic's own ``input_tokens``),
  ``gen_ai.usage.output_tokens``, ``gen_ai.usage.cache_read.input_tokens`` and
  ``gen_ai.usage.cache_creation.input_tokens``.
- What the conventions do not name is ``sessionpin.*``: the routing decision (rule, outcome,
  target, moved), the cache-write split by lifetime, reasoning tokens, the turn's limit, miss
  and reason.
- Ids, names and numbers only: never a prompt's text.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..reader import facts as F
from .ledger import Turn

PROVIDERS = {F.ANTHROPIC_MESSAGES: "anthropic", F.OPENAI_CHAT: "openai", F.OPENAI_RESPONSES: "openai"}
Value = str | int | float | bool


def span_name(turn: Turn) -> str:
    return f"chat {turn.model}" if turn.model else "chat"


def attributes(turn: Turn, session: str, agent: str, decision: Mapping[str, Any] | None = None,
               request_model: str | None = None) -> dict[str, Value]:
    u = turn.usage
    out: dict[str, Value] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": PROVIDERS.get(turn.api, turn.api),
        "gen_ai.conversation.id": session,
        "gen_ai.usage.input_tokens": u.input,
        "gen_ai.usage.output_tokens": u.output,
        "gen_ai.usage.cache_read.input_tokens": u.cache_read,
        "gen_ai.usage.cache_creation.input_tokens": u.cache_write,
        "sessionpin.agent": agent,
        "sessionpin.server": turn.server,
        "sessionpin.lane": turn.lane,
        "sessionpin.turn": turn.kind,
        "sessionpin.usage.cache_creation_5m.input_tokens": u.cache_write_5m,
        "sessionpin.usage.cache_creation_1h.input_tokens": u.cache_write_1h,
        "sessionpin.usage.reasoning.output_tokens": u.reasoning,
        "sessionpin.cache.miss": turn.miss,
    }
    if turn.model:
        out["gen_ai.response.model"] = turn.model
    if request_model:
        out["gen_ai.request.model"] = request_model
    if turn.id:
        out["gen_ai.response.id"] = turn.id
    if turn.limit is not None:
        out["sessionpin.cache.limit_tokens"] = turn.limit
    if turn.reason:
        out["sessionpin.cache.reason"] = turn.reason
    if turn.detail:
        out["sessionpin.cache.detail"] = turn.detail
    for key in ("rule", "outcome", "target", "why", "moved", "pool"):
        v = (decision or {}).get(key)
        if isinstance(v, (str, int, float, bool)) and v != "":
            out[f"sessionpin.decision.{key}"] = v
    return out


def metric_attributes(turn: Turn, request_model: str | None = None) -> dict[str, Value]:
    """The client metrics' attributes: few and bounded (no session, no id)."""
    out: dict[str, Value] = {"gen_ai.operation.name": "chat",
                             "gen_ai.provider.name": PROVIDERS.get(turn.api, turn.api),
                             "sessionpin.server": turn.server}
    if turn.model:
        out["gen_ai.response.model"] = turn.model
    if request_model:
        out["gen_ai.request.model"] = request_model
    return out


def request_attributes(decision: Mapping[str, Any], status: int | None) -> dict[str, Value]:
    """A request that gave no turn (refused, failed, answered without usage): its decision."""
    out: dict[str, Value] = {"gen_ai.operation.name": "chat"}
    api = decision.get("api")
    if api in PROVIDERS:
        out["gen_ai.provider.name"] = PROVIDERS[api]
    if isinstance(decision.get("session"), str):
        out["gen_ai.conversation.id"] = decision["session"]
    if isinstance(decision.get("agent"), str):
        out["sessionpin.agent"] = decision["agent"]
    if isinstance(decision.get("turn"), str):
        out["sessionpin.turn"] = decision["turn"]
    renamed = decision.get("model")
    if isinstance(renamed, list) and renamed and isinstance(renamed[0], str):
        out["gen_ai.request.model"] = renamed[0]
    if status is not None:
        out["http.response.status_code"] = status
    for key in ("rule", "outcome", "target", "why", "moved", "pool", "refusal"):
        v = decision.get(key)
        if isinstance(v, (str, int, float, bool)) and v != "":
            out[f"sessionpin.decision.{key}"] = v
    return out
