"""The invariants of seeds/002 §3 over the store, in one process and across two."""
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

from hypothesis import given, settings, strategies as st

from sessionpin.pool import state
from sessionpin.pool.acquire import take_fresh
from sessionpin.pool.options import PoolConfig
from sessionpin.store import open_store

P, M = "opencode", "big-pickle"
NOW = 1_794_000_000_000
ROOT = Path(__file__).resolve().parent.parent


def spare(ms=900, at=NOW):
    return state.Spare(upstream_ms=ms, verified_at=at, created_at=at)


def check_invariants(store):
    bound = [b.routed_id for b in state.bindings(store).values()]
    spares = set()
    for p, m in state.targets_in_store(store):
        spares |= set(state.spares(store, p, m))
    assert len(bound) == len(set(bound)), "an id is in two conversations"
    assert not spares & set(bound), "a bound id is also a spare"
    retired = set(store.hgetall(state.RETIRED))
    assert not retired & set(bound) and not retired & spares, "a retired id came back"


def test_codecs_roundtrip_and_garbage_reads_as_absent():
    s = spare()
    assert state.decode_spare(state.encode(s)) == s
    assert state.decode_spare("{bad") is None and state.decode_binding('{"x":1}') is None
    store = open_store("memory:")
    store.hset(state.spare_key(P, M), "junk", "not json")
    store.hset(state.BINDINGS, "k", "[]")
    assert state.spares(store, P, M) == {} and state.bindings(store) == {}
    assert store.hgetall(state.BINDINGS) == {}     # dropped on sight


def test_store_holds_no_secret_or_url():
    store = open_store("memory:")
    state.add_spare(store, P, M, "id1", spare())
    take_fresh(store, state.binding_key("ses_x", P, M), P, M, PoolConfig(), NOW, Counter())
    dump = repr({k: store.hgetall(k) for k in store.keys("")})
    assert "http" not in dump and "key" not in dump.lower().replace("binding", "")


def test_retire_is_final_even_against_a_late_update():
    store = open_store("memory:")
    key = state.binding_key("c", P, M)
    b = state.Binding(routed_id="r1", provider=P, model=M, bound_at=NOW, last_seen_at=NOW)
    state.bind(store, key, b)
    assert state.retire(store, key, "r1", NOW)
    assert state.update(store, key, b) is False          # a late observation cannot resurrect it
    assert state.binding(store, key) is None
    assert state.add_spare(store, P, M, "r1", spare()) is False
    check_invariants(store)


def test_prune_retires_idle_caps_oldest_idle_first_and_forgets_old_tombstones():
    store = open_store("memory:")
    for i, seen in enumerate([NOW - 10, NOW - 30, NOW - 20, NOW - 5_000]):
        state.bind(store, f"c{i}", state.Binding(routed_id=f"r{i}", provider=P, model=M, bound_at=seen,
                                                 last_seen_at=seen))
    store.hset(state.RETIRED, "ancient", str(NOW - 10_000))
    pruned = state.prune(store, NOW, lease_ttl_ms=1_000, quarantine_failures=2, max_bindings=2,
                         keep_retired_ms=5_000)
    assert pruned.idle == 1 and pruned.capped == 1 and pruned.forgotten == 1
    assert {b.routed_id for b in state.bindings(store).values()} == {"r0", "r2"}   # r1 oldest idle dropped
    assert state.is_retired(store, "r1") and state.is_retired(store, "r3")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "retire", "add", "prune"]), st.integers(0, 5)), max_size=40))
def test_invariants_hold_under_any_sequence(ops):
    store = open_store("memory:")
    cfg = PoolConfig()
    n = 0
    for op, i in ops:
        key = state.binding_key(f"c{i}", P, M)
        if op == "add":
            n += 1
            state.add_spare(store, P, M, f"id{n}", spare(ms=100 + i))
        elif op == "take":
            take_fresh(store, key, P, M, cfg, NOW, Counter())
        elif op == "retire":
            b = state.binding(store, key)
            if b:
                state.retire(store, key, b.routed_id, NOW)
        else:
            state.prune(store, NOW + i * 10**8, lease_ttl_ms=cfg.lease_ttl_ms, quarantine_failures=2,
                        max_bindings=3, keep_retired_ms=10**12)
        check_invariants(store)


WORKER = textwrap.dedent("""
    import sys
    from collections import Counter
    from sessionpin.pool import state
    from sessionpin.pool.acquire import take_fresh
    from sessionpin.pool.options import PoolConfig
    from sessionpin.store import open_store
    url, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = open_store(url)
    cfg, now = PoolConfig(), int(sys.argv[4])
    for i in range(n):
        # two conversations per process, plus one key both processes race for
        for conv in (f"{name}-{i}", f"shared-{i}"):
            got = take_fresh(store, state.binding_key(conv, "opencode", "big-pickle"), "opencode", "big-pickle", cfg, now, Counter())
            if got is not None and got.how == "spare":
                b = state.binding(store, state.binding_key(conv, "opencode", "big-pickle"))
                if i % 3 == 0:
                    state.retire(store, state.binding_key(conv, "opencode", "big-pickle"), b.routed_id, now)
    store.close()
""")


def test_two_processes_sharing_one_file_store_never_share_an_id(tmp_path):
    url = f"file:{tmp_path / 'state.db'}"
    store = open_store(url)
    ids = {f"sp{i:03d}" for i in range(60)}
    for sid in ids:
        state.add_spare(store, P, M, sid, spare(ms=int(sid[2:])))
    store.close()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, url, name, "20", str(NOW)], cwd=ROOT,
                              stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    store = open_store(url)
    check_invariants(store)
    bound = {b.routed_id for b in state.bindings(store).values()}
    left = set(state.spares(store, P, M))
    retired = set(store.hgetall(state.RETIRED))
    assert bound | left | retired == ids               # nothing invented, nothing double-used
    assert len(bound) + len(left) + len(retired) == len(ids)
    shared = [k for k in state.bindings(store) if k.startswith("shared-")]
    assert len(shared) == len(set(shared))
    store.close()
