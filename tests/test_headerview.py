"""headerview: the same answers as mitmproxy's ``headers.get`` and ``in``, from one pass."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import http

from sessionpin.reader import headerview

NAMES = ["content-type", "Content-Type", "CONTENT-ENCODING", "content-encoding", "request-id", "x-a", "X-A", "upgrade"]
VALUES = st.one_of(st.sampled_from([b"", b"text/event-stream", b"gzip", b" br ", b"caf\xc3\xa9", b"\xff\xfe"]),
                   st.binary(max_size=12))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(NAMES), VALUES), max_size=8))
def test_the_same_answers_as_mitmproxy(pairs):
    h = http.Headers([(n.encode(), v) for n, v in pairs])
    for name in {n.lower() for n in NAMES}:
        assert headerview.get(h, name) == h.get(name, "")
        assert headerview.get(h, name, None) == h.get(name)
        assert headerview.has(h, name) == (name in h)
    assert headerview.pairs(h) == tuple(h.items(multi=True))


def test_a_change_to_the_headers_is_seen():
    h = http.Headers([(b"content-type", b"application/json")])
    assert headerview.get(h, "content-type") == "application/json"
    h["content-type"] = "text/event-stream"              # mitmproxy makes a new fields tuple
    assert headerview.get(h, "content-type") == "text/event-stream"
    del h["content-type"]
    assert not headerview.has(h, "content-type") and headerview.get(h, "content-type", None) is None
    h.fields = h.fields + ((b"Content-Type", b"a"), (b"content-type", b"b"))
    assert headerview.get(h, "content-type") == "a, b" == h.get("content-type")


def test_many_messages_each_get_their_own_answer():
    hs = [http.Headers([(b"request-id", str(i).encode())]) for i in range(20)]
    for _ in range(2):
        assert [headerview.get(h, "request-id") for h in hs] == [str(i) for i in range(20)]
