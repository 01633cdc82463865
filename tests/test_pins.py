"""Pins over the async store: compare-and-set on every change, the per-server index."""

from __future__ import annotations

import msgspec
import pytest

from sessionpin.records import pins
from sessionpin.records.pins import Loaded, Pin
from sessionpin.store import open_store


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
async def store(clock):
    s = open_store("memory:", clock=clock)
    yield s
    await s.close()


def make(server="glm", agent="claude-code", t=1_800_000_000.0):
    return Pin(agent=agent, server=server, since=t, renewed=t, rule="opening", turn="opening")


async def test_create_then_load(store):
    assert (await pins.load(store, "s")).pin is None
    got = await pins.create(store, "s", make())
    assert got.pin == make()
    loaded = await pins.load(store, "s")
    assert loaded.pin == make() and loaded.raw == got.raw
    assert await store.ttl(pins.key("s")) == pytest.approx(pins.PIN_TTL)


async def test_first_writer_wins(store):
    first = await pins.create(store, "s", make("glm"))
    second = await pins.create(store, "s", make("anthropic"))
    assert first.pin.server == "glm" and second.pin.server == "glm"


async def test_garbage_reads_as_no_pin_and_is_replaced(store):
    for garbage in ("", "{", "null", "{}", '{"server": "x"}', '{"agent": "", "server": "x", "since": 1, "renewed": 1}'):
        await store.set(pins.key("s"), garbage)
        seen = await pins.load(store, "s")
        assert seen.pin is None
        assert (await pins.create(store, "s", make(), seen)).pin == make()
        await store.delete(pins.key("s"))


async def test_renew_is_a_compare_and_set(store, clock):
    seen = await pins.create(store, "s", make())
    clock.t += 2 * pins.DAY
    # an operator moves the session between the router's read and its renewal
    assert await pins.move(store, "s", seen, make("anthropic"))
    assert not await pins.renew(store, "s", seen, clock.t)
    assert (await pins.load(store, "s")).pin.server == "anthropic"
    fresh = await pins.load(store, "s")
    assert await pins.renew(store, "s", fresh, clock.t)
    assert (await pins.load(store, "s")).pin.renewed == clock.t


async def test_renew_keeps_text_it_did_not_write(store, clock):
    # a pin written by another version (other key order, an unknown field) renews too:
    # the compare is against the text read, not a re-encoding
    text = '{"v":1,"server":"glm","agent":"claude-code","renewed":1800000000.0,"since":1800000000.0,"extra":1}'
    await store.set(pins.key("s"), text, pins.PIN_TTL)
    seen = await pins.load(store, "s")
    assert seen.pin.server == "glm" and seen.raw == text
    assert await pins.renew(store, "s", seen, clock.t + 2 * pins.DAY)


def test_renew_due():
    p = make(t=0.0)
    assert not pins.renew_due(p, pins.DAY - 1)
    assert pins.renew_due(p, pins.DAY)


async def test_forget_only_what_was_read(store):
    seen = await pins.create(store, "s", make())
    assert await pins.move(store, "s", seen, make("anthropic"))
    assert not await pins.forget(store, "s", seen)          # it changed since
    assert await pins.forget(store, "s", await pins.load(store, "s"))
    assert (await pins.load(store, "s")).pin is None


async def test_counts_follow_every_change_without_a_walk(store, clock):
    now = clock.t
    for i in range(5):
        await pins.create(store, f"g{i}", make("glm"))
    await pins.create(store, "n", make(None))
    a = await pins.create(store, "a", make("anthropic"))
    await pins.create(store, "o", make("glm", agent="opencode"))
    cc = "claude-code"
    assert await pins.counts(store, now) == {(cc, "glm"): (5, 0), (cc, None): (1, 0), (cc, "anthropic"): (1, 0),
                                             ("opencode", "glm"): (1, 0)}
    await pins.move(store, "a", a, make("glm"))
    await pins.forget(store, "g0", await pins.load(store, "g0"))
    assert pins.by_server(await pins.counts(store, now)) == {"glm": (6, 0), None: (1, 0)}
    await pins.record_seen(store, [("g1", cc, "glm", now, 3), ("n", cc, None, now - 7200, 1)])
    assert await pins.counts(store, now, active_since=now - 3600) == {(cc, "glm"): (5, 1), (cc, None): (1, 0),
                                                                      ("opencode", "glm"): (1, 0)}
    assert await pins.seen(store, "g1") == pins.Seen(now, 3)
    # expiry: 30 days on, nothing counts, and the sweep drops the index members
    clock.t = now + pins.PIN_TTL + 1
    assert await pins.counts(store, clock.t) == {}
    assert await pins.sweep_index(store, clock.t) >= 7


async def test_sessions_lists_valid_pins(store):
    await pins.create(store, "a", make("glm"))
    await pins.create(store, "b", make(None))
    await store.set(pins.key("junk"), "nope")
    assert sorted([(s, p.server) async for s, p in pins.sessions(store, batch=1)]) == [("a", "glm"), ("b", None)]


def test_pin_codec_is_compact_and_strict():
    text = pins.encode(make())
    assert msgspec.json.decode(text)["server"] == "glm"
    assert pins.decode(text) == make()
    assert pins.decode("[]") is None
    assert Loaded(None, None).pin is None


class Counting:
    """A real store whose calls are counted by name (how many reads a walk makes)."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, {}

    def __getattr__(self, name):
        fn = getattr(self.store, name)

        async def counted(*args, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            return await fn(*args, **kw)
        return counted


async def walked(store, now, names, batch):
    return [b async for b in pins.listing(store, now, names, batch)]


async def test_listing_walks_the_index_newest_renewal_first_in_batches(store, clock):
    now = clock.t
    made = {}
    for i in range(12):
        agent, server = ("claude-code", "opencode")[i % 2], ("glm", "anthropic", None)[i % 3]
        made[f"s{i:02d}"] = pin = make(server, agent, now - 100 * i)
        await pins.create(store, f"s{i:02d}", pin)
    await pins.record_seen(store, [("s03", "opencode", None, now - 5, 7)])
    counting = Counting(store)
    names = await pins.groups(store)
    assert len(names) == 6
    batches = await walked(counting, now, names, 5)
    assert [len(b) for b in batches] == [5, 5, 2]
    rows = [r for b in batches for r in b]
    assert [s for s, _, _ in rows] == sorted(made)                 # s00 renewed last: first
    assert all(loaded.pin == made[s] for s, loaded, _ in rows)
    assert dict((s, seen) for s, _, seen in rows)["s03"] == pins.Seen(now - 5, 7)
    assert dict((s, seen) for s, _, seen in rows)["s04"] == pins.Seen()
    # per batch one pin read and one activity read, whatever the number of rows
    assert counting.calls["mget"] == counting.calls["hgetall_many"] == 3
    assert "hgetall" not in counting.calls and "get" not in counting.calls
    assert counting.calls["zpage"] <= len(names) * 2 + 3


async def test_listing_filters_by_group_and_skips_what_the_index_no_longer_holds(store, clock):
    now = clock.t
    for i in range(6):
        await pins.create(store, f"g{i}", make("glm", t=now - i))
    await pins.create(store, "n0", make(None, t=now))
    await pins.create(store, "o0", make("glm", "opencode", t=now))
    assert await pins.groups(store, "claude-code", "glm", any_server=False) == ["claude-code:glm"]
    assert await pins.groups(store, None, None, any_server=False) == ["claude-code:-"]
    assert await pins.groups(store, "opencode") == ["opencode:glm"]
    assert await pins.groups(store, "pi") == []
    # a pin moved away from the group, one forgotten, one replaced by garbage behind the index
    moved = await pins.load(store, "g1")
    await pins.move(store, "g1", moved, make("anthropic", t=now))
    await pins.forget(store, "g2", await pins.load(store, "g2"))
    await store.set(pins.key("g3"), "not a pin")
    rows = [r for b in await walked(store, now, ["claude-code:glm"], 2) for r in b]
    assert [s for s, _, _ in rows] == ["g0", "g4", "g5"]
    assert [s for b in await walked(store, now, ["claude-code:anthropic"], 2) for s, _, _ in b] == ["g1"]
    # an expired index entry is not listed (counts does not count it either)
    assert [s for b in await walked(store, now + pins.PIN_TTL - 4.5, ["claude-code:glm"], 2) for s, _, _ in b] == \
        ["g0", "g4"]
    assert await walked(store, now, [], 2) == []
    assert await pins.indexed(store, now, ["claude-code:glm"]) == 4        # g0 g4 g5, and g3's entry (a count)
    assert await pins.indexed(store, now, await pins.groups(store)) == 7


async def test_the_index_says_which_missing_pins_were_lost(store, clock):
    await pins.create(store, "a", make("glm"))
    await pins.create(store, "b", make("alt"))
    now = clock.t
    await store.delete(pins.key("a"))                                           # lost
    assert await pins.index_entry(store, "claude-code", "a", now) == ("glm", pins.expiry(make("glm")))
    assert await pins.index_entry(store, "codex", "a", now) is None                 # another agent's index
    assert await pins.index_entry(store, "claude-code", "a", pins.expiry(make("glm")) + 1) is None   # expired
    assert await pins.forget(store, "b", await pins.load(store, "b"))
    assert await pins.index_entry(store, "claude-code", "b", now) is None           # forgotten: unindexed
    assert await pins.drop_lost(store, now) == 1                                # the operator accepts "a"
    assert await pins.index_entry(store, "claude-code", "a", now) is None
    assert await pins.drop_lost(store, now) == 0


async def test_lost_names_the_index_entries_whose_pins_are_gone_and_forget_takes_one(store, clock):
    """What the CLI lists and decides one by one: a live index entry whose pin is gone (not
    an expired one, not a pin that is there). ``forget`` of such a pin (read as absent, its
    pin as the index says) unindexes it and leaves a tombstone, and only while it is absent."""
    await pins.create(store, "a", make("glm"))
    await pins.create(store, "b", make("glm"))
    await pins.create(store, "c", make(None))
    now = clock.t
    for s in ("a", "c"):
        await store.delete(pins.key(s))
    names = await pins.groups(store)
    assert sorted(await pins.lost(store, now, names)) == [
        ("a", "claude-code", "glm", pins.expiry(make("glm"))), ("c", "claude-code", None, pins.expiry(make(None)))]
    assert await pins.lost(store, pins.expiry(make("glm")) + 1, names) == []        # expired: not lost
    assert not await pins.forget(store, "a", Loaded(None, None))                    # nothing read: nothing forgotten
    lost_a = Loaded(make("glm"), None)
    await pins.create(store, "a", make("glm", t=now))                               # made again meanwhile
    assert not await pins.forget(store, "a", lost_a)                                # not forgotten over it
    await store.delete(pins.key("a"))
    assert await pins.forget(store, "a", lost_a, now=now)
    assert await pins.index_entry(store, "claude-code", "a", now) is None
    assert pins.tombstone(await store.get(pins.FORGOT_PREFIX + "a")) == pins.Tombstone(
        at=now, since=make("glm").since, expires=pins.expiry(make("glm")))         # the pin it forgot
    assert [x[0] for x in await pins.lost(store, now, await pins.groups(store))] == ["c"]


def test_a_tombstone_is_compared_by_the_pin_it_names_not_by_clocks():
    """``forgot_after``: the same pin forgotten (or a later one) is the operator's whatever the
    clocks say; an older pin's tombstone is not; a tombstone of a lost pin (no ``since``) goes
    by the expiry; an older tombstone (its time alone) by the time; garbage is the operator's."""
    t = '{"at":100.0,"since":50.0,"expires":2000.0}'
    assert pins.forgot_after(t, since=50.0, expires=2000.0, at=500.0)      # served after the forget's clock
    assert pins.forgot_after(t, since=40.0, expires=1990.0, at=500.0)      # an older pin: forgotten too
    assert not pins.forgot_after(t, since=60.0, expires=3000.0, at=50.0)   # a pin made after it: a loss
    lost = '{"at":100.0,"expires":2000.0}'
    assert pins.forgot_after(lost, since=50.0, expires=2000.0, at=500.0)
    assert not pins.forgot_after(lost, since=60.0, expires=3000.0, at=50.0)
    assert pins.forgot_after("100.0", since=50.0, expires=2000.0, at=90.0)
    assert not pins.forgot_after("100.0", since=50.0, expires=2000.0, at=110.0)
    assert pins.forgot_after("garbage", since=50.0, expires=2000.0, at=110.0)
    assert not pins.forgot_after(None, since=50.0, expires=2000.0, at=1.0)


async def test_record_seen_is_one_read_and_one_write_per_flush(store, clock):
    """A flush of many sessions' activity: one read and one apply, not a store call per field
    (fails before: four to five calls per session)."""
    now = clock.t
    cc = "claude-code"
    await store.hset(pins.SEEN_PREFIX + "b", "last", repr(now + 50))     # another proxy saw b later
    await store.hset(pins.SEEN_PREFIX + "b", "requests", "4")
    counting = Counting(store)
    await pins.record_seen(counting, [("a", cc, "glm", now, 3), ("b", cc, "glm", now, 2),
                                      ("c", "opencode", None, now - 10, 1)])
    assert counting.calls == {"hgetall_many": 1, "apply": 1}
    assert await pins.seen(store, "a") == pins.Seen(now, 3)
    assert await pins.seen(store, "b") == pins.Seen(now + 50, 6)       # the later last is kept
    assert await pins.seen(store, "c") == pins.Seen(now - 10, 1)
    for s in "abc":
        assert await store.ttl(pins.SEEN_PREFIX + s) == pytest.approx(pins.PIN_TTL)
    assert await store.zrange(pins.active_key(cc, "glm"), 0, float("inf")) == [("a", now), ("b", now)]
    assert await store.zscore(pins.active_key("opencode", None), "c") == now - 10
    # the next flush adds to the counts and renews the TTL
    clock.t += 100
    await pins.record_seen(store, [("a", cc, "glm", clock.t, 2)])
    assert await pins.seen(store, "a") == pins.Seen(clock.t, 5)
    assert await store.ttl(pins.SEEN_PREFIX + "a") == pytest.approx(pins.PIN_TTL)


async def test_every_durable_change_of_a_pin_counts_one_pin_made_and_nothing_else_does(store, clock):
    """The store's count of pins made (``identity.MADE_KEY``) grows with each creation, move
    and forget, in their own ``apply``: an older copy of the store counts fewer."""
    from sessionpin.store import identity

    assert await identity.made(store) == 0
    got = await pins.create(store, "s", make("glm"))
    assert await identity.made(store) == 1
    assert (await pins.create(store, "s", make("alt"))).pin.server == "glm"       # lost the race: nothing made
    assert await identity.made(store) == 1
    clock.t += pins.RENEW_AFTER
    assert await pins.renew(store, "s", got, clock.t)                           # a renewal is not counted
    assert await identity.made(store) == 1
    moved = make("alt")
    assert await pins.move(store, "s", await pins.load(store, "s"), moved)
    assert await identity.made(store) == 2
    assert await pins.forget(store, "s", await pins.load(store, "s"))
    assert await identity.made(store) == 3
    assert await store.ttl(identity.MADE_KEY) is None                            # never expires
    assert identity.made_writes()[0] in pins.index_writes("t", make())         # a pool's allocation counts too
