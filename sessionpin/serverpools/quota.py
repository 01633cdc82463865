"""What a server's own answers say about its quota. Pure: status and headers in, a ``Quota`` out.

sessionpin sends no probes: it reads the headers real responses carry.

Rules it keeps:
- Anthropic: ``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,
  remaining,reset}`` (reset: an RFC 3339 time). OpenAI and compatible servers:
  ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` (reset: a duration such as
  ``1s``, ``6m0s``, ``20ms``, or seconds). ``retry-after`` (seconds or an HTTP date) and
  ``retry-after-ms``.
- Headroom is the smallest remaining/limit share over the dimensions reported.
- 429: the member is exhausted until ``retry-after``; else until the latest reset of a
  dimension with nothing remaining; else the earliest reset reported; else for
  ``DEFAULT_429`` seconds. 529 (overloaded): until ``retry-after``, else for
  ``DEFAULT_529`` seconds.
- A success with a dimension at 0 remaining: exhausted until that dimension's reset.
  Any other success clears exhaustion (the member answered) — unless the exhaustion was
  observed after the successful request was sent (``supersedes``): an answer speaks for
  when its request was admitted, not for later.
- Any other status teaches nothing (``None``) unless it carries rate-limit headers.
- A member's claims are clamped, never trusted past what a real provider says (issue 20):
  a reset or ``retry-after`` further than ``max_reset`` (default ``MAX_RESET``, 1 h: the
  longest window the providers document) is taken as ``max_reset`` (the ``why`` keeps
  the claim); a remaining above its limit is the limit (headroom at most 1: "full", what a
  member that says nothing counts as); numbers that are not finite are no numbers.
  ``clamped`` applies the same bound to a state read back from the store (written by an
  older proxy, or one with another bound), and ``decode`` refuses what no ``observe``
  writes (non-finite times, a headroom outside 0..1), so no reader can overflow on it.
"""

from __future__ import annotations

import email.utils
import math
import re
from datetime import datetime
from typing import Iterable

import msgspec

DEFAULT_429 = 60.0
DEFAULT_529 = 15.0
MAX_RESET = 3600.0        # seconds: the furthest reset a claim is believed (the providers' longest window)
STALE = 600.0             # an observation is kept this long past its exhaustion (the store's TTL)

_ANTHROPIC = re.compile(r"^anthropic-ratelimit-(requests|tokens|input-tokens|output-tokens)-(limit|remaining|reset)$")
_OPENAI = re.compile(r"^x-ratelimit-(limit|remaining|reset)-(requests|tokens)$")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


class Quota(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    observed: float                     # when (epoch seconds)
    status: int = 0                     # the answer's status
    headroom: float | None = None       # 0..1; None: no limits reported
    exhausted_until: float = 0.0        # epoch seconds; 0: not exhausted
    why: str = ""                       # "429, retry-after 30s", "tokens 0 left"


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Quota)


def encode(q: Quota) -> str:
    return _enc.encode(q).decode()


def decode(raw: str | None) -> Quota | None:
    if not raw:
        return None
    try:
        q = _dec.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not (math.isfinite(q.observed) and math.isfinite(q.exhausted_until)):
        return None
    if q.headroom is not None and not 0.0 <= q.headroom <= 1.0:
        return msgspec.structs.replace(q, headroom=None if q.headroom != q.headroom else min(1.0, max(0.0, q.headroom)))
    return q


def clamped(q: Quota | None, now: float, max_reset: float = MAX_RESET) -> Quota | None:
    """``q`` with its exhaustion ending at most ``max_reset`` after it was observed (and
    after ``now``, for an observation stamped in the future)."""
    if q is None:
        return None
    bound = min(q.observed, now) + max_reset
    if q.exhausted_until <= bound:
        return q
    return msgspec.structs.replace(q, exhausted_until=bound, why=f"{q.why} (taken as {max_reset:g}s)")


def supersedes(new: Quota, sent: float, old: Quota | None) -> bool:
    """Whether ``new``, the answer to a request sent at ``sent``, replaces the state ``old``.

    Not when ``old`` was observed after that request was sent and is an exhaustion still in
    force that ``new`` would shorten: a member admitted that request before it said "out of
    quota" (a slow answer, another proxy's 429 meanwhile), which says nothing of after. Any
    newer request's answer, or one that keeps or extends the exhaustion, replaces it."""
    if old is None or old.observed <= sent:
        return True
    return not (old.exhausted_until > new.observed and new.exhausted_until < old.exhausted_until)


def ttl(q: Quota, now: float) -> float:
    return max(q.exhausted_until - now, 0.0) + STALE


def observe(status: int, headers: Iterable[tuple[str, str]], now: float,
            max_reset: float = MAX_RESET) -> Quota | None:
    dims: dict[str, dict[str, str]] = {}
    retry: float | None = None
    for name, value in headers:
        n = name.lower()
        if m := _ANTHROPIC.match(n):
            dims.setdefault(m.group(1), {})[m.group(2)] = value.strip()
        elif m := _OPENAI.match(n):
            dims.setdefault(m.group(2), {})[m.group(1)] = value.strip()
        elif n == "retry-after-ms":
            ms = _number(value, 1000.0)
            retry = max(0.0, ms) if retry is None and ms is not None else retry
        elif n == "retry-after":
            retry = _retry_after(value, now)
    shares: list[float] = []
    empty_resets: list[float] = []
    resets: list[float] = []
    empty: list[str] = []
    for dim, d in dims.items():
        limit, remaining = _number(d.get("limit")), _number(d.get("remaining"))
        reset = _reset(d.get("reset"), now)
        if reset is not None:
            resets.append(reset)
        if limit and remaining is not None and limit > 0 and (share := remaining / limit) == share:
            shares.append(max(0.0, min(1.0, share)))     # more left than its limit: full, no more
        if remaining is not None and remaining <= 0:
            empty.append(dim)
            if reset is not None:
                empty_resets.append(reset)
    headroom = min(shares) if shares else None
    if status == 429:
        if retry is not None:
            until, why = now + retry, f"429, retry-after {retry:g}s"
        elif empty_resets:
            until, why = max(empty_resets), f"429, {', '.join(empty)} 0 left"
        elif resets:
            until, why = min(resets), "429"
        else:
            until, why = now + DEFAULT_429, "429, no reset given"
        return _bounded(Quota(observed=now, status=status, headroom=0.0 if headroom is None else headroom,
                              exhausted_until=max(until, now), why=why), max_reset)
    if status == 529:
        until = now + (retry if retry is not None else DEFAULT_529)
        return _bounded(Quota(observed=now, status=status, headroom=headroom, exhausted_until=until,
                              why="529 overloaded"), max_reset)
    if 200 <= status < 300:
        if empty_resets and max(empty_resets) > now:
            return _bounded(Quota(observed=now, status=status, headroom=headroom, exhausted_until=max(empty_resets),
                                  why=f"{', '.join(empty)} 0 left"), max_reset)
        return Quota(observed=now, status=status, headroom=headroom)
    if dims:
        return Quota(observed=now, status=status, headroom=headroom)
    return None


def _bounded(q: Quota, max_reset: float) -> Quota:
    """An observation's exhaustion ends at most ``max_reset`` after it (the claim kept in ``why``)."""
    if q.exhausted_until - q.observed <= max_reset:
        return q
    return msgspec.structs.replace(q, exhausted_until=q.observed + max_reset,
                                   why=f"{q.why} (taken as {max_reset:g}s)")


def _number(text: str | None, scale: float = 1.0) -> float | None:
    if text is None:
        return None
    try:
        v = float(text.strip())
    except ValueError:
        return None
    # "nan" is no number; an overflow ("1e400", a thousand digits) is infinitely far: every
    # time made of it is clamped to the reset bound, and a share of it to 0..1
    return None if v != v else v / scale


def _retry_after(text: str, now: float) -> float | None:
    v = _number(text)
    if v is not None:
        return max(0.0, v)
    try:
        return max(0.0, email.utils.parsedate_to_datetime(text.strip()).timestamp() - now)
    except (TypeError, ValueError, IndexError, OverflowError, OSError):
        return None


def _reset(text: str | None, now: float) -> float | None:
    """A reset as epoch seconds: an RFC 3339 time, a duration ("6m0s", "20ms") or seconds."""
    if not text:
        return None
    v = _number(text)
    if v is not None:
        return now + max(0.0, v)
    if "T" in text or text[:4].isdigit() and "-" in text:
        try:
            return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError, OSError):
            return None
    parts = _DURATION.findall(text)
    if not parts or "".join(a + b for a, b in parts) != text.strip():
        return None
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return now + sum(float(a) * scale[b] for a, b in parts)
