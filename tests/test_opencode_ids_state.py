"""The invariants of seeds/002 §3 over the async store, in one process and across two."""
import asyncio
import sys
import textwrap
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from sessionpin.opencode_ids import state
from sessionpin.opencode_ids.acquire import take_fresh
from sessionpin.opencode_ids.options import PoolConfig
from sessionpin.store import identity, open_store, open_sync_store

P, M = "opencode", "big-pickle"
NOW = 1_794_000_000_000
ROOT = Path(__file__).resolve().parent.parent


def spare(ms=900, at=NOW):
    return state.Spare(upstream_ms=ms, verified_at=at, created_at=at)


def binding(rid, at=NOW, **kw):
    return state.Binding(routed_id=rid, provider=P, model=M, bound_at=at, last_seen_at=at, **kw)


async def check_invariants(store):
    bound = [b.routed_id for b in (await state.bindings(store)).values()]
    spares = set()
    for p, m in await state.targets_in_store(store):
        spares |= set(await state.spares(store, p, m))
    retired = {k[len(state.ID_PREFIX):] for k in await store.keys(state.ID_PREFIX)
               if await state.is_retired(store, k[len(state.ID_PREFIX):])}
    assert len(bound) == len(set(bound)), "an id is in two conversations"
    assert not spares & set(bound), "a bound id is also a spare"
    assert not retired & set(bound) and not retired & spares, "a retired id came back"


def _file_store_has_the_contract(url: str) -> bool:
    backend = open_sync_store(url)
    try:
        return hasattr(backend, "apply") and hasattr(backend, "cas")
    finally:
        backend.close()


@pytest.fixture(params=["memory", "file"])
async def store(request, tmp_path):
    """Each transition on the memory store, and on the file store once it has the whole contract."""
    url = "memory:" if request.param == "memory" else f"file:{tmp_path / 'state.db'}"
    if request.param == "file" and not _file_store_has_the_contract(url):
        pytest.skip("the file store does not implement cas/apply yet (branch store-file)")
    s = open_store(url)
    yield s
    await s.close()


async def test_codecs_roundtrip_and_garbage_reads_as_absent(store):
    s = spare()
    assert state.decode_spare(state.encode(s)) == s
    assert state.decode_spare("{bad") is None and state.decode_binding('{"x":1}') is None
    await store.hset(state.spare_key(P, M), "junk", "not json")
    await store.set(state.bind_key("k"), "[]")
    assert await state.spares(store, P, M) == {} and await state.bindings(store) == {}
    assert await store.keys("pool:") == []                       # dropped on sight
    assert await state.bind(store, "k", binding("r1")) == binding("r1")


async def test_store_holds_no_secret_or_url():
    store = open_store("memory:")
    await state.add_spare(store, P, M, "id1", spare())
    await take_fresh(store, state.binding_key("ses_x", P, M), P, M, PoolConfig(), NOW, Counter())
    dump = repr([await store.get(k) if k.startswith(("pool:bind:", "pool:id:")) else await store.hgetall(k)
                 for k in await store.keys("")])
    assert "http" not in dump and "key" not in dump.lower().replace("binding", "")


async def test_bind_is_first_writer_wins_and_an_id_binds_once(store):
    assert await state.bind(store, "c1", binding("r1")) == binding("r1")
    assert (await state.bind(store, "c1", binding("r2"))).routed_id == "r1"   # the key's binding wins
    assert await state.bind(store, "c2", binding("r1")) is None                # r1 is taken: never twice
    assert await state.binding(store, "c2") is None


async def test_every_binding_made_counts_one_pin_made_so_a_rolled_back_store_is_seen(store):
    """A new binding is counted in the store's pins made (``identity.made``), in its apply: a
    copy of the store older than a binding counts fewer and is refused as rolled back (the
    router's guard), instead of the binding reading as never made and its id, a spare again
    in the old copy, going to another conversation. A bind that finds the key bound, or the
    id taken, writes nothing and counts nothing."""
    assert await identity.made(store) == 0
    assert await state.bind(store, "c1", binding("r1")) == binding("r1")
    assert await identity.made(store) == 1
    assert (await state.bind(store, "c1", binding("r2"))).routed_id == "r1"
    assert await state.bind(store, "c2", binding("r1")) is None
    assert await identity.made(store) == 1
    assert await state.bind(store, "c2", binding("r2")) == binding("r2")
    assert await identity.made(store) == 2


async def test_retire_is_final_even_against_a_late_update(store):
    key = state.binding_key("c", P, M)
    await state.bind(store, key, binding("r1"))
    assert await state.retire(store, key, "r1", NOW)
    late = await state.change(store, key, "r1", lambda b: b)     # a late observation cannot resurrect it
    assert late is None and await state.binding(store, key) is None
    assert await state.add_spare(store, P, M, "r1", spare()) is False
    assert await state.bind(store, key, binding("r1")) is None
    assert await state.is_retired(store, "r1")
    assert 0 < await store.ttl(state.id_key("r1")) <= state.KEEP_RETIRED_S   # the tombstone expires
    await check_invariants(store)


async def test_a_change_between_read_and_write_is_not_lost():
    store = open_store("memory:")
    await state.bind(store, "c", binding("r"))
    calls = []

    def strike(b):
        calls.append(b.failures)
        if len(calls) == 1:   # another process strikes in between our read and our write
            other = state.encode(binding("r", failures=1))
            store.backend.set(state.bind_key("c"), other)
        return msgspec.structs.replace(b, failures=b.failures + 1)

    assert (await state.change(store, "c", "r", strike)).failures == 2
    assert calls == [0, 1]


async def test_retire_leaves_a_binding_touched_meanwhile(store):
    await state.bind(store, "c", binding("r", at=NOW - 10_000))
    await state.change(store, "c", "r", lambda b: binding("r", at=NOW))   # touched after prune read it
    assert not await state.retire(store, "c", "r", NOW, still=lambda b: b.last_seen_at < NOW - 5000)
    assert (await state.binding(store, "c")).routed_id == "r"


async def test_prune_retires_idle_caps_oldest_idle_first(store):
    for i, seen in enumerate([NOW - 10, NOW - 30, NOW - 20, NOW - 5_000]):
        await state.bind(store, f"c{i}", binding(f"r{i}", at=seen))
    pruned = await state.prune(store, NOW, lease_ttl_ms=1_000, quarantine_failures=2, max_bindings=2)
    assert (pruned.idle, pruned.capped) == (1, 1)
    assert {b.routed_id for b in (await state.bindings(store)).values()} == {"r0", "r2"}   # r1 oldest idle dropped
    assert await state.is_retired(store, "r1") and await state.is_retired(store, "r3")


async def test_prune_drops_a_spare_whose_claim_a_crash_lost(store):
    await state.add_spare(store, P, M, "s1", spare())
    await state.add_spare(store, P, M, "s2", spare())
    assert await state.claim(store, P, M, "s1")
    await state.bind(store, "c", binding("s1"))
    await store.hset(state.spare_key(P, M), "s1", state.encode(spare()))   # the claim is lost, the binding kept
    # a take that meets it cannot bind it again...
    got = await take_fresh(store, "other", P, M, PoolConfig(), NOW, Counter())
    assert got.routed_id == "s2"
    await store.hset(state.spare_key(P, M), "s1", state.encode(spare()))
    # ...and prune removes it from the spares
    assert (await state.prune(store, NOW, lease_ttl_ms=10**9, quarantine_failures=2, max_bindings=10)).stray == 1
    assert await state.spares(store, P, M) == {}
    await check_invariants(store)


async def test_prune_moves_the_synchronous_pools_bindings_and_forgets_its_tombstones(store):
    await store.hset(state.LEGACY_BINDINGS, "c1", state.encode(binding("r1")))
    await store.hset(state.LEGACY_BINDINGS, "bad", "{")
    await store.hset(state.LEGACY_RETIRED, "gone", str(NOW))
    pruned = await state.prune(store, NOW, lease_ttl_ms=10**9, quarantine_failures=2, max_bindings=10)
    assert pruned.migrated == 1
    assert await state.binding(store, "c1") == binding("r1")
    assert await store.hgetall(state.LEGACY_BINDINGS) == {} and await store.hgetall(state.LEGACY_RETIRED) == {}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "retire", "add", "prune", "readd"]), st.integers(0, 5)),
                max_size=40))
def test_invariants_hold_under_any_sequence(ops):
    async def run():
        store = open_store("memory:")
        cfg = PoolConfig()
        n = 0
        for op, i in ops:
            key = state.binding_key(f"c{i}", P, M)
            if op == "add":
                n += 1
                await state.add_spare(store, P, M, f"id{n}", spare(ms=100 + i))
            elif op == "readd":     # a put-back of an id that may be bound or retired by now
                await state.add_spare(store, P, M, f"id{i}", spare(ms=100 + i))
            elif op == "take":
                await take_fresh(store, key, P, M, cfg, NOW, Counter())
            elif op == "retire":
                b = await state.binding(store, key)
                if b:
                    await state.retire(store, key, b.routed_id, NOW)
            else:
                await state.prune(store, NOW + i * 10**8, lease_ttl_ms=cfg.lease_ttl_ms, quarantine_failures=2,
                                  max_bindings=3)
            await check_invariants(store)

    asyncio.run(run())


WORKER = textwrap.dedent("""
    import asyncio, sys
    from collections import Counter
    from sessionpin.opencode_ids import state
    from sessionpin.opencode_ids.acquire import take_fresh
    from sessionpin.opencode_ids.options import PoolConfig
    from sessionpin.store import open_store

    async def main(url, name, n, now):
        store = open_store(url)
        cfg = PoolConfig()
        for i in range(n):
            # two conversations per process, plus one key both processes race for
            for conv in (f"{name}-{i}", f"shared-{i}"):
                key = state.binding_key(conv, "opencode", "big-pickle")
                got = await take_fresh(store, key, "opencode", "big-pickle", cfg, now, Counter())
                if got is not None and got.how == "spare" and i % 3 == 0:
                    await state.retire(store, key, got.routed_id, now)
        await store.close()

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
""")


async def test_two_processes_sharing_one_file_store_never_share_an_id(tmp_path):
    url = f"file:{tmp_path / 'state.db'}"
    if not _file_store_has_the_contract(url):
        pytest.skip("the file store does not implement cas/apply yet (branch store-file)")
    store = open_store(url)
    ids = {f"sp{i:03d}" for i in range(60)}
    for sid in ids:
        await state.add_spare(store, P, M, sid, spare(ms=int(sid[2:])))
    await store.close()
    procs = [await asyncio.create_subprocess_exec(sys.executable, "-c", WORKER, url, name, "20", str(NOW), cwd=ROOT,
                                                  stderr=asyncio.subprocess.PIPE) for name in ("a", "b")]
    for p in procs:
        _, err = await asyncio.wait_for(p.communicate(), 60)
        assert p.returncode == 0, err.decode()
    store = open_store(url)
    try:
        await check_invariants(store)
        bound = {b.routed_id for b in (await state.bindings(store)).values()}
        left = set(await state.spares(store, P, M))
        retired = {i for i in ids if await state.is_retired(store, i)}
        assert bound | left | retired == ids               # nothing invented, nothing double-used
        assert len(bound) + len(left) + len(retired) == len(ids)
    finally:
        await store.close()
