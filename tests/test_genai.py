"""A turn's span attributes, named by OpenTelemetry's GenAI conventions (input inclusive of the cache)."""

from sessionpin.reader import facts as F
from sessionpin.accounting.genai import attributes, metric_attributes, span_name
from sessionpin.accounting.ledger import Turn
from sessionpin.accounting.usage import Usage


def test_an_anthropic_turn_counts_its_input_inclusive_of_the_cache():
    turn = Turn(t=1.0, api=F.ANTHROPIC_MESSAGES, lane="main", kind="continuation", server="glm", model="glm-4.6",
                id="msg_1", usage=Usage(input=90_503, output=420, cache_read=90_000, cache_write_5m=200,
                                        cache_write_1h=300), limit=90_000, miss=False)
    a = attributes(turn, "sess-1", "claude-code", {"rule": "pinned", "outcome": "routed", "target": "glm",
                                                   "moved": True, "why": "pin", "model": ["a", "b"]},
                   "claude-opus-5-5")
    assert span_name(turn) == "chat glm-4.6"
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "anthropic"
    assert a["gen_ai.conversation.id"] == "sess-1" and a["gen_ai.response.id"] == "msg_1"
    assert a["gen_ai.request.model"] == "claude-opus-5-5" and a["gen_ai.response.model"] == "glm-4.6"
    assert a["gen_ai.usage.input_tokens"] == 90_503 and a["gen_ai.usage.output_tokens"] == 420
    assert a["gen_ai.usage.cache_read.input_tokens"] == 90_000
    assert a["gen_ai.usage.cache_creation.input_tokens"] == 500
    assert a["sessionpin.usage.cache_creation_1h.input_tokens"] == 300
    assert a["sessionpin.decision.rule"] == "pinned" and a["sessionpin.decision.moved"] is True
    assert "sessionpin.decision.model" not in a          # only plain values
    assert a["sessionpin.cache.limit_tokens"] == 90_000 and a["sessionpin.cache.miss"] is False
    assert all(isinstance(v, (str, int, float, bool)) for v in a.values())


def test_a_miss_and_an_openai_turn():
    turn = Turn(t=1.0, api=F.OPENAI_RESPONSES, server="openai", model="", usage=Usage(input=10, output=2,
                                                                                     reasoning=1),
                limit=None, miss=True, reason="idle", detail="idle 7 min")
    a = attributes(turn, "s", "codex")
    assert a["gen_ai.provider.name"] == "openai" and span_name(turn) == "chat"
    assert a["sessionpin.cache.reason"] == "idle" and a["sessionpin.usage.reasoning.output_tokens"] == 1
    assert "gen_ai.response.model" not in a and "sessionpin.cache.limit_tokens" not in a


def test_metric_attributes_are_few_and_bounded():
    turn = Turn(t=1.0, api=F.OPENAI_CHAT, server="kimi", model="kimi-k2", id="c1", usage=Usage(input=5))
    assert metric_attributes(turn, "k2") == {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
                                             "sessionpin.server": "kimi", "gen_ai.response.model": "kimi-k2",
                                             "gen_ai.request.model": "k2"}
