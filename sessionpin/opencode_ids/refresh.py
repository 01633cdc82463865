"""One background refresh cycle (seeds/002 §8).

In order: prune idle and struck-out bindings (and cap the table); re-verify *stale* spares
only; probe new ids until each provider+model has ``size`` fresh spares. At most
``2 × size`` probes per provider+model a cycle. Ids owned by a live conversation are never
probed: its real traffic validates them for free.

A stale spare is claimed (``hdel``) before its probe and written back only if it is still
fast, so a concurrent take in another process can never see it bound and spare at once;
if the cycle is cancelled mid-probe (shutdown, script reload) the spare is put back.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable

from . import state
from .acquire import Clock, ProbeFn, TargetState, probe_when_allowed
from .options import PoolConfig
from ..store.base import Store

class Plan:
    """What a cycle may probe: (provider, model) -> (probe function, target state)."""

    def __init__(self, items: Iterable[tuple[tuple[str, str], ProbeFn, TargetState]]):
        self.items = list(items)


async def refill_target(store: Store, provider: str, model: str, probe: ProbeFn, target: TargetState,
                        cfg: PoolConfig, clock: Clock, counters: Counter[str]) -> int:
    """Re-verify stale spares, then refill to size; returns the probes sent."""
    budget = cfg.probes_per_cycle
    sent = 0
    now = clock.now_ms()
    for sid, spare in state.ranked(await state.spares(store, provider, model), now, cfg.ttl_ms, fresh=False):
        if sent >= budget or target.blocked:
            return sent
        if not await state.claim(store, provider, model, sid):
            continue
        try:
            result = await probe_when_allowed(target, clock, cfg, probe, sid, None, counters)
        except BaseException:
            await state.add_spare(store, provider, model, sid, spare)
            raise
        if result is None:  # backing off: leave it for the next cycle
            await state.add_spare(store, provider, model, sid, spare)
            return sent
        sent += 1
        if result.fast:
            await state.add_spare(store, provider, model, sid, state.Spare(
                upstream_ms=result.ms or 0, verified_at=clock.now_ms(), created_at=spare.created_at,
                source=result.source))
            counters["spares_reverified"] += 1
        else:
            counters["spares_dropped"] += 1
    while sent < budget and not target.blocked:
        now = clock.now_ms()
        fresh = state.ranked(await state.spares(store, provider, model), now, cfg.ttl_ms, fresh=True)
        if len(fresh) >= cfg.size:
            break
        sid = state.new_id()
        result = await probe_when_allowed(target, clock, cfg, probe, sid, None, counters)
        if result is None:
            break
        sent += 1
        if result.fast:
            now = clock.now_ms()
            await state.add_spare(store, provider, model, sid, state.Spare(
                upstream_ms=result.ms or 0, verified_at=now, created_at=now, source=result.source))
            counters["spares_added"] += 1
    return sent


async def cycle(store_of: Callable[[], Store], plan: Plan, cfg: PoolConfig, clock: Clock,
                counters: Counter[str]) -> int:
    """Prune, then refill every planned target; returns the probes sent.

    ``store_of`` is asked for the store at every step, so a store swapped during the cycle
    (a reload, a fall-back to memory) is the one written to."""
    pruned = await state.prune(store_of(), clock.now_ms(), lease_ttl_ms=cfg.lease_ttl_ms,
                               quarantine_failures=cfg.quarantine_failures, max_bindings=cfg.max_bindings)
    counters["retired_idle"] += pruned.idle
    counters["retired_cap"] += pruned.capped
    counters["cycles"] += 1
    sent = 0
    for (provider, model), probe, target in plan.items:
        sent += await refill_target(store_of(), provider, model, probe, target, cfg, clock, counters)
    return sent
