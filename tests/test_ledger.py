"""The ledger's figures: limits, misses and their reasons; its records in a real store, summed."""

import json

import msgspec
import pytest

from sessionpin.reader import facts as F
from sessionpin.accounting import ledger
from sessionpin.accounting.ledger import Turn, assess, prior_of
from sessionpin.reader.promptshape import shape
from sessionpin.store import open_store
from sessionpin.accounting.usage import Diagnostic, Usage
from stores import file_url, memory_url, redis_cluster_url, redis_url, store_url  # noqa: F401

TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}}]


def request(n: int, model: str = "claude-opus-5-5", tools=TOOLS, system="sys", edit: int | None = None):
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}" + ("!" if i == edit else "")}
            for i in range(n)]
    return shape(json.dumps({"model": model, "tools": tools, "system": system, "messages": msgs}).encode(),
                 F.ANTHROPIC_MESSAGES)


def answered(t: float, read: int, total: int = 10_000, server: str = "anthropic", model: str = "claude-opus-5-5",
             write_1h: int = 0) -> Turn:
    return Turn(t=t, api=F.ANTHROPIC_MESSAGES, server=server, model=model,
                usage=Usage(input=total, output=100, cache_read=read, cache_write_1h=write_1h))


def chain(*steps):
    """Assess turns one after another like the proxy does: (turn, started, shape, diagnostic)."""
    prior = prior_shape = None
    out = []
    for turn, started, s, diag in steps:
        got = assess(turn, started, s, prior, prior_shape, diag)
        prior, prior_shape = prior_of(got, s, prior), s
        out.append(got)
    return out


def test_a_first_turn_has_no_limit_and_a_continued_history_hits():
    first, second = chain((answered(10, 0, 8_000), 0, request(2), None),
                          (answered(20, 8_000, 9_000), 15, request(4), None))
    assert first.limit is None and not first.miss and first.reason == "first_turn"
    assert second.limit == 8_000 and not second.miss and second.reason == "" and second.efficiency == 1.0


@pytest.mark.parametrize("change,reason,detail", [
    (dict(model="claude-sonnet-5"), "model_changed", "from claude-opus-5-5"),
    (dict(tools=TOOLS * 2), "tools_changed", ""),
    (dict(system="another"), "system_changed", ""),
    (dict(edit=1), "messages_changed", "at message 1"),
])
def test_each_change_is_the_reason_of_its_miss(change, reason, detail):
    model = change.get("model", "claude-opus-5-5")
    _, second = chain((answered(10, 0, 8_000), 0, request(3), None),
                      (answered(20, 0, 9_000, model=model), 15, request(5, **change), None))
    assert second.miss and second.reason == reason and second.detail == detail
    assert second.limit < 8_000


def test_a_move_to_another_server_and_an_idle_gap():
    moved = chain((answered(10, 0, 8_000), 0, request(3), None),
                  (answered(20, 0, 9_000, server="glm"), 15, request(5), None))[1]
    assert moved.miss and moved.reason == "server_changed" and moved.detail == "from anthropic" and moved.limit == 0
    idle = chain((answered(10, 0, 8_000), 0, request(3), None),
                 (answered(1000, 0, 9_000), 400, request(5), None))[1]
    assert idle.miss and idle.reason == "idle" and idle.detail.startswith("idle 6 min") and idle.limit == 8_000
    # a lane that wrote 1-hour cache keeps it for an hour: 400 s idle is no reason then
    unexplained = chain((answered(10, 0, 8_000, write_1h=7_000), 0, request(3), None),
                        (answered(1000, 0, 9_000), 400, request(5), None))[1]
    assert unexplained.miss and unexplained.reason == "unknown"


def test_the_providers_diagnostic_comes_first_and_the_proxys_detail_stays():
    second = chain((answered(10, 0, 8_000), 0, request(3), None),
                   (answered(20, 100, 9_000), 15, request(5, edit=2),
                    Diagnostic(reason="messages_changed", missed=7000)))[1]
    assert second.reason == "messages_changed" and second.detail == "at message 2; provider: messages_changed"
    # a diagnostic that names no change leaves the proxy's reason
    other = chain((answered(10, 0, 8_000), 0, request(3), None),
                  (answered(20, 0, 9_000), 15, request(5, tools=[]), Diagnostic(reason="unavailable")))[1]
    assert other.reason == "tools_changed" and other.detail == "provider: unavailable"


def test_short_prompts():
    # under 1,024 tokens no provider caches: nothing to miss
    tiny = chain((answered(10, 0, 900), 0, request(3), None), (answered(20, 0, 1_000), 15, request(5), None))[1]
    assert not tiny.miss and tiny.limit == 0
    # under 4,096 some models do not: said when nothing else explains the miss
    short = chain((answered(10, 0, 3_000), 0, request(3), None), (answered(20, 0, 3_200), 15, request(5), None))[1]
    assert short.miss and short.reason == "too_short" and "3000 tokens" in short.detail
    moved = chain((answered(10, 0, 3_000), 0, request(3), None),
                  (answered(20, 0, 3_200, server="glm"), 15, request(5), None))[1]
    assert moved.reason == "server_changed"


def test_a_small_drop_is_no_miss():
    second = chain((answered(10, 0, 10_000), 0, request(3), None),
                   (answered(20, 8_500, 11_000), 15, request(5), None))[1]
    assert not second.miss and second.efficiency == 0.85


def test_the_stored_compact_prior_says_whether_the_history_was_rewritten():
    first = answered(10, 0, 8_000)
    stored = prior_of(first, request(3), None)
    stored = ledger.decode_prior(json.dumps(json.loads(ledger._turn_encoder.encode(stored))))
    grown = assess(answered(20, 8_000, 9_000), 15, request(5), stored)
    assert not grown.miss and grown.limit == 8_000
    rewritten = assess(answered(20, 0, 9_000), 15, request(5, edit=1), stored)
    assert rewritten.reason == "messages_changed" and rewritten.detail == "before message 3"


def test_lanes():
    assert ledger.lane_of(F.CLAUDE_CODE, F.SUBAGENT, None, {"x-claude-code-agent-id": "a1"}) == "agent:a1"
    assert ledger.lane_of(F.CODEX, F.CONTINUATION, None, {"thread-id": "t"}) == "thread:t"
    assert ledger.lane_of(F.OPENCODE, F.SIDE, "nano", {}) == "side:nano"
    assert ledger.lane_of(F.PI, F.CONTINUATION, "m", {}) == "main"


@pytest.fixture
async def store(store_url):
    s = open_store(store_url)     # every kind: memory, file, Redis, Redis Cluster (tests/stores.py)
    yield s
    await s.close()


async def test_the_store_sums_what_each_turn_reported(store):
    turns = chain((answered(10, 0, 8_000, write_1h=7_000), 0, request(3), None),
                  (answered(20, 7_000, 9_000), 15, request(5), None),
                  (answered(30, 0, 10_000, server="glm"), 25, request(7), None))
    prior = None
    for t in turns:
        prior = prior_of(t, None, prior)
        assert await store.apply([], ledger.writes("s1", F.CLAUDE_CODE, t, prior))
    s = await ledger.load(store, "s1")
    assert s.agent == F.CLAUDE_CODE and s.turns == 3 and s.misses == 1 and s.reasons == {"server_changed": 1}
    assert s.by[("anthropic", "claude-opus-5-5")] == Usage(input=17_000, output=200, cache_read=7_000,
                                                           cache_write_1h=7_000)
    assert s.by[("glm", "claude-opus-5-5")] == Usage(input=10_000, output=100)
    assert s.usage == turns[0].usage + turns[1].usage + turns[2].usage
    assert s.limit == 8_000 and s.within == 7_000 and s.efficiency == 7_000 / 8_000
    back = await ledger.turns(store, "s1")
    assert back == turns
    assert await ledger.load_prior(store, "s1", "main") == prior
    assert await ledger.load(store, "nothing") is None


def test_a_bad_ledger_hash_reads_what_it_can():
    s = ledger.summary({"turns": "x", "a|m|input": "5", "a|m|bogus": "1", "weird": "1", "miss:idle": "2"})
    assert s.turns == 0 and s.by == {("a", "m"): Usage(input=5)} and s.reasons == {"idle": 2}


async def test_a_long_conversation_keeps_its_last_turns_and_whole_sums(store):
    prior = None
    for i in range(12):
        t = Turn(t=100.0 + i, api=F.ANTHROPIC_MESSAGES, server="a", model="m", id=f"msg_{i}", usage=Usage(input=10))
        prior = prior_of(t, None, prior)
        await store.apply([], ledger.writes("long", "pi", t, prior))
    assert await ledger.trim(store, "long", keep=5) == 7
    assert [t.id for t in await ledger.turns(store, "long")] == [f"msg_{i}" for i in range(7, 12)]
    assert (await ledger.load(store, "long")).usage == Usage(input=120)
    assert await ledger.trim(store, "long", keep=5) == 0


def test_a_batchs_writes_are_folded_to_the_same_sums_in_fewer_operations():
    """Three turns of one conversation and one of another, in one batch: each (key, field) is
    incremented once by the sum, each hash field set once to its last value, every turn's
    record kept; applied to a store, the same ledger as the unfolded writes."""
    import asyncio

    def turn(i: int, server: str = "glm", model: str = "glm-4.6", read: int = 0) -> ledger.Turn:
        return ledger.Turn(id=f"m{i}", t=1000.0 + i, api="anthropic-messages", lane="main", server=server,
                           model=model, usage=Usage(input=100 + read, output=10, cache_read=read),
                           limit=read or None, miss=False)
    def prior(i: int) -> ledger.Prior:          # each turn leaves its own: the last one's stays
        return ledger.Prior(t=float(i), model="glm-4.6", server="glm", input=100 * i)
    turns = [("s1", "claude-code", turn(1)), ("s1", "claude-code", turn(2, read=90)),
             ("s2", "pi", turn(3, server="alt")), ("s1", "claude-code", turn(4, read=95))]
    turns.append(("s1", "claude-code", msgspec.structs.replace(turn(5, read=1), miss=True, reason="idle", limit=95)))
    raw = [w for i, (s, a, t) in enumerate(turns) for w in ledger.writes(s, a, t, prior(i))]
    batch = ledger.Batch()
    for i, (s, a, t) in enumerate(turns):
        batch.add(s, a, t, prior(i))
    folded = batch.writes()
    assert len(folded) < len(raw)
    assert len([w for w in folded if type(w).__name__ == "ZAdd"]) == 5
    assert len({(w.key, w.field) for w in folded if type(w).__name__ != "ZAdd"}) == len(folded) - 5

    async def applied(writes):
        store = open_store("memory:")
        try:
            await store.apply([], writes)
            return ([await ledger.load(store, s) for s in ("s1", "s2")],
                    [await ledger.turns(store, s) for s in ("s1", "s2")],
                    [await ledger.load_prior(store, s, "main") for s in ("s1", "s2")])
        finally:
            await store.close()
    got = asyncio.run(applied(folded))
    assert got == asyncio.run(applied(raw))
    summaries, turns, priors = got
    assert summaries[0].turns == 4 and summaries[1].turns == 1 and [len(t) for t in turns] == [4, 1]
    assert summaries[0].misses == 1 and summaries[0].reasons == {"idle": 1}
    assert [p.input for p in priors] == [400, 200]          # each lane's last turn's


async def test_no_turn_adds_more_than_a_bounded_amount_to_any_sum(store):
    """The store's sums are int64 (Redis ``HINCRBY``): a turn adds at most ``MAX_ADD`` to each,
    whatever its figures say (a ``Usage`` made elsewhere, a limit from a stored record another
    version wrote), so a conversation's sums need more than 10**9 turns to pass 2**63-1."""
    big = 2**63 - 1
    t = Turn(t=1.0, api=F.ANTHROPIC_MESSAGES, server="glm", model="m", lane="main",
             usage=Usage(input=big, output=big, cache_read=big, reasoning=big), limit=big)
    prior = prior_of(t, None, None)
    for _ in range(2):                       # twice: a second turn over the first overflowed before
        assert await store.apply([], ledger.writes("s1", F.CLAUDE_CODE, t, prior))
    sums = await store.hgetall(ledger.key("s1"))
    assert int(sums["glm|m|input"]) == 2 * ledger.MAX_ADD and int(sums["limit"]) == 2 * ledger.MAX_ADD
    assert all(int(v) <= 2 * ledger.MAX_ADD for f, v in sums.items() if f != "agent" and not f.startswith("lane:"))
    assert (2**63 - 1) // ledger.MAX_ADD > 10**9
