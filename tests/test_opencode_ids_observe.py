"""seeds/002 §6-7: real responses reset, strike or retire the binding of their id."""
from collections import Counter

import pytest

from sessionpin.opencode_ids import state
from sessionpin.opencode_ids.observe import observe
from sessionpin.opencode_ids.options import PoolConfig
from sessionpin.store import open_store

P, M, KEY = "opencode", "m", "conv::opencode::m"
NOW = 1_794_000_000_000
CFG = PoolConfig()


@pytest.fixture
async def store():
    s = open_store("memory:")
    await state.bind(s, KEY, state.Binding(routed_id="r", provider=P, model=M, bound_at=NOW, last_seen_at=NOW,
                                           upstream_ms=900, verified_at=NOW))
    return s


async def obs(store, status=200, timing="upstream;dur=1000", at=NOW, rid="r", counters=None):
    return await observe(store, KEY, rid, status, timing, CFG, at, counters if counters is not None else Counter())


async def test_healthy_response_persists_at_most_every_5s(store):
    assert await obs(store, at=NOW + 1000) == "healthy"
    assert (await state.binding(store, KEY)).last_seen_at == NOW          # not written within 5 s
    assert await obs(store, timing="upstream;dur=1234", at=NOW + 5000) == "healthy"
    b = await state.binding(store, KEY)
    assert (b.last_seen_at, b.upstream_ms, b.verified_at) == (NOW + 5000, 1234, NOW + 5000)


async def test_one_strike_then_reset_then_strikes_retire(store):
    c = Counter()
    assert await obs(store, timing="upstream;dur=6500", counters=c) == "strike"
    assert (await state.binding(store, KEY)).failures == 1
    assert await obs(store, timing="upstream;dur=900", at=NOW + 1) == "healthy"
    assert (await state.binding(store, KEY)).failures == 0                 # a strike clears at once
    await obs(store, timing="upstream;dur=6000", counters=c)
    assert await obs(store, timing="upstream;dur=7000", counters=c) == "retire"
    assert await state.binding(store, KEY) is None and await state.is_retired(store, "r")
    assert c["retired_strikes"] == 1 and c["strikes"] == 2


@pytest.mark.parametrize("status,timing,reason", [(200, "upstream;dur=8000", "quarantine"),
                                                  (200, "upstream;dur=43000", "quarantine"),
                                                  (429, None, "429")])
async def test_quarantine_threshold_or_429_retires_at_once(store, status, timing, reason):
    c = Counter()
    assert await obs(store, status=status, timing=timing, counters=c) == "retire"
    assert await state.binding(store, KEY) is None and c[f"retired_{reason}"] == 1


async def test_no_server_timing_only_keeps_the_lease(store):
    assert await obs(store, timing=None, at=NOW + 6000) == "healthy"
    b = await state.binding(store, KEY)
    assert b.last_seen_at == NOW + 6000 and b.upstream_ms == 900


async def test_response_for_an_id_no_longer_bound_changes_nothing(store):
    assert await obs(store, rid="other", status=429) == "unbound"
    assert (await state.binding(store, KEY)).routed_id == "r"
