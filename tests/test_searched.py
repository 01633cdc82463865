"""searched: a large body's tail searches skip the bytes the last body had searched empty, and
every answer is the search's (byte for byte what it finds without them)."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings, strategies as st

from sessionpin.reader import largebody, searched, wire


@pytest.fixture(autouse=True)
def nothing_kept():
    searched.forget()
    yield
    searched.forget()


def _history(turns: int, session: str = "s1") -> list[dict]:
    messages = [{"role": "user", "content": f"({session}) fix the failing test"}]
    for i in range(turns):
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "Bash",
                                               "input": {"command": f"cat part{i}.txt"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "x" * 900}]}]
    return messages


def _body(messages: list[dict], **tail) -> bytes:
    doc = {"model": "claude-opus-4-5", "messages": messages, "system": "s", "tools": [],
           "metadata": {"user_id": "u"}, "max_tokens": 64, "stream": True, **tail}
    return json.dumps(doc, separators=(",", ":")).encode()


def _next_turn(messages: list[dict]) -> list[dict]:
    """The next turn as a client sends it: the last message's cache mark moved, two more."""
    grown = json.loads(json.dumps(messages))
    grown[-1]["content"][0]["cache_control"] = {"type": "ephemeral"}
    return grown + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "and now?"}]


def _steps(fn) -> int:
    wire.STEPS.n = 0
    fn()
    return wire.STEPS.n


def test_the_next_turn_searches_only_its_new_bytes_and_reads_the_same_facts():
    """The second top-level "model" that must not be there, and ``prompt_cache_key``: searched
    through the whole history on the first turn, on the next only past the bytes they share."""
    first = _body(_history(300))
    second = _body(_next_turn(_history(300)))
    assert len(first) > largebody.FAST_MIN
    cold = _steps(lambda: largebody.fast_decode(second, "anthropic", cache_key=True))
    expected = largebody.fast_decode(second, "anthropic", cache_key=True)
    searched.forget()
    largebody.fast_decode(first, "anthropic", cache_key=True)
    got = []
    warm = _steps(lambda: got.append(largebody.fast_decode(second, "anthropic", cache_key=True)))
    assert got[0] == expected and expected is not None and expected[0].model == "claude-opus-4-5"
    assert cold > 2 * len(second) and warm < len(second) // 20, (cold, warm)


@pytest.mark.parametrize("added", [b',"model":"other"', b',"prompt_cache_key":"k"', b', "model" : "other"'])
def test_a_member_added_where_the_bodies_part_is_still_found(added):
    """A top-level member put just past the bytes two bodies share (a second model, a cache key)
    is found as it is without the memo: the search starts a needle's length before the end."""
    messages = _history(300)
    first = _body(messages)
    at = first.index(b'],"system"') + 1          # just past the messages array
    second = first[:at] + added + first[at:]
    searched.forget()
    expected = largebody.fast_decode(second, "anthropic", cache_key=True)
    searched.forget()
    largebody.fast_decode(first, "anthropic", cache_key=True)
    assert searched._kept, "the first body's searches are kept"
    assert largebody.fast_decode(second, "anthropic", cache_key=True) == expected
    if b"model" in added:
        assert expected is None          # a duplicate top-level model: the whole read decides
    else:
        assert expected is not None and expected[0].prompt_cache_key == "k"


NEEDLE_KEY = b"m"
TOKENS = st.sampled_from([b'"m"', b'"m', b'm"', b'"', b"m", b",", b":", b"{", b" ", b"x"])


@settings(max_examples=400, deadline=None)
@given(st.lists(TOKENS, max_size=30).map(b"".join), st.lists(TOKENS, max_size=20).map(b"".join),
       st.integers(min_value=0, max_value=60), st.integers(min_value=0, max_value=8))
@example(b'x,"m"x', b',"m":', 6, 0)          # a member just past the shared bytes
@example(b',"m', b'":', 3, 0)                # a member's name astride the end of the shared bytes
@example(b',"m":x', b'x', 3, 0)              # … and the earlier body's own member past it
@example(b',xxxxx', b'"m":', 1, 0)            # the earlier body searched empty past the shared bytes
def test_a_search_with_the_memo_finds_what_it_finds_without(old, tail, cut, lo):
    """Any earlier body, any next body sharing any prefix of it: ``_key_before`` answers the
    same with what the earlier body's search left as without it."""
    cut = min(cut, len(old))
    new = old[:cut] + tail
    lo = min(lo, len(old), len(new))
    probe, searched.PROBE = searched.PROBE, 1
    try:
        searched.forget()
        memo = searched.Memo(old, lo)
        largebody._key_before(old, NEEDLE_KEY, lo, len(old), None, memo)
        memo.keep()
        expected = largebody._key_before(new, NEEDLE_KEY, lo, len(new))
        memo = searched.Memo(new, lo)
        assert largebody._key_before(new, NEEDLE_KEY, lo, len(new), None, memo) == expected
        # and what this search leaves is as true: a third body, the same as this one
        memo.keep()
        assert largebody._key_before(new, NEEDLE_KEY, lo, len(new), None, searched.Memo(new, lo)) == expected
    finally:
        searched.PROBE = probe


@given(st.binary(max_size=50), st.binary(max_size=50), st.integers(min_value=0, max_value=60))
def test_shared_counts_the_bytes_two_bodies_begin_with(a, b, upto):
    alike = 0
    while alike < min(len(a), len(b)) and a[alike] == b[alike]:
        alike += 1
    assert searched.shared(a, b, upto) == min(alike, upto)


def test_only_bytes_are_kept_and_within_the_budget(monkeypatch):
    """A buffer that could change is never kept (what it held could be other bytes next time);
    the kept bodies stay within ``COUNT`` and ``BUDGET``."""
    data = bytearray(b'[' + b'x' * 100)
    memo = searched.Memo(data, 0)      # type: ignore[arg-type]
    memo.clean(b'"m"', len(data))
    memo.keep()
    assert searched._kept == []
    monkeypatch.setattr(searched, "BUDGET", 1000)
    for i in range(20):
        body = bytes([65 + i]) * 300
        memo = searched.Memo(body, 0)
        memo.clean(b'"m"', len(body))
        memo.keep()
    assert len(searched._kept) <= searched.COUNT and sum(len(k[0]) for k in searched._kept) <= 1000
    assert searched._kept[0][0] == bytes([65 + 19]) * 300          # the most recent first
