import msgspec
import pytest

from sessionpin.reader import largebody, wire


def test_contents_stay_raw_and_unknown_fields_are_skipped():
    data = (
        b'{"model":"m","stream":true,"extra":{"deep":[1,2,3]},'
        b'"system":[{"type":"text","text":"s","cache_control":{"type":"ephemeral"}}],'
        b'"messages":[{"role":"user","content":[{"type":"tool_result","content":[{"type":"text","text":"x"}]}]},'
        b'{"role":"assistant","content":"ok","id":7}],'
        b'"tools":[{"name":"Bash","input_schema":{}}],"metadata":{"user_id":"u","other":1}}'
    )
    b = wire.body_decoder.decode(data)
    assert b.model == "m" and b.stream is True
    assert b.system == [wire.Block(type="text", text="s")]
    assert [m.role for m in b.messages] == ["user", "assistant"]
    assert isinstance(b.messages[0].content, msgspec.Raw)
    assert bytes(b.messages[1].content) == b'"ok"'
    assert len(b.tools) == 1 and b.metadata.user_id == "u"


def test_absent_content_is_empty_raw():
    b = wire.body_decoder.decode(b'{"input":[{"type":"function_call_output","call_id":"c"}]}')
    assert len(b.input[0].content) == 0 and b.input[0].type == "function_call_output"


def test_input_may_be_a_string():
    assert wire.body_decoder.decode(b'{"input":"hi"}').input == "hi"


@pytest.mark.parametrize(
    "data",
    [b'{"messages":"x"}', b'{"model":1}', b'{"system":[1]}', b'{"messages":[{"role":3}]}', b'{"tools":{}}'],
)
def test_a_wrong_type_is_a_validation_error_and_each_field_decodes_alone(data):
    with pytest.raises(msgspec.ValidationError):
        wire.body_decoder.decode(data)
    fields = wire.loose_decoder.decode(data)
    (name,) = fields
    with pytest.raises(msgspec.ValidationError):
        wire.field_decoders[name].decode(fields[name])


def test_field_decoders_cover_every_body_field():
    assert set(wire.field_decoders) == set(wire.Body.__struct_fields__)


@pytest.mark.parametrize(
    "item,history",
    [
        ({"role": "assistant"}, True),
        ({"type": "message", "role": "assistant"}, True),
        ({"type": "function_call"}, True),
        ({"type": "function_call_output"}, True),
        ({"type": "custom_tool_call_output"}, True),
        ({"type": "reasoning"}, True),
        ({"type": "compaction_summary"}, True),
        ({"type": "message", "role": "user"}, False),
        ({"type": "message", "role": "developer"}, False),
        ({"type": "additional_tools", "role": "developer"}, False),  # Codex 0.171's first item
        ({"role": "system"}, False),
        ({}, False),
    ],
)
def test_is_history(item, history):
    assert wire.is_history(msgspec.json.decode(msgspec.json.encode(item), type=wire.Message)) is history


def test_msgspec_names_where_a_value_ends():
    # fast_decode finds an element's end from this message; if msgspec rewords it, this fails
    # (and fast_decode falls back to reading the whole body, correct but slower).
    data = b'{"role":"user","content":"}]"} ,{"x":1}]'
    with pytest.raises(msgspec.DecodeError) as err:
        msgspec.json.decode(data, type=msgspec.Raw)
    m = largebody._TRAILING.search(str(err.value))
    assert m and data[int(m.group(1)) - 1 :].startswith(b",{")  # one past the "," after the space


def test_fast_decode_reads_the_head_first_messages_and_tail():
    data = (b'{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"x"},'
            + b'{"role":"user","content":"' + b"y" * 1000 + b'"}],"tools":[{"name":"stream"}],"stream":true}')
    body, problem = largebody.fast_decode(data, "anthropic")
    assert problem == "" and body.model == "m" and body.stream is True and len(body.tools) == 1
    assert [m.role for m in body.messages] == ["user", "assistant"]  # stopped once both were known


def test_fast_decode_walks_on_past_a_long_opening_message_a_few_items():
    """The items the facts need were most of the body (a long first message): the walk goes on
    a few items (MORE_ITEMS), in case the array ends there; a longer one is searched from the end."""
    long_first = b'{"role":"user","content":"' + b"q" * 20000 + b'"}'
    for n_after, walked in ((1, 3), (12, 2 + largebody.MORE_ITEMS)):
        items = [long_first, b'{"role":"assistant","content":"x"}']
        items += [b'{"role":"%s","content":"y"}' % r for r in [b"user", b"assistant"] * 6][:n_after]
        data = b'{"model":"m","messages":[' + b",".join(items) + b'],"tools":[{"name":"stream"}],"stream":true}'
        body, problem = largebody.fast_decode(data, "anthropic")
        assert problem == "" and body.model == "m" and body.stream is True and len(body.tools) == 1
        assert len(body.messages) == walked


@pytest.mark.parametrize("after", [b"}", b' , "stream" : true , "model":"m"}', b',"stream":true,"x":{"model":"z"}}',
                                   b', "stream": true} ', b"]", b', "stream": true', b",}", b'}{"model":"z"}'])
def test_the_tail_read_from_where_the_array_ended_is_the_whole_reads(after, monkeypatch):
    """An array the walk reached the end of: the members after it read from there — the same
    answer as the search from the end (MORE_ITEMS = 0: the walk stops where the facts are
    known) and, when the body is JSON, as the whole read (a second top-level model, a nested
    look-alike, odd text after)."""
    data = (b'{"model":"m","messages":[{"role":"user","content":"' + b"q" * 1000 + b'"},'
            b'{"role":"assistant","content":"a"}]' + after)
    got = largebody.fast_decode(data, "anthropic")
    monkeypatch.setattr(largebody, "MORE_ITEMS", 0)
    searched = largebody.fast_decode(data, "anthropic")
    assert (got is None) == (searched is None)
    if got is None:
        return                                     # the whole read decides, as before
    assert (got[0].model, got[0].stream, got[1]) == (searched[0].model, searched[0].stream, searched[1])
    try:
        whole = msgspec.json.decode(data, type=wire.Body)
    except msgspec.DecodeError:
        return                                     # not JSON: what the parts do not prove (docs/facts.md)
    assert (got[0].model, got[0].stream) == (whole.model, whole.stream)


@pytest.mark.parametrize(
    "data",
    [
        b'[{"messages": []}]',
        b'{"model": "m"}',
        b'{"messages": {"a": 1}}',
        b'{"messages": ["text"]}',
        b'{"messages": [{"role": "user"} {"role": "x"}]}',
        b'{"messages": [{"role": 5}]}',
        b'{"messages": [{"role": "user"}]} trailing',
    ],
)
def test_fast_decode_falls_back_on_anything_odd(data):
    assert largebody.fast_decode(data, "anthropic") is None


def _big(tail: bytes, msgs: list[bytes] | None = None) -> bytes:
    pad = b'{"role":"user","content":"' + b"x" * (largebody.FAST_MIN + 10) + b'"}'
    body = b'{"model":"m","messages":[' + b",".join([pad, *(msgs or [])]) + b"]" + tail + b"}"
    return body


def test_prompt_cache_key_after_the_messages_is_found_when_asked():
    data = _big(b',"prompt_cache_key":"pi-123"')
    body, _ = largebody.fast_decode(data, "chat", cache_key=True)
    assert body.prompt_cache_key == "pi-123"
    body, _ = largebody.fast_decode(data, "chat", cache_key=False)
    assert body.prompt_cache_key is None   # not looked for: no scan paid for it


@pytest.mark.parametrize("n", [200, 3000])
def test_many_nested_look_alikes_read_the_same_in_parts_as_whole(n):
    # Tool inputs holding a "metadata" member, and no top-level metadata: every look-alike is
    # tried and refused (each try reads only its own object) — up to TAIL_HITS of them; more,
    # and the parts give up: the whole read (one decode in C) says the same.
    calls = [b'{"role":"assistant","content":[{"type":"tool_use","input":{"a":1,"metadata":{"k":%d}}}]}' % i
             for i in range(n)]
    data = _big(b',"tools":[{"name":"t"}]', calls)
    got = largebody.fast_decode(data, "anthropic")
    assert (got is None) == (n > largebody.TAIL_HITS)
    whole = wire.body_decoder.decode(data)
    assert whole.metadata is None
    if got is not None:
        fast = got[0]
        assert fast.metadata is None
        assert bool(fast.tools) == bool(whole.tools) and fast.model == whole.model == "m"   # tools: any or none


def test_a_key_both_before_and_after_the_messages_is_left_to_the_whole_read():
    data = b'{"model":"a","stream":true,"messages":[' + b'{"role":"user","content":"' + b"x" * largebody.FAST_MIN + \
        b'"}],"tools":[],"model":"b"}'
    assert largebody.fast_decode(data, "anthropic") is None


def test_a_typed_user_message_is_not_history_in_messages_bodies():
    # In chat/anthropic bodies history is an assistant role; a "type" only counts in Responses.
    data = _big(b"", [b'{"role":"user","type":"function_call_output","content":"y"}',
                      b'{"role":"assistant","content":"z"}'])
    body, _ = largebody.fast_decode(data, "chat")
    assert [m.role for m in body.messages] == ["user", "user", "assistant"]


@pytest.mark.parametrize("second", [b'"b"', b'"a"'])
def test_a_second_top_level_model_after_the_messages_sends_the_body_to_the_whole_read(second):
    # the head's model span is what a rename trusts: a duplicate later in the body (the
    # whole read takes the last) must never be missed, whatever its value
    pad = b'{"role":"user","content":"' + b"x" * (largebody.FAST_MIN + 10) + b'"}'
    data = (b'{"model":"a","messages":[' + pad + b'],"tools":[{"name":"T","input_schema":{"properties":'
            b'{"model":{"type":"string"}}}}],"model":' + second + b',"stream":true}')
    assert largebody.fast_decode(data, "anthropic") is None
    # nested look-alikes alone do not
    data = (b'{"model":"a","messages":[' + pad + b'],"tools":[{"name":"T","input_schema":{"properties":'
            b'{"model":{"type":"string"}}}}],"stream":true}')
    spans = {}
    body, _ = largebody.fast_decode(data, "anthropic", spans=spans)
    assert body.model == "a" and data[slice(*spans["model"])] == b'"a"'


@pytest.mark.parametrize("value", [b"[]", b"[ ]", b"[\n\t ]", b'[{"name":"t"}]', b"[ 1 ]", b"null", b'"x"', b"{}",
                                   b"1", b"true", b'[[]]'])
def test_tools_any_or_none_from_the_top_level_as_the_typed_read_says(value):
    """``any_items``: the raw member's first bytes say what the typed read of every tool would
    (a second scan of 92 KB of schemas in a Claude Code request): empty, some, none, wrong type."""
    raw = wire.loose_decoder.decode(b'{"tools":' + value + b"}")["tools"]
    try:
        typed = msgspec.json.Decoder(list[msgspec.Raw] | None).decode(value)
    except msgspec.ValidationError:
        with pytest.raises(msgspec.ValidationError):
            wire.any_items(raw)
        return
    got = wire.any_items(raw)
    assert (got is None) is (typed is None) and bool(got) == bool(typed)


@pytest.mark.parametrize("pad", [b" ", b"\n\t\r ", b" " * (1 << 20)])
def test_tools_any_or_none_past_any_whitespace(pad):
    """Found by a search in C, not a Python step per byte (a hostile array of megabytes of spaces)."""
    empty = wire.loose_decoder.decode(b'{"tools":[' + pad + b"]}")["tools"]
    some = wire.loose_decoder.decode(b'{"tools":[' + pad + b'{"name":"t"}' + pad + b"]}")["tools"]
    assert wire.any_items(empty) == [] and wire.any_items(some)


def test_a_head_member_followed_by_megabytes_of_spaces_has_its_exact_span():
    """The large-body reader's span of a head member ends at its last byte, found back over the
    spaces in doubling windows (a Python step per byte was 0.3 s for 4 MiB)."""
    pad = b" \r\n\t" * (1 << 18)
    data = b'{"model":"claude-opus-4-5"' + pad + b',"messages":[{"role":"user","content":"hi"}]}'
    spans: dict = {}
    body, _ = largebody.fast_decode(data, "anthropic", True, spans)
    assert body.model == "claude-opus-4-5" and data[slice(*spans["model"])] == b'"claude-opus-4-5"'


@pytest.mark.parametrize("odd", [b'{"role":5,"content":"y"}', b'"text"', b'{"role":"user","content":"y"} {'])
def test_an_odd_item_past_what_the_facts_need_is_left_unread_as_before(odd, monkeypatch):
    """The walk past the items the facts need (a long first message) meets an odd item: it is
    left unread and the tail searched for, as when the walk stopped where the facts were known
    — not sent to the whole read, which would say the body has a wrong shape."""
    data = (b'{"model":"m","messages":[{"role":"user","content":"' + b"q" * 20000 + b'"},'
            b'{"role":"assistant","content":"a"},' + odd + b'],"stream":true}')
    got = largebody.fast_decode(data, "anthropic")
    monkeypatch.setattr(largebody, "MORE_ITEMS", 0)
    before = largebody.fast_decode(data, "anthropic")
    assert got is not None and before is not None
    assert (got[0].model, got[0].stream, got[1], len(got[0].messages)) == ("m", True, "", 2) \
        == (before[0].model, before[0].stream, before[1], len(before[0].messages))
