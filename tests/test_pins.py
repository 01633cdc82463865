"""Pins over the async store: compare-and-set on every change, the per-server index."""

from __future__ import annotations

import msgspec
import pytest

from sessionpin import pins
from sessionpin.pins import Loaded, Pin
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


async def test_the_index_says_which_missing_pins_were_lost(store, clock):
    await pins.create(store, "a", make("glm"))
    await pins.create(store, "b", make("alt"))
    now = clock.t
    await store.delete(pins.key("a"))                                           # lost
    assert await pins.indexed(store, "claude-code", "a", now) == ("glm", pins.expiry(make("glm")))
    assert await pins.indexed(store, "codex", "a", now) is None                 # another agent's index
    assert await pins.indexed(store, "claude-code", "a", pins.expiry(make("glm")) + 1) is None   # expired
    assert await pins.forget(store, "b", await pins.load(store, "b"))
    assert await pins.indexed(store, "claude-code", "b", now) is None           # forgotten: unindexed
    assert await pins.drop_lost(store, now) == 1                                # the operator accepts "a"
    assert await pins.indexed(store, "claude-code", "a", now) is None
    assert await pins.drop_lost(store, now) == 0
