"""Session ids as people see them: one ``short()`` for the log, flow comments and the CLI.

Rules it keeps:
- Eight characters that tell conversations apart. For ids that begin with a timestamp —
  UUIDv7 (Codex, pi) and opencode's ``ses_…`` ids (twelve hex digits of time, then
  random) — that is the **end** of the id: two conversations begun in the same minute
  share their first eight characters.
- A kind prefix stays visible (``ses_``, ``fp:`` for a fingerprint), so the short form
  says what sort of id it is; ``user_`` (an old Claude Code form) is dropped.
- ``matches(id, given)`` is how the CLI finds a session from what a person typed: a
  prefix of the id, or a prefix of its short form, or the end of the id, or a shown
  ``head…tail`` (both); ``typed(given)`` first drops what is drawn as nothing (pasted from a
  refusal to pi).
- ``shorts(ids)``: the short forms of the ids shown together, unique among them: where two
  share one (two pi conversations that opened alike: one fingerprint, two nonces), each
  gets ``…`` and as much of its end as tells it apart; the whole id if nothing does.
"""

from __future__ import annotations

import re
import unicodedata

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


ELLIPSIS = "…"


def shorts(sessions) -> dict[str, str]:
    """Each id's short form, unique among ``sessions`` (longer where needed)."""
    ids = list(dict.fromkeys(s for s in sessions if s))
    groups: dict[str, list[str]] = {}
    for s in ids:
        groups.setdefault(short(s), []).append(s)
    out: dict[str, str] = {}
    for head, same in groups.items():
        if len(same) == 1:
            out[same[0]] = head
            continue
        for k in range(4, max(len(x) for x in same) + 1):
            tails = [x[-k:] for x in same]
            if len(set(tails)) == len(same):
                break
        for x in same:
            tail = x[-k:] if len({y[-k:] for y in same}) == len(same) else None
            out[x] = f"{head}{ELLIPSIS}{tail}" if tail is not None and len(head) + k < len(x) else x
    return out


def typed(given: str) -> str:
    """What a person typed or pasted as an id, without the blanks around it and the characters
    drawn as nothing (a refusal to pi holds a word joiner inside digits its retry rule reads)."""
    given = given.strip()
    return "".join(c for c in given if unicodedata.category(c) != "Cf") if not given.isascii() else given


def matches(session: str, given: str) -> bool:
    if ELLIPSIS in given:
        head, _, tail = given.partition(ELLIPSIS)
        return (session.startswith(head) or short(session).startswith(head)) and session.endswith(tail)
    return session.startswith(given) or short(session).startswith(given) or session.endswith(given)
