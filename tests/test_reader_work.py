"""The reader's work per byte is bounded for every body (issue 10): its steps are counted
(``wire.STEPS``: the bytes each find, copy, decompression and decode attempt scans), never
timed. Adversarial bodies: look-alike keys nested before, inside and after the messages,
many of them in one object, deep nesting, strings full of quotes and ``"messages":``, many
commas, long runs of spaces, many compressed frames. A quadratic search shows up as steps
growing with the square of the body, far past the bound."""

from __future__ import annotations

import gzip
import json
import re

import msgspec

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessionpin.reader import facts, largebody, wire
from sessionpin.lineage import lineage_wire

# Steps per byte the reader may take, plus a constant for small bodies (a decompressor per
# frame). The measured worst over these generators is about 9: a long first message is
# scanned twice, and each tail key that is absent costs one backward search.
K = 20
C = 1 << 15

FLAVOURS = {"anthropic": ("messages", "https://api.anthropic.com/v1/messages"),
            "chat": ("messages", "https://x/v1/chat/completions"),
            "responses": ("input", "https://x/v1/responses")}
KEYS = ["messages", "input", "model", "stream", "system", "tools", "metadata", "prompt_cache_key",
        "instructions", "previous_response_id"]


def blob(kind: str, key: str, n: int) -> bytes:
    """A JSON value built to make a key search work hard."""
    k = json.dumps(key).encode()
    if kind == "array of look-alikes":
        return b"[" + b",".join([b"{" + k + b":0}"] * n) + b"]"
    if kind == "one object of look-alikes":       # every try decodes to the end of this object
        return b'{"a":0,' + b",".join([k + b":0"] * n) + b"}"
    if kind == "nested look-alikes":
        depth = min(n, 3000)
        return (b"{" + k + b":") * depth + b"0" + b"}" * depth
    if kind == "look-alikes with padding":
        return b"[" + b",".join([b'{"x":"' + b"y" * 64 + b'",' + k + b":[0]}"] * n) + b"]"
    if kind == "string of quotes":
        return json.dumps(('",' + key + '":[{"role":"assistant"}]},{"' + key + '":') * n).encode()
    if kind == "commas":
        return b"[" + b"0," * n + b"0]"
    if kind == "spaces":
        return b"{" + b" " * n + k + b" " * n + b":" + b" " * n + b"0" + b" " * n + b"}"
    if kind == "deep arrays":
        depth = min(n, 3000)
        return b"[" * depth + b"]" * depth
    raise AssertionError(kind)


KINDS = ["array of look-alikes", "one object of look-alikes", "nested look-alikes", "look-alikes with padding",
         "string of quotes", "commas", "spaces", "deep arrays"]


@st.composite
def bodies(draw):
    flavour = draw(st.sampled_from(sorted(FLAVOURS)))
    array_key = FLAVOURS[flavour][0]
    parts = []
    for where in ("head", "message", "tail"):
        if draw(st.booleans()):
            parts.append((where, draw(st.sampled_from(KINDS)), draw(st.sampled_from(KEYS)),
                          draw(st.integers(1, 20_000))))
    head, tail, content = [b'"model":"m"'], [], b'"hi"'
    for where, kind, key, n in parts:
        b = blob(kind, key, n)
        if where == "head":
            head.insert(draw(st.integers(0, len(head))), b'"h":' + b)
        elif where == "tail":
            tail.append(b'"t":' + b)
        else:
            content = b
    if draw(st.booleans()):
        tail.append(b'"stream":true')
    items = [b'{"role":"user","content":' + content + b"}"]
    if draw(st.booleans()):
        items.append(b'{"role":"assistant","content":"ok"}')
    body = (b"{" + b",".join(head) + b"," + json.dumps(array_key).encode() + b":[" + b",".join(items) + b"]"
            + b"".join(b"," + t for t in tail) + b"}")
    return flavour, body


def steps(fn) -> int:
    wire.STEPS.n = 0
    fn()
    return wire.STEPS.n


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(bodies())
def test_the_large_body_reader_does_bounded_work_per_byte(case):
    flavour, body = case
    n = steps(lambda: largebody.fast_decode(body, flavour))
    assert n <= K * len(body) + C, f"{n / len(body):.1f} steps per byte"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(bodies())
def test_the_whole_reader_does_bounded_work_per_byte_and_reads_as_the_whole_body(case):
    flavour, body = case
    url = FLAVOURS[flavour][1]
    headers = [("user-agent", "pi/1")]          # pi: prompt_cache_key looked for, fingerprint made
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(largebody, "FAST_MIN", 0)          # every body read in parts
        parts = []
        n = steps(lambda: parts.append(facts.read("POST", url, headers, body)))
        mp.setattr(largebody, "FAST_MIN", 1 << 62)    # and whole
        whole = facts.read("POST", url, headers, body)
        # and whole as raw members (a model map's config; Claude Code's bodies are read so)
        cc = [("user-agent", "claude-cli/2.1")]
        members = []
        m = steps(lambda: members.append(facts.read("POST", url, cc, body, locate_model=True)))
        typed = facts.read("POST", url, cc, body)
    assert n <= K * len(body) + C, f"{n / len(body):.1f} steps per byte"
    assert m <= K * len(body) + C, f"{m / len(body):.1f} steps per byte"
    assert msgspec.structs.replace(members[0], model_span=None) == msgspec.structs.replace(typed, model_span=None)
    if whole.parsed:   # the parts never read what lies past the first messages (docs/facts.md)
        assert [msgspec.structs.replace(p, model_span=None) for p in parts] == [msgspec.structs.replace(whole, model_span=None)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["head", "tail"])
def test_the_reported_shape_and_its_kin_stay_linear(kind, where):
    """The incident: thousands of nested {"messages":0} before the top-level key. Twice the
    look-alikes must cost about twice the steps, not four times."""
    def body(n):
        b = blob(kind, "messages" if where == "head" else "metadata", n)
        pad = b'{"role":"user","content":"' + b"x" * 1000 + b'"}'
        if where == "head":
            return b'{"h":' + b + b',"model":"m","messages":[' + pad + b"]}"
        return b'{"model":"m","messages":[' + pad + b'],"t":' + b + b',"stream":true}'

    small, large = body(4000), body(8000)
    s_small = steps(lambda: largebody.fast_decode(small, "anthropic"))
    s_large = steps(lambda: largebody.fast_decode(large, "anthropic"))
    assert s_large <= K * len(large) + C
    assert s_large <= 2.5 * s_small * len(large) / len(small) + C


def test_many_compressed_frames_are_bounded():
    frame = gzip.compress(b"")
    for n in (10, 64, 65, 10_000):
        data = frame * n
        s = steps(lambda: facts.decode_body(data, "gzip"))
        assert s <= K * len(data) + C
    assert facts.decode_body(frame * 65, "gzip")[1] == "bad gzip body"   # more frames than anyone sends
    assert facts.decode_body(gzip.compress(b'{"a":1}') * 3, "gzip") == (b'{"a":1}' * 3, "")


def test_many_content_codings_are_not_undone():
    assert facts.decode_body(b"{}", "gzip, " * 5 + "gzip")[1] == "too many content-encodings"
    assert facts.decode_body(b"{}", "identity, " * 50) == (b"{}", "")


def test_a_compression_bomb_costs_its_decoded_size_at_most():
    data = gzip.compress(b" " * (8 << 20))
    s = steps(lambda: facts.read("POST", "https://x/v1/chat/completions", [], data, "gzip"))
    assert s <= K * (8 << 20) + C


def test_a_long_user_id_is_not_searched(monkeypatch):
    seen = []

    class Spy:
        def search(self, text):
            seen.append(len(text))
            return None

    from sessionpin.reader import sessions
    monkeypatch.setattr(sessions, "_LEGACY_USER_ID", Spy())
    uid = "_session_a" * 100_000 + "!"
    f = facts.read("POST", "https://api.anthropic.com/v1/messages", [("user-agent", "claude-cli/2")],
                   json.dumps({"model": "m", "messages": [], "metadata": {"user_id": uid}}).encode())
    assert seen == [] and f.session is None
    facts.read("POST", "https://api.anthropic.com/v1/messages", [("user-agent", "claude-cli/2")],
               json.dumps({"model": "m", "messages": [], "metadata": {"user_id": "user_x_session_abc"}}).encode())
    assert seen == [len("user_x_session_abc")]


# ---------------------------------------------------------------- every other head search
# The lineage reader (lineage_wire) finds a large body's history and its links by the same
# kind of search: the array's start (``array_start``), the members around it
# (``top_fields``), and the items one by one (``walk``). Its head search once decoded the text
# before each look-alike key it met: quadratic (a 60 KB head of ``{"messages":0}`` took 1 s,
# 1.2 MB would have taken minutes). It now walks the head as the large-body reader does.


class _Counted:
    """A msgspec decoder that adds what it is given to the steps: the count does not rest on
    the reader counting its own decodes (the quadratic head search counted nothing)."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder

    def decode(self, buf):
        try:
            value = self.decoder.decode(buf)
        except msgspec.DecodeError as err:   # msgspec stops where it says
            at = re.search(r"\(byte (\d+)\)", str(err))
            wire.count(int(at.group(1)) if at else len(buf))
            raise
        except BaseException:
            wire.count(len(buf))
            raise
        wire.count(len(buf))
        return value


def _count_decoders(mp: pytest.MonkeyPatch) -> None:
    for module in (lineage_wire, largebody, wire):
        for name, value in list(vars(module).items()):
            if isinstance(value, msgspec.json.Decoder):
                mp.setattr(module, name, _Counted(value))


def lineage_reads(flavour: str, body: bytes) -> None:
    with pytest.MonkeyPatch.context() as mp:
        _count_decoders(mp)
        _lineage_reads(flavour, body)


def _lineage_reads(flavour: str, body: bytes) -> None:
    key = b"input" if flavour == "responses" else b"messages"
    lineage_wire.array_start(body, key)
    lineage_wire.top_fields(body, ("system", "diagnostics", "previous_response_id", "client_metadata"), key)
    items = lineage_wire.walk(body, key)
    if items is not None:
        for _ in items:
            pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(bodies())
def test_the_lineage_reader_does_bounded_work_per_byte(case):
    flavour, body = case
    n = steps(lambda: lineage_reads(flavour, body))
    assert n <= K * len(body) + C, f"{n / len(body):.1f} steps per byte"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["head", "tail"])
def test_the_lineage_reader_stays_linear_on_the_reported_shape(kind, where):
    def body(n):
        b = blob(kind, "messages" if where == "head" else "system", n)
        pad = b'{"role":"user","content":"' + b"x" * 1000 + b'"}'
        if where == "head":
            return b'{"h":' + b + b',"model":"m","messages":[' + pad + b"]}"
        return b'{"model":"m","messages":[' + pad + b'],"t":' + b + b',"system":"s"}'

    small, large = body(4000), body(8000)
    s_small = steps(lambda: lineage_reads("anthropic", small))
    s_large = steps(lambda: lineage_reads("anthropic", large))
    assert s_large <= K * len(large) + C
    assert s_large <= 2.5 * s_small * len(large) / len(small) + C


def test_the_lineage_reader_still_finds_what_it_found():
    body = (b'{"h":[' + b",".join([b'{"messages":0}'] * 5000) + b'],"model":"m","messages":['
            b'{"role":"user","content":"hi"},{"role":"assistant","content":"ok"}],'
            b'"t":[{"system":1}],"system":"billing","diagnostics":{"previous_message_id":"msg_1"}}')
    fields = lineage_wire.top_fields(body, ("system", "diagnostics"), b"messages")
    assert bytes(fields["system"]) == b'"billing"' and bytes(fields["model"]) == b'"m"'
    assert bytes(fields["diagnostics"]) == b'{"previous_message_id":"msg_1"}'
    assert [i.role for i in lineage_wire.walk(body, b"messages")] == ["user", "assistant"]
    assert lineage_wire.walk(b'{"a":{"messages":[1]}}', b"messages") is None
    deep = b'{"messages":[' + b"[" * 20000 + b"]" * 20000 + b"]}"
    assert list(lineage_wire.walk(deep, b"messages")) == []


def test_a_model_property_in_the_tool_schemas_costs_no_failed_try():
    """Claude Code's Agent tool schema has a ``"model"`` property, after the messages: the search
    for a second top-level model runs last, past the tail already decoded, so it is passed over
    (no decode that fails there, no copy of the body for the tries after it): about one scan of
    the history and the tail's decode, and the same facts as the whole read."""
    tools = [{"name": "Agent", "input_schema": {"type": "object", "properties": {
        "subagent_type": {"type": "string"}, "model": {"type": "string", "enum": ["sonnet", "opus"]}}}}]
    history = [{"role": "user", "content": "go"}]
    for i in range(300):
        history += [{"role": "assistant", "content": [{"type": "text", "text": f"step {i} " + "y" * 900}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "x" * 900}]}]
    body = json.dumps({"model": "claude-opus-4-5", "messages": history, "system": "s", "tools": tools,
                       "metadata": {"user_id": "u"}, "max_tokens": 64, "stream": True},
                      separators=(",", ":")).encode()
    assert len(body) > largebody.FAST_MIN
    got = []
    n = steps(lambda: got.append(largebody.fast_decode(body, "anthropic", cache_key=False)))
    assert got[0] is not None and got[0][0].model == "claude-opus-4-5" and got[0][0].stream is True
    assert n <= 1.3 * len(body), f"{n / len(body):.2f} steps per byte"


def test_a_long_opening_message_is_scanned_once():
    """A short conversation whose first message is most of the body (a file pasted into the
    prompt, and its first answer): the walk reaches the end of the messages and reads the
    tail from there — no search from the body's end over the long message again."""
    body = json.dumps({"model": "claude-opus-4-5", "messages": [
        {"role": "user", "content": "x" * (1 << 20)}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "and now?"}]}],
        "system": "s", "tools": [], "metadata": {"user_id": "u"}, "max_tokens": 64, "stream": True}).encode()
    got = []
    n = steps(lambda: got.append(largebody.fast_decode(body, "anthropic", cache_key=True)))
    assert got[0] is not None and got[0][0].model == "claude-opus-4-5" and len(got[0][0].messages) == 3
    assert n <= 1.1 * len(body), f"{n / len(body):.2f} steps per byte"


@pytest.mark.parametrize("lookalike", [b'"model"', b'{"model":1}', b'{"a":1,"model":1}', b'"stream"'])
def test_many_look_alikes_cost_a_bounded_number_of_python_steps(lookalike, monkeypatch):
    """Tens of thousands of a needed name's quoted text (values, nested keys) in a body of few
    objects, read on the event loop: each find is a few µs of Python, so the tail search gives
    up after ``TAIL_HITS`` of them and the whole read (one decode in C) decides — the same facts."""
    calls = []
    real = largebody._find
    monkeypatch.setattr(largebody, "_find", lambda *a, **k: calls.append(1) or real(*a, **k))
    body = (b'{"model":"m","messages":[{"role":"user","content":"go"},{"role":"assistant","content":"ok"},'
            b'{"role":"user","content":[{"type":"text","text":"t","x":[' + b",".join([lookalike] * 40000)
            + b']}]}],"system":"s","tools":[],"metadata":{"user_id":"u"},"stream":true}')
    assert len(body) > largebody.FAST_MIN
    largebody.fast_decode(body, "anthropic", cache_key=False)
    assert len(calls) <= 300          # TAIL_HITS (256) and the few finds before them
    got = facts.read("POST", "https://api.anthropic.com/v1/messages", [("user-agent", "claude-cli/2.1")], body)
    assert got.parsed and got.model == "m" and got.stream is True
