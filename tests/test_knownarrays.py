"""knownarrays: a conversation's messages array sent again has only its new items decoded, and
every answer is the whole decode's."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from sessionpin.reader import knownarrays, wire

MESSAGES = wire.field_decoders["messages"]


class Counting:
    """A decoder that counts the bytes it is given (msgspec's own cannot be patched)."""

    def __init__(self, decoder) -> None:
        self.decoder, self.given = decoder, 0

    def decode(self, data):
        self.given += len(data)
        return self.decoder.decode(data)


@pytest.fixture(autouse=True)
def nothing_kept():
    knownarrays._kept.clear()
    yield
    knownarrays._kept.clear()


def _msg(i: int, rnd: random.Random) -> dict:
    text = f"m{i} " + "x" * rnd.randint(200, 600)
    role = "user" if i % 2 == 0 else "assistant"
    return {"role": role, "content": [{"type": "text", "text": text}] if rnd.random() < 0.6 else text}


def test_interleaved_conversations_decode_as_a_whole_decode_would():
    """Twelve conversations interleaved (grown, cut, edited, restarted; the cache mark on the
    newest message; most compact, some laid out with spaces): every answer is the whole
    decode's, and a grown turn hands the decoder only its new items. Seeded."""
    rnd = random.Random(5)
    counting = Counting(MESSAGES)
    convs = [[_msg(i, rnd) for i in range(rnd.randint(30, 60))] for _ in range(12)]
    last: dict[int, tuple[str, bytes, int]] = {}   # a conversation's last layout, array, last item's bytes
    grown = 0
    for _ in range(500):
        k = rnd.randrange(len(convs))
        conv, r = convs[k], rnd.random()
        if r < 0.7:
            conv.extend(_msg(len(conv) + j, rnd) for j in range(rnd.randint(1, 3)))
        elif r < 0.8 and len(conv) > 2:
            del conv[rnd.randrange(1, len(conv)):]
        elif r < 0.9:
            conv[rnd.randrange(len(conv))] = _msg(999, rnd)
        elif r < 0.95:
            convs[k] = conv = [_msg(0, rnd) for _ in range(40)]
        sent = [dict(m) for m in conv]
        if isinstance(sent[-1]["content"], list):
            sent[-1]["content"] = [dict(sent[-1]["content"][0], cache_control={"type": "ephemeral"})]
        sep = (",", ":") if rnd.random() < 0.85 else (", ", ": ")
        raw = msgspec.Raw(json.dumps(sent, separators=sep).encode())
        before = counting.given
        still = k in last and any(kept[1] == last[k][1] for kept in knownarrays._kept)   # (not pushed out)
        got, _ = knownarrays.decode(raw, counting)
        assert got == MESSAGES.decode(raw)
        if r < 0.7 and still and last[k][0] == sep[0]:
            # a grown turn: the decoder saw its new items and the one whose mark moved, not the history
            assert counting.given - before <= len(raw) - len(last[k][1]) + last[k][2] + 8
            grown += 1
        last[k] = (sep[0], bytes(raw), len(json.dumps(sent[-1], separators=sep)))
    assert grown > 50 and len(knownarrays._kept) <= knownarrays.COUNT


def test_a_new_item_of_a_wrong_type_raises_as_the_whole_decode_does_and_spoils_nothing():
    rnd = random.Random(1)
    history = [_msg(i, rnd) for i in range(80)]
    knownarrays.decode(msgspec.Raw(json.dumps(history).encode()), MESSAGES)
    bad = msgspec.Raw(json.dumps(history + [{"role": 3, "content": "x"}]).encode())
    with pytest.raises(msgspec.ValidationError):
        MESSAGES.decode(bad)
    with pytest.raises(msgspec.ValidationError):
        knownarrays.decode(bad, MESSAGES)
    good = msgspec.Raw(json.dumps(history + [{"role": "assistant", "content": "ok"}]).encode())
    assert knownarrays.decode(good, MESSAGES)[0] == MESSAGES.decode(good)


def test_short_arrays_and_other_values_are_decoded_whole_and_not_kept():
    for raw in (b'[{"role":"user","content":"hi"}]', b"null", b'"x"'):
        counting = Counting(MESSAGES)
        try:
            got = knownarrays.decode(msgspec.Raw(raw), counting)[0]
        except msgspec.ValidationError:
            got = "raised"
        assert counting.given == len(raw) and got == (
            MESSAGES.decode(raw) if raw != b'"x"' else "raised")
    assert knownarrays._kept == []


def test_the_facts_read_of_a_grown_history_decodes_its_new_messages_only(monkeypatch):
    """Through ``wire.decode_fields`` (the facts read of a body's members): a conversation's next
    turn has the messages decoder read its two new messages, not its 200."""
    rnd = random.Random(2)
    history = [_msg(i, rnd) for i in range(200)]
    first = {"model": "m", "messages": history}
    second = {"model": "m", "messages": history + [_msg(200, rnd), _msg(201, rnd)]}
    fields = [msgspec.json.decode(json.dumps(b, separators=(",", ":")).encode(), type=dict[str, msgspec.Raw])
              for b in (first, second)]
    counting = Counting(MESSAGES)
    monkeypatch.setitem(wire.field_decoders, "messages", counting)
    wire.decode_fields(fields[0])
    counting.given = 0
    values, problem = wire.decode_fields(fields[1])
    assert problem == "" and values["messages"] == MESSAGES.decode(fields[1]["messages"])
    assert 0 < counting.given < 3_000 < len(fields[1]["messages"])


def test_an_array_of_more_items_than_any_history_is_decoded_once_and_not_kept():
    raw = msgspec.Raw(b"[" + b",".join([b"{}"] * (knownarrays.MAX_ITEMS + 1)) + b"]")
    counting = Counting(MESSAGES)
    got, _ = knownarrays.decode(raw, counting)
    assert got == MESSAGES.decode(raw) and counting.given == len(raw) and knownarrays._kept == []


def test_every_recording_read_in_a_row_has_the_facts_of_a_fresh_read():
    """Claude Code's, opencode's, Codex's and pi's recorded requests read one after the other,
    then twice more in a shuffled order, with the arrays and values remembered from the reads
    before: each has the facts it has read alone, with nothing remembered."""
    from pathlib import Path

    from sessionpin.reader import facts, knownvalues
    traffic = Path(__file__).parent / "fixtures" / "traffic"
    requests = []
    for path in sorted(traffic.glob("*/*.json")):
        fx = json.loads(path.read_text())
        if isinstance(fx.get("body"), dict):
            headers = fx["headers"].items() if isinstance(fx["headers"], dict) else fx["headers"]
            body = json.dumps(fx["body"], separators=(",", ":"), ensure_ascii=False).encode()
            requests.append((fx["method"], fx["url"], [tuple(h) for h in headers], body))
    saved = list(knownvalues._known)

    def alone(r):
        knownarrays._kept.clear()
        knownvalues._known.clear()
        return facts.read(*r, members=[])
    try:
        want = [alone(r) for r in requests]
        knownarrays._kept.clear()
        knownvalues._known.clear()
        rnd = random.Random(9)
        for order in (list(range(len(requests))), rnd.sample(range(len(requests)), len(requests)),
                      rnd.sample(range(len(requests)), len(requests))):
            for i in order:
                assert facts.read(*requests[i], members=[]) == want[i], requests[i][:2]
        assert len(requests) > 100 and knownarrays._kept, "some recorded histories were kept"
    finally:
        knownvalues._known[:] = saved


def test_a_chat_clients_long_history_is_read_by_its_new_messages_with_the_facts_of_a_typed_read(monkeypatch):
    """pi's recorded chat request, its history grown past ``MIN_SIZE`` (a typed read: the body
    is not Claude Code's nor opencode's), read turn after turn beside a second conversation and
    an edited one: each read has the facts it has alone, and a next turn has its new messages
    decoded — not the whole body (the typed decode of every message, on every turn, before)."""
    from pathlib import Path

    from sessionpin.reader import facts, knownvalues
    fx = json.loads((Path(__file__).parent / "fixtures" / "traffic" / "pi" / "lineage-chat-05-fork.json").read_text())
    headers = [tuple(h) for h in fx["headers"]]
    rnd = random.Random(4)
    lead, steps = fx["body"]["messages"][:1], fx["body"]["messages"][1:]

    def body(history, n):
        return json.dumps(dict(fx["body"], messages=lead + (history * 60)[:n]), separators=(",", ":")).encode()
    saved = list(knownvalues._known)
    counting = Counting(wire.body_decoder)
    try:
        turns = []
        for n in range(200, 240, 2):
            turns += [body(steps, n), body(steps[::-1], n + 1)]
            if rnd.random() < 0.3:
                turns.append(body(steps, n).replace(b"Read", b"Sent", 1))       # an edited history
        assert len(turns[0]) > knownarrays.MIN_SIZE
        want = []
        for raw in turns:
            knownarrays._kept.clear()
            want.append(facts.read(fx["method"], fx["url"], headers, raw))
        knownarrays._kept.clear()
        monkeypatch.setattr(wire, "body_decoder", counting)
        messages = Counting(MESSAGES)
        monkeypatch.setitem(wire.field_decoders, "messages", messages)
        for raw, expected in zip(turns, want):
            messages.given = counting.given = 0
            got = facts.read(fx["method"], fx["url"], headers, raw)
            assert got == expected and got.agent == facts.PI and got.parsed
        assert counting.given == 0                      # no typed read of a whole body
        assert 0 < messages.given < len(turns[-1]) // 10   # the last turn: its new messages
    finally:
        knownvalues._known[:] = saved
