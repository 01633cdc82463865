import msgspec
import pytest

from sessionpin import pins
from sessionpin.store import open_store


@pytest.fixture
def store():
    s = open_store("memory:")
    yield s
    s.close()


def pin(agent="claude-code", server="glm", at=1000.0):
    return pins.Pin(agent=agent, server=server, since=at, renewed=at, rule="opening", turn="opening")


def test_create_then_load_round_trips(store):
    made = pins.create(store, "s1", pin())
    assert made == pin()
    assert pins.load(store, "s1") == pin()
    ttl = store.ttl(pins.key("s1"))
    assert ttl is not None and pins.PIN_TTL - 5 < ttl <= pins.PIN_TTL


def test_create_never_overwrites_an_existing_pin(store):
    pins.create(store, "s1", pin(server="glm"))
    # A second proxy racing to pin the same session reads the first pin back.
    assert pins.create(store, "s1", pin(server="anthropic")).server == "glm"
    assert pins.load(store, "s1").server == "glm"


def test_not_routed_pin_round_trips(store):
    pins.create(store, "s1", pin(server=None))
    assert pins.load(store, "s1").server is None


@pytest.mark.parametrize("garbage", ["", "{}", "null", "[]", "not json", '{"agent": ""}',
                                     '{"renewed": 5}', '{"agent": 3, "server": "x"}'])
def test_a_value_that_is_not_a_pin_reads_as_no_pin(store, garbage):
    store.set(pins.key("s1"), garbage)
    assert pins.load(store, "s1") is None


def test_create_replaces_a_value_that_is_not_a_pin(store):
    store.set(pins.key("s1"), "{}")
    assert pins.create(store, "s1", pin()).server == "glm"
    assert pins.load(store, "s1") == pin()


def test_renewal_at_most_once_a_day(store):
    p = pins.create(store, "s1", pin(at=0.0))
    assert not pins.renew_due(p, pins.DAY - 1)
    assert pins.renew_due(p, pins.DAY)
    fresh = pins.renew(store, "s1", p, pins.DAY)
    assert fresh.renewed == pins.DAY and fresh.since == 0.0
    assert pins.load(store, "s1") == fresh


def test_sessions_lists_valid_pins_only(store):
    pins.create(store, "a", pin())
    pins.create(store, "b", pin(agent="opencode", server=None))
    store.set(pins.key("junk"), "nope")
    store.set("other:key", "x")
    assert dict(pins.sessions(store)) == {"a": pin(), "b": pin(agent="opencode", server=None)}


def test_forget_removes_pin_and_activity(store):
    pins.create(store, "s1", pin())
    pins.record_seen(store, "s1", 50.0, 3)
    assert pins.forget(store, "s1")
    assert pins.load(store, "s1") is None
    assert pins.seen(store, "s1") == pins.Seen()
    assert not pins.forget(store, "s1")


def test_activity_accumulates_and_keeps_latest(store):
    pins.record_seen(store, "s1", 50.0, 3)
    pins.record_seen(store, "s1", 40.0, 2)  # an older flush from another proxy
    assert pins.seen(store, "s1") == pins.Seen(50.0, 5)


def test_pin_record_holds_ids_and_names_only():
    # Nothing from a prompt can be in a pin: its fields are fixed and typed.
    assert {f.name for f in msgspec.structs.fields(pins.Pin)} == {"agent", "server", "since", "renewed", "rule", "turn", "v"}


def test_renewal_never_undoes_an_operator_move_or_forget(store):
    p = pins.create(store, "s1", pin(at=0.0))
    moved = pins.Pin(agent="claude-code", server="anthropic", since=5.0, renewed=5.0, rule="operator")
    pins.put(store, "s1", moved)                     # `sessionpin move` after the request read p
    assert pins.renew(store, "s1", p, pins.DAY) == moved
    assert pins.load(store, "s1") == moved
    pins.forget(store, "s1")                         # `sessionpin forget` likewise
    pins.renew(store, "s1", moved, 2 * pins.DAY)
    assert pins.load(store, "s1") is None
