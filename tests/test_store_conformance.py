"""The Store rules of sessionpin/store/base.py (redis semantics), for every store we ship.

Each test runs against ``memory:`` and ``file:`` with one injected clock, so TTLs are
exact; a hypothesis test then drives both with the same random operations and demands
the same answers.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessionpin.store import Store, StoreError, WrongType, open_store
from sessionpin.store.memory import prefix_end


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(kind: str, tmp_path, clock) -> Store:
    url = "memory:" if kind == "memory" else f"file:{tmp_path}/store.db"
    return open_store(url, clock=clock)


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path, clock):
    s = make(request.param, tmp_path, clock)
    yield s
    s.close()


def test_is_a_store(store):
    assert isinstance(store, Store)
    assert store.url.split(":")[0] in ("memory", "file")


# -- strings ---------------------------------------------------------------------------

def test_get_set(store):
    assert store.get("a") is None
    assert store.set("a", "1") is True
    assert store.get("a") == "1"
    assert store.set("a", "2") is True
    assert store.get("a") == "2"
    assert store.set("empty", "") is True
    assert store.get("empty") == ""


def test_set_nx(store, clock):
    assert store.set("a", "1", nx=True) is True
    assert store.set("a", "2", nx=True) is False
    assert store.get("a") == "1"
    store.set("t", "old", 5)
    clock.advance(5)
    assert store.set("t", "new", nx=True) is True   # an expired key is absent
    assert store.get("t") == "new"
    assert store.ttl("t") is None


def test_ttl_and_expiry(store, clock):
    store.set("a", "1", 10)
    assert store.ttl("a") == pytest.approx(10)
    clock.advance(9.5)
    assert store.get("a") == "1"
    assert store.ttl("a") == pytest.approx(0.5)
    clock.advance(0.5)
    assert store.get("a") is None
    assert store.ttl("a") is None
    assert store.keys() == []
    assert store.delete("a") is False


def test_set_without_ttl_clears_it(store):
    store.set("a", "1", 10)
    store.set("a", "2")
    assert store.ttl("a") is None


def test_ttl_of_missing_and_persistent(store):
    assert store.ttl("nope") is None
    store.set("a", "1")
    assert store.ttl("a") is None


@pytest.mark.parametrize("ttl", [0, -1, -0.5])
def test_expire_non_positive_deletes(store, ttl):
    store.set("a", "1", 100)
    assert store.expire("a", ttl) is True
    assert store.get("a") is None
    assert store.keys() == []
    store.hset("h", "f", "v")
    assert store.expire("h", ttl) is True
    assert store.hgetall("h") == {}


def test_expire(store, clock):
    assert store.expire("missing", 10) is False
    store.set("a", "1")
    assert store.expire("a", 10) is True
    assert store.ttl("a") == pytest.approx(10)
    clock.advance(10)
    assert store.get("a") is None
    assert store.expire("a", 10) is False


def test_delete(store):
    store.set("a", "1")
    assert store.delete("a") is True
    assert store.delete("a") is False
    store.hset("h", "f", "v")
    assert store.delete("h") is True
    store.hset("h", "g", "w")
    assert store.hgetall("h") == {"g": "w"}  # the old fields went with the key


def test_incr(store, clock):
    assert store.incr("n") == 1
    assert store.incr("n", 10) == 11
    assert store.incr("n", -20) == -9
    assert store.get("n") == "-9"
    store.expire("n", 30)
    clock.advance(10)
    assert store.incr("n") == -8
    assert store.ttl("n") == pytest.approx(20)   # incr keeps the TTL
    clock.advance(20)
    assert store.incr("n") == 1                  # expired: starts again from 0
    assert store.ttl("n") is None


def test_incr_not_an_integer(store):
    store.set("a", "x")
    with pytest.raises(StoreError):
        store.incr("a")
    assert store.get("a") == "x"


# -- hashes ----------------------------------------------------------------------------

def test_hash_basics(store):
    assert store.hget("h", "f") is None
    assert store.hgetall("h") == {}
    store.hset("h", "f", "1")
    store.hset("h", "g", "2")
    store.hset("h", "f", "3")
    assert store.hget("h", "f") == "3"
    assert store.hget("h", "zz") is None
    assert store.hgetall("h") == {"f": "3", "g": "2"}


def test_hsetnx(store):
    assert store.hsetnx("h", "f", "1") is True
    assert store.hsetnx("h", "f", "2") is False
    assert store.hget("h", "f") == "1"


def test_hdel(store):
    store.hset("h", "f", "1")
    store.hset("h", "g", "2")
    assert store.hdel("h", "f") is True
    assert store.hdel("h", "f") is False
    assert store.hdel("nope", "f") is False
    assert store.hdel("h", "g") is True
    assert store.keys() == []                     # an empty hash is no key (redis)


def test_hincr(store):
    assert store.hincr("h", "n") == 1
    assert store.hincr("h", "n", 5) == 6
    assert store.hincr("h", "m", -2) == -2
    assert store.hgetall("h") == {"n": "6", "m": "-2"}
    store.hset("h", "x", "abc")
    with pytest.raises(StoreError):
        store.hincr("h", "x")
    assert store.hget("h", "x") == "abc"


def test_hash_writes_keep_ttl(store, clock):
    store.hset("h", "f", "1")
    store.expire("h", 10)
    store.hset("h", "g", "2")
    store.hincr("h", "n")
    store.hsetnx("h", "z", "1")
    store.hdel("h", "z")
    assert store.ttl("h") == pytest.approx(10)
    clock.advance(10)
    assert store.hgetall("h") == {}
    assert store.hget("h", "f") is None
    assert store.hsetnx("h", "f", "new") is True   # the expired hash's fields are gone
    assert store.hgetall("h") == {"f": "new"}
    assert store.ttl("h") is None


# -- types -----------------------------------------------------------------------------

def test_wrong_type(store):
    store.set("s", "1")
    store.hset("h", "f", "1")
    for call in (
        lambda: store.get("h"),
        lambda: store.incr("h"),
        lambda: store.hget("s", "f"),
        lambda: store.hgetall("s"),
        lambda: store.hset("s", "f", "v"),
        lambda: store.hsetnx("s", "f", "v"),
        lambda: store.hdel("s", "f"),
        lambda: store.hincr("s", "f"),
    ):
        with pytest.raises(WrongType):
            call()
    assert store.get("s") == "1"
    assert store.hgetall("h") == {"f": "1"}
    assert issubclass(WrongType, StoreError)


def test_set_replaces_a_hash(store):
    store.hset("k", "f", "1")
    store.set("k", "v")                      # redis SET overwrites any type
    assert store.get("k") == "v"
    store.delete("k")
    store.hset("k", "g", "2")
    assert store.hgetall("k") == {"g": "2"}  # no field of the first hash came back


def test_expired_key_of_other_type_is_absent(store, clock):
    store.set("k", "v", 1)
    clock.advance(1)
    store.hset("k", "f", "1")                # no WrongType: the string is gone
    assert store.hgetall("k") == {"f": "1"}


# -- keys ------------------------------------------------------------------------------

def test_keys_prefix(store, clock):
    for k in ("pin:a", "pin:b", "pin", "pio", "seen:a", "pin:\U0010ffff", "pin:é"):
        store.set(k, "1")
    store.hset("pin:h", "f", "v")
    store.set("pin:gone", "1", 1)
    assert store.keys("pin:") == ["pin:a", "pin:b", "pin:gone", "pin:h", "pin:é", "pin:\U0010ffff"]
    clock.advance(1)
    assert store.keys("pin:") == ["pin:a", "pin:b", "pin:h", "pin:é", "pin:\U0010ffff"]
    assert store.keys("pi") == ["pin", "pin:a", "pin:b", "pin:h", "pin:é", "pin:\U0010ffff", "pio"]
    assert store.keys("") == sorted(store.keys(""))
    assert len(store.keys()) == 8
    assert store.keys("zzz") == []


@pytest.mark.parametrize("prefix, end", [
    ("", None), ("a", "b"), ("pin:", "pin;"), ("a\U0010ffff", "b"), ("\U0010ffff", None), ("\ud7ff", "\ue000"),
])
def test_prefix_end(prefix, end):
    assert prefix_end(prefix) == end


# -- threads ---------------------------------------------------------------------------

def test_threads_lose_no_update(store):
    def work(i):
        for _ in range(200):
            store.incr("n")
            store.hincr("h", "shared")
            store.hincr("h", f"t{i}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get("n") == "800"
    assert store.hgetall("h") == {"shared": "800", **{f"t{i}": "200" for i in range(4)}}


def test_claim_exactly_once_across_threads(store):
    store.hset("claims", "x", "1")
    wins = []
    barrier = threading.Barrier(4)

    def claim():
        barrier.wait()
        wins.append(store.hdel("claims", "x"))

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == [False, False, False, True]


# -- memory and file agree on any sequence of operations --------------------------------

KEYS = st.sampled_from(["a", "b", "h"])
FIELDS = st.sampled_from(["f", "g"])
VALUES = st.sampled_from(["0", "1", "-3", "x", ""])
TTLS = st.one_of(st.none(), st.sampled_from([-1.0, 0.0, 1.0, 2.5]))
OPS = st.one_of(
    st.tuples(st.just("set"), KEYS, VALUES, TTLS, st.booleans()),
    st.tuples(st.just("get"), KEYS),
    st.tuples(st.just("delete"), KEYS),
    st.tuples(st.just("expire"), KEYS, st.sampled_from([-1.0, 0.0, 1.0, 3.0])),
    st.tuples(st.just("ttl"), KEYS),
    st.tuples(st.just("incr"), KEYS, st.integers(-3, 3)),
    st.tuples(st.just("hget"), KEYS, FIELDS),
    st.tuples(st.just("hgetall"), KEYS),
    st.tuples(st.just("hset"), KEYS, FIELDS, VALUES),
    st.tuples(st.just("hsetnx"), KEYS, FIELDS, VALUES),
    st.tuples(st.just("hdel"), KEYS, FIELDS),
    st.tuples(st.just("hincr"), KEYS, FIELDS, st.integers(-3, 3)),
    st.tuples(st.just("keys"), st.sampled_from(["", "a", "h"])),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 2.0])),
)


def apply(store, clock, op):
    name, *args = op
    if name == "tick":
        clock.advance(args[0])
        return None
    if name == "set":
        key, value, ttl, nx = args
        return store.set(key, value, ttl, nx=nx)
    return getattr(store, name)(*args)


def outcome(store, clock, op):
    try:
        result = apply(store, clock, op)
    except WrongType:
        return "WrongType"
    except StoreError:
        return "StoreError"
    if isinstance(result, float):
        return round(result, 6)
    return result


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, max_size=40))
def test_memory_and_file_agree(tmp_path_factory, ops):
    clock = Clock()
    memory = open_store("memory:", clock=clock)
    path = tmp_path_factory.mktemp("agree") / "s.db"
    file = open_store(f"file:{path}", clock=clock)
    try:
        for op in ops:
            assert outcome(memory, clock, op) == outcome(file, clock, op), op
        assert memory.keys() == file.keys()
    finally:
        file.close()
