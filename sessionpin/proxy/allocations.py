"""Allocations: the shell of server pools (docs/serverpools.md), a participant (``participants``).

It performs the stepper's pool effects for the router and watches members' answers. The
pools' rules (which member, when one is exhausted) are ``allocate``'s, ``members``' and
``quota``'s; the rules this module keeps, about performing them:

- ``Allocate`` -> ``members.allocate`` (the store transaction), one allocation of a pool
  at a time in this process (an ``asyncio.Lock`` per pool: this proxy's openings do not
  race each other for the cursor; the compare-and-set settles races between proxies),
  waiting up to ``sessionpin_pools_wait_ms`` while every member is exhausted. In a soft
  pool, members whose connection failed here in the last ``UNREACHABLE_FOR`` seconds are
  left out of new allocations.
- ``CheckMember`` -> the member's quota state from the store; for a soft pool also
  whether it is drained, gone from the config, or unreachable (``ConnectCheck``'s TCP
  connect, none when a connection to it is open).
- ``responseheaders``: a pool member's answer (status and rate-limit headers, never the
  body) becomes its quota state in the store, shared by every proxy; written in the
  background, at most every ``WRITE_EVERY`` seconds per member unless it changed. A reset
  claimed further than ``sessionpin_pools_max_reset_ms`` (default 1 h) is taken as that,
  when observed and when read back (``quota.clamped``).
- ``metrics``: allocations (this process), active conversations, exhausted, drained, per
  member; one log line per allocation and per soft move.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Any, Iterable, Mapping

from mitmproxy import ctx, http

from ..serverpools import members, quota
from ..decision import route
from ..reader.ids import short
from ..store import StoreError
from .configwatch import ConfigWatch
from .connect import ConnectCheck
from .exposition import family, joined
from .later import after_hook
from .participants import Participant
from .storeruntime import StoreRuntime

log = logging.getLogger("sessionpin")
decisions = logging.getLogger("sessionpin.decisions")

WAIT_OPTION = "sessionpin_pools_wait_ms"
WAIT_DEFAULT_MS = 10_000
MAX_RESET_OPTION = "sessionpin_pools_max_reset_ms"
MAX_RESET_DEFAULT_MS = int(quota.MAX_RESET * 1000)
UNREACHABLE_FOR = 10.0      # seconds a failed connection keeps a soft member out of new allocations
WRITE_EVERY = 5.0           # seconds between unchanged quota writes of one member


class Allocations(Participant):
    name = "pools"          # its key under "participants" in /__sessionpin/status

    def __init__(self, config: ConfigWatch, runtime: StoreRuntime, connect: ConnectCheck) -> None:
        self.config = config
        self.runtime = runtime
        self.connect = connect
        self.locks: dict[str, asyncio.Lock] = {}
        self.allocated: Counter[tuple[str, str]] = Counter()     # (pool, member) -> allocations here
        self.moved: Counter[tuple[str, str]] = Counter()         # (pool, member) -> soft moves to it here
        self.unreachable: dict[str, float] = {}                  # member -> monotonic time of a failure
        self._written: dict[str, tuple[float, quota.Quota]] = {}
        self._tasks: set[asyncio.Task] = set()

    def load(self, loader) -> None:
        loader.add_option(
            WAIT_OPTION, int, WAIT_DEFAULT_MS,
            "sessionpin server pools: how long (ms) a new conversation waits when every member of its pool is "
            "out of quota, before it is answered 429 'pool exhausted' with retry-after.",
        )
        loader.add_option(
            MAX_RESET_OPTION, int, MAX_RESET_DEFAULT_MS,
            "sessionpin server pools: the furthest (ms) a member's claimed reset (retry-after, rate-limit "
            "resets) is believed; a later one is taken as this. Default: 1 h, the providers' longest window.",
        )

    def _max_reset_s(self) -> float:
        try:
            return max(1, int(getattr(ctx.options, MAX_RESET_OPTION))) / 1000.0
        except AttributeError:       # driven without mitmproxy's options (tests)
            return quota.MAX_RESET

    def _wait_s(self) -> float:
        try:
            return max(0, int(getattr(ctx.options, WAIT_OPTION))) / 1000.0
        except AttributeError:       # driven without mitmproxy's options (tests)
            return WAIT_DEFAULT_MS / 1000.0

    # ---- the effects ----------------------------------------------------------------------
    async def perform(self, flow: http.HTTPFlow, state: route.State, effect: route.Allocate | route.CheckMember
                      ) -> route.Event:
        store = self.runtime.store
        r = state.request
        if isinstance(effect, route.CheckMember):
            return await self._check(flow, r, effect)
        if store is None:
            return route.NotSaved("no store is open")
        pool = r.config.pools[effect.pool]
        exclude = effect.exclude
        if pool.affinity == "soft":
            horizon = time.monotonic() - UNREACHABLE_FOR
            exclude |= {m for m, t in self.unreachable.items() if t > horizon and m in pool.members}
        deadline = time.time() + self._wait_s()
        lock = self.locks.setdefault(pool.name, asyncio.Lock()) if effect.commit else contextlib.nullcontext()
        try:
            async with lock:
                got = await members.allocate(store, r.config, pool, effect.session, effect.pin, effect.seen,
                                             exclude=exclude, commit=effect.commit, deadline=deadline,
                                             move_reason=effect.reason, max_reset=self._max_reset_s())
        except StoreError as e:
            msg = f"{store.url}: {e}" if store.url not in str(e) else str(e)
            return route.NotSaved(msg)
        if isinstance(got, members.Lost):
            self.runtime.guard.saw(effect.session, got.loaded.pin, time.time())     # another proxy's pin
            return route.PinLost(got.loaded)
        if isinstance(got, members.Refused):
            return route.NotAllocated(got.status, got.kind, got.message, got.retry_after)
        if effect.commit:
            # the pin the allocation wrote is one this proxy served, as a CreatePin's is: its loss
            # later is a loss (a refusal), never "a conversation never seen begin"
            self.runtime.guard.saw(effect.session, got.loaded.pin, time.time(), made=True)
            counter = self.moved if effect.reason else self.allocated
            counter[(pool.name, got.member)] += 1
            if effect.reason:
                log.warning("sessionpin: %s %s", short(effect.session), got.why)
        return route.Allocated(got.member, got.loaded, got.why)

    async def _check(self, flow: http.HTTPFlow, r: route.Request, effect: route.CheckMember) -> route.Event:
        store = self.runtime.store
        q = None
        drained: dict[str, float] = {}
        try:
            if store is not None:
                q = await members.read_quota(store, effect.member, time.time(), self._max_reset_s())
                if effect.soft:
                    drained = await members.drained(store, [effect.member])
        except StoreError as e:    # unknown state: the pin decides, as without pools
            log.warning("sessionpin: reading member %s's state: %s", effect.member, e)
        missing = None
        if effect.soft:
            server = r.config.servers.get(effect.member)
            if server is None:
                missing = "gone"
            elif effect.member in drained:
                missing = "drained"
            else:
                addr = (server.host, server.port)
                self.connect.moved_to(addr, server.name)
                err = await self.connect.reachable(flow.client_conn.id, addr, ride_out=False)   # another member takes it
                if err is not None:
                    self.unreachable[server.name] = time.monotonic()
                    missing = "unreachable"
                else:
                    self.unreachable.pop(server.name, None)
        return route.MemberChecked(q.exhausted_until if q else 0.0, q.why if q else "", missing)

    # ---- watching answers ---------------------------------------------------------------------
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        meta = flow.metadata.get("sessionpin") or {}
        member = meta.get("target")
        resp = flow.response
        if not member or resp is None or meta.get("refused") or not self.config.config.pools_of(member):
            return
        now = time.time()
        q = quota.observe(resp.status_code, resp.headers.items(multi=True), now, self._max_reset_s())
        if q is None:
            return
        last = self._written.get(member)
        if last is not None and now - last[0] < WRITE_EVERY and _same(last[1], q):
            return
        self._written[member] = (now, q)
        if q.exhausted_until > now:
            decisions.info("sessionpin: %s out of quota for %ds (%s): no new allocations until then",
                           member, round(q.exhausted_until - now), q.why)
        # the answer speaks for when the member admitted the request: a success to a request
        # sent before another proxy's 429 must not clear that exhaustion (members.write_quota)
        self._later(self._write(member, q, flow.request.timestamp_start or now))

    async def _write(self, member: str, q: quota.Quota, sent: float) -> None:
        await after_hook()      # mitmproxy's tasks start eagerly: not in the hook, ahead of the answer's stream
        store = self.runtime.store
        if store is None:
            return
        try:
            await members.write_quota(store, member, q, sent)
        except StoreError as e:
            self.runtime.errors += 1
            log.warning("sessionpin: quota of %s: %s", member, e)

    def failed(self, flow: http.HTTPFlow) -> None:
        """The router's ``error`` hook: a soft member whose connection failed leaves new
        allocations. Only a connection that failed: a member that answered, or whose connection
        was made (the client hung up while it thought, or mid-stream), is not unreachable."""
        member = (flow.metadata.get("sessionpin") or {}).get("target")
        if not member or flow.response is not None:
            return
        conn = flow.server_conn
        if conn.timestamp_tcp_setup is not None and (not conn.tls or conn.timestamp_tls_setup is not None):
            return
        if any(p.affinity == "soft" for p in self.config.config.pools_of(member)):
            self.unreachable[member] = time.monotonic()

    def _later(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- what the status endpoints show ------------------------------------------------------
    async def metrics(self) -> str:
        cfg = self.config.config
        if not cfg.pools:
            return ""
        store = self.runtime.store
        everyone = sorted({m for p in cfg.pools.values() for m in p.members})
        active: dict[str, int] = {}
        q: dict[str, quota.Quota] = {}
        drained: dict[str, float] = {}
        if store is not None:
            try:
                active = await members.active_counts(store, everyone, time.time())
                q = await members.quotas(store, everyone, time.time(), self._max_reset_s())
                drained = await members.drained(store, everyone)
            except StoreError as e:
                log.warning("sessionpin: pool metrics: %s", e)
        return pool_metrics_text(cfg.pools.values(), self.allocated, self.moved, everyone, active, q, drained,
                                 time.time())

    def status(self) -> dict[str, Any]:
        return {"allocated": {f"{p}/{m}": n for (p, m), n in sorted(self.allocated.items())},
                "moved": {f"{p}/{m}": n for (p, m), n in sorted(self.moved.items())},
                "unreachable": sorted(self.unreachable)}


def pool_metrics_text(pools: Iterable[Any], allocated: Mapping[tuple[str, str], int],
                      moved: Mapping[tuple[str, str], int], everyone: list[str], active: Mapping[str, int],
                      q: Mapping[str, quota.Quota], drained: Mapping[str, float], now: float) -> str:
    """The server pools' families, from what was read (no store read here)."""
    out: list[str] = []
    family(out, "sessionpin_pool_allocations_total", "counter",
           "New conversations allocated to a pool member by this proxy.", ("pool", "member"),
           [((p.name, m), allocated.get((p.name, m), 0)) for p in pools for m in p.members])
    family(out, "sessionpin_pool_moves_total", "counter",
           "Pool conversations moved to a member by this proxy (soft misses, openings off an exhausted member).",
           ("pool", "member"), sorted(moved.items()))
    family(out, "sessionpin_pool_member_active", "gauge", "Live pinned conversations per pool member.", ("member",),
           [(m, active.get(m, 0)) for m in everyone])
    family(out, "sessionpin_pool_member_exhausted", "gauge", "1 while a member is known out of quota.", ("member",),
           [(m, int(m in q and q[m].exhausted_until > now)) for m in everyone])
    family(out, "sessionpin_pool_member_drained", "gauge", "1 while a member is drained.", ("member",),
           [(m, int(m in drained)) for m in everyone])
    return joined(out)


def _same(a: quota.Quota, b: quota.Quota) -> bool:
    """Unchanged enough not to write again: same exhaustion, headroom within 2 points."""
    if abs(a.exhausted_until - b.exhausted_until) > 1.0 or a.status != b.status:
        return False
    if (a.headroom is None) != (b.headroom is None):
        return False
    return a.headroom is None or abs(a.headroom - b.headroom) < 0.02
