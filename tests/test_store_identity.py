"""store.identity: a store knows it is the store it was; a machine remembers it (issue 18)."""

from __future__ import annotations

import stat

import pytest

from sessionpin.store import StoreError, open_store
from sessionpin.store import identity as ident
from sessionpin.store.identity import (ACCEPTED, FIRST, LOST, NEW, OK, REPLACED, Identity, Memory, Remembered,
                                       judge)


def test_judge():
    r = Remembered("file:x", "a", pins=3, seen=1.0)
    assert judge(None, None) == NEW
    assert judge(None, Identity("b", 1.0)) == FIRST
    assert judge(r, Identity("a", 1.0)) == OK
    assert judge(r, None) == LOST                              # empty, flushed, restarted without AOF
    assert judge(r, Identity("b", 1.0)) == REPLACED
    assert judge(r, Identity("b", 1.0, accepts=("z", "a"))) == ACCEPTED


def test_an_unreadable_identity_is_another_identity_not_none():
    assert ident.decode_identity("not json") == Identity("unreadable", 0.0)
    assert judge(Remembered("u", "a"), ident.decode_identity("{}")) == REPLACED


def test_the_loss_message_names_the_store_what_it_held_and_the_commands():
    msg = ident.describe_loss("redis://h:1", LOST, Remembered("redis://h:1", "abc", pins=20, seen=0.0), None)
    assert "store redis://h:1 lost what it held" in msg and "abc holding 20 pins" in msg
    assert "sessionpin store accept-loss --store redis://h:1" in msg and "sessionpin store copy BACKUP" in msg


def test_location_ignores_password_and_options_but_not_where_the_data_is(tmp_path):
    a = ident.location("redis://:secret@h:6380/2?durability=accept-weaker")
    assert a == ident.location("redis://h:6380/2") and "secret" not in a
    assert a != ident.location("redis://h:6380/3")
    assert a != ident.location("redis://h:6380/2?prefix={other}:")
    assert ident.location("memory:") is None
    assert ident.location(f"file:{tmp_path}/s.db") == ident.location(f"file://{tmp_path}/s.db")


def test_memory_is_a_0600_file_outside_the_store_and_survives_the_store_dir(tmp_path):
    env = {ident.MEMORY_ENV: str(tmp_path / "mem")}
    m = Memory(f"file:{tmp_path}/store/s.db", env)
    assert m.load() is None
    m.save(Remembered("file:x", "abc", pins=2, seen=5.0))
    assert stat.S_IMODE(m.path.stat().st_mode) == 0o600
    assert Memory(f"file:{tmp_path}/store/s.db", env).load() == Remembered("file:x", "abc", pins=2, seen=5.0)
    assert Memory(f"file:{tmp_path}/other.db", env).load() is None
    m.path.write_text("garbage")
    with pytest.raises(StoreError, match="unreadable"):          # never "nothing remembered"
        m.load()


def test_the_default_memory_is_not_under_the_state_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(ident.MEMORY_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert ident.memory_dir() == tmp_path / "config" / "sessionpin" / "stores"


@pytest.fixture
async def store():
    s = open_store("memory:")
    yield s
    await s.close()


async def test_settle_makes_a_new_store_once_then_knows_it(store):
    s = await ident.settle(store, store.url, None, 1.0)
    assert s.kind == NEW and s.identity is not None
    r = Remembered(store.url, s.identity.id)
    assert (await ident.settle(store, store.url, r, 2.0)).kind == OK
    assert (await ident.settle(store, store.url, None, 2.0)).kind == FIRST      # another machine


async def test_a_flushed_store_is_lost_and_accept_loss_starts_over(store):
    s = await ident.settle(store, store.url, None, 1.0)
    r = Remembered(store.url, s.identity.id, pins=7, seen=1.0)
    for k in await store.keys():
        await store.delete(k)                                              # FLUSHALL
    lost = await ident.settle(store, store.url, r, 2.0)
    assert lost.kind == LOST and "holding 7 pins" in lost.message
    assert await store.get(ident.IDENTITY_KEY) is None                      # nothing made over a loss
    await ident.record_loss(store, r, "proxy-1", 2.0)
    await ident.record_partial(store, "sess", ident.PartialLoss("glm", "claude-code", 9e9, "proxy-1", 2.0))
    new, accepted, partial = await ident.accept_loss(store, None, 3.0)     # from a machine that never saw it
    assert accepted == [r.id] and partial == 1 and new.id != r.id
    assert await ident.losses(store) == {}
    assert (await ident.settle(store, store.url, r, 4.0)).kind == ACCEPTED


async def test_a_copy_carries_the_identity_and_accepts_the_one_it_replaced():
    src, dst = open_store("memory:"), open_store("memory:")
    try:
        a = (await ident.settle(src, src.url, None, 1.0)).identity
        b = (await ident.settle(dst, dst.url, None, 1.0)).identity
        await dst.hset(ident.LOSSES_KEY, a.id, "{}")
        got = await ident.carry(dst, a)
        assert got.id == a.id and b.id in got.accepts and got.accepted == a.accepted   # a restore accepts no loss
        assert await ident.losses(dst) == {}                               # the lost store is back
        assert judge(Remembered("", a.id), got) == OK and judge(Remembered("", b.id), got) == ACCEPTED
    finally:
        await src.close()
        await dst.close()


def test_evictions_grown_since_last_seen_whole_are_counted_until_settled():
    # this machine never saw a count: taken as it is (first sight of the store's counts)
    assert ident.evictions({}, {}, {"r1": 40}) == (0, {"r1": 40})
    # nobody can tell (a file store, INFO refused): nothing changes
    assert ident.evictions({"r1": 40}, {}, None) == (0, {"r1": 40})
    # the count grew: keys lost, and the count remembered is not moved on
    assert ident.evictions({"r1": 40}, {}, {"r1": 45}) == (5, {"r1": 40})
    # the operator settled 45 (accept-loss, or a restore): nothing more; then 2 more
    assert ident.evictions({"r1": 40}, {"r1": 45}, {"r1": 45}) == (0, {"r1": 45})
    assert ident.evictions({"r1": 40}, {"r1": 45}, {"r1": 47}) == (2, {"r1": 45})
    # a restarted server (a run_id this machine never saw, when it saw others) counts from 0
    assert ident.evictions({"r1": 40}, {}, {"r2": 3}) == (3, {"r1": 40, "r2": 0})
    assert ident.evictions({"r1": 40}, {}, {"r2": 0}) == (0, {"r1": 40, "r2": 0})
    # CONFIG RESETSTAT: a count below the remembered one is remembered as it is; a settled
    # count above the count now is of before the reset and does not hide later evictions
    assert ident.evictions({"r1": 40}, {"r1": 45}, {"r1": 2}) == (0, {"r1": 2})
    assert ident.evictions({"r1": 2}, {"r1": 45}, {"r1": 9}) == (7, {"r1": 2})
    # a cluster: per node
    assert ident.evictions({"a": 1, "b": 5}, {}, {"a": 1, "b": 6}) == (1, {"a": 1, "b": 5})
    # a node that did not answer this time keeps its count (not "never seen" when it is back)
    assert ident.evictions({"a": 1, "b": 5}, {}, {"a": 1}) == (0, {"b": 5, "a": 1})
    assert ident.evictions({"b": 5, "a": 1}, {}, {"a": 1, "b": 5}) == (0, {"a": 1, "b": 5})


def test_judge_evictions_takes_a_new_store_as_it_is_and_says_what_was_evicted():
    r = ident.Remembered("redis://h:1/0", "abc", 3, 1_700_000_000.0, {"r1": 1})
    found = ident.Identity(id="abc", created=1.0)
    assert ident.judge_evictions("redis://h:1/0", ident.NEW, None, None, {"r1": 9}) == (0, {"r1": 9}, "")
    assert ident.judge_evictions("redis://h:1/0", ident.FIRST, r, found, {"r1": 9})[:2] == (0, {"r1": 9})
    grown, keep, message = ident.judge_evictions("redis://h:1/0", ident.OK, r, found, {"r1": 9})
    assert (grown, keep) == (8, {"r1": 1})
    assert "store redis://h:1/0 may have lost pins: Redis evicted 8 keys since 2023-11-14 22:13:20 UTC" in message
    assert "sessionpin store accept-loss --store redis://h:1/0" in message
    assert "sessionpin store copy BACKUP redis://h:1/0" in message
    assert "noeviction in the server's configuration file" in message
    # old memory files and identities (no counts) still read
    assert ident._mem_decoder.decode(b'{"store":"x","id":"y"}').evicted == {}
    assert ident.decode_identity('{"id":"y","created":1.0}').evicted == {}


def test_a_recorded_loss_waits_for_the_operator_whatever_this_machine_remembers():
    """``store:losses`` as read: an identity a proxy recorded lost is pending until the
    operator decides (accept-loss clears the records; a restore the one it brings back)."""
    import msgspec

    def said(**recs):
        return {k: msgspec.json.encode(v).decode() for k, v in recs.items()}

    x = Identity("x", 1.0)
    lost = said(x={"store": "u", "pins": 3, "by": "a", "at": 5.0, "kind": LOST})
    assert ident.pending_loss(lost, None)[0] == "x"                          # still empty
    assert ident.pending_loss(lost, Identity("y", 2.0))[0] == "x"            # another proxy took it for new
    assert ident.pending_loss(lost, Identity("y", 2.0, accepts=("x",))) is None   # the operator accepted it
    assert ident.pending_loss(lost, x) is None                               # its identity is back
    evicted = said(x={"by": "a", "at": 5.0, "kind": ident.EVICTED, "accepted": 0.0})
    assert ident.pending_loss(evicted, x)[0] == "x"                          # evicted: the identity stays
    assert ident.pending_loss(evicted, Identity("x", 1.0, accepted=7.0)) is None   # made before a decision
    assert ident.pending_loss(said(x={"by": "an older proxy"}), x)[0] == "x"     # says not how: nobody can tell
    assert ident.pending_loss({"x": "garbage"}, x)[0] == "x"
    assert ident.pending_loss(said(**{ident.PARTIAL + "s": {}}), x) is None  # a lost pin is not a lost store
    msg = ident.describe_recorded("redis://h:6379/0", *ident.pending_loss(evicted, x))
    assert msg.startswith("store redis://h:6379/0 lost what it held, as a recorded in it at ")
    assert "Redis evicted keys of store x" in msg
    assert "sessionpin store copy BACKUP redis://h:6379/0" in msg and "sessionpin store accept-loss" in msg


async def test_nothing_is_made_over_a_recorded_loss_and_a_lost_pin_is_recorded_whole(store):
    s = await ident.settle(store, store.url, None, 1.0)
    r = Remembered(store.url, s.identity.id, pins=2, seen=1.0)
    await store.delete(ident.IDENTITY_KEY)
    await ident.record_loss(store, r, "proxy-1", 2.0, LOST)
    await ident.record_loss(store, None, "a machine that never saw it", 2.0, LOST)   # says nothing
    said = await ident.losses(store)
    assert list(said) == [r.id]
    got = await ident.settle(store, store.url, None, 3.0, said)              # another machine: makes nothing
    assert got.kind == NEW and got.identity is None and await store.get(ident.IDENTITY_KEY) is None
    await ident.record_partial(store, "s", ident.PartialLoss("glm", "claude-code", 9e9, "proxy-1", 2.0))
    assert await ident.partial_loss(store, "s") == ident.PartialLoss("glm", "claude-code", 9e9, "proxy-1", 2.0)
    assert await ident.partial_loss(store, "other") is None
    assert ident.decode_partial("glm (by host:1 at 5)") == ident.PartialLoss("glm")     # an older record


def test_a_store_counting_fewer_pins_made_than_this_machine_saw_is_rolled_back():
    r = Remembered("u", "x", pins=3, seen=1.0, made=5, accepted=2.0)
    x = Identity("x", 1.0, accepted=2.0)
    assert ident.rolled_back(r, OK, x, 4)                                   # an older copy of itself
    assert not ident.rolled_back(r, OK, x, 5) and not ident.rolled_back(r, OK, x, 9)
    assert not ident.rolled_back(r, OK, Identity("x", 1.0, accepted=3.0), 0)   # the operator decided since
    assert not ident.rolled_back(r, ACCEPTED, Identity("y", 1.0, accepts=("x",)), 0)
    assert not ident.rolled_back(None, FIRST, x, 0)                          # never seen: taken as it is
    assert not ident.rolled_back(Remembered("u", "x"), OK, Identity("x", 1.0), 0)   # an older memory file
    msg = ident.describe_rollback("file:/s.db", r, 4)
    assert msg.startswith("store file:/s.db was rolled back: it is store x as it was when 4 pins had been made")
    assert "sessionpin store copy BACKUP file:/s.db" in msg and "sessionpin store accept-loss --store" in msg
    import msgspec
    rec = {"by": "a", "at": 5.0, "kind": ident.ROLLED_BACK, "accepted": 2.0, "made": 5}
    said = {"x": msgspec.json.encode(rec).decode()}
    assert ident.pending_loss(said, x, 4)[0] == "x"                          # still the older copy
    assert ident.pending_loss(said, x, 5) is None                            # a copy that recent restored
    assert ident.pending_loss(said, Identity("x", 1.0, accepted=3.0), 0) is None     # the operator decided


def test_a_writer_that_does_not_count_keeps_the_count_remembered(tmp_path):
    m = Memory("file:/tmp/s.db", {ident.MEMORY_ENV: str(tmp_path)})
    m.save(Remembered("u", "x", pins=2, seen=1.0, made=7, accepted=2.0))
    m.save(Remembered("u", "x", pins=3, seen=4.0))                         # the CLI: it counts no pins made
    assert m.load() == Remembered("u", "x", pins=3, seen=4.0, made=7, accepted=2.0)
    m.save(Remembered("u", "y", pins=0, seen=5.0))                         # another identity: nothing kept
    assert m.load() == Remembered("u", "y", pins=0, seen=5.0)


def test_others_are_the_other_stores_remembered_with_live_pins(tmp_path):
    """What a proxy names when it makes a new store's identity: the other stores this
    machine saw whole within a pin's life holding pins, most first — not itself, not an
    empty one, not one seen too long ago, not an unreadable file."""
    env = {ident.MEMORY_ENV: str(tmp_path / "mem")}
    now = 1_800_000_000.0
    here = Memory("file:/x/new.db", env)
    Memory("redis://h:1/0?prefix={a}:", env).save(Remembered("redis://h:1/0?prefix={a}:", "a", 3, now - 60))
    Memory("redis://h:1/1?prefix={a}:", env).save(Remembered("redis://h:1/1?prefix={a}:", "b", 9, now - 60))
    Memory("file:/x/empty.db", env).save(Remembered("file:/x/empty.db", "c", 0, now - 60))
    Memory("file:/x/old.db", env).save(Remembered("file:/x/old.db", "d", 5, now - ident.REMEMBERED_LIVE - 1))
    here.save(Remembered("file:/x/new.db", "e", 4, now))
    (tmp_path / "mem" / "garbage.json").write_text("{")
    assert [(r.store, r.pins) for r in ident.others(here, now)] == [
        ("redis://h:1/1?prefix={a}:", 9), ("redis://h:1/0?prefix={a}:", 3)]
    assert ident.others(Memory("memory:", env), now) == []
