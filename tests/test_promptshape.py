"""A request's prompt as a cache sees it: digests and sizes, and where a later request departs from it."""

import bisect
import gzip
import json
from pathlib import Path

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from sessionpin.reader import facts as F
from sessionpin.reader import promptshape
from sessionpin.reader.promptshape import Difference, Shape, compare, repeated, shape

TRAFFIC = Path(__file__).parent / "fixtures" / "traffic"


def body(**kw) -> bytes:
    return json.dumps(kw).encode()


TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}}]
SYSTEM = [{"type": "text", "text": "you are a coding agent"}]


def turn(n: int, marker_at: int | None = None, **over) -> bytes:
    msgs = []
    for i in range(n):
        m = {"role": "user" if i % 2 == 0 else "assistant", "content": [{"type": "text", "text": f"message {i}"}]}
        if i == marker_at:
            m["content"][0]["cache_control"] = {"type": "ephemeral"}
        msgs.append(m)
    kw = {"model": "claude-opus-5-5", "system": SYSTEM, "tools": TOOLS, "messages": msgs, **over}
    return body(**kw)


def test_a_history_that_only_grew_repeats_all_of_the_previous_prompt():
    prev, cur = shape(turn(3, marker_at=2), F.ANTHROPIC_MESSAGES), shape(turn(5, marker_at=4), F.ANTHROPIC_MESSAGES)
    assert len(cur.messages) == 5 and cur.messages[:3] == prev.messages   # the moved breakpoint changes nothing
    d = compare(prev, cur)
    assert d.share == 1.0 and d.kind == "" and d.at is None


def test_the_first_difference_is_named():
    prev = shape(turn(5), F.ANTHROPIC_MESSAGES)
    edited = json.loads(turn(7))
    edited["messages"][3]["content"][0]["text"] = "compacted"
    d = compare(prev, shape(json.dumps(edited).encode(), F.ANTHROPIC_MESSAGES))
    assert d.kind == "messages" and d.at == 3 and 0 < d.share < 1
    assert compare(prev, shape(turn(7, model="claude-haiku-5"), F.ANTHROPIC_MESSAGES)).kind == "model"
    assert compare(prev, shape(turn(7, tools=TOOLS * 2), F.ANTHROPIC_MESSAGES)).kind == "tools"
    sys_changed = compare(prev, shape(turn(7, system="another"), F.ANTHROPIC_MESSAGES))
    assert sys_changed.kind == "system" and 0 < sys_changed.share < 0.5


def test_chat_leading_system_messages_are_the_system_prompt():
    def chat(system: str, n: int) -> bytes:
        return body(model="kimi", messages=[{"role": "system", "content": system}] +
                    [{"role": "user", "content": f"m{i}"} for i in range(n)])
    a, b = shape(chat("s1", 2), F.OPENAI_CHAT), shape(chat("s2", 3), F.OPENAI_CHAT)
    assert len(a.messages) == 2 and a.system
    assert compare(a, b).kind == "system"
    assert compare(a, shape(chat("s1", 3), F.OPENAI_CHAT)).share == 1.0


def test_responses_instructions_and_a_stored_history():
    a = shape(body(model="gpt", instructions="i", input=[{"role": "user", "content": "x"}]), F.OPENAI_RESPONSES)
    b = shape(body(model="gpt", instructions="i", input=[{"role": "user", "content": "y"}],
                   previous_response_id="resp_1"), F.OPENAI_RESPONSES)
    assert b.partial and compare(a, b).share == 1.0


def test_a_compressed_body_and_bad_input():
    raw = turn(3)
    assert shape(gzip.compress(raw), F.ANTHROPIC_MESSAGES, "gzip") == shape(raw, F.ANTHROPIC_MESSAGES)
    assert shape(b"{not json", F.ANTHROPIC_MESSAGES) is None
    assert shape(None, F.ANTHROPIC_MESSAGES) is None
    assert shape(raw, F.OTHER) is None


def _recorded(name):
    d = json.loads((TRAFFIC / "claude-code" / name).read_text())
    return shape(json.dumps(d["body"], separators=(",", ":"), ensure_ascii=False).encode(), F.ANTHROPIC_MESSAGES)


def test_recorded_claude_code_turns_continue_their_history():
    # One recorded interactive conversation: each main turn repeats the whole previous prompt,
    # though the billing line changes every request, the cache breakpoint moves to the newest
    # message, and that message goes from one marked text block to a string.
    names = ["interactive-04-opening.json", "interactive-05-tool-result.json", "interactive-06-continuation.json",
             "interactive-08-tool-result.json", "interactive-09-continuation.json", "interactive-11-tool-result.json"]
    shapes = [_recorded(n) for n in names]
    for a, b in zip(shapes, shapes[1:]):
        assert compare(a, b) == compare(a, a) == Difference(share=1.0)
        assert len(b.messages) > len(a.messages) and a.tools and a.system


def test_recorded_compaction_rewrites_the_history_from_its_first_message():
    d = compare(_recorded("interactive-19-compaction.json"), _recorded("interactive-20-after-compaction.json"))
    assert d.kind == "messages" and d.at == 0 and 0 < d.share < 1


def test_digests_kept_between_requests_give_the_same_shape_and_skip_repeated_messages(monkeypatch):
    from sessionpin.reader import promptshape
    names = ["interactive-04-opening.json", "interactive-05-tool-result.json", "interactive-06-continuation.json",
             "interactive-08-tool-result.json", "interactive-09-continuation.json", "interactive-11-tool-result.json",
             "interactive-19-compaction.json", "interactive-20-after-compaction.json"]
    bodies = []
    for n in names:
        d = json.loads((TRAFFIC / "claude-code" / n).read_text())
        bodies.append(json.dumps(d["body"], separators=(",", ":"), ensure_ascii=False).encode())
    worked = []
    digest = promptshape._digest
    monkeypatch.setattr(promptshape, "_digest", lambda raw, message=False, **kw: worked.append(message) or
                        digest(raw, message, **kw))
    seen: promptshape.Seen = {}
    before = None
    for i, b in enumerate(bodies):
        cold = shape(b, F.ANTHROPIC_MESSAGES)
        worked.clear()
        assert shape(b, F.ANTHROPIC_MESSAGES, seen=seen) == cold
        if 0 < i < 6:       # one continuing conversation (then a compaction rewrites it)
            # only the messages new since the last request, and the one whose mark moved
            assert worked.count(True) <= len(cold.messages) - len(before.messages) + 1 < len(cold.messages)
        before = cold
    worked.clear()
    assert shape(bodies[-1], F.ANTHROPIC_MESSAGES, seen=seen) is not None and worked.count(True) == 0


def test_a_new_message_is_read_once_for_its_crc_unless_its_bytes_change(monkeypatch):
    """A message seen for the first time: the CRC of its key is its digest's when no cache
    mark is cut and its form is kept (one pass over its bytes, not two); a message with a mark,
    or one text as blocks, is digested from its changed bytes — the same digests either way."""
    import zlib
    calls = []

    class Counting:
        @staticmethod
        def crc32(data, *a):
            calls.append(len(data))
            return zlib.crc32(data, *a)
    plain = json.dumps({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                     "content": "x" * 5000}]}).encode()
    marked = json.dumps({"role": "user", "content": [{"type": "text", "text": "y" * 5000,
                                                      "cache_control": {"type": "ephemeral"}}]}).encode()
    one_text = json.dumps({"role": "user", "content": [{"type": "text", "text": "z" * 5000}]}).encode()
    for raw, passes in ((plain, 1), (marked, 2), (one_text, 2)):
        want = promptshape._digest(raw, message=True)
        monkeypatch.setattr(promptshape, "zlib", Counting)
        calls.clear()
        assert promptshape._message_digest(msgspec.Raw(raw), {}) == want
        monkeypatch.setattr(promptshape, "zlib", zlib)
        assert len(calls) == passes, raw[:40]


def test_the_digests_kept_are_bounded(monkeypatch):
    from sessionpin.reader import promptshape
    monkeypatch.setattr(promptshape, "SEEN_BOUND", 10)
    seen: promptshape.Seen = {}
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"m{i}"} for i in range(40)]}).encode()
    assert shape(body, F.ANTHROPIC_MESSAGES, seen=seen) == shape(body, F.ANTHROPIC_MESSAGES)
    assert len(seen) <= 10

def test_a_history_past_max_items_has_no_shape_and_is_not_digested(monkeypatch):
    """Issue 20: the body reader asks for no shape past 50,000 messages (a digest each, in Python)."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * 5}).encode()
    digested = []
    real = promptshape._digest
    monkeypatch.setattr(promptshape, "_digest", lambda *a, **k: digested.append(1) or real(*a, **k))
    assert promptshape.shape(body, F.ANTHROPIC_MESSAGES, max_items=4) is None and digested == []
    assert len(promptshape.shape(body, F.ANTHROPIC_MESSAGES, max_items=5).messages) == 5


_MARKER_BITS = [b'"cache_control"', b'"cache_control":{"type":"ephemeral"}', b",", b" ", b"\n", b"\t",
                b":", b"{", b"}", b'"', b"x", b"\\", b"\x0b", b"\x0c", b'{"a":1}', b' : ', b", "]


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(_MARKER_BITS), max_size=40))
def test_markers_are_removed_as_the_regex_removes_them(bits):
    """Issue 22: ``_unmarked`` (find the key, match there) removes exactly what
    ``_MARKER.sub`` removes — the regex took 5 ms on a real 144 KB system prompt."""
    raw = b"".join(bits)
    assert promptshape._unmarked(raw) == promptshape._MARKER.sub(b"", raw)


def test_markers_in_a_real_system_prompt_are_removed_as_the_regex_removes_them():
    for p in sorted(Path(__file__).parent.glob("fixtures/traffic/claude-code/*.json")):
        body = json.loads(p.read_text())["body"]
        raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        assert promptshape._unmarked(raw) == promptshape._MARKER.sub(b"", raw), p.name


def test_tools_and_system_remembered_give_the_digests_worked_out_afresh(monkeypatch):
    """The tools array and the system prompt, the same bytes every turn, are remembered with
    their digests (``_digest_whole``); a different array of the same length is not taken for
    the remembered one, and what is remembered is bounded in number and size."""
    monkeypatch.setattr(promptshape, "_whole", [])
    tools = [{"name": "t%d" % i, "input_schema": {"type": "object"}} for i in range(50)]
    body = {"model": "m", "system": "sys " * 300, "tools": tools,
            "messages": [{"role": "user", "content": "hi"}]}
    first = shape(json.dumps(body).encode(), F.ANTHROPIC_MESSAGES)
    again = shape(json.dumps(body).encode(), F.ANTHROPIC_MESSAGES)
    monkeypatch.setattr(promptshape, "_whole", [])
    fresh = shape(json.dumps(body).encode(), F.ANTHROPIC_MESSAGES)
    assert first == again == fresh and first.tools and first.system
    other = json.loads(json.dumps(body))
    other["tools"][7]["name"] = "u7"                     # same length, one byte apart
    changed = shape(json.dumps(other).encode(), F.ANTHROPIC_MESSAGES)
    assert changed.tools_len == first.tools_len and changed.tools != first.tools
    assert changed.system == first.system
    for i in range(3 * promptshape.WHOLE_MEMO):
        promptshape._digest_whole(b"x" * i)
    promptshape._digest_whole(b"y" * (promptshape.WHOLE_MEMO_MAX + 1))
    assert len(promptshape._whole) == promptshape.WHOLE_MEMO
    assert all(len(raw) <= promptshape.WHOLE_MEMO_MAX for raw, _ in promptshape._whole)


def test_a_shape_from_the_raw_members_is_the_shape_of_the_body():
    """``members`` (the facts reader's decode of the body's top level): every recorded request's
    shape, and a body with a field of the wrong type (no shape either way)."""
    from sessionpin.reader import wire
    n = 0
    for path in sorted(TRAFFIC.glob("*/*.json")):
        fx = json.loads(path.read_text())
        if not isinstance(fx.get("body"), dict):
            continue
        api = F.api_of(fx["method"], fx["url"])
        data = json.dumps(fx["body"], separators=(",", ":")).encode()
        assert shape(data, api, members=wire.loose_decoder.decode(data)) == shape(data, api), path.name
        n += 1
    assert n > 50
    bad = b'{"model": 5, "messages": []}'
    assert shape(bad, F.ANTHROPIC_MESSAGES) is None
    assert shape(bad, F.ANTHROPIC_MESSAGES, members=wire.loose_decoder.decode(bad)) is None


def test_a_marker_behind_megabytes_of_spaces_is_cut_in_c_time():
    """The spaces before a ``cache_control`` key are stepped over in doubling windows stripped in
    C, not a Python step per byte (4 MiB: 0.25 s on the event loop); the same cut."""
    pad = b" \t\n" * (1 << 18)
    msg = b'{"role":"user","content":[{"type":"text","text":"hi",' + pad + b'"cache_control":{"type":"ephemeral"}}]}'
    assert promptshape._unmarked(msg) == b'{"role":"user","content":[{"type":"text","text":"hi"}]}'


def _repeated_one_by_one(prev, cur):
    """``repeated`` as it was written first: a digest at a time."""
    for i, d in enumerate(prev):
        if i >= len(cur) or cur[i] != d:
            return i
    return len(prev)


@given(st.lists(st.sampled_from("abc"), max_size=40), st.lists(st.sampled_from("abc"), max_size=40),
       st.integers(0, 40))
def test_repeated_is_a_digest_at_a_time(prev, cur, shared):
    """``repeated`` (slices compared in C, halving) says what a loop over the digests says,
    for any two histories, most sharing a prefix (``shared`` of ``prev``'s digests first)."""
    cur = prev[:shared] + cur
    prev, cur = tuple(prev), tuple(cur)
    assert repeated(prev, cur) == _repeated_one_by_one(prev, cur)


def test_a_long_history_is_compared_as_one_digest_at_a_time_would():
    """10,000 messages: the same share and first difference as the loop gives (the
    difference at every place it can be: first, middle, last, past the end)."""
    prev = Shape(tools="t", tools_len=10, messages=tuple(f"d{i}" for i in range(10_000)), lengths=(3,) * 10_000)
    for at in (0, 1, 4_999, 9_999):
        cur = msgspec.structs.replace(prev, messages=prev.messages[:at] + ("x",) + prev.messages[at + 1:])
        assert compare(prev, cur) == Difference(share=(10 + 3 * at) / prev.size, kind="messages", at=at)
    shorter = msgspec.structs.replace(prev, messages=prev.messages[:7_000])
    assert compare(prev, shorter) == Difference(share=(10 + 3 * 7_000) / prev.size, kind="messages", at=7_000)
    longer = msgspec.structs.replace(prev, messages=prev.messages + ("y",))
    assert compare(prev, longer) == Difference(share=1.0)


def _compact(b: bytes) -> bytes:
    return json.dumps(json.loads(b), separators=(",", ":"), ensure_ascii=False).encode()


def test_openai_histories_kept_through_many_conversations_never_change_a_shape():
    """OpenAI chat ``messages`` and Responses ``input`` lists, kept as Claude Code's arrays are:
    eight conversations of each interleaved (grown, cut, edited, restarted; leading system or
    developer items, none, or only those; a Responses input sometimes a string), compact or
    spaced, through the body reader's ``Runs`` and the event loop's (by conversation): every
    shape is the shape read afresh. Seeded: the same run each time."""
    import random
    rnd = random.Random(7)

    def item(api, i):
        if i < 0:           # a leading item: the system prompt's
            return {"role": rnd.choice(["system", "developer"]), "content": f"be brief {i} " + "y" * rnd.randint(0, 20)}
        if api == F.OPENAI_RESPONSES and rnd.random() < 0.3:
            return rnd.choice([{"type": "function_call", "call_id": f"c{i}", "name": "sh", "arguments": "{}"},
                               {"type": "function_call_output", "call_id": f"c{i}", "output": "ok" * rnd.randint(0, 9)},
                               {"type": "reasoning", "encrypted_content": "e" * rnd.randint(1, 40)}])
        return {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i} " + "x" * rnd.randint(0, 30)}

    def opening(api):
        return [item(api, -1 - j) for j in range(rnd.choice([0, 1, 1, 2]))] + [item(api, i) for i in range(rnd.randint(0, 20))]
    for api, name in ((F.OPENAI_CHAT, "messages"), (F.OPENAI_RESPONSES, "input")):
        runs, seen, keyed = promptshape.Runs(), {}, promptshape.Runs(limit=64)
        convs = [opening(api) for _ in range(8)]
        for _ in range(300):
            k = rnd.randrange(len(convs))
            conv, r = convs[k], rnd.random()
            if r < 0.6:
                conv.extend(item(api, len(conv) + j) for j in range(rnd.randint(1, 3)))
            elif r < 0.7 and len(conv) > 1:
                del conv[rnd.randrange(len(conv)):]
            elif r < 0.8 and conv:
                conv[rnd.randrange(len(conv))] = item(api, rnd.choice([-9, 999]))
            elif r < 0.85:
                convs[k] = conv = opening(api)
            doc = {"model": "gpt", name: [dict(m) for m in conv], "tools": [{"type": "function", "name": "sh"}]}
            if api == F.OPENAI_RESPONSES:
                doc["instructions"] = "you code"
                if rnd.random() < 0.05:
                    doc["input"] = "just a string"
            raw = json.dumps(doc, separators=(",", ":") if rnd.random() < 0.85 else (", ", ": ")).encode()
            fresh = shape(raw, api)
            assert fresh is not None
            assert shape(raw, api, seen=seen, runs=runs) == fresh
            assert shape(raw, api, seen=seen, runs=keyed, key=f"c{k}") == fresh
            assert shape(raw, api, runs=promptshape.Runs(), max_items=len(fresh.messages)) == fresh
            assert shape(raw, api, runs=keyed, key=f"c{k}", max_items=len(fresh.messages) - 1) is None \
                or not fresh.messages


def test_a_long_openai_history_is_digested_once_then_only_its_new_items(monkeypatch):
    """A chat history of 3,000 messages after a system message, and a Codex-like Responses input
    (developer items first): the next turn, two items more, digests those two (the leading items
    stay the system prompt's)."""
    stepped = []
    real = promptshape._message_digest
    monkeypatch.setattr(promptshape, "_message_digest", lambda raw, seen: stepped.append(1) or real(raw, seen))

    def chat(n):
        msgs = [{"role": "system", "content": "be brief"}] + [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(n)]
        return _compact(body(model="gpt", messages=msgs))

    def responses(n):
        items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
                 {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "AGENTS.md"}]}]
        items += [{"type": "function_call", "call_id": f"c{i}", "name": "sh", "arguments": "{}"} if i % 2 else
                  {"type": "function_call_output", "call_id": f"c{i - 1}", "output": f"out {i}"} for i in range(n)]
        return _compact(body(model="gpt", instructions="you code", input=items))
    for api, make in ((F.OPENAI_CHAT, chat), (F.OPENAI_RESPONSES, responses)):
        runs, seen = promptshape.Runs(), {}
        first, second = make(3_000), make(3_002)
        assert shape(first, api, seen=seen, runs=runs) == shape(first, api)
        stepped.clear()
        got = shape(second, api, seen=seen, runs=runs)
        assert len(stepped) == 2 and got == shape(second, api)
        assert got.system and len(got.messages) == (3_002 if api == F.OPENAI_CHAT else 3_003)


def test_arrays_kept_between_requests_give_the_same_shape_and_digest_only_new_messages(monkeypatch):
    """``Runs`` (the body reader's): each body's shape is the shape read afresh, through a
    recorded conversation, its compaction, a second conversation between its turns, a body laid
    out with spaces and one with no messages; and a continuing turn digests only the messages
    its array does not share byte for byte with one kept (not one step per message), whatever
    its layout."""
    names = ["interactive-04-opening.json", "interactive-05-tool-result.json", "interactive-06-continuation.json",
             "interactive-08-tool-result.json", "interactive-09-continuation.json", "interactive-11-tool-result.json",
             "interactive-19-compaction.json", "interactive-20-after-compaction.json"]
    recorded = [_compact(json.dumps(json.loads((TRAFFIC / "claude-code" / n).read_text())["body"]).encode())
                for n in names]
    other = [_compact(turn(n, marker_at=n - 1)) for n in (3, 5, 7)]
    spaced = turn(9, marker_at=8)                       # ", " and ": ": not compact
    bodies = [recorded[0], other[0], *recorded[1:4], other[1], spaced, *recorded[4:], other[2],
              _compact(body(model="m", messages=[])), _compact(body(model="m"))]
    stepped = []
    real = promptshape._message_digest
    monkeypatch.setattr(promptshape, "_message_digest", lambda raw, seen: stepped.append(1) or real(raw, seen))
    runs, seen = promptshape.Runs(), {}
    before: dict[int, Shape] = {}
    for b in bodies:
        fresh = shape(b, F.ANTHROPIC_MESSAGES)
        stepped.clear()
        assert shape(b, F.ANTHROPIC_MESSAGES, seen=seen, runs=runs) == fresh
        for prev in before.values() if b is not spaced else ():  # (its turns before it were compact: no bytes shared)
            if fresh.messages[:len(prev.messages) - 1] == prev.messages[:-1] and len(fresh.messages) > len(prev.messages):
                # a continuing turn: its earlier messages (but the one whose mark moved) are not stepped over
                assert len(stepped) <= len(fresh.messages) - len(prev.messages) + 1
        before[len(before)] = fresh
    assert len(runs.kept) <= promptshape.RUNS


def test_a_long_compact_history_is_digested_once_then_only_its_new_messages(monkeypatch):
    """11,000 messages: the second turn (two messages more, the mark moved) digests three."""
    stepped = []
    real = promptshape._message_digest
    monkeypatch.setattr(promptshape, "_message_digest", lambda raw, seen: stepped.append(1) or real(raw, seen))
    runs, seen = promptshape.Runs(), {}
    first, second = _compact(turn(11_000, marker_at=10_999)), _compact(turn(11_002, marker_at=11_001))
    assert shape(first, F.ANTHROPIC_MESSAGES, seen=seen, runs=runs) == shape(first, F.ANTHROPIC_MESSAGES)
    stepped.clear()
    got = shape(second, F.ANTHROPIC_MESSAGES, seen=seen, runs=runs)
    assert len(stepped) == 3 and got == shape(second, F.ANTHROPIC_MESSAGES)
    assert len(runs.kept) == 1          # the turn it continues (its mark moved) gave its place


def test_a_long_spaced_history_is_digested_once_then_only_its_new_messages(monkeypatch):
    """The same with ``json.dumps``' default layout (", " between items): a body a client
    made with spaces between its messages is not digested a message at a time on every turn."""
    stepped = []
    real = promptshape._message_digest
    monkeypatch.setattr(promptshape, "_message_digest", lambda raw, seen: stepped.append(1) or real(raw, seen))
    runs, seen = promptshape.Runs(), {}
    first, second = turn(2_000, marker_at=1_999), turn(2_002, marker_at=2_001)
    assert b", " in first
    assert shape(first, F.ANTHROPIC_MESSAGES, seen=seen, runs=runs) == shape(first, F.ANTHROPIC_MESSAGES)
    stepped.clear()
    got = shape(second, F.ANTHROPIC_MESSAGES, seen=seen, runs=runs)
    assert len(stepped) == 3 and got == shape(second, F.ANTHROPIC_MESSAGES)
    stepped.clear()
    assert shape(second, F.ANTHROPIC_MESSAGES, seen=seen, runs=runs) == got and stepped == []


def test_the_arrays_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(promptshape, "RUNS_BYTES", 4_000)
    runs = promptshape.Runs()
    for n in range(3, 40):
        shape(_compact(turn(n)), F.ANTHROPIC_MESSAGES, runs=runs)
        assert len(runs.kept) <= promptshape.RUNS and sum(len(r.array) for r in runs.kept) <= 4_000


def test_arrays_kept_through_many_conversations_never_change_a_shape():
    """Twelve conversations interleaved (turns grown, cut, edited, restarted; the cache mark on
    the newest message; most bodies compact, some spaced, some with a space inside the array):
    with the arrays kept, every shape is the shape read afresh. Seeded: the same run each time."""
    import random
    rnd = random.Random(11)

    def msg(i):
        c = {"type": "text", "text": f"m{i} " + "x" * rnd.randint(0, 30)}
        return {"role": "user" if i % 2 == 0 else "assistant", "content": [c] if rnd.random() < 0.7 else c["text"]}
    runs, seen, keyed = promptshape.Runs(), {}, promptshape.Runs(limit=64)
    convs = [[msg(i) for i in range(rnd.randint(1, 30))] for _ in range(12)]
    for _ in range(400):
        k = rnd.randrange(len(convs))
        conv, r = convs[k], rnd.random()
        if r < 0.6:
            conv.extend(msg(len(conv) + j) for j in range(rnd.randint(1, 3)))
        elif r < 0.7 and len(conv) > 2:
            del conv[rnd.randrange(len(conv)):]
        elif r < 0.8 and conv:
            conv[rnd.randrange(len(conv))] = msg(999)
        elif r < 0.85:
            convs[k] = conv = [msg(0)]
        doc = {"model": "m", "system": [{"type": "text", "text": "s"}], "messages": [dict(m) for m in conv]}
        last = doc["messages"][-1] if conv else None
        if last is not None and isinstance(last["content"], list) and rnd.random() < 0.8:
            last["content"] = [dict(last["content"][0], cache_control={"type": "ephemeral"})]
        raw = json.dumps(doc, separators=(",", ":") if rnd.random() < 0.85 else (", ", ": ")).encode()
        if rnd.random() < 0.03:
            raw = raw.replace(b'"messages":[', b'"messages":[ ', 1)
        fresh = shape(raw, F.ANTHROPIC_MESSAGES)
        assert shape(raw, F.ANTHROPIC_MESSAGES, seen=seen, runs=runs) == fresh
        # as the ledger shapes a small body on the event loop: from the facts' members, by conversation
        members = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
        assert shape(raw, F.ANTHROPIC_MESSAGES, seen=seen, members=members, runs=keyed, key=f"c{k}") == fresh
        array = bytes(members["messages"])
        for run in keyed.kept:         # the quick compares say what halving says
            assert promptshape._shared(run, array) == bisect.bisect_right(run.ends, promptshape._common_prefix(run.array, array))
    assert len(runs.kept) == promptshape.RUNS
    # the index by key holds the kept runs, no more, and their bytes are counted right
    assert sorted(map(id, keyed.kept)) == sorted(id(r) for same in keyed._keyed.values() for r in same)
    assert keyed._bytes == sum(len(r.array) for r in keyed.kept) and all(keyed._keyed.values())
