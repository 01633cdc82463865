"""reader/modelspan.py: where the top-level model lies, byte for byte — the common layouts'
fast path checked where the walk checks, duplicates refused, and the same span from a top
level the caller decoded (the facts reader's, issue 22)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessionpin.decision import rewrite
from sessionpin.reader import modelspan
from sessionpin.reader.modelspan import ModelNotFound

# ---- model_span's fast path (issue 22): the common layouts, checked where the walk checks ----

LAYOUTS = [None, (",", ":"), (", ", ": ")]     # None: a layout of its own (indent), walked


def _body(members, seps):
    return (json.dumps(dict(members), indent=1) if seps is None
            else json.dumps(dict(members), separators=seps, ensure_ascii=False)).encode()


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6).filter(lambda k: k != "model"),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=200),
                                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4),
                                    max_leaves=30), max_size=5),
       st.integers(min_value=0, max_value=5), st.sampled_from(LAYOUTS), st.text(min_size=1, max_size=12))
def test_the_fast_path_and_the_walk_find_the_same_span_and_make_the_same_bytes(other, at, seps, model):
    items = list(other.items())
    items.insert(min(at, len(items)), ("model", model))
    body = _body(items, seps)
    top = modelspan._decode_top.decode(body)
    fast, walked = modelspan._laid_out(body, top), modelspan._walk(body, top)
    assert (fast is not None) is (seps is not None)          # the usual layouts take the fast path
    assert fast in (None, walked)
    assert modelspan.model_span(body) == walked
    start, end = walked
    out = rewrite.replace_model(body, model, "glm-4.6")
    assert out == body[:start] + b'"glm-4.6"' + body[end:]    # the walk's span: byte for byte


@pytest.mark.parametrize("seps", [(",", ":"), (", ", ": ")])
@pytest.mark.parametrize("body", [
    '{"model":"a","x":1,"model":"a"}',
    '{"model":"a","x":"longer value","x":"s"}',
    '{"x":"long long long","model":"a","x":"s"}',
    '{"messages":[' + '"m",' * 100 + '"m"],"model":"a","messages":["' + "z" * 300 + '"]}',
])
def test_the_fast_path_refuses_nothing_and_takes_no_duplicate(body, seps):
    body = body.replace(",", seps[0]).replace(":", seps[1]).encode()
    top = modelspan._decode_top.decode(body)
    assert modelspan._laid_out(body, top) is None     # not taken: the walk decides
    with pytest.raises(ModelNotFound):
        modelspan.model_span(body)


@pytest.mark.parametrize("body", [
    b'{"model":"a","messages":[]}',
    b'{"messages": [], "model": "claude-opus-4-5", "stream": true}',
    b'{\n  "model" : "a" ,\n  "x" : {"model": "b"}\n}',
])
def test_a_top_level_handed_in_gives_the_span_the_body_gives(body):
    top = modelspan._decode_top.decode(body)
    assert modelspan.model_span(body, top) == modelspan.model_span(body)


@pytest.mark.parametrize("body", [b'{"model":"a","model":"a"}', b'{"model":1}', b'{"x":1}'])
def test_a_top_level_handed_in_refuses_what_the_body_refuses(body):
    top = modelspan._decode_top.decode(body)
    with pytest.raises(ModelNotFound):
        modelspan.model_span(body, top)


@pytest.mark.parametrize("pad", [b" ", b"\t", b"\r\n", b" \n\t\r" * 4, b" " * (1 << 20)])
def test_whitespace_anywhere_between_members_is_walked_to_the_same_span(pad):
    """The walk skips whitespace with a search in C (a body padded with megabytes of spaces
    cost a Python step per byte on the event loop): every place a space may go."""
    parts = [b"{", b'"x"', b":", b"1", b",", b'"model"', b":", b'"claude-opus-4-5"', b",", b'"m"', b":", b"[]", b"}"]
    body = pad + pad.join(parts) + pad
    start, end = modelspan.model_span(body)
    assert body[start:end] == b'"claude-opus-4-5"'
    with pytest.raises(ModelNotFound):     # and a duplicate behind the padding is still refused
        modelspan.model_span(body[:-len(pad) - 1] + b"," + pad + b'"model":"a"}')


@pytest.mark.parametrize("key", ["a\\", "\\\\", 'q"q', '\\"', "\\" * 5 + '"', "\\" * (1 << 20)])
def test_keys_of_escaped_backslashes_and_quotes_are_walked_to_the_same_span(key):
    """A key's closing quote is told by the backslashes before each quote, counted in C (a key
    of megabytes of them was a Python step per byte)."""
    body = b"{ " + json.dumps(key).encode() + b': 1 , "model" : "claude-opus-4-5" }'
    start, end = modelspan.model_span(body)
    assert body[start:end] == b'"claude-opus-4-5"'


def test_a_key_of_many_escaped_quotes_is_read_in_c(monkeypatch):
    """A key of 60,000 escaped quotes in a body the fast layout check does not take (spaces of
    its own): its end is found by one decode, not a Python step per quote (57 ms on the event
    loop before) — the same span."""
    from sessionpin.reader import modelspan as M, wire as W
    calls = []
    real = M.back_over
    monkeypatch.setattr(M, "back_over", lambda *a, **k: calls.append(1) or real(*a, **k))
    body = ('{ "model" : "claude-opus-4-5" , ' + json.dumps('"' * 60000) + ' : 1 , "messages" : [] }').encode()
    assert M.model_span(body, W.loose_decoder.decode(body)) == (12, 29)
    assert len(calls) <= 8
