"""Feeding real responses back into their binding (seeds/002 §6, §7).

``observe`` is a store transition the participant runs as a task of its own after
``responseheaders``: it reads one binding and writes at most one record (a compare-and-set
or a retirement), and the response stream never waits for it.

Rules it keeps:
- ``upstream;dur < degrade_ms``: failures reset; the measurement and ``last_seen_at`` are
  persisted at most every 5 s (or at once when a strike is cleared);
- ``upstream;dur >= degrade_ms``: one strike; the strike that reaches
  ``quarantine_failures`` retires the id;
- ``upstream;dur >= quarantine_ms`` or HTTP 429: retired at once;
- a response without ``upstream;dur`` only keeps the lease alive: the wall clock of a real
  request includes generation, so it says nothing about the shard;
- a response for an id no longer bound to that key (retired, re-bound) changes nothing.
"""

from __future__ import annotations

from collections import Counter

import msgspec

from . import state
from .options import OBSERVE_WRITE_EVERY_MS, PoolConfig
from .signals import judge, upstream_ms
from ..store.base import Store


async def observe(store: Store, key: str, routed_id: str, status: int, server_timing: str | None,
                  cfg: PoolConfig, now: int, counters: Counter[str]) -> str:
    """One real response -> healthy | strike | retire | unbound (what happened to the binding)."""
    b = await state.binding(store, key)
    if b is None or b.routed_id != routed_id:
        return "unbound"
    up = upstream_ms(server_timing)
    verdict, reason = judge(status, up, b.failures, degrade_ms=cfg.degrade_ms,
                            quarantine_ms=cfg.quarantine_ms, quarantine_failures=cfg.quarantine_failures)
    counters["observed"] += 1
    if verdict == "retire":
        # durable: a slow id must not come back after a crash (observation is off the stream's path)
        if await state.retire(store, key, routed_id, now, durable=True):
            counters[f"retired_{reason}"] += 1
        return "retire"
    if verdict == "strike":
        counters["strikes"] += 1
        await state.change(store, key, routed_id, lambda x: msgspec.structs.replace(
            x, failures=x.failures + 1, last_seen_at=now, upstream_ms=up))
        return "strike"
    if b.failures or now - b.last_seen_at >= OBSERVE_WRITE_EVERY_MS:
        changes: dict[str, object] = {"failures": 0, "last_seen_at": now}
        if up is not None:
            changes.update(upstream_ms=up, verified_at=now)
        await state.change(store, key, routed_id, lambda x: msgspec.structs.replace(x, **changes))
    return "healthy"
