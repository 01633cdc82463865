"""What every command shares: one-line user errors, output, and the words for times and pins."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from ..records import pins
from ..reader.ids import short

HOUR = 3600.0
# One wording, used everywhere, for what happens to a conversation the proxy has no pin for.
NOT_SEEN_BEGIN = "the proxy leaves a conversation it did not see begin alone (not routed)"

# Why a pin says what it says: the ladder rule that made it (ladder.py), in words.
PIN_WHY = {
    "opening": "began here",
    "unknown-turn": "turn unknown",
    "not-routed": "agent not routed",
    "continuation-unseen": "not seen begin",
    "unknown-turn-unseen": "not seen begin",
    "continuation-after-title": "began here",
    "operator": "moved",
}


class Fail(Exception):
    """A user error: one line, and the exit code."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def out(line: str = "") -> None:
    print(line)


def err(line: str) -> None:
    print(line, file=sys.stderr)


def dump_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))


class JsonArray:
    """A JSON array printed item by item as the items come: the same text as ``dump_json``
    of the whole list, without holding it."""

    def __init__(self) -> None:
        self.n = 0

    def add(self, value: Any) -> None:
        text = json.dumps(value, indent=2).replace("\n", "\n  ")    # one level deeper
        sys.stdout.write(("[\n  " if self.n == 0 else ",\n  ") + text)
        self.n += 1

    def close(self) -> None:
        sys.stdout.write("[]\n" if self.n == 0 else "\n]\n")


def ago(then: float | None, now: float) -> str:
    if not then:
        return "-"
    d = max(0.0, now - then)
    if d < 60:
        return f"{int(d)}s ago"
    if d < HOUR:
        return f"{int(d // 60)}m ago"
    if d < 48 * HOUR:
        return f"{int(d // HOUR)}h ago"
    return f"{int(d // 86400)}d ago"


def why(pin: pins.Pin) -> str:
    if pin.parent and not pin.why:            # a fork or resume under a new id follows its parent
        return f"fork of {short(pin.parent)}"
    return pin.why or PIN_WHY.get(pin.rule, pin.rule or "-")    # a pool's allocation says its own


def iso(t: float | None) -> str | None:
    if not t:
        return None
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    except (OverflowError, OSError, ValueError):    # a time from a store no clock can show (1e300)
        return "beyond 9999" if t > 0 else "before 1970"


def where(server: str | None) -> str:
    return server if server is not None else "not routed"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def table(rows: list[list[str]], indent: str = "") -> list[str]:
    if not rows:
        return []
    widths = widths_of(rows)
    return [indent + line(r, widths) for r in rows]


def widths_of(rows: list[list[str]]) -> list[int]:
    return [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]


def line(row: list[str], widths: list[int]) -> str:
    """One row of a table whose column widths are known (a longer cell pushes its line only)."""
    return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
