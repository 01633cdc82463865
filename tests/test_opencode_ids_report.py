"""The pool's views for the CLI and the status endpoints: plain data, no secrets, no writes."""
import json
from collections import Counter

from sessionpin.opencode_ids import report, state
from sessionpin.store import identity, open_store

NOW = 1_794_000_000_000
TTL = 1_800_000


async def filled():
    store = open_store("memory:")
    await state.add_spare(store, "opencode-go", "kimi", "fresh-1", state.Spare(upstream_ms=800, verified_at=NOW - 1000,
                                                                                 created_at=NOW - 1000))
    await state.add_spare(store, "opencode-go", "kimi", "stale-1", state.Spare(upstream_ms=500, verified_at=NOW - TTL - 1,
                                                                                 created_at=NOW - TTL - 1))
    await state.bind(store, state.binding_key("ses_a", "opencode", "big"), state.Binding(
        routed_id="bound-1", provider="opencode", model="big", bound_at=NOW - 60_000, last_seen_at=NOW - 5_000,
        upstream_ms=1200, failures=1, origin="spare"))
    await state.bind(store, "old", state.Binding(routed_id="gone-1", provider="opencode", model="big",
                                                 bound_at=NOW, last_seen_at=NOW))
    await state.retire(store, "old", "gone-1", NOW)
    await store.set(state.bind_key("junk"), "{not json")
    return store


async def dump(store):
    out = {}
    for k in await store.keys(""):
        hashed = k.startswith(state.SPARE_PREFIX) or k == identity.MADE_KEY     # (each binding counts one pin made)
        out[k] = await store.hgetall(k) if hashed else await store.get(k)
    return out


async def test_snapshot_groups_by_provider_and_model_and_never_writes():
    store = await filled()
    before = await dump(store)
    snap = await report.snapshot(store, NOW, TTL)
    assert await dump(store) == before and state.bind_key("junk") in before
    groups = {(g["provider"], g["model"]): g for g in snap["groups"]}
    kimi = groups[("opencode-go", "kimi")]
    assert [s["id"] for s in kimi["spares"]] == ["fresh-1", "stale-1"] and kimi["fresh_spares"] == 1
    (b,) = groups[("opencode", "big")]["bindings"]
    assert b == {"conversation": "ses_a", "id": "bound-1", "how": "spare", "upstream_ms": 1200, "failures": 1,
                 "idle_s": 5, "bound_ago_s": 60}
    assert snap["retired"] == 1


async def test_text_and_json():
    snap = await report.snapshot(await filled(), NOW, TTL)
    text = report.text(snap)
    assert "opencode-go / kimi: 1 fresh spare(s) of 2, 0 binding(s)" in text
    assert "STALE" in text and "bound bound-1  <- ses_a" in text
    assert json.loads(report.json_text(snap)) == json.loads(json.dumps(snap))
    assert report.text(await report.snapshot(open_store("memory:"), NOW, TTL)).startswith("pool: empty")


async def test_status_and_metrics():
    c = Counter(routed_spare=3, probes=5)
    st = report.status(c, running=True, enabled=True, loops=1)
    assert st["counters"]["routed_spare"] == 3 and st["counters"]["retired_429"] == 0 and st["refresh_loops"] == 1
    text = report.metrics(c, await report.snapshot(await filled(), NOW, TTL))
    assert 'sessionpin_pool_events_total{event="probes"} 5' in text
    assert 'sessionpin_pool_spares{provider="opencode-go",model="kimi"} 1' in text
    assert 'sessionpin_pool_bindings{provider="opencode",model="big"} 1' in text
