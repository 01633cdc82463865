"""searched: a large body's tail searches skip the bytes the last body had searched empty, and
every answer is the search's (byte for byte what it finds without them)."""

from __future__ import annotations

import json
from pathlib import Path

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


def _searched(fn) -> int:
    """The bytes ``fn``'s finds looked through (``largebody._find``: each from its end back to
    what it found, or to its start). The compares that spare them are counted in ``wire.STEPS``
    with every other scan; a find costs ~1.8 instructions a byte, a compare (memcmp) a tenth."""
    scanned = [0]
    real = largebody._find

    def find(data, needle, lo, hi, last):
        p = real(data, needle, lo, hi, last)
        scanned[0] += (hi - p if last else p + len(needle) - lo) if p != -1 else hi - lo
        return p

    largebody._find = find
    try:
        fn()
    finally:
        largebody._find = real
    return scanned[0]


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
    cold = _searched(lambda: largebody.fast_decode(second, "anthropic", cache_key=True))
    searched.forget()
    cold_steps = _steps(lambda: largebody.fast_decode(second, "anthropic", cache_key=True))
    expected = largebody.fast_decode(second, "anthropic", cache_key=True)
    searched.forget()
    largebody.fast_decode(first, "anthropic", cache_key=True)
    got = []
    warm = _searched(lambda: got.append(largebody.fast_decode(second, "anthropic", cache_key=True)))
    searched.forget()
    largebody.fast_decode(first, "anthropic", cache_key=True)
    warm_steps = _steps(lambda: largebody.fast_decode(second, "anthropic", cache_key=True))
    assert got[0] == expected and expected is not None and expected[0].model == "claude-opus-4-5"
    assert cold > 1.9 * len(second) and warm < len(second) // 100, (cold, warm)
    # the compares that spare the finds, counted as scans too: within what the finds were
    assert warm_steps <= cold_steps * 1.1, (cold_steps, warm_steps)


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


# pieces of a messages array and of a tail: look-alikes of the names searched for, nested in
# every way the search turns one down (its neighbours, a nested object's first member, a
# decode that fails, inside the tail already found), and top-level members after the array
ITEMS = st.sampled_from([
    b'{"role":"user","content":"go"}', b'{"a":1,"model":2}', b'{"model":{"x":1}}', b'"\\"model\\""',
    b'{"tools":[1,{"model":3}]}', b'{"x":"tools","model" :[]}', b'{"y":[{"tools":{}}],"stream":0}',
    b'"model"', b'{"prompt_cache_key":"k","z":{"model":"m"}}', b'{"content":"a,\\"model\\":1"}'])
TAILS = st.sampled_from([
    b',"tools":[{"name":"Agent","input_schema":{"model":{"type":"string"}}}]', b',"stream":true',
    b',"model":"other"', b',"prompt_cache_key":"c"', b',"x":{"model":1}', b', "tools" : []', b',"x":{"a":1,"model":1}',
    b''])
FIXTURES = Path(__file__).parent / "fixtures" / "traffic"
NAMES = ["tools", "stream", "prompt_cache_key", "model"]
OTHER_NAMES = ["x", "model"]


def _generated(items: list[bytes], tail: list[bytes]) -> bytes:
    return b'{"model":"m","messages":[' + b",".join(items) + b"]" + b"".join(tail) + b"}"


JUNK = st.lists(st.sampled_from([b":", b"1", b"}", b"]", b",", b" ", b'"', b"{", b'"model"', b'"x"']),
                max_size=6).map(b"".join)


@settings(max_examples=500, deadline=None)
@given(st.lists(ITEMS, max_size=12), st.lists(TAILS, max_size=3), st.integers(min_value=0, max_value=12),
       st.lists(ITEMS, max_size=4), st.lists(TAILS, max_size=3), st.integers(min_value=0, max_value=400),
       JUNK, st.integers(min_value=0, max_value=400), JUNK)
@example([b'{"role":"user","content":"go"}', b'"model"'], [], 0, [], [], 63, b":1}", 0, b"")  # turned down by a byte past the cut
@example([b'{"role":"user","content":"go"}', b'"model"'], [], 2, [], [], 63, b":1}", 0, b"")  # … by a body two back
@example([b'{"a":1,"model":2}'], [], 0, [], [], 41, b"}", 0, b"")   # a decode that failed past the cut
@example([], [b',"stream":true', b',"x":{"a":1,"model":1}'], 0, [], [], 62, b"", 0, b"")   # inside the tail found
def test_a_tail_read_with_the_memo_is_the_tail_read_without(items, tail, keep, more, new_tail, cut, junk, cut2, junk2):
    """Bodies one after the other — an earlier one, its items (some) and more, its bytes cut
    anywhere and anything put after, itself again, the second cut: ``tail_members`` reads the
    same members of each with what the bodies before it left known as without (the budgets
    lifted, so only the memo differs)."""
    old = _generated(items, tail)
    grown = _generated(items[:keep] + more, new_tail)
    bodies = [old, grown, old[:cut] + junk, old, grown[:cut2] + junk2, grown]
    probe, budget, hits = searched.PROBE, largebody.TAIL_BUDGET, largebody.TAIL_HITS
    searched.PROBE, largebody.TAIL_BUDGET, largebody.TAIL_HITS = 1, 10**9, 10**9
    lo = 25                          # past '{"model":"m","messages":' in every body
    try:
        for i, body in enumerate(bodies):
            for names in (NAMES, OTHER_NAMES):      # (the facts' keys, then the lineage's: kept together)
                kept = list(searched._kept)
                searched.forget()
                expected = largebody.tail_members(body, names, lo)
                searched._kept[:] = kept
                assert largebody.tail_members(body, names, lo) == expected, (bodies[:i + 1], names)
    finally:
        searched.PROBE, largebody.TAIL_BUDGET, largebody.TAIL_HITS = probe, budget, hits


def test_codex_nested_tools_are_not_proved_nested_again():
    """Codex's first input item holds ``"tools"`` (four times, nested); the top level has none.
    A first read proves each nested (a decode, a copy of the body); the next turn's read, the
    same bytes and more, does not. (A recorded Codex request, its history repeated to ~1 MB.)"""
    doc = json.loads((FIXTURES / "codex/exec-lineage-06-tool-result.json").read_text())["body"]
    items = doc["input"]
    while len(json.dumps(doc)) < 1_000_000:
        doc["input"] = doc["input"] + items[1:]

    def body(n: int) -> bytes:
        return json.dumps(dict(doc, input=doc["input"][:n]), separators=(",", ":")).encode()

    first, second = body(len(doc["input"]) - 2), body(len(doc["input"]))
    assert second.count(b'"tools"') == 4 and len(first) > largebody.FAST_MIN
    cold = _steps(lambda: largebody.fast_decode(second, "responses"))
    expected = largebody.fast_decode(second, "responses")
    searched.forget()
    largebody.fast_decode(first, "responses")
    got = []
    warm = _steps(lambda: got.append(largebody.fast_decode(second, "responses")))
    assert got[0] == expected and expected is not None and expected[0].prompt_cache_key
    # cold: a find through the body, two copies of it, a decode per look-alike; warm: the
    # compare with the first body (counted as the bytes it may read) and the first items walked
    assert cold > 3 * len(second) and warm < cold / 2, (cold, warm)
    assert _searched(lambda: largebody.fast_decode(second, "responses")) < len(second) // 100


def test_the_facts_and_the_lineage_keep_each_others_findings():
    """The facts' reader and the lineage's search the same body for other keys, one after the
    other: neither's findings are lost to the other's, so the next turn's reads of both search
    only its new bytes."""
    first = _body(_history(300))
    second = _body(_next_turn(_history(300)))
    lo = first.index(b"[")
    largebody.tail_members(first, ["stream", "model"], lo)           # the facts' keys
    largebody.tail_members(first, ["system", "diagnostics"], lo)     # the lineage's
    searched_bytes = _searched(lambda: largebody.tail_members(second, ["stream", "model"], lo))
    assert searched_bytes < len(second) // 100, searched_bytes
    searched_bytes = _searched(lambda: largebody.tail_members(second, ["system", "diagnostics"], lo))
    assert searched_bytes < len(second) // 100, searched_bytes
    searched.forget()
    assert _searched(lambda: largebody.tail_members(second, ["system", "diagnostics"], lo)) > len(second)
