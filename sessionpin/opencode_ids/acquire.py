"""The acquisition algorithm of seeds/002 §5, over the store, a clock and a probe function.

``acquire`` is the whole decision for one binding key; its I/O is injected (``probe``
sends one 1-token request, ``clock`` tells and waits, the async ``Store`` remembers), so
every branch runs under a fake clock in tests.

Rules it keeps:
- a live binding is returned (and touched at most every 30 s): a resumed conversation
  keeps its id;
- no binding, where the caller routed one for the key (``lost``): a loss is raised
  (``state.BindingLost``), never a new id taken (the binding was deleted, not retired);
- else the best *fresh* spare is claimed and bound in one store transition, with no
  network call; a stale spare is only probed when the budget allows a probe at all;
- then, only while budget remains: probes of new random ids, spaced by
  ``min_probe_interval_ms``, never inside a 429 ``retry-after`` window (a window that
  outlives the budget ends acquisition), each probe's timeout the budget left, none
  started with under 1.5 s left; 401/403/400 block the target until its credentials
  change;
- an id that probed fast is bound directly and never enters the spares;
- a claimed spare that cannot be bound because its id was bound or retired before (a
  claim a crash lost) is dropped, and the next spare is tried.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

import msgspec

from . import state
from .options import MIN_PROBE_BUDGET_MS, TOUCH_EVERY_MS, PoolConfig
from .signals import STOPS_PROBING, ProbeResult
from ..store.base import Store

ProbeFn = Callable[[str, int], Awaitable[ProbeResult]]


class Clock(Protocol):
    def now_ms(self) -> int: ...
    async def sleep_ms(self, ms: int) -> None: ...


@dataclass
class TargetState:
    """What one probe target (gateway origin + provider + model) has taught us, in memory."""
    last_probe_at: int | None = None
    backoff_until: int = 0
    blocked: str = ""          # why probing stopped (401/403/400); cleared on new credentials


@dataclass(frozen=True)
class Acquired:
    routed_id: str
    how: str                   # binding | spare | stale | probe
    binding: state.Binding


async def probe_when_allowed(target: TargetState, clock: Clock, cfg: PoolConfig, probe: ProbeFn,
                             sid: str, deadline: int | None, counters: Counter[str]) -> ProbeResult | None:
    """Wait out spacing and backoff, then probe; None when the deadline forbids a probe.

    ``deadline`` None is a background probe: it waits for spacing, skips during a backoff,
    and times out after the probe ceiling plus connection slack."""
    now = clock.now_ms()
    ready = target.backoff_until
    if target.last_probe_at is not None:
        ready = max(ready, target.last_probe_at + cfg.min_probe_interval_ms)
    if deadline is None:
        if target.backoff_until > now:
            return None
    elif ready > now and deadline - ready < MIN_PROBE_BUDGET_MS:
        return None  # the wait (a Retry-After window, or spacing) outlives the budget
    if ready > now:
        await clock.sleep_ms(ready - now)
        now = clock.now_ms()
    timeout = cfg.background_probe_timeout_ms if deadline is None else deadline - now
    if timeout < MIN_PROBE_BUDGET_MS or target.blocked:
        return None
    target.last_probe_at = now
    result = await probe(sid, timeout)
    counters["probes"] += 1
    counters[f"probes_{result.kind}"] += 1
    note(target, result, clock.now_ms())
    return result


def note(target: TargetState, result: ProbeResult, now: int) -> None:
    if result.kind in STOPS_PROBING:
        target.blocked = result.detail or result.kind
    elif result.kind == "overloaded":
        target.backoff_until = max(target.backoff_until, now + result.retry_after_ms)


def _new_binding(result_ms: int | None, provider: str, model: str, sid: str, now: int, how: str) -> state.Binding:
    return state.Binding(routed_id=sid, provider=provider, model=model, bound_at=now, last_seen_at=now,
                         upstream_ms=result_ms, verified_at=now if result_ms is not None else None,
                         origin=how)


async def bind_owned(store: Store, key: str, b: state.Binding, now: int, counters: Counter[str],
                     spare: state.Spare | None) -> state.Binding | None:
    """Bind an id the caller owns; if the key was bound meanwhile, keep that binding and
    put our id (verified fast, never handed out) back among the spares. None: our id is
    unusable (bound or retired before) and the key is still unbound."""
    won = await state.bind(store, key, b)
    if won is None:
        counters["spares_dropped"] += 1
        return None
    if won.routed_id != b.routed_id:
        counters["bind_conflicts"] += 1
        back = spare or state.Spare(upstream_ms=b.upstream_ms or 0, verified_at=b.verified_at or now,
                                    created_at=b.bound_at)
        if b.upstream_ms is not None:
            await state.add_spare(store, b.provider, b.model, b.routed_id, back)
    return won


async def take_fresh(store: Store, key: str, provider: str, model: str, cfg: PoolConfig, now: int,
                     counters: Counter[str]) -> Acquired | None:
    """Claim the best fresh spare and bind it: the whole request-path cost of a new conversation."""
    pool = await state.spares(store, provider, model)
    for sid, spare in state.ranked(pool, now, cfg.ttl_ms, fresh=True):
        if not await state.claim(store, provider, model, sid):
            counters["take_races_lost"] += 1
            continue  # another process took it first: try the next one
        b = state.Binding(routed_id=sid, provider=provider, model=model, bound_at=now, last_seen_at=now,
                          upstream_ms=spare.upstream_ms, verified_at=spare.verified_at, origin="spare")
        won = await bind_owned(store, key, b, now, counters, spare)
        if won is None:
            continue  # that id was used before: dropped; try the next one
        counters["takes"] += 1 if won.routed_id == sid else 0
        return Acquired(won.routed_id, "spare" if won.routed_id == sid else "binding", won)
    return None


async def existing(store: Store, key: str, cfg: PoolConfig, now: int, counters: Counter[str],
                   lost: Callable[[], Awaitable[None]] | None = None) -> Acquired | None:
    """A live binding (touched at most every 30 s); a dead one is retired on sight. ``lost``:
    awaited when there is no binding, raises when that is a loss (``state.witness``)."""
    b = await state.binding(store, key)
    if b is None:
        if lost is not None:
            await lost()
        return None

    def dead(x: state.Binding) -> bool:
        return not state.alive(x, now, cfg.lease_ttl_ms, cfg.quarantine_failures)

    if dead(b):
        if await state.retire(store, key, b.routed_id, now, still=dead):
            counters["retired_idle"] += 1
        return None
    if now - b.last_seen_at >= TOUCH_EVERY_MS:
        touched = await state.change(store, key, b.routed_id, lambda x: msgspec.structs.replace(x, last_seen_at=now))
        if touched is None:
            return None   # retired or re-bound meanwhile: acquire afresh
        b = touched
    return Acquired(b.routed_id, "binding", b)


async def acquire(store: Store, key: str, provider: str, model: str, *, budget_ms: int, cfg: PoolConfig,
                  clock: Clock, probe: ProbeFn, target: TargetState, counters: Counter[str],
                  lost: Callable[[], Awaitable[None]] | None = None) -> Acquired | None:
    """seeds/002 §5. None: no pooled id for this request (the caller falls back). ``lost``
    (``existing``) raises ``state.BindingLost`` rather than take an absent binding for a new
    conversation when the caller knows the key had one."""
    now = clock.now_ms()
    found = await existing(store, key, cfg, now, counters, lost)
    if found is not None:
        return found
    found = await take_fresh(store, key, provider, model, cfg, now, counters)
    if found is not None:
        return found
    if budget_ms < MIN_PROBE_BUDGET_MS or target.blocked:
        return None  # a zero budget leaves stale spares alone: refresh re-verifies them
    deadline = now + budget_ms

    stale = state.ranked(await state.spares(store, provider, model), now, cfg.ttl_ms, fresh=False)
    if stale:
        sid, spare = stale[0]
        if await state.claim(store, provider, model, sid):
            try:
                result = await probe_when_allowed(target, clock, cfg, probe, sid, deadline, counters)
            except BaseException:
                await state.add_spare(store, provider, model, sid, spare)  # cancelled: the spare is not lost
                raise
            if result is None:
                await state.add_spare(store, provider, model, sid, spare)
                return None
            now = clock.now_ms()
            if result.fast:
                b = _new_binding(result.ms, provider, model, sid, now, "stale")
                won = await bind_owned(store, key, b, now, counters, None)
                if won is not None:
                    return Acquired(won.routed_id, "stale" if won.routed_id == sid else "binding", won)
            else:
                counters["spares_dropped"] += 1  # no longer fast: the claimed spare is dropped
                if result.kind in STOPS_PROBING or result.kind == "overloaded":
                    return None

    while clock.now_ms() < deadline:
        if deadline - clock.now_ms() < MIN_PROBE_BUDGET_MS or target.blocked:
            break
        sid = state.new_id()
        result = await probe_when_allowed(target, clock, cfg, probe, sid, deadline, counters)
        if result is None:
            break
        if result.fast:
            now = clock.now_ms()
            b = _new_binding(result.ms, provider, model, sid, now, "probe")
            won = await bind_owned(store, key, b, now, counters, None)
            if won is not None:
                return Acquired(won.routed_id, "probe" if won.routed_id == sid else "binding", won)
        elif result.kind in STOPS_PROBING:
            break
    return None
