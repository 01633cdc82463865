"""A body's top level with a remembered long value passed over: always the whole decode's answer."""

import json
from pathlib import Path

import msgspec
import pytest

from sessionpin.reader import knownarrays
from sessionpin.reader import knownvalues as K
from sessionpin.reader import wire

TRAFFIC = Path(__file__).parent / "fixtures" / "traffic"
TOOLS = [{"name": f"tool{i}", "description": "does a thing " * 40,
          "input_schema": {"type": "object", "properties": {"model": {"type": "string"}}}} for i in range(40)]
TOOLS_RAW = json.dumps(TOOLS, separators=(",", ":")).encode()


@pytest.fixture(autouse=True)
def fresh():
    saved, arrays = list(K._known), list(knownarrays._kept)
    K._known.clear()
    knownarrays._kept.clear()
    yield
    K._known[:] = saved
    knownarrays._kept[:] = arrays


def as_bytes(fields):
    return [(k, bytes(v)) for k, v in fields.items()]


def same_as_whole(data: bytes):
    """``members(data)`` against the whole decode: the same members in the same order, or the
    same error."""
    try:
        want = as_bytes(wire.loose_decoder.decode(data))
    except msgspec.DecodeError as e:
        with pytest.raises(msgspec.DecodeError) as got:
            K.members(data)
        assert str(got.value) == str(e)
        return None
    got = as_bytes(K.members(data))
    assert got == want
    assert all(K._TOKEN not in v and K._ITEMS not in v for _, v in got)
    return got


def body(**extra) -> bytes:
    b = {"model": "claude-x", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **extra}
    return json.dumps(b, separators=(",", ":")).encode()


def test_the_tools_sent_again_are_compared_not_skimmed():
    first = body()
    same_as_whole(first)
    assert K._known == [TOOLS_RAW]
    nxt = body(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    same_as_whole(nxt)
    wire.STEPS.n = 0
    K.members(nxt)
    # the decode read what is not the tools (the compare and the search are memcmp and a find)
    assert wire.STEPS.n < len(nxt) - len(TOOLS_RAW) + 200


def test_every_recording_in_a_row_reads_as_its_whole_decode():
    """Claude Code's, opencode's, Codex's and pi's recorded requests, one after the other (each
    remembered value met again by the next), and each re-encoded with spaces."""
    n = 0
    for path in sorted(TRAFFIC.glob("*/*.json")):
        fx = json.loads(path.read_text())
        if not isinstance(fx.get("body"), dict):
            continue
        for data in (json.dumps(fx["body"], separators=(",", ":")).encode(), json.dumps(fx["body"]).encode()):
            same_as_whole(data)
            same_as_whole(data)
            n += 1
    assert n > 100
    assert K._known, "the recordings' tool schemas were remembered"


def test_the_same_bytes_inside_a_message_are_not_taken_for_the_member():
    K.members(body())
    inner = json.loads(body())
    inner["messages"].append({"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "x", "input": {"tools": TOOLS}}]})
    # found first inside the message, so the member is read the long way; never a wrong member
    nested_first = json.dumps(inner, separators=(",", ":")).encode()
    assert nested_first.find(TOOLS_RAW) < nested_first.rfind(TOOLS_RAW)
    same_as_whole(nested_first)
    # only inside a message, no top-level tools at all
    del inner["tools"]
    same_as_whole(json.dumps(inner, separators=(",", ":")).encode())
    # inside a string (escaped): never found
    same_as_whole(json.dumps({"model": "m", "messages": [{"role": "user", "content": TOOLS_RAW.decode()}]}).encode())


def test_duplicate_keys_read_as_the_whole_decode_reads_them():
    K.members(body())
    other = b'[{"name":"other"}]'
    tail = b'{"model":"m","messages":[]'
    same_as_whole(tail + b',"tools":' + TOOLS_RAW + b',"tools":' + other + b"}")
    same_as_whole(tail + b',"tools":' + other + b',"tools":' + TOOLS_RAW + b"}")
    same_as_whole(tail + b',"tools":' + TOOLS_RAW + b',"tools":' + TOOLS_RAW + b"}")


def test_a_bad_body_says_what_the_whole_decode_says():
    K.members(body())
    good = body()
    for bad in (good[:-1], good + b"x", good.replace(b'"hi"', b'"hi'), b"[" + good + b"]",
                good.replace(b'"model":"claude-x"', b'"model":claude-x'),
                b"{" + b'"a":' + TOOLS_RAW[:-1] + b"}", TOOLS_RAW + TOOLS_RAW):
        same_as_whole(bad)


def test_the_value_inside_a_string_or_under_another_name_reads_as_the_whole_decode():
    value = b'["' + b"a" * K.MIN_SIZE + b'","b"]'
    K.remember({"tools": msgspec.Raw(value)})
    # its text inside a string is escaped: never found there
    same_as_whole(b'{"x":' + json.dumps(value.decode()).encode() + b',"tools":' + value + b"}")
    # found first as another member's value: that member is passed over, the tools read
    same_as_whole(b'{"x":' + value + b',"tools":' + value + b"}")
    # a string that closes where the value's first bytes begin cannot go on as JSON
    same_as_whole(b'{"x":"' + value[2:] + b',"tools":' + value + b"}")


def test_remembered_values_are_few_and_bounded():
    for i in range(K.COUNT + 3):
        tools = TOOLS + [{"name": f"extra{i}"}]
        K.members(json.dumps({"model": "m", "tools": tools}).encode())
    assert len(K._known) == K.COUNT
    K.remember({"tools": msgspec.Raw(b"[" + b" " * 10 + b"]")})        # short: not worth it
    K.remember({"tools": msgspec.Raw(b"[" + b" " * (K.MAX_SIZE + 1) + b"]")})
    assert len(K._known) == K.COUNT and all(K.MIN_SIZE <= len(v) <= K.MAX_SIZE for v in K._known)


def test_the_token_is_unguessable_and_never_leaves():
    assert len(K._TOKEN) > 32 and K._TOKEN.startswith(b'"') and K._TOKEN.endswith(b'"')
    K.members(body())
    got = K.members(body())
    assert bytes(got["tools"]) == TOOLS_RAW


def test_a_large_body_s_tail_passes_over_the_tools_too():
    """``largebody`` decodes a large body's tail (the tools after the messages): the same facts
    with the schemas remembered, fewer bytes read."""
    from sessionpin.reader import largebody
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x" * 3000} for i in range(120)]
    data = body(messages=history, metadata={"user_id": "u"}, max_tokens=5)
    assert len(data) >= largebody.FAST_MIN
    wire.STEPS.n = 0
    cold = largebody.fast_decode(data, "anthropic")
    cold_steps = wire.STEPS.n
    assert K._known == [TOOLS_RAW]
    wire.STEPS.n = 0
    warm = largebody.fast_decode(data, "anthropic")
    assert warm == cold and cold is not None
    assert wire.STEPS.n <= cold_steps - len(TOOLS_RAW) + 200


def test_a_body_without_any_remembered_value_is_searched_at_most_twice():
    """Each miss is a find over the body: a client whose schemas change every request costs at
    most ``TRIES`` of them, not one per remembered value."""
    for i in range(K.COUNT):
        K.remember({"tools": msgspec.Raw(json.dumps(TOOLS + [{"name": f"v{i}"}], separators=(",", ":")).encode())})
    finds = []

    class Counted(bytes):
        def find(self, *a):
            finds.append(a)
            return super().find(*a)
    data = Counted(body(tools=TOOLS + [{"name": "new"}]))
    assert K.passed_over(data) is None
    assert len(finds) == K.TRIES < K.COUNT


def _history(n: int, tag: str = "") -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{tag}m{i} " + "x" * 300} for i in range(n)]


def _read(data: bytes) -> None:
    """The facts read of a body: its members, then its fields (the messages array kept)."""
    wire.decode_fields(K.members(data))


def test_a_grown_conversations_messages_are_passed_over_not_skimmed(monkeypatch):
    """Issue 22: the messages a conversation sent last turn (all but the newest, whose cache mark
    moved) are stood in for when its next turn is read: the decode reads its new messages and
    the members around them, not its history — and the members are the whole decode's."""
    history = _history(120)
    first = body(messages=history)
    _read(first)
    assert knownarrays.kept()
    grown = body(messages=history + _history(2, "new"))
    same_as_whole(grown)
    given = []
    real = wire.loose_decoder
    monkeypatch.setattr(wire, "loose_decoder", type("Counting", (), {"decode": lambda self, b: given.append(len(b)) or real.decode(b)})())
    K.members(grown)
    assert given and given[0] < len(grown) - len(json.dumps(history, separators=(",", ":"))) + 2_000


def test_repeated_messages_anywhere_but_the_members_value_read_as_the_whole_decode():
    """The kept items' bytes where they are not the first items of the messages member's value
    — inside a string, under another name, after another member named "messages", with the
    member said twice, past a body that does not parse — read as the whole decode reads them."""
    history = _history(120)
    _read(body(messages=history))
    items = json.dumps(history, separators=(",", ":")).encode()
    more = json.dumps(history + _history(1, "n"), separators=(",", ":")).encode()
    cases = [
        b'{"model":"m","note":' + json.dumps(items.decode()).encode() + b',"messages":' + more + b"}",
        b'{"model":"m","other":' + more + b',"messages":[]}',
        b'{"model":"m","messages":[],"messages":' + more + b"}",
        b'{"model":"m","messages":' + more + b',"messages":[]}',
        b'{"model":"m","messages":' + more[:-1] + b"}",
        b'{"model":"m","messages":' + more + b"",
        b'{"model":"m","messages":' + more + b',"messages":' + more + b"}",
        b'{"model":"m","messages" : ' + more + b"}",
        b'{"model":"m","messages":' + more.replace(b"},{", b"}, {", 1) + b"}",
        b'{"messages":' + items[:-1] + b',{"role":3}]}',
        b'["messages",' + more + b"]",
        b'{"model":"m","messages":{"a":' + more + b"}}",
        b'{"model":"m","x":"\\"messages\\":' + more[:40] + b'","messages":' + more + b"}",
        b'{"model":"m","x":"messages","y":["messages"],"messages":' + more + b"}",
        b'{"model":"m","x":{"messages":' + more + b'},"messages":' + more + b"}",
    ]
    for data in cases:
        same_as_whole(data)
    # a value of that text before the member: the member is still found, its history passed over;
    # found nested first (a member's name inside another's value), it is not taken: a whole decode
    assert K.passed_over(cases[-2]) is not None and K.passed_over(cases[-1]) is None


def test_many_conversations_read_as_their_whole_decodes():
    """Conversations interleaved, grown, edited and cut, some with their tools (after their
    messages or before), some laid out with spaces: every members read is the whole decode's.
    Seeded: the same run each time."""
    import random
    rnd = random.Random(4)
    convs = [_history(rnd.randint(40, 90), f"c{k}") for k in range(6)]
    for _ in range(150):
        k = rnd.randrange(len(convs))
        conv, r = convs[k], rnd.random()
        if r < 0.7:
            conv += _history(rnd.randint(1, 3), f"t{rnd.random()}")
        elif r < 0.85:
            conv[rnd.randrange(len(conv))] = {"role": "user", "content": "edited"}
        elif len(conv) > 2:
            del conv[rnd.randrange(1, len(conv)):]
        tools, first = ({"tools": TOOLS} if rnd.random() < 0.6 else {}), rnd.random() < 0.3
        doc = {"model": "m", **(tools if first else {}), "messages": conv, **({} if first else tools)}
        data = json.dumps(doc, separators=(",", ":") if rnd.random() < 0.85 else (", ", ": ")).encode()
        same_as_whole(data)
        _read(data)
