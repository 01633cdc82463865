"""The allocator (sessionpin/serverpools/allocate.py): every policy, exhaustion, drains, misses — a table each."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessionpin.serverpools import allocate as A
from sessionpin.config.config import Pool

NOW = 1_800_000_000.0
RR = Pool("glm", ("a", "b", "c"))
H = A.Health


def walk(pool, n, health=None, exclude=frozenset(), cursor=None):
    """``n`` allocations in a row, each from the cursor the previous one left."""
    c = cursor or A.Cursor()
    out = []
    for _ in range(n):
        got = A.choose(pool, c, health or {}, NOW, exclude)
        if not isinstance(got, A.Choice):
            out.append(got)
            break
        out.append(got.member)
        c = got.cursor
    return out


WALKS = [
    ("round-robin: exact", RR, {}, 7, ["a", "b", "c", "a", "b", "c", "a"]),
    ("round-robin: a drained member is skipped, the rest stay in turn", RR, {"b": H(drained=True)}, 4,
     ["a", "c", "a", "c"]),
    ("round-robin: an exhausted member is skipped until its reset", RR, {"a": H(exhausted_until=NOW + 5)}, 3,
     ["b", "c", "b"]),
    ("round-robin: a reset in the past is no exhaustion", RR, {"a": H(exhausted_until=NOW - 1)}, 3, ["a", "b", "c"]),
    ("weighted: a twice per period, never twice in a row", Pool("w", ("a", "b", "c"), "weighted", (("a", 2),)), {},
     8, ["a", "b", "c", "a", "a", "b", "c", "a"]),
    ("weighted 3:1", Pool("w", ("a", "b"), "weighted", (("a", 3),)), {}, 8, ["a", "a", "b", "a"] * 2),
    ("least-active: the fewest pins first, ties take turns",
     Pool("l", ("a", "b", "c"), "least-active"), {"a": H(active=5), "b": H(active=1), "c": H(active=1)}, 3,
     ["b", "c", "b"]),
    ("quota: equal headroom, equal shares", Pool("q", ("a", "b"), "quota"), {}, 4, ["b", "a", "b", "a"]),
    ("quota: an exhausted member is out whatever its headroom", Pool("q", ("a", "b"), "quota"),
     {"a": H(headroom=1.0, exhausted_until=NOW + 60), "b": H(headroom=0.1)}, 2, ["b", "b"]),
]


@pytest.mark.parametrize("pool, health, n, expected", [w[1:] for w in WALKS], ids=[w[0] for w in WALKS])
def test_walks(pool, health, n, expected):
    assert walk(pool, n, health) == expected


def test_every_member_exhausted_gives_the_earliest_reset():
    health = {"a": H(exhausted_until=NOW + 30), "b": H(exhausted_until=NOW + 10), "c": H(drained=True)}
    got = A.choose(RR, A.Cursor(), health, NOW)
    assert got == A.Exhausted(NOW + 10, ("a", "b"))


def test_drained_or_missed_everywhere_is_no_member():
    got = A.choose(RR, A.Cursor(), {"a": H(drained=True), "b": H(drained=True)}, NOW, frozenset({"c"}))
    assert isinstance(got, A.NoMember)
    assert "a drained" in got.why and "b drained" in got.why and "c missed" in got.why


def test_a_miss_goes_to_the_best_fresh_member():
    assert walk(RR, 2, exclude=frozenset({"a"})) == ["b", "c"]


def test_the_cursor_advances_past_the_choice_and_records_the_revision():
    got = A.choose(RR, A.Cursor(7, "old"), {"b": H(drained=True)}, NOW)
    # 7 % 3 = 1 -> b is drained, c at position 8 is chosen: the cursor goes to 9
    assert got == A.Choice("c", A.Cursor(9, RR.revision), "pool glm: round-robin → c")


def test_cursor_text():
    assert A.decode_cursor(A.encode_cursor(A.Cursor(5, "r"))) == A.Cursor(5, "r")
    for bad in (None, "", "{", '{"n": -3}', '"x"', '{"n": "x"}'):
        assert A.decode_cursor(bad) == A.Cursor()


WAITS = [
    ("reset within the deadline: wait for it, in steps of at most 1 s", NOW + 0.4, NOW + 10, 0.4),
    ("a far reset within the deadline: look again in a second", NOW + 5, NOW + 10, 1.0),
    ("reset beyond the deadline: give up now", NOW + 11, NOW + 10, None),
    ("deadline passed", NOW + 1, NOW, None),
]


@pytest.mark.parametrize("until, deadline, expected", [w[1:] for w in WAITS], ids=[w[0] for w in WAITS])
def test_wait(until, deadline, expected):
    got = A.wait(A.Exhausted(until, ("a",)), NOW, deadline)
    assert got == pytest.approx(expected) if expected is not None else got is None


def test_retry_after_is_whole_seconds_at_least_one():
    assert A.retry_after(NOW + 0.2, NOW) == 1
    assert A.retry_after(NOW + 30.1, NOW) == 31
    assert A.retry_after(NOW - 5, NOW) == 1


@given(members=st.integers(1, 6), start=st.integers(0, 10_000), n=st.integers(1, 40))
def test_round_robin_never_skips_or_doubles(members, start, n):
    pool = Pool("p", tuple(f"m{i}" for i in range(members)))
    got = walk(pool, n, cursor=A.Cursor(start, pool.revision))
    counts = [got.count(m) for m in pool.members]
    assert max(counts) - min(counts) <= 1
    assert all(got[i] != got[i + 1] for i in range(len(got) - 1)) or members == 1


@given(weights=st.lists(st.integers(1, 5), min_size=1, max_size=5))
def test_weighted_gives_each_member_its_weight_per_period(weights):
    members = tuple(f"m{i}" for i in range(len(weights)))
    pool = Pool("w", members, "weighted", tuple(zip(members, weights)))
    got = walk(pool, sum(weights))
    assert [got.count(m) for m in members] == weights


QUOTA = Pool("q", ("a", "b", "c"), "quota")


def shares(health, members=("a", "b", "c")):
    w = {m: A._headroom(health.get(m, H())) for m in members}
    return {m: w[m] / sum(w.values()) for m in members}


@given(start=st.integers(0, 10**9), n=st.integers(1, 300),
       heads=st.lists(st.one_of(st.none(), st.floats(0, 1)), min_size=3, max_size=3))
def test_quota_gives_each_member_its_headroom_s_share(start, n, heads):
    """Any run of consecutive allocations, from any cursor: each member within a few
    conversations of its share (headroom over the total; unknown counts as full)."""
    health = {m: H(headroom=h) for m, h in zip("abc", heads)}
    got = walk(QUOTA, n, health, cursor=A.Cursor(start, QUOTA.revision))
    for m, share in shares(health).items():
        assert abs(got.count(m) - share * n) <= 3, (m, got.count(m), share * n)


def test_quota_a_lying_member_gets_no_more_than_a_full_member_s_share():
    # "remaining 1000000 of a limit of 1" is headroom 1.0 (quota.observe): what a member that
    # said nothing, or a full one, counts for. Honest members at 80 %: 1/2.6 of 30 is 11.5.
    liar = {"a": H(headroom=1.0), "b": H(headroom=0.8), "c": H(headroom=0.8)}
    got = walk(QUOTA, 30, liar)
    assert got.count("a") <= 13 and got.count("b") >= 9 and got.count("c") >= 9, got
    # a headroom claimed above 1 (a store written by anyone) counts as 1
    assert walk(QUOTA, 30, {**liar, "a": H(headroom=1e300)}) == got
    # nothing it claims gets it more than round-robin would when the others are full
    assert walk(QUOTA, 30, {"a": H(headroom=1.0)}).count("a") == 10


def test_quota_a_member_that_last_said_empty_is_still_asked_now_and_then():
    got = walk(QUOTA, 200, {"a": H(headroom=0.0), "b": H(headroom=1.0), "c": H(headroom=1.0)})
    assert 2 <= got.count("a") <= 8
