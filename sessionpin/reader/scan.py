"""Stepping over runs of bytes in C, never a Python step per byte.

A hostile body can pad itself with megabytes of spaces between its members or items, or make a
key of megabytes of backslashes: a ``while data[i] in …`` loop then held the event loop for
tenths of a second (issue 22). Forwards a regular expression's match finds the end of a run;
backwards (``re`` cannot search back) windows that double are stripped by ``bytes.rstrip``,
so a run costs C-speed copies of about twice its length.
"""

from __future__ import annotations

import re

WS = b" \t\r\n"                       # JSON's whitespace
_WS_RUN = re.compile(rb"[ \t\r\n]*")


def skip_ws(data: bytes | memoryview, i: int) -> int:
    """The index of the first byte at or after ``i`` that is not JSON whitespace (``len(data)``: none)."""
    return _WS_RUN.match(data, i).end()   # type: ignore[union-attr]   (``*`` always matches)


def back_over(data: bytes, chars: bytes, i: int, floor: int = 0) -> int:
    """The index just past the last byte of ``data[floor:i]`` that is not one of ``chars``
    (``floor``: all of them are)."""
    width = 16
    while i > floor:
        lo = max(floor, i - width)
        kept = len(data[lo:i].rstrip(chars))
        if kept:
            return lo + kept
        i, width = lo, width * 2
    return floor
