"""reader/scan.py: runs of bytes stepped over in C, forwards and back (issue 22: a hostile body's
megabytes of padding were a Python step per byte on the event loop)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessionpin.reader import scan


@given(st.binary(max_size=200).map(lambda b: bytes(c if c % 3 else 32 for c in b)), st.data())
def test_skip_ws_is_the_first_byte_that_is_not_json_whitespace(data, draw):
    i = draw.draw(st.integers(0, len(data)))
    want = next((k for k in range(i, len(data)) if data[k] not in scan.WS), len(data))
    assert scan.skip_ws(data, i) == want


@given(st.binary(max_size=300).map(lambda b: bytes(92 if c % 2 else c for c in b)), st.data())
def test_back_over_is_just_past_the_last_byte_not_in_the_set(data, draw):
    i = draw.draw(st.integers(0, len(data)))
    floor = draw.draw(st.integers(0, i))
    want = next((k + 1 for k in range(i - 1, floor - 1, -1) if data[k] not in b"\\"), floor)
    assert scan.back_over(data, b"\\", i, floor) == want


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1 << 20])
def test_long_runs_both_ways(n):
    data = b"a" + b" \t\r\n" * n + b"b"
    assert scan.skip_ws(data, 1) == len(data) - 1
    assert scan.back_over(data, scan.WS, len(data) - 1) == 1
    assert scan.back_over(b"\\" * n, b"\\", n) == 0


@pytest.mark.parametrize("data", [
    b"", b"{", b"x{y{z{", b'{"a":{}}' * 5000, b"no braces" * 1000,
    b"x" * (64 * 1024 - 1) + b"{{" + b"y" * 70_000 + b"{",      # across the slices it counts in
    b"{" * (64 * 1024 * 2 + 3),
])
def test_count_is_bytes_count_and_stops_past_its_limit(data):
    """``scan.count`` (memchr's speed, in slices) says what ``bytes.count`` says, of bytes and of a
    view; with a limit, more than it exactly when there are more than it."""
    from sessionpin.reader.scan import count
    want = data.count(b"{")
    assert count(data, b"{") == want and count(memoryview(data)[1:], b"{") == data[1:].count(b"{")
    for limit in {0, 1, 2, want - 1, want, want + 1} - {-1}:
        assert (count(data, b"{", limit) > limit) is (want > limit)
        assert count(data, b"{", limit) <= max(want, limit + 1)
