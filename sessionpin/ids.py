"""Session ids as people see them: one ``short()`` for the log, flow comments and the CLI.

Rules it keeps:
- Eight characters that tell conversations apart. For ids that begin with a timestamp —
  UUIDv7 (Codex, pi) and opencode's ``ses_…`` ids (twelve hex digits of time, then
  random) — that is the **end** of the id: two conversations begun in the same minute
  share their first eight characters.
- A kind prefix stays visible (``ses_``, ``fp:`` for a fingerprint), so the short form
  says what sort of id it is; ``user_`` (an old Claude Code form) is dropped.
- ``matches(id, given)`` is how the CLI finds a session from what a person typed: a
  prefix of the id, or a prefix of its short form, or the end of the id.
"""

from __future__ import annotations

import re

_UUID7 = re.compile(r"\A[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}\Z", re.IGNORECASE)
_TIME_FIRST = ("ses_", "msg_", "prt_")   # opencode's time-ordered identifiers
WIDTH = 8


def short(session: str | None) -> str:
    if not session:
        return "-"
    if session.startswith("fp:"):
        return session[:3 + WIDTH]
    for prefix in _TIME_FIRST:
        if session.startswith(prefix) and len(session) > len(prefix) + WIDTH:
            return prefix + session[-WIDTH:]
    if _UUID7.match(session):
        return session[-WIDTH:]
    if session.startswith("user_"):
        session = session[5:]
    return session[:WIDTH]


def matches(session: str, given: str) -> bool:
    return session.startswith(given) or short(session).startswith(given) or session.endswith(given)
