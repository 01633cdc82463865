"""seeds/002 §5, branch by branch, with a fake clock and a scripted probe."""
from collections import Counter

import msgspec
import pytest

from fakegateway import FakeClock, ScriptedProbe
from sessionpin.opencode_ids import state
from sessionpin.opencode_ids.acquire import TargetState, acquire
from sessionpin.opencode_ids.options import PoolConfig
from sessionpin.opencode_ids.signals import ProbeResult
from sessionpin.store import open_store

P, M = "opencode-go", "deepseek-v4.1-flash"
KEY = state.binding_key("ses_1", P, M)
FAST = ProbeResult("fast", 200, 900, "upstream")
SLOW = ProbeResult("slow", 200, 20_000, "upstream")


@pytest.fixture
def env():
    clock = FakeClock()
    return open_store("memory:"), clock, TargetState(), Counter()


async def spare(store, sid, clock, *, ms=900, age_ms=0):
    await state.add_spare(store, P, M, sid, state.Spare(upstream_ms=ms, verified_at=clock.now - age_ms,
                                                        created_at=clock.now - age_ms))


async def run(env, probe, *, budget=0, cfg=PoolConfig(), key=KEY):
    store, clock, target, counters = env
    return await acquire(store, key, P, M, budget_ms=budget, cfg=cfg, clock=clock, probe=probe,
                         target=target, counters=counters)


async def test_live_binding_is_returned_and_touched_at_most_every_30s(env):
    store, clock, *_ = env
    probe = ScriptedProbe(clock)
    await spare(store, "s1", clock)
    first = await run(env, probe)
    assert first.how == "spare" and first.routed_id == "s1"
    clock.now += 10_000
    again = await run(env, probe)
    assert again.how == "binding" and again.routed_id == "s1"
    assert (await state.binding(store, KEY)).last_seen_at == clock.now - 10_000   # not rewritten yet
    clock.now += 25_000
    await run(env, probe)
    assert (await state.binding(store, KEY)).last_seen_at == clock.now
    assert probe.calls == []


async def test_fresh_spare_best_first_no_probe(env):
    store, clock, _, counters = env
    await spare(store, "slowish", clock, ms=2000)
    await spare(store, "best", clock, ms=700)
    await spare(store, "stale", clock, ms=100, age_ms=PoolConfig().ttl_ms + 1)
    probe = ScriptedProbe(clock)
    got = await run(env, probe)
    assert got.routed_id == "best" and got.how == "spare"
    assert set(await state.spares(store, P, M)) == {"slowish", "stale"}
    assert probe.calls == [] and counters["takes"] == 1


async def test_zero_budget_leaves_a_stale_spare_alone(env):
    store, clock, *_ = env
    await spare(store, "stale", clock, age_ms=PoolConfig().ttl_ms + 1)
    probe = ScriptedProbe(clock)
    assert await run(env, probe, budget=0) is None
    assert probe.calls == [] and "stale" in await state.spares(store, P, M)


async def test_stale_spare_verified_when_budget_allows(env):
    store, clock, *_ = env
    await spare(store, "stale", clock, age_ms=PoolConfig().ttl_ms + 1)
    probe = ScriptedProbe(clock, [FAST])
    got = await run(env, probe, budget=5000)
    assert got.routed_id == "stale" and got.how == "stale"
    assert probe.calls[0][0] == "stale" and probe.calls[0][1] == 5000   # the budget is the timeout
    assert await state.spares(store, P, M) == {}


async def test_stale_spare_no_longer_fast_is_dropped_then_new_ids_probed(env):
    store, clock, *_ = env
    await spare(store, "stale", clock, age_ms=PoolConfig().ttl_ms + 1)
    probe = ScriptedProbe(clock, [SLOW, FAST])
    got = await run(env, probe, budget=6000)
    assert got.how == "probe" and got.routed_id not in ("stale",)
    assert await state.spares(store, P, M) == {}                         # dropped, not put back
    assert (await state.binding(store, KEY)).routed_id == got.routed_id
    assert probe.calls[1][0] == got.routed_id                      # a new random id


@pytest.mark.parametrize("kind", ["unauthorized", "rejected", "overloaded"])
async def test_stale_spare_rejected_or_overloaded_ends_acquisition(env, kind):
    store, clock, target, _ = env
    await spare(store, "stale", clock, age_ms=PoolConfig().ttl_ms + 1)
    probe = ScriptedProbe(clock, [ProbeResult(kind, 401, 5, "upstream", retry_after_ms=30_000)])
    assert await run(env, probe, budget=10_000) is None
    assert len(probe.calls) == 1
    assert bool(target.blocked) == (kind != "overloaded")


async def test_probe_loop_binds_the_first_fast_id_which_never_enters_the_pool(env):
    store, clock, _, counters = env
    probe = ScriptedProbe(clock, [SLOW, SLOW, FAST], takes_ms=500)
    got = await run(env, probe, budget=10_000)
    assert got.how == "probe" and got.routed_id == probe.calls[2][0]
    assert len({c[0] for c in probe.calls}) == 3                   # a fresh id each time
    assert await state.spares(store, P, M) == {}
    assert counters["probes"] == 3 and counters["probes_slow"] == 2


async def test_probes_are_spaced_by_min_probe_interval(env):
    store, clock, *_ = env
    cfg = PoolConfig(min_probe_interval_ms=2000)
    probe = ScriptedProbe(clock, [SLOW, FAST], takes_ms=500)
    await run(env, probe, budget=10_000, cfg=cfg)
    assert probe.calls[1][2] - probe.calls[0][2] == 2000


async def test_budget_is_the_probe_timeout_and_no_probe_under_1500ms(env):
    store, clock, *_ = env
    probe = ScriptedProbe(clock, default=SLOW, takes_ms=1000)
    cfg = PoolConfig(min_probe_interval_ms=0)
    assert await run(env, probe, budget=4_200, cfg=cfg) is None
    timeouts = [c[1] for c in probe.calls]
    assert timeouts == [4200, 3200, 2200]                           # 1200 left: no fourth probe
    assert all(t >= 1500 for t in timeouts)


async def test_a_slow_shard_cannot_blow_the_budget(env):
    store, clock, *_ = env
    probe = ScriptedProbe(clock, default=SLOW, takes_ms=40_000)     # cut at its timeout
    start = clock.now
    assert await run(env, probe, budget=3000) is None
    assert clock.now - start == 3000 and len(probe.calls) == 1


@pytest.mark.parametrize("kind", ["unauthorized", "rejected"])
async def test_401_403_400_stop_probing_the_target(env, kind):
    store, clock, target, _ = env
    probe = ScriptedProbe(clock, [ProbeResult(kind, 401)], default=FAST)
    assert await run(env, probe, budget=10_000) is None
    assert len(probe.calls) == 1 and target.blocked
    assert await run(env, probe, budget=10_000) is None
    assert len(probe.calls) == 1                                   # blocked: no more probes


async def test_retry_after_is_honoured_inside_the_budget(env):
    store, clock, target, _ = env
    cfg = PoolConfig(min_probe_interval_ms=0)
    probe = ScriptedProbe(clock, [ProbeResult("overloaded", 429, retry_after_ms=2000), FAST], takes_ms=100)
    got = await run(env, probe, budget=10_000, cfg=cfg)
    assert got.how == "probe"
    assert probe.calls[1][2] - probe.calls[0][2] >= 2000 + 100


async def test_a_backoff_that_outlives_the_budget_stops_probing(env):
    store, clock, target, _ = env
    probe = ScriptedProbe(clock, [ProbeResult("overloaded", 429, retry_after_ms=60_000)], default=FAST)
    assert await run(env, probe, budget=10_000) is None
    assert len(probe.calls) == 1
    # ...and the next request inside the window does not probe either
    assert await run(env, probe, budget=10_000) is None
    assert len(probe.calls) == 1


async def test_dead_binding_is_retired_and_replaced(env):
    store, clock, _, counters = env
    await spare(store, "old", clock)
    await run(env, ScriptedProbe(clock))
    clock.now += PoolConfig().lease_ttl_ms + 1
    await spare(store, "new", clock)
    got = await run(env, ScriptedProbe(clock))
    assert got.routed_id == "new" and await state.is_retired(store, "old")
    assert counters["retired_idle"] == 1


async def test_struck_out_binding_is_not_alive(env):
    store, clock, *_ = env
    await spare(store, "a", clock)
    await run(env, ScriptedProbe(clock))
    b = await state.binding(store, KEY)
    await store.set(state.bind_key(KEY), state.encode(msgspec.structs.replace(b, failures=2)))
    await spare(store, "b", clock)
    assert (await run(env, ScriptedProbe(clock))).routed_id == "b"


async def test_lost_take_race_tries_the_next_spare(env):
    store, clock, _, counters = env
    await spare(store, "a", clock, ms=100)
    await spare(store, "b", clock, ms=200)
    real_claim = state.claim
    calls = []

    async def racing_claim(st, p, m, sid):
        calls.append(sid)
        if sid == "a":
            await real_claim(st, p, m, sid)   # another process wins "a" first
        return await real_claim(st, p, m, sid)

    state_claim, state.claim = state.claim, racing_claim
    try:
        got = await run(env, ScriptedProbe(clock))
    finally:
        state.claim = state_claim
    assert got.routed_id == "b" and calls == ["a", "b"] and counters["take_races_lost"] == 1


async def test_key_bound_meanwhile_keeps_that_binding_and_our_spare_goes_back(env):
    store, clock, _, counters = env
    await spare(store, "mine", clock)
    theirs = state.Binding(routed_id="theirs", provider=P, model=M, bound_at=clock.now, last_seen_at=clock.now)
    real_bind = state.bind

    async def late_bind(st, key, b):
        await real_bind(st, key, theirs)   # another process got there first
        return await real_bind(st, key, b)

    state.bind = late_bind
    try:
        got = await run(env, ScriptedProbe(clock))
    finally:
        state.bind = real_bind
    assert got.routed_id == "theirs" and got.how == "binding"
    assert "mine" in await state.spares(store, P, M) and counters["bind_conflicts"] == 1


async def test_a_spare_bound_before_is_dropped_and_the_next_one_taken(env):
    # a claim a crash lost: the id is among the spares again while its binding stands
    store, clock, _, counters = env
    await spare(store, "used", clock, ms=100)
    await spare(store, "next", clock, ms=200)
    other = state.Binding(routed_id="used", provider=P, model=M, bound_at=clock.now, last_seen_at=clock.now)
    assert await state.claim(store, P, M, "used")
    await state.bind(store, state.binding_key("ses_other", P, M), other)
    await store.hset(state.spare_key(P, M), "used", state.encode(state.Spare(upstream_ms=100, verified_at=clock.now,
                                                                              created_at=clock.now)))
    got = await run(env, ScriptedProbe(clock))
    assert got.routed_id == "next" and got.how == "spare"
    assert "used" not in await state.spares(store, P, M) and counters["spares_dropped"] == 1
