"""StoreGuard: the proxy refuses a store that lost what it held (issue 18)."""

from __future__ import annotations

import logging
import time

import pytest

from sessionpin import pins
from sessionpin.proxy.storeguard import StoreGuard
from sessionpin.store import identity as ident
from sessionpin.store import open_store


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
    assert await other.gate(store) is None and other.kind == ident.NEW
    await guard.check(store)                                                    # the first one: another identity
    assert "answers with another identity" in guard.lost


async def test_a_served_pin_gone_is_a_loss_but_a_forgotten_or_expired_one_is_not(rig, caplog):
    store, guard, url, env = rig
    await guard.gate(store)
    p = pin()
    got = await pins.create(store, "s1", p)
    guard.saw("s1", got.pin, time.time())
    await store.delete(pins.key("s1"))                                          # a cleanup script's DEL
    with caplog.at_level(logging.ERROR, "sessionpin"):
        msg = await guard.missed(store, "s1", "claude-code", True, time.time())
        assert "no longer has the pin of session s1 (pinned to glm)" in msg
        assert await guard.missed(store, "s1", "claude-code", True, time.time()) == msg
    assert sum("no longer has the pin" in r.message for r in caplog.records) == 1   # one ERROR line
    assert guard.partial == 1

    got = await pins.create(store, "s2", p)
    guard.saw("s2", got.pin, time.time())
    assert await pins.forget(store, "s2", got)                                  # the operator's decision
    assert await guard.missed(store, "s2", "claude-code", True, time.time()) is None

    guard.saw("s3", p, time.time())
    assert await guard.missed(store, "s3", "claude-code", True, pins.expiry(p) + 1) is None    # expired

    await pins.drop_lost(store, time.time())                                   # the operator starts over
    await ident.accept_loss(store, None, time.time())                          # (as `store accept-loss` does)
    await guard.check(store)
    assert await guard.missed(store, "s1", "claude-code", True, time.time()) is None


async def test_a_continuation_miss_checks_the_store_at_once(rig):
    store, guard, url, env = rig
    await guard.gate(store)
    await flush(store)
    assert guard.lost is None                                                   # not looked yet
    assert "lost what it held" in await guard.missed(store, "never-served", "claude-code", True, time.time())


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
    assert "no longer has the pin of session gone" in await guard.missed(store, "gone", "claude-code", True, time.time())
    await pins.drop_lost(store, time.time())
    await ident.accept_loss(store, None, time.time())
    await guard.check(store)
    assert await guard.missed(store, "gone", "claude-code", True, time.time()) is None      # accepted: decided afresh
    await store.delete(pins.key("kept"))                                    # lost after the acceptance
    assert "no longer has the pin of session kept" in await guard.missed(store, "kept", "claude-code", True, time.time())


async def test_a_pin_another_proxy_made_is_found_lost_by_its_index(rig):
    store, guard, url, env = rig
    await guard.gate(store)
    got = await pins.create(store, "theirs", pin("alt"))          # made by another proxy: never served here
    await store.delete(pins.key("theirs"))
    msg = await guard.missed(store, "theirs", "claude-code", True, time.time())
    assert "no longer has the pin of session theirs (pinned to alt), which its pin index still holds" in msg
    assert await guard.missed(store, "theirs", "claude-code", False, time.time()) is None   # an opening: new
    assert await guard.missed(store, "theirs", "codex", True, time.time()) is None          # another agent's id
    assert await guard.missed(store, "never", "claude-code", True, time.time()) is None     # never pinned
    again = await pins.create(store, "forgotten", pin())
    assert await pins.forget(store, "forgotten", again)
    assert await guard.missed(store, "forgotten", "claude-code", True, time.time()) is None
    assert got.pin is not None
