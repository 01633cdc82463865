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
