"""seeds/002 §8: prune, re-verify stale spares only, refill to size, <= 2 x size probes."""
from collections import Counter

import asyncio
import pytest

from fakegateway import FakeClock, ScriptedProbe
from sessionpin.opencode_ids import state
from sessionpin.opencode_ids.acquire import TargetState
from sessionpin.opencode_ids.options import PoolConfig
from sessionpin.opencode_ids.refresh import Plan, cycle, refill_target
from sessionpin.opencode_ids.signals import ProbeResult
from sessionpin.store import open_store

P, M = "opencode-go", "kimi"
FAST = ProbeResult("fast", 200, 800, "upstream")
SLOW = ProbeResult("slow", 200, 20_000, "upstream")
CFG = PoolConfig(size=2, min_probe_interval_ms=0)


@pytest.fixture
def env():
    return open_store("memory:"), FakeClock(), TargetState(), Counter()


async def refill(env, probe, cfg=CFG):
    store, clock, target, counters = env
    return await refill_target(store, P, M, probe, target, cfg, clock, counters)


async def test_refills_to_size(env):
    store, clock, *_ = env
    probe = ScriptedProbe(clock, [SLOW, FAST, SLOW, FAST])
    assert await refill(env, probe) == 4
    assert len(await state.spares(store, P, M)) == 2


async def test_at_most_two_times_size_probes_a_cycle(env):
    store, clock, *_ = env
    probe = ScriptedProbe(clock, default=SLOW)
    assert await refill(env, probe) == 4 and await state.spares(store, P, M) == {}


async def test_full_pool_sends_nothing_and_bound_ids_are_never_probed(env):
    store, clock, _, counters = env
    for sid in ("a", "b"):
        await state.add_spare(store, P, M, sid, state.Spare(upstream_ms=900, verified_at=clock.now, created_at=clock.now))
    await state.bind(store, "c::p::m", state.Binding(routed_id="bound", provider=P, model=M, bound_at=clock.now,
                                                     last_seen_at=clock.now))
    probe = ScriptedProbe(clock)
    assert await refill(env, probe) == 0 and probe.calls == []


async def test_stale_spares_reverified_or_dropped(env):
    store, clock, _, counters = env
    old = clock.now - CFG.ttl_ms - 1
    for sid in ("keep", "drop"):
        await state.add_spare(store, P, M, sid, state.Spare(upstream_ms=900, verified_at=old, created_at=old))
    probe = ScriptedProbe(clock, [lambda sid: FAST if sid == "keep" else SLOW] * 2 + [FAST])
    await refill(env, probe)
    spares = await state.spares(store, P, M)
    assert "keep" in spares and spares["keep"].verified_at > old and "drop" not in spares
    assert [c[0] for c in probe.calls][:2] == sorted(["keep", "drop"]) or {c[0] for c in probe.calls[:2]} == {"keep", "drop"}
    assert len(spares) == 2 and counters["spares_reverified"] == 1 and counters["spares_dropped"] == 1


async def test_cancelled_mid_probe_puts_the_claimed_spare_back(env):
    store, clock, target, counters = env
    old = clock.now - CFG.ttl_ms - 1
    await state.add_spare(store, P, M, "s", state.Spare(upstream_ms=900, verified_at=old, created_at=old))
    started = asyncio.Event()

    async def hang(sid, timeout):
        started.set()
        await asyncio.sleep(3600)

    task = asyncio.ensure_future(refill_target(store, P, M, hang, target, CFG, clock, counters))
    await started.wait()
    assert await state.spares(store, P, M) == {}          # claimed while probing
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "s" in await state.spares(store, P, M)


async def test_blocked_or_backing_off_target_is_not_probed(env):
    store, clock, target, _ = env
    probe = ScriptedProbe(clock)
    target.blocked = "HTTP 401"
    assert await refill(env, probe) == 0
    target.blocked, target.backoff_until = "", clock.now + 10_000
    assert await refill(env, probe) == 0 and probe.calls == []


async def test_cycle_prunes_then_refills_every_target(env):
    store, clock, target, counters = env
    cfg = PoolConfig(size=1, min_probe_interval_ms=0, lease_ttl_ms=1000)
    await state.bind(store, "old::p::m", state.Binding(routed_id="gone", provider=P, model=M,
                                                       bound_at=clock.now - 5000, last_seen_at=clock.now - 5000))
    probe = ScriptedProbe(clock)
    plan = Plan([((P, M), probe, target), ((P, "other"), probe, TargetState())])
    sent = await cycle(lambda: store, plan, cfg, clock, counters)
    assert sent == 2 and counters["retired_idle"] == 1 and await state.is_retired(store, "gone")
    assert len(await state.spares(store, P, M)) == 1 and len(await state.spares(store, P, "other")) == 1
