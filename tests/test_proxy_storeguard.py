"""StoreGuard: the proxy refuses a store that lost what it held (issue 18)."""

from __future__ import annotations

import logging
import time

import pytest

from sessionpin.records import pins
from sessionpin.proxy.storeguard import StoreGuard
from sessionpin.store import identity as ident
from sessionpin.store import open_store
from redis_servers import evict


@pytest.fixture
async def rig(tmp_path):
    url = f"file:{tmp_path}/store/state.db"
    env = {ident.MEMORY_ENV: str(tmp_path / "memory")}
    store = open_store(url)
    guard = StoreGuard(env)
    guard.use(store, url)
    yield store, guard, url, env
    await store.close()


def pin(server="glm"):
    t = time.time()
    return pins.Pin(agent="claude-code", server=server, since=t, renewed=t, rule="opening", turn="opening")


async def flush(store):
    for k in await store.keys():
        await store.delete(k)


async def test_a_new_store_is_remembered_and_a_flushed_one_refused_until_accepted(rig, caplog):
    store, guard, url, env = rig
    assert await guard.gate(store) is None and guard.kind == ident.NEW
    assert ident.Memory(url, env).load().id == guard.describe()["identity"]
    await flush(store)
    with caplog.at_level(logging.ERROR, "sessionpin"):
        await guard.check(store)
    lost = await guard.gate(store)
    assert lost and f"store {store.url} lost what it held" in lost and "accept-loss" in lost
    assert sum("lost what it held" in r.message for r in caplog.records) == 1
    assert list(await ident.losses(store)) == [guard.describe()["identity"]]    # said in the store too
    await guard.check(store)                                                    # still lost, said once
    assert sum("lost what it held" in r.message for r in caplog.records) == 1
    await ident.accept_loss(store, None, time.time())
    await guard.check(store)
    assert await guard.gate(store) is None and guard.kind == ident.ACCEPTED


async def test_a_restarted_proxy_remembers_and_refuses_an_emptied_store(rig, tmp_path):
    store, guard, url, env = rig
    await guard.gate(store)
    await flush(store)
    again = StoreGuard(env)                 # a new process on this machine
    again.use(store, url)
    assert "lost what it held" in await again.gate(store)
    other = StoreGuard({ident.MEMORY_ENV: str(tmp_path / "elsewhere")})      # a machine that never saw it
    other.use(store, url)
    # the loss the others recorded in the store decides: refused, and no identity made over it
    assert "as " in (await other.gate(store) or "") and "recorded in it" in other.lost
    assert other.kind == ident.LOST and await store.get(ident.IDENTITY_KEY) is None
    await ident.accept_loss(store, None, time.time())
    for g in (guard, again, other):
        await g.check(store)
        assert g.lost is None, g.lost


async def test_a_machine_that_never_saw_an_emptied_store_takes_it_for_new_until_a_loss_is_recorded(rig, tmp_path):
    store, guard, url, env = rig
    await guard.gate(store)
    await flush(store)
    other = StoreGuard({ident.MEMORY_ENV: str(tmp_path / "elsewhere")})      # before anyone looked again
    other.use(store, url)
    assert await other.gate(store) is None and other.kind == ident.NEW
    await guard.check(store)                                                    # the first one: another identity
    assert "answers with another identity" in guard.lost
    await other.check(store)                                                    # and now the other one too
    assert "recorded in it" in (other.lost or "") and other.kind == ident.REPLACED
    assert "answered with another identity" in other.lost


async def test_a_served_pin_gone_is_a_loss_but_a_forgotten_or_expired_one_is_not(rig, caplog):
    store, guard, url, env = rig
    await guard.gate(store)
    p = pin()
    got = await pins.create(store, "s1", p)
    guard.saw("s1", got.pin, time.time())
    await store.delete(pins.key("s1"))                                          # a cleanup script's DEL
    with caplog.at_level(logging.ERROR, "sessionpin"):
        msg = await guard.missed(store, "s1", "claude-code", time.time())
        assert "no longer has the pin of session s1 (pinned to glm)" in msg
        assert await guard.missed(store, "s1", "claude-code", time.time()) == msg
    assert sum("no longer has the pin" in r.message for r in caplog.records) == 1   # one ERROR line
    assert guard.partial == 1

    got = await pins.create(store, "s2", p)
    guard.saw("s2", got.pin, time.time())
    assert await pins.forget(store, "s2", got)                                  # the operator's decision
    assert await guard.missed(store, "s2", "claude-code", time.time()) is None

    guard.saw("s3", p, time.time())
    assert await guard.missed(store, "s3", "claude-code", pins.expiry(p) + 1) is None    # expired

    await pins.drop_lost(store, time.time())                                   # the operator starts over
    await ident.accept_loss(store, None, time.time())                          # (as `store accept-loss` does)
    await guard.check(store)
    assert await guard.missed(store, "s1", "claude-code", time.time()) is None


async def test_a_continuation_miss_checks_the_store_at_once(rig):
    store, guard, url, env = rig
    await guard.gate(store)
    await flush(store)
    assert guard.lost is None                                                   # not looked yet
    assert "lost what it held" in await guard.missed(store, "never-served", "claude-code", time.time())


async def test_accepting_forgets_only_the_pins_missing_then_and_a_restore_accepts_nothing(rig, tmp_path):
    store, guard, url, env = rig
    await guard.gate(store)
    for s in ("kept", "gone"):
        got = await pins.create(store, s, pin())
        guard.saw(s, got.pin, time.time())
    src, _ = await ident.read(store)
    await store.delete(pins.key("gone"))
    await ident.carry(store, src)                       # a restore (of a backup without "gone")
    await guard.check(store)
    assert "no longer has the pin of session gone" in await guard.missed(store, "gone", "claude-code", time.time())
    await pins.drop_lost(store, time.time())
    await ident.accept_loss(store, None, time.time())
    await guard.check(store)
    assert await guard.missed(store, "gone", "claude-code", time.time()) is None      # accepted: decided afresh
    await store.delete(pins.key("kept"))                                    # lost after the acceptance
    assert "no longer has the pin of session kept" in await guard.missed(store, "kept", "claude-code", time.time())


async def test_a_pin_another_proxy_made_is_found_lost_by_its_index(rig):
    store, guard, url, env = rig
    await guard.gate(store)
    got = await pins.create(store, "theirs", pin("alt"))          # made by another proxy: never served here
    await store.delete(pins.key("theirs"))
    msg = await guard.missed(store, "theirs", "claude-code", time.time())
    assert "no longer has the pin of session theirs (pinned to alt), which its pin index still holds" in msg
    assert await guard.missed(store, "theirs", "codex", time.time()) is None          # another agent's id
    assert await guard.missed(store, "never", "claude-code", time.time()) is None     # never pinned
    again = await pins.create(store, "forgotten", pin())
    assert await pins.forget(store, "forgotten", again)
    assert await guard.missed(store, "forgotten", "claude-code", time.time()) is None
    assert got.pin is not None


async def test_a_request_without_history_whose_pin_the_index_holds_is_a_loss_for_a_restarted_proxy(rig):
    """A subagent's request, or a Codex socket reconnecting (``history_initialization:
    new``), carries no history: its missing pin is looked up like a continuation's (the
    index, the store's identity at once), so it is neither sent where the agent addresses
    nor pinned anew; a truly new session has no index entry and is new."""
    store, guard, url, env = rig
    await guard.gate(store)
    await pins.create(store, "lost", pin("alt"))
    await store.delete(pins.key("lost"))                    # a cleanup script's DEL; the index entry stays
    restarted = StoreGuard(env)                             # served nothing: only the index witnesses it
    restarted.use(store, url)
    await restarted.gate(store)
    msg = await restarted.missed(store, "lost", "claude-code", time.time())
    assert msg and "no longer has the pin of session lost (pinned to alt), which its pin index still holds" in msg
    assert await restarted.missed(store, "brand-new", "claude-code", time.time()) is None
    # another proxy's opening of the same session won the race between our read and our look
    # at the index: its pin (and index entry) are there now: not a loss, its pin decides
    await pins.create(store, "raced", pin("alt"))
    assert await restarted.missed(store, "raced", "claude-code", time.time()) is None
    await flush(store)                                      # a store emptied: seen by the opening that meets it
    assert "lost what it held" in (await restarted.missed(store, "brand-new-2", "claude-code", time.time()) or "")


async def test_a_pin_another_proxy_recorded_lost_is_refused_until_the_operator_decides(rig, tmp_path):
    """The pin and its whole index went (a cleanup script's ``*pin*``): only the proxy that
    served it knows, and it records the loss in the store. Every other proxy refuses the
    session by that record — of that agent, until it would have expired, unless the operator
    forgot it since — until accept-loss clears it."""
    store, guard, url, env = rig
    await guard.gate(store)
    got = await pins.create(store, "s1", pin())
    guard.saw("s1", got.pin, time.time())
    for gone in (pins.key("s1"), pins.index_key("claude-code", "glm")):
        await store.delete(gone)
    assert "which this proxy served" in (await guard.missed(store, "s1", "claude-code", time.time()) or "")
    other = StoreGuard(env)                                 # another router (it never served s1)
    other.use(store, url)
    await other.gate(store)
    msg = await other.missed(store, "s1", "claude-code", time.time())
    assert msg and "no longer has the pin of session s1 (pinned to glm), which " in msg
    assert "recorded lost in the store" in msg and "accept-loss" in msg and "store copy BACKUP" in msg
    assert await other.missed(store, "s1", "codex", time.time()) is None                 # another agent's id
    assert await other.missed(store, "s1", "claude-code", pins.expiry(got.pin) + 1) is None   # it would have expired
    assert await other.missed(store, "never", "claude-code", time.time()) is None
    restored = await pins.create(store, "s1", pin())                  # put back, then forgotten: the operator's
    assert await pins.forget(store, "s1", restored)
    assert await other.missed(store, "s1", "claude-code", time.time()) is None
    got = await pins.create(store, "s2", pin())
    guard.saw("s2", got.pin, time.time())
    for gone in (pins.key("s2"), pins.index_key("claude-code", "glm")):
        await store.delete(gone)
    assert await guard.missed(store, "s2", "claude-code", time.time())
    assert await other.missed(store, "s2", "claude-code", time.time())
    await ident.accept_loss(store, None, time.time())                 # the operator starts over
    await other.check(store)
    assert await other.missed(store, "s2", "claude-code", time.time()) is None


async def test_a_store_rolled_back_to_an_older_copy_is_a_loss_until_a_newer_copy_or_accept_loss(rig, tmp_path,
                                                                                                 monkeypatch):
    """The store keeps its identity when an older copy of it is put back (a backup restored
    while the proxy was stopped, a Redis restarted on an older snapshot): the pins made
    since read as never made. Its count of pins made is below the one remembered."""
    from sessionpin.proxy import storeguard

    monkeypatch.setattr(storeguard, "MADE_SETTLE", 0.0)     # (a count is remembered once read MADE_SETTLE ago)
    store, guard, url, env = rig
    await guard.gate(store)
    for s in ("a", "b", "c"):
        await pins.create(store, s, pin())
    await guard.check(store)
    assert ident.Memory(url, env).load().made == 3 and guard.describe()["remembered_made"] == 3
    await store.hset(ident.MADE_KEY, ident.MADE_FIELD, "1")        # as an older copy holds it
    restarted = StoreGuard(env)                                    # the proxy started again on it
    restarted.use(store, url)
    lost = await restarted.gate(store) or ""
    assert f"store {store.url} was rolled back: it is store " in lost and "when 1 pins had been made" in lost
    assert restarted.kind == ident.ROLLED_BACK
    elsewhere = StoreGuard({ident.MEMORY_ENV: str(tmp_path / "elsewhere")})   # another machine: by the record
    elsewhere.use(store, url)
    assert "rolled back to an older copy of store" in (await elsewhere.gate(store) or "")
    await store.hset(ident.MADE_KEY, ident.MADE_FIELD, "3")        # a copy as recent restored
    for g in (restarted, elsewhere):
        await g.check(store)
        assert g.lost is None, g.lost
    await store.hset(ident.MADE_KEY, ident.MADE_FIELD, "2")        # older again
    await restarted.check(store)
    assert restarted.kind == ident.ROLLED_BACK
    await ident.accept_loss(store, None, time.time())              # the operator starts over
    await restarted.check(store)
    assert restarted.lost is None
    await restarted.check(store)
    assert restarted.describe()["remembered_made"] == 2                 # counted afresh: as it is now
    await pins.create(store, "d", pin())
    await restarted.check(store)
    assert restarted.lost is None and ident.Memory(url, env).load().made == 3


async def test_a_count_of_pins_made_is_remembered_only_once_read_a_while_ago(rig, monkeypatch):
    """A count read now may hold a write in flight that a Redis replica taking over never
    gets (its pin was not acknowledged): the count remembered is one read MADE_SETTLE ago."""
    from sessionpin.proxy import storeguard

    clock = [1000.0]
    monkeypatch.setattr(storeguard.time, "monotonic", lambda: clock[0])
    store, guard, url, env = rig
    await guard.gate(store)
    await pins.create(store, "a", pin())
    await guard.check(store)
    assert guard.describe()["remembered_made"] == 0              # read just now: not yet
    clock[0] += storeguard.MADE_SETTLE
    await pins.create(store, "b", pin())
    await guard.check(store)
    assert guard.describe()["remembered_made"] == 1              # the count read MADE_SETTLE ago
    clock[0] += storeguard.MADE_SETTLE
    await guard.check(store)
    assert guard.describe()["remembered_made"] == 2


@pytest.fixture
def redis_server(tmp_path):
    from redis_servers import RedisServer

    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.cleanup()


async def test_keys_redis_evicted_are_a_loss_until_settled_also_for_a_proxy_started_after(redis_server, tmp_path):
    """Redis counts what it evicted (``evicted_keys``, per run_id) but not which keys: a pin
    and its index entry may both be gone, and then nothing tells a lost pin from a
    never-made one. A count grown since this machine last saw the store is a loss."""
    from redis_servers import unique_prefix

    url = redis_server.url(unique_prefix())
    env = {ident.MEMORY_ENV: str(tmp_path / "memory")}
    store = open_store(url)
    later = open_store(url)
    try:
        guard = StoreGuard(env)
        guard.use(store, url)
        assert await guard.gate(store) is None and guard.kind == ident.NEW
        assert ident.Memory(url, env).load().evicted                # the count it started from, remembered
        n = evict(redis_server)
        # the request that meets a missing pin reads the count then (not the last watch's)
        msg = await guard.missed(store, "never-served", "claude-code", time.time())
        assert msg and f"store {store.url} may have lost pins: Redis evicted {n} keys since" in msg, msg
        assert "accept-loss" in msg and "store copy BACKUP" in msg
        assert guard.kind == ident.EVICTED and await guard.gate(store) == msg
        assert list(await ident.losses(store)) == [guard.describe()["identity"]]   # said in the store too
        # a proxy started after the eviction, on this machine: it remembers the count, and refuses
        other = StoreGuard(env)
        other.use(later, url)
        assert f"Redis evicted {n} keys" in (await other.gate(later) or "")
        # one on another machine (it never saw the count) refuses by the loss recorded in the store
        elsewhere = StoreGuard({ident.MEMORY_ENV: str(tmp_path / "elsewhere")})
        elsewhere.use(later, url)
        assert "Redis evicted keys of store" in (await elsewhere.gate(later) or "")
        assert elsewhere.kind == ident.EVICTED
        # the operator starts over: accept-loss settles the count it read
        await ident.accept_loss(store, None, time.time(), await store.evictions())
        for g, s in ((guard, store), (other, later)):
            await g.check(s)
            assert await g.gate(s) is None and g.kind == ident.OK       # the same store, its losses accepted
        await elsewhere.check(later)
        assert await elsewhere.gate(later) is None and elsewhere.kind == ident.FIRST
        assert ident.Memory(url, env).load().evicted == store.evicted
        # more evictions: a loss again; a restore (store copy) settles it without accepting anything
        n = evict(redis_server, 2)
        await store.watch()
        await guard.check(store)
        assert f"Redis evicted {n} keys" in guard.lost
        accepted = (await ident.read(store))[0].accepted
        await ident.settle_evictions(store, await store.evictions())
        await guard.check(store)
        assert guard.lost is None and (await ident.read(store))[0].accepted == accepted
        assert await ident.losses(store) == {}
    finally:
        await store.close()
        await later.close()


async def test_a_redis_restarted_with_its_data_counts_its_evictions_from_zero(redis_server, tmp_path):
    """A new run_id: the server's count started again at 0, after this machine last looked."""
    from redis_servers import unique_prefix

    url = redis_server.url(unique_prefix())
    env = {ident.MEMORY_ENV: str(tmp_path / "memory")}
    store = open_store(url)
    try:
        guard = StoreGuard(env)
        guard.use(store, url)
        evict(redis_server)                                 # before sessionpin used it: taken as it is
        assert await guard.gate(store) is None
        redis_server.kill()
        redis_server.start()                                # its AOF replayed: the same store
        await store.watch()
        await guard.check(store)
        assert guard.lost is None and guard.kind == ident.OK
        n = evict(redis_server, 2)
        await store.watch()
        await guard.check(store)
        assert f"Redis evicted {n} keys" in (guard.lost or "")
    finally:
        await store.close()
