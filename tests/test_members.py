"""The allocation transaction and members' state in a real store (sessionpin/serverpools/members.py).

Three "proxies" are three store handles on one SQLite file (each its own connections and
writer thread, as three processes would have), each with its own per-pool lock as the
shell keeps one: their concurrent openings must come out exactly round-robin, one pin each.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from sessionpin.serverpools import allocate as A
from sessionpin.serverpools import members, quota
from sessionpin.records import pins
from sessionpin.config.config import parse
from sessionpin.records.pins import Loaded, Pin
from sessionpin.store import open_store
from stores import file_url, memory_url, redis_url, store_options  # noqa: F401

TEXT = '''
[servers.glm-a]
url = "https://a.example"
models = { "claude-*" = "glm-4.6" }
[servers.glm-b]
url = "https://b.example"
[servers.glm-c]
url = "https://c.example"
[pools.glm]
members = ["glm-a", "glm-b", "glm-c"]
[agents.claude-code]
server = "glm"
'''
CONFIG = parse(TEXT)
POOL = CONFIG.pools["glm"]
NONE = Loaded(None, None)


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        self.t += s

    def advance(self, s: float) -> None:     # the Redis fixtures make the same time pass for TTLs
        self.t += s


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
async def store(clock):
    s = open_store("memory:", clock=clock)
    yield s
    await s.close()


def template(t=1_800_000_000.0, agent="claude-code"):
    return Pin(agent=agent, server=None, since=t, renewed=t, rule="opening", turn="opening")


async def alloc(store, session, clock, pool=POOL, config=CONFIG, **kw):
    return await members.allocate(store, config, pool, session, template(clock()), kw.pop("seen", NONE),
                                  clock=clock, sleep=clock.sleep, **kw)


async def test_one_allocation_writes_pin_index_cursor_and_record_together(store, clock):
    got = await alloc(store, "s1", clock)
    assert isinstance(got, members.Allocated) and got.member == "glm-a"
    pin = (await pins.load(store, "s1")).pin
    assert pin == got.loaded.pin
    assert (pin.server, pin.pool, pin.models, pin.why) == ("glm-a", "glm", (("claude-*", "glm-4.6"),),
                                                           "pool glm: round-robin → glm-a")
    assert pin.at == "https://a.example"     # where the member is: ladder.moved compares it
    assert await members.cursor(store, "glm") == A.Cursor(1, POOL.revision)
    assert await members.active_counts(store, POOL.members, clock()) == {"glm-a": 1, "glm-b": 0, "glm-c": 0}
    history = await members.history(store, "glm")
    # the first allocation under this definition records the definition too (same moment)
    assert [(r.kind, r.member, r.session) for r in history] == [("config", "", ""), ("allocation", "glm-a", "s1")]
    assert history[0].rev == POOL.revision and history[0].previous == ""


async def test_a_pin_another_proxy_wrote_first_decides(store, clock):
    theirs = Pin(agent="claude-code", server="glm-c", since=clock(), renewed=clock())
    await pins.create(store, "s1", theirs)
    got = await alloc(store, "s1", clock)
    assert isinstance(got, members.Lost) and got.loaded.pin == theirs
    assert await members.cursor(store, "glm") == A.Cursor()       # nothing of ours was written


async def test_garbage_under_the_pin_is_allocated_over(store, clock):
    await store.set(pins.key("s1"), "{not a pin")
    got = await alloc(store, "s1", clock)
    assert isinstance(got, members.Allocated) and (await pins.load(store, "s1")).pin.server == "glm-a"


class Busy:
    """A real store whose cursor another allocator advances right after every read of it."""

    def __init__(self, store, times: int) -> None:
        self.store, self.times, self.bumps = store, times, 0

    def __getattr__(self, name):
        return getattr(self.store, name)

    async def mget(self, keys):
        values = await self.store.mget(keys)
        key = members.cursor_key("glm")
        if key in keys and self.bumps < self.times:
            self.bumps += 1
            c = A.decode_cursor(values[keys.index(key)])
            await self.store.set(key, A.encode_cursor(A.Cursor(c.n + 1, c.rev)))
        return values


async def test_conflicts_retry_then_succeed(store, clock):
    busy = Busy(store, members.MAX_CONFLICTS - 1)
    got = await alloc(busy, "s1", clock)
    assert isinstance(got, members.Allocated)
    # 19 others went first: the cursor stood at 19, this one took position 19 (19 % 3 = 1)
    assert got.member == "glm-b" and (await members.cursor(store, "glm")).n == 20


async def test_twenty_conflicts_are_an_actionable_refusal(store, clock):
    got = await alloc(Busy(store, 10_000), "s1", clock)
    assert isinstance(got, members.Refused)
    assert (got.status, got.kind, got.retry_after) == (503, "pool-contention", members.CONTENTION_RETRY)
    assert "s1" in got.message and "glm" in got.message and "Retry" in got.message
    assert (await pins.load(store, "s1")).pin is None


async def exhaust(store, clock, member, seconds):
    q = quota.observe(429, [("retry-after", str(seconds))], clock())
    await members.write_quota(store, member, q)


async def test_exhausted_members_get_no_new_allocations(store, clock):
    await exhaust(store, clock, "glm-a", 60)
    got = [(await alloc(store, f"s{i}", clock)).member for i in range(4)]
    assert got == ["glm-b", "glm-c", "glm-b", "glm-c"]


async def test_every_member_exhausted_waits_for_the_reset_within_the_limit(store, clock):
    for m, s in (("glm-a", 30), ("glm-b", 3), ("glm-c", 30)):
        await exhaust(store, clock, m, s)
    start = clock()
    got = await alloc(store, "s1", clock, deadline=start + 10)
    assert isinstance(got, members.Allocated) and got.member == "glm-b"
    assert 3 <= clock() - start <= 4


async def test_every_member_exhausted_past_the_limit_is_429_with_the_reset(store, clock):
    for m in POOL.members:
        await exhaust(store, clock, m, 30)
    start = clock()
    got = await alloc(store, "s1", clock, deadline=start + 10)
    assert isinstance(got, members.Refused)
    assert (got.status, got.kind, got.retry_after) == (429, "pool-exhausted", 30)
    assert clock() == start, "a reset beyond the limit is not waited for"
    assert (await pins.load(store, "s1")).pin is None


async def test_drained_members_and_side_choices(store, clock):
    assert await members.drain(store, "glm-a", clock()) and not await members.drain(store, "glm-a", clock())
    got = await alloc(store, "side", clock, commit=False)
    assert isinstance(got, members.Allocated) and got.member == "glm-b" and got.loaded.pin is None
    assert await members.cursor(store, "glm") == A.Cursor(), "a side request's choice writes nothing"
    assert (await alloc(store, "s1", clock)).member == "glm-b"
    assert await members.undrain(store, "glm-a", clock())
    assert (await alloc(store, "s2", clock)).member == "glm-c"
    assert (await alloc(store, "s3", clock)).member == "glm-a"
    for m in POOL.members:
        await members.drain(store, m, clock())
    got = await alloc(store, "s4", clock)
    assert isinstance(got, members.Refused) and got.status == 503 and "drained" in got.message
    kinds = [(r.kind, r.member) for r in await members.history(store)]
    assert ("drain", "glm-a") in kinds and ("undrain", "glm-a") in kinds


async def test_a_hard_pool_s_opening_moved_off_an_exhausted_member_says_so(store, clock):
    first = await alloc(store, "s1", clock)
    assert first.member == "glm-a"
    await exhaust(store, clock, "glm-a", 60)
    got = await members.allocate(store, CONFIG, POOL, "s1", template(clock()), first.loaded,
                                 exclude=frozenset({"glm-a"}), move_reason="out of quota before the opening began",
                                 clock=clock)
    assert got.member == "glm-b" and got.why == "hard: glm-a out of quota before the opening began → glm-b"
    assert (await pins.load(store, "s1")).pin.server == "glm-b"
    move = [r for r in await members.history(store, "glm") if r.kind == "move"]
    assert [(r.session, r.previous, r.member) for r in move] == [("s1", "glm-a", "glm-b")]


async def test_a_soft_move_replaces_the_pin_read_and_records_from_where(store, clock):
    soft = parse(TEXT.replace('members = ["glm-a", "glm-b", "glm-c"]',
                              'members = ["glm-a", "glm-b", "glm-c"]\naffinity = "soft"'))
    pool = soft.pools["glm"]
    first = await alloc(store, "s1", clock, pool=pool, config=soft)
    assert first.member == "glm-a"
    fresh = Pin(agent="claude-code", server=None, since=clock(), renewed=clock(), rule="soft-move")
    got = await members.allocate(store, soft, pool, "s1", fresh, first.loaded, exclude=frozenset({"glm-a"}),
                                 move_reason="unreachable", clock=clock)
    assert got.member == "glm-b" and got.why == "soft: glm-a unreachable → glm-b"
    assert (await pins.load(store, "s1")).pin.server == "glm-b"
    assert await members.active_counts(store, pool.members, clock()) == {"glm-a": 0, "glm-b": 1, "glm-c": 0}
    move = [r for r in await members.history(store, "glm") if r.kind == "move"]
    assert [(r.session, r.previous, r.member) for r in move] == [("s1", "glm-a", "glm-b")]
    # a move over a pin that changed meanwhile loses to it
    stale = await members.allocate(store, soft, pool, "s1", fresh, first.loaded, exclude=frozenset({"glm-a"}),
                                   move_reason="unreachable", clock=clock)
    assert isinstance(stale, members.Lost) and stale.loaded.pin.server == "glm-b"


async def test_a_changed_definition_is_recorded_once(store, clock):
    await alloc(store, "s1", clock)
    edited = parse(TEXT.replace('members = ["glm-a", "glm-b", "glm-c"]', 'members = ["glm-a", "glm-b"]'))
    pool = edited.pools["glm"]
    assert pool.revision != POOL.revision
    assert (await alloc(store, "s2", clock, pool=pool, config=edited)).member == "glm-b"
    assert (await alloc(store, "s3", clock, pool=pool, config=edited)).member == "glm-a"
    configs = [r for r in await members.history(store, "glm") if r.kind == "config"]
    assert [(r.previous, r.rev) for r in configs] == [("", POOL.revision), (POOL.revision, pool.revision)]
    assert (await pins.load(store, "s1")).pin.server == "glm-a", "running conversations stay"


async def test_three_proxies_on_one_file_allocate_exactly_round_robin(tmp_path):
    url = f"file:{tmp_path}/state.db"
    proxies = [open_store(url) for _ in range(3)]
    try:
        async def proxy(store, who: int) -> list[str]:
            lock = asyncio.Lock()     # the shell's per-pool lock: one allocation at a time per proxy

            async def opening(i: int) -> str:
                async with lock:
                    got = await members.allocate(store, CONFIG, POOL, f"p{who}-s{i}", template(), NONE)
                assert isinstance(got, members.Allocated), got
                return got.member
            return await asyncio.gather(*(opening(i) for i in range(10)))

        got = await asyncio.gather(*(proxy(s, i) for i, s in enumerate(proxies)))
        counts = Counter(m for per in got for m in per)
        assert counts == {"glm-a": 10, "glm-b": 10, "glm-c": 10}
        store = proxies[0]
        assert (await members.cursor(store, "glm")).n == 30
        records = [r for r in await members.history(store, "glm", limit=0) if r.kind == "allocation"]
        records.sort(key=lambda r: r.n)
        # in cursor order the members go a, b, c, a, b, c…: no member skipped or doubled
        assert [r.n for r in records] == list(range(30))
        assert [r.member for r in records] == ["glm-a", "glm-b", "glm-c"] * 10
        assert len({r.session for r in records}) == 30
        assert len([s async for s in pins.sessions(store)]) == 30
    finally:
        for s in proxies:
            await s.close()


async def _stored(store, member, q):
    """A quota state as an older proxy (without the bound) would have written it."""
    await store.set(members.quota_key(member), quota.encode(q), 3600)


async def test_a_far_exhaustion_in_the_store_is_read_clamped(store, clock):
    """A state written unbounded (issue 20: ``retry-after: 99999999``) keeps a member out of
    new allocations and defers its pinned turns for at most the bound."""
    far = quota.Quota(observed=clock(), status=429, headroom=0.0, exhausted_until=clock() + 99999999.0,
                      why="429, retry-after 1e+08s")
    await _stored(store, "glm-a", far)
    _, health = await members.state(store, POOL, clock())
    assert health["glm-a"].exhausted_until == clock() + quota.MAX_RESET
    got = await members.read_quota(store, "glm-a", clock(), max_reset=60.0)
    assert got.exhausted_until == clock() + 60.0 and "taken as 60s" in got.why
    assert (await members.quotas(store, ["glm-a"]))["glm-a"] == far            # the operator sees what is stored
    assert (await members.quotas(store, ["glm-a"], clock()))["glm-a"].exhausted_until == clock() + quota.MAX_RESET
    # past the bound it takes new conversations again
    clock.t += quota.MAX_RESET + 1
    got = [(await alloc(store, f"s{i}", clock)).member for i in range(3)]
    assert sorted(got) == ["glm-a", "glm-b", "glm-c"]


async def test_reset_forgets_a_member_s_state_and_records_it(store, clock):
    await exhaust(store, clock, "glm-a", 600)
    assert await members.reset(store, "glm-a", clock())
    assert await store.get(members.quota_key("glm-a")) is None
    assert await members.read_quota(store, "glm-a", clock()) is None
    assert not await members.reset(store, "glm-a", clock())         # nothing left: nothing written
    assert [(r.kind, r.member) for r in await members.history(store)] == [("reset", "glm-a")]
    got = [(await alloc(store, f"s{i}", clock)).member for i in range(3)]
    assert sorted(got) == ["glm-a", "glm-b", "glm-c"]


async def test_by_pool_counts_a_member_s_pins_per_pool_that_allocated_them(store, clock):
    for s in ("s1", "s2", "s3", "s4"):
        await alloc(store, s, clock)                           # glm-a, glm-b, glm-c, glm-a
    t = clock()
    await pins.create(store, "hand", Pin(agent="opencode", server="glm-a", since=t, renewed=t, rule="operator",
                                         turn="opening"))      # no pool's, another agent's group
    assert await members.by_pool(store, "glm-a", clock()) == {"glm": 2, "": 1}
    assert await members.by_pool(store, "glm-b", clock()) == {"glm": 1}
    assert await members.by_pool(store, "nobody", clock()) == {}


@pytest.fixture(params=["memory", "file", "redis"])
async def any_store(request, clock):
    url = request.getfixturevalue(f"{request.param}_url")
    s = open_store(url, **store_options(url, clock))
    yield s
    await s.close()


async def test_an_answer_sent_before_a_stored_exhaustion_never_shortens_it(any_store, clock):
    """Proxy 1 stores a 429 (60 s); proxy 0's success to a request sent before it lands
    after: not written. An answer to a request sent after the 429 is. (Every store kind:
    the write is a compare-and-set.)"""
    store = any_store
    t = clock()
    await exhaust(store, clock, "glm-a", 60)
    ok = quota.observe(200, [], t + 1)
    assert not await members.write_quota(store, "glm-a", ok, sent=t - 5)
    assert (await members.read_quota(store, "glm-a", t + 1)).exhausted_until == t + 60
    # a longer exhaustion from an older request still extends it (it only ever grows then)
    longer = quota.observe(429, [("retry-after", "120")], t + 1)
    assert await members.write_quota(store, "glm-a", longer, sent=t - 5)
    assert (await members.read_quota(store, "glm-a", t + 1)).exhausted_until == t + 121
    # a request sent after the state was observed: its success clears it
    assert await members.write_quota(store, "glm-a", quota.observe(200, [], t + 2), sent=t + 1.5)
    assert (await members.read_quota(store, "glm-a", t + 2)).exhausted_until == 0.0
