"""The allocator: which member of a server pool a new conversation goes to. Pure.

A pool (``config.Pool``, docs/serverpools.md) shares an agent's new conversations among servers.
``members.allocate`` reads the pool's stored cursor and its members' state, asks
``choose`` here, and writes the pin and the cursor's advance in one compare-and-set. No
store, no clock, no I/O in this module: everything it decides on is an argument.

Rules it keeps:
- One cursor per pool, shared by every agent and every proxy: ``Cursor(n, rev)``, ``n``
  the position in the pool's schedule, ``rev`` the pool revision it was last advanced
  under. A choice advances it to just past the position chosen, so successive
  allocations walk the schedule: with every member eligible, round-robin is exact (no
  member skipped or doubled).
- The schedule: round-robin and least-active and quota walk the members in written
  order; weighted walks the smooth weighted round-robin sequence of the weights (nginx's:
  a member of weight 2 comes twice per period, never twice in a row unless it must).
- Eligible: not drained, not known exhausted (its reset still ahead), not excluded (a
  soft pool's member this request just missed). Only eligible members are chosen.
- round-robin / weighted: the first eligible member on the walk from the cursor.
- least-active: the eligible member with the fewest active (pinned, live) conversations;
  ties take turns by the walk.
- quota: each eligible member's share of new conversations is its headroom (the smallest
  remaining/limit share it last reported, at most 1; unknown counts as full; at least
  ``HEADROOM_FLOOR``, so a member whose last word was "empty" is asked again) over the
  eligible members' total. The cursor's position picks the member on the golden-ratio
  sequence laid over those shares (a low-discrepancy walk: any run of consecutive
  allocations, across proxies, is within a few conversations of the shares). No claim
  buys a member more than a full member's share: a member reporting ``remaining
  1000000`` of a limit of 1 counts as full, like one that says nothing (issue 20).
- No eligible member: when some member is only exhausted, ``Exhausted(until)`` with the
  earliest reset (the caller may wait for it, ``wait``); otherwise ``NoMember``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping

import msgspec

from ..config.config import Config, Pool, Server
from ..records.pins import Pin

HEADROOM_FLOOR = 0.05     # quota: the least share a member's reported headroom counts for
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0     # quota: the step of the low-discrepancy walk
WAIT_STEP = 1.0           # seconds: a waiting allocation looks again at least this often

ROUND_ROBIN, WEIGHTED, LEAST_ACTIVE, QUOTA = "round-robin", "weighted", "least-active", "quota"


class Cursor(msgspec.Struct, frozen=True, omit_defaults=True):
    n: int = 0            # position in the schedule (it only grows)
    rev: str = ""         # the pool revision of the allocation that advanced it last


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Cursor)


def encode_cursor(c: Cursor) -> str:
    return _enc.encode(c).decode()


def decode_cursor(raw: str | None) -> Cursor:
    """A missing or unreadable cursor starts at 0 (compare-and-set is on its text, so a
    garbage value is replaced, never trusted)."""
    if not raw:
        return Cursor()
    try:
        c = _dec.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Cursor()
    return c if c.n >= 0 else Cursor()


@dataclass(frozen=True)
class Health:
    """One member as the allocator sees it."""
    active: int = 0                     # live pins on it (pins' index)
    headroom: float | None = None       # 0..1, the smallest remaining/limit share reported; None: unknown
    exhausted_until: float = 0.0        # epoch seconds; in the past: not exhausted
    drained: bool = False


@dataclass(frozen=True)
class Choice:
    member: str
    cursor: Cursor                      # the cursor after this allocation
    why: str                            # "pool glm: round-robin → glm-b"


@dataclass(frozen=True)
class Exhausted:
    until: float                        # the earliest reset among the exhausted members
    members: tuple[str, ...]


@dataclass(frozen=True)
class NoMember:
    why: str


def schedule(pool: Pool) -> tuple[str, ...]:
    """The order the cursor walks: the members, or for a weighted pool one period of
    smooth weighted round-robin."""
    if pool.policy != WEIGHTED:
        return pool.members
    weights = {m: pool.weight(m) for m in pool.members}
    total = sum(weights.values())
    current = dict.fromkeys(pool.members, 0)
    out = []
    for _ in range(total):
        for m in pool.members:
            current[m] += weights[m]
        best = max(pool.members, key=lambda m: current[m])   # first of equals: written order
        current[best] -= total
        out.append(best)
    return tuple(out)


def eligible(health: Health, now: float) -> bool:
    return not health.drained and health.exhausted_until <= now


def choose(pool: Pool, cursor: Cursor, health: Mapping[str, Health], now: float,
           exclude: frozenset[str] = frozenset()) -> Choice | Exhausted | NoMember:
    order = schedule(pool)
    size = len(order)
    ok = {m for m in pool.members if m not in exclude and eligible(health.get(m, Health()), now)}
    if not ok:
        exhausted = [m for m in pool.members if m not in exclude
                     and not health.get(m, Health()).drained and health.get(m, Health()).exhausted_until > now]
        if exhausted:
            return Exhausted(min(health[m].exhausted_until for m in exhausted), tuple(exhausted))
        return NoMember(_none_why(pool, health, exclude))
    if pool.policy == LEAST_ACTIVE:
        low = min(health.get(m, Health()).active for m in ok)
        ok = {m for m in ok if health.get(m, Health()).active == low}
    elif pool.policy == QUOTA:
        return _by_headroom(pool, cursor, [m for m in pool.members if m in ok], health)
    for step in range(size):
        member = order[(cursor.n + step) % size]
        if member in ok:
            return Choice(member, Cursor(cursor.n + step + 1, pool.revision), f"pool {pool.name}: {pool.policy} → {member}")
    raise AssertionError("an eligible member is on the schedule")   # every member is on it


def _headroom(h: Health) -> float:
    """A member's weight under quota: its headroom in ``HEADROOM_FLOOR``..1 (unknown: 1)."""
    if h.headroom is None or h.headroom != h.headroom:
        return 1.0
    return max(HEADROOM_FLOOR, min(1.0, h.headroom))


def _by_headroom(pool: Pool, cursor: Cursor, members: list[str], health: Mapping[str, Health]) -> Choice:
    """The member whose share of ``[0, total)`` holds the cursor's point on the golden-ratio
    sequence: each gets its headroom's share of consecutive allocations (see the module)."""
    weights = [_headroom(health.get(m, Health())) for m in members]
    point = ((cursor.n + 1) * GOLDEN) % 1.0 * sum(weights)
    chosen = members[-1]
    for member, w in zip(members, weights):
        if point < w:
            chosen = member
            break
        point -= w
    return Choice(chosen, Cursor(cursor.n + 1, pool.revision), f"pool {pool.name}: {pool.policy} → {chosen}")


def _none_why(pool: Pool, health: Mapping[str, Health], exclude: frozenset[str]) -> str:
    parts = []
    for m in pool.members:
        if m in exclude:
            parts.append(f"{m} missed")
        elif health.get(m, Health()).drained:
            parts.append(f"{m} drained")
    return f"no member of pool {pool.name} can take a new conversation ({', '.join(parts)})"


def wait(exhausted: Exhausted, now: float, deadline: float) -> float | None:
    """Seconds to wait before looking again, or None: give up now (the earliest reset is
    beyond the deadline, or the deadline has passed)."""
    if now >= deadline or exhausted.until > deadline:
        return None
    return max(0.0, min(exhausted.until, now + WAIT_STEP) - now)


def retry_after(until: float, now: float) -> int:
    """Whole seconds until ``until`` (at least 1): what a refusal's ``retry-after`` says."""
    return max(1, math.ceil(until - now))


def snapshot(config: Config, pin: Pin | None) -> Config:
    """The config a pinned request is planned with: a pool pin's member keeps the model map
    it was allocated with (editing a member changes future allocations only)."""
    if pin is None or not pin.pool or pin.models is None or pin.server not in config.servers:
        return config
    server = config.servers[pin.server]
    if server.models == pin.models:
        return config
    return replace(config, servers={**config.servers, pin.server: replace(server, models=pin.models)})


def addressed_as(config: Config, source: Server | None, target: str | None) -> Server | None:
    """The addressed server as the rewrite should see it. Pool members may share one URL
    (accounts of one provider); a request to that URL addresses none of them in
    particular, so the agent's key is never taken for the target's: the target gets its
    own key even when it is the server the URL resolved to."""
    if source is None or target != source.name:
        return source
    if any(s.name != source.name and (s.origin, s.prefix) == (source.origin, source.prefix)
           for s in config.servers.values()):
        return replace(source, name=source.name + " (shared address)")
    return source
