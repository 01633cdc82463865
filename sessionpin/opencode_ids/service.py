"""The pool as the addon sees it: ``route`` a request, ``observe`` its response, a refresh loop.

Rules this module keeps:
- Scope: POST requests to a configured gateway origin on ``/zen/v1/<kind>`` (provider
  ``opencode``) or ``/zen/go/v1/<kind>`` (provider ``opencode-go``), kind one of
  chat/completions, messages, responses, with a model and credentials. Anything else is
  left alone (``route`` returns None).
- The binding key is (conversation, provider, model); the conversation is the client's
  ``x-opencode-session``, else the session the caller passes: the router's for a conversation
  named by a fingerprint of its opening (pi), which the participant passes only when the
  router resolved it; ``unresolved``: it did not (the gateway is not a server it routes), and
  the fingerprint keys it, as before — two conversations that opened alike then share an id,
  which the log says once, with the configuration that tells them apart.
- The request leaves with ``x-opencode-session`` = ``Route.routed_id``; nothing else changes.
- No pooled id (no fresh spare, no budget): a client that sent its own id keeps it; a
  client that sent none is bound a fresh random id, so the gateway (400 without the
  header) accepts it and the conversation keeps one id from then on.
- A binding this proxy routed (remembered in bounded memory) that is gone from the store
  while nothing says it was retired (``state.witness``: its id's record still names it, or
  is gone too within the hour a retirement's tombstone lasts) is a loss: the request is
  refused (424 ``pool-lost``, naming the conversation and the way out), never given a new id.
- Probe credentials come from clients' live requests to that gateway and provider; they
  are kept in this object's memory only. A new credential unblocks a target that a
  401/403/400 had stopped.
- Per-key de-duplication: concurrent requests of one key share one acquisition.
- A failed *budgeted* acquisition puts the key in cooldown (no budget) for
  ``probe_cooldown_ms``.
- The store is the async ``Store``: nothing here touches a file on the event loop. The
  store is the only place bindings live, as the router's pins do: a store call that fails
  (``StoreError``: ``StoreUnavailable``, ``NotDurable``…) is tried once more, and if it
  fails again the request is refused (``route`` returns a ``Refuse``: 503 naming the store,
  ``retry-after``), never routed from a private store — that would hand the conversation
  an id other proxies do not know and a restart forgets. A failed observation or refresh
  cycle is counted and dropped (the binding stays as it was; the next cycle tries again).
  The first failure of a streak is logged as a warning, the store answering again as info.
- Probes go out the way mitmproxy's upstream connections go (``cfg.upstream``); how is
  logged in one line when the service starts and whenever it changes.
- Nothing here raises into the request path: ``route``/``observe`` log and return (an
  error that is not the store's leaves the request alone).
- The refresh loop runs in the caller's event loop; ``start``/``stop`` are synchronous
  (mitmproxy's running/done), and its schedule lives on the service, so stopping and
  starting again (a script reload) neither resets the first-run delay nor runs twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from . import state
from .acquire import Acquired, Clock, ProbeFn, TargetState, acquire
from .observe import observe as observe_binding
from .options import PoolConfig, normalize_origin
from .prober import COPIED_HEADERS, CREDENTIAL_HEADERS, ProbeTarget, probe as send_probe
from .refresh import Plan, cycle
from .signals import ProbeResult
from .upstream import describe as describe_upstream, ssl_context
from ..reader.ids import short
from ..decision.answers import NO_RETRY_STATUS
from ..decision.steps import Refuse
from ..store.base import Store, StoreError

log = logging.getLogger(__name__)

HEADER = "x-opencode-session"
PROVIDERS = (("/zen/go/v1/", "opencode-go"), ("/zen/v1/", "opencode"))
KINDS = ("chat/completions", "messages", "responses")
MAX_CONVERSATION = 256
ROUTED_BOUND = 50_000      # bindings this proxy remembers routing (as records/served.py for pins)
STORE_RETRY_AFTER = 1      # seconds: a store that failed twice in a row may well be back by then


class RealClock:
    def now_ms(self) -> int:
        return int(time.time() * 1000)

    async def sleep_ms(self, ms: int) -> None:
        await asyncio.sleep(max(0, ms) / 1000)


@dataclass(frozen=True)
class Scope:
    origin: str
    provider: str
    kind: str
    path: str


def scope_of(cfg: PoolConfig, method: str, url: str) -> Scope | None:
    """Is this request one the pool routes? Pure; never raises."""
    if not cfg.enabled or method.upper() != "POST":
        return None
    try:
        parts = urlsplit(url)
        origin = normalize_origin(f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}")
    except ValueError:
        return None
    if origin not in cfg.gateways:
        return None
    for prefix, provider in PROVIDERS:
        if parts.path.startswith(prefix):
            kind = parts.path[len(prefix):].rstrip("/")
            return Scope(origin, provider, kind, parts.path) if kind in KINDS else None
    return None


def conversation_of(headers: Mapping[str, str], session: str | None) -> str | None:
    own = (headers.get(HEADER) or "").strip()
    for candidate in (own, session or ""):
        if candidate and len(candidate) <= MAX_CONVERSATION and candidate.isprintable():
            return candidate
    return None


@dataclass(frozen=True)
class Route:
    """The pool's decision for one request; the addon sets ``x-opencode-session`` to routed_id."""
    key: str
    routed_id: str
    how: str               # binding | spare | stale | probe | fresh | client
    provider: str
    model: str
    origin: str
    client_id: str | None  # the x-opencode-session the client sent (None: it sent none)

    @property
    def observed(self) -> bool:
        """Whether responses feed a binding (the client's own id is not ours to judge)."""
        return self.how != "client"


def _credential_tag(headers: tuple[tuple[str, str], ...]) -> str:
    # A short hash to notice a changed key; the key itself never leaves memory.
    return hashlib.sha256(repr(headers).encode()).hexdigest()[:12]


@dataclass
class _Target:
    probe_target: ProbeTarget
    tag: str
    state: TargetState = field(default_factory=TargetState)


class PoolService:
    def __init__(self, cfg: PoolConfig, store: Store, *, clock: Clock | None = None,
                 probe: Callable[[ProbeTarget, str, int], Any] | None = None) -> None:
        self.cfg = cfg
        self._store = store
        self._store_down = False      # in a streak of store failures (logged once per streak)
        self.clock: Clock = clock or RealClock()
        self._probe_impl = probe
        self._ssl = None
        self.counters: Counter[str] = Counter()
        self._said_unresolved = False   # the warning about a fingerprint the router did not resolve, said once
        # binding key -> (id, when last routed): the bindings this proxy routed, so one gone
        # from the store is a loss, not a new conversation (bounded: the least recent goes first)
        self._routed: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._lost_said: set[str] = set()
        self.targets: dict[tuple[str, str, str], _Target] = {}   # (origin, provider, model)
        self._inflight: dict[str, asyncio.Future] = {}
        self._cooldown: dict[str, int] = {}
        self._task: asyncio.Task | None = None
        self._previous: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self.next_cycle_at: int | None = None     # survives stop/start (reload)
        self.refill_at: int | None = None
        self.loops_alive = 0                      # refresh loops past their start-up (never > 1)
        self._said_upstream = None
        self._say_upstream()

    # ---- configuration and store ------------------------------------------------------

    def configure(self, cfg: PoolConfig, store: Store | None = None) -> None:
        if cfg.upstream != self.cfg.upstream:
            self._ssl = None
        self.cfg = cfg
        self._say_upstream()
        if store is not None and store is not self._store:
            self._store = store

    def _say_upstream(self) -> None:
        if self.cfg.enabled and self.cfg.upstream != self._said_upstream:
            self._said_upstream = self.cfg.upstream
            log.info("sessionpin pool: %s", describe_upstream(self.cfg.upstream))

    @property
    def store(self) -> Store:
        return self._store

    def _store_failed(self, exc: BaseException) -> None:
        if not self._store_down:
            self._store_down = True
            log.warning("sessionpin pool: store %s failed (%s: %s); pooled requests are refused until it answers",
                        getattr(self._store, "url", "?"), type(exc).__name__, exc)
        self.counters["store_errors"] += 1

    def _store_answered(self) -> None:
        if self._store_down:
            self._store_down = False
            log.info("sessionpin pool: store %s answers again", getattr(self._store, "url", "?"))

    def _refusal(self, exc: BaseException, provider: str, conversation: str) -> Refuse:
        self.counters["refused_store"] += 1
        url = getattr(self._store, "url", "?")
        error = f"{url}: {exc}" if url not in str(exc) else str(exc)
        return Refuse(503, "pool-store", (
            f"sessionpin cannot reach its pool store ({error}), so the {provider} session id of conversation "
            f"{short(conversation)} is unknown and the request was not sent: a guessed id would split the "
            "conversation between ids. Retry in a moment; if this persists, run 'sessionpin doctor'."),
            STORE_RETRY_AFTER)

    # ---- probes -------------------------------------------------------------------------

    def _probe_fn(self, t: _Target) -> ProbeFn:
        async def run(sid: str, timeout_ms: int) -> ProbeResult:
            if self._probe_impl is not None:
                return await self._probe_impl(t.probe_target, sid, timeout_ms)
            if self._ssl is None:
                try:
                    self._ssl = ssl_context(self.cfg.upstream)
                except (OSError, ValueError) as e:   # a CA file that cannot be read (ssl.SSLError is an OSError)
                    if not self.counters["ca_errors"]:
                        log.warning("sessionpin pool: probes cannot verify TLS: %s", e)
                    self.counters["ca_errors"] += 1
                    return ProbeResult("failed", None, None, "", detail=type(e).__name__)
            return await send_probe(t.probe_target, sid, timeout_ms, max_upstream_ms=self.cfg.max_upstream_ms,
                                    require_gateway_id=self.cfg.require_gateway_id, ssl_ctx=self._ssl,
                                    via=self.cfg.upstream)
        return run

    def _learn(self, sc: Scope, model: str, headers: Mapping[str, str]) -> _Target | None:
        """Remember the client's credentials for this gateway+provider+model (memory only)."""
        copied = tuple((n, headers[n]) for n in COPIED_HEADERS if headers.get(n))
        if not any(n in CREDENTIAL_HEADERS for n, _ in copied):
            return None
        tag = _credential_tag(copied)
        key = (sc.origin, sc.provider, model)
        t = self.targets.get(key)
        pt = ProbeTarget(sc.origin, sc.path, sc.kind, model, copied)
        if t is None:
            t = self.targets[key] = _Target(pt, tag)
        elif t.tag != tag or t.probe_target.path != sc.path:
            if t.tag != tag:
                t.state.blocked = ""   # a new key deserves a new chance
            t.probe_target, t.tag = pt, tag
        return t

    # ---- the request path ---------------------------------------------------------------

    async def route(self, method: str, url: str, headers: Mapping[str, str], *, session: str | None,
                    model: str | None, opening: bool = False, unresolved: bool = False) -> Route | Refuse | None:
        """The pool's decision for one request: a route, a refusal (the store failed twice), or
        None to leave it alone. Never raises. ``unresolved``: the request's conversation is
        named by a fingerprint the router did not resolve (``session`` is that fingerprint);
        without an id of the client's own it is counted, and said once in the log."""
        try:
            return await self._route(method, url, headers, session, model, opening, unresolved)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug of ours: the request goes on, untouched
            log.exception("sessionpin pool: routing failed; request left alone")
            self.counters["errors"] += 1
            return None

    async def _route(self, method, url, headers, session, model, opening, unresolved=False) -> Route | Refuse | None:
        sc = scope_of(self.cfg, method, url)
        if sc is None or not model:
            return None
        h = {str(k).lower(): str(v) for k, v in headers.items()}
        conversation = conversation_of(h, session)
        target = self._learn(sc, model, h)
        if unresolved and not h.get(HEADER) and target is not None:
            # keyed by the fingerprint, as before the router told conversations apart: the
            # gateway answers (it refuses a request without an id), and the limit is said once
            self.counters["routed_unresolved"] += 1
            if not self._said_unresolved:
                self._said_unresolved = True
                log.warning("sessionpin pool: requests to %s without an x-opencode-session, whose conversation "
                            "only the fingerprint of its opening names, are keyed by that fingerprint: "
                            "conversations that opened alike share it (and so one gateway id); only the router "
                            "tells them apart — for a server it routes. Configure the gateway as a server "
                            "(docs/opencode_ids.md, \"Scope\") or have the client send its own id", sc.origin)
        if conversation is None or target is None:
            self.counters["skipped"] += 1   # no conversation or no credentials: header untouched
            return None
        key = state.binding_key(conversation, sc.provider, model)
        client_id = h.get(HEADER) or None
        pending = self._inflight.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._acquire(key, sc, model, target, opening))
            self._inflight[key] = pending
            pending.add_done_callback(lambda _f, k=key: self._inflight.pop(k, None))
        else:
            self.counters["deduped"] += 1
        try:
            got: Acquired | None = await asyncio.shield(pending)
        except state.BindingLost as e:
            return self._lost(e, sc.provider, conversation)
        except Exception as e:
            if not _is_store_fault(e):
                raise
            return self._refusal(e, sc.provider, conversation)
        if got is not None:
            self.counters[f"routed_{got.how}"] += 1
            self._remember(key, got.routed_id)
            return Route(key, got.routed_id, got.how, sc.provider, model, sc.origin, client_id)
        if client_id:
            self.counters["routed_client"] += 1
            return Route(key, client_id, "client", sc.provider, model, sc.origin, client_id)
        try:
            fresh = await self._bind_fresh(key, sc.provider, model)
        except Exception as e:
            if not _is_store_fault(e):
                raise
            return self._refusal(e, sc.provider, conversation)
        self.counters[f"routed_{fresh.how}"] += 1
        self._remember(key, fresh.routed_id)
        return Route(key, fresh.routed_id, fresh.how, sc.provider, model, sc.origin, None)

    def _remember(self, key: str, routed_id: str) -> None:
        self._routed[key] = (routed_id, self.clock.now_ms())
        self._routed.move_to_end(key)
        self._lost_said.discard(key)
        while len(self._routed) > ROUTED_BOUND:
            self._routed.popitem(last=False)

    def _witness(self, key: str):
        """For ``acquire``: the check that a missing binding of ``key`` is not a loss (None:
        this proxy never routed the key, nothing to say)."""
        known = self._routed.get(key)
        if known is None:
            return None
        routed_id, at = known

        async def lost() -> None:
            recent = self.clock.now_ms() - at < state.KEEP_RETIRED_S * 1000
            await state.witness(self.store, key, routed_id, recent=recent)
        return lost

    def _lost(self, e: state.BindingLost, provider: str, conversation: str) -> Refuse:
        self.counters["refused_lost"] += 1
        url = getattr(self._store, "url", "?")
        how = ("its id's record still names it" if e.record is not None
               else "and its id's record with it, less than an hour after this proxy routed it")
        if e.key not in self._lost_said:
            if len(self._lost_said) >= ROUTED_BOUND:     # said once per key, in bounded memory
                self._lost_said.clear()
            self._lost_said.add(e.key)
            log.error("sessionpin pool: the binding of conversation %s (%s %s -> %s) is gone from store %s, %s: "
                      "refused until it is back", short(conversation), provider, e.key.rsplit(state.SEP, 1)[-1],
                      e.routed_id[:8], url, how)
        return Refuse(NO_RETRY_STATUS, "pool-lost", (
            f"sessionpin: the {provider} session id of conversation {short(conversation)} is gone from its pool "
            f"store {url}: the binding was deleted, not retired ({how}), so the request was not sent — another "
            f"id would change the conversation's id mid-way. Restore the store from a backup ('sessionpin store "
            f"copy BACKUP {url}') or start a new conversation; a restart of the proxy forgets the conversation, "
            "whose next request then takes a new id."))

    async def _acquire(self, key: str, sc: Scope, model: str, target: _Target, opening: bool) -> Acquired | None:
        now = self.clock.now_ms()
        budget = self.cfg.startup_budget_ms if opening else self.cfg.request_budget_ms
        if self._cooldown.get(key, 0) > now:
            budget = 0
        for attempt in (1, 2):     # a store fault: once more on the same store, then the caller refuses
            try:
                got = await acquire(self.store, key, sc.provider, model, budget_ms=budget, cfg=self.cfg,
                                    clock=self.clock, probe=self._probe_fn(target), target=target.state,
                                    counters=self.counters, lost=self._witness(key))
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not _is_store_fault(e):
                    raise
                self._store_failed(e)
                if attempt == 2:
                    raise
        self._store_answered()
        if got is None and budget > 0:
            self._cooldown[key] = self.clock.now_ms() + self.cfg.probe_cooldown_ms
            self.counters["cooldowns"] += 1
        if got is not None and got.how == "spare":
            self.request_refill()
        return got

    async def _bind_fresh(self, key: str, provider: str, model: str) -> Acquired:
        """A client with no id of its own and no pooled id: one random id for good."""
        now = self.clock.now_ms()
        b = state.Binding(routed_id=state.new_id(), provider=provider, model=model, bound_at=now,
                          last_seen_at=now, origin="fresh")
        try:
            won = await state.bind(self.store, key, b)
        except Exception as e:
            if not _is_store_fault(e):
                raise
            self._store_failed(e)
            try:
                won = await state.bind(self.store, key, b)   # once more on the same store; else the caller refuses
            except Exception as again:
                if _is_store_fault(again):
                    self._store_failed(again)
                raise
        self._store_answered()
        if won is None:     # cannot happen for a new random id; route the id anyway
            won = b
        return Acquired(won.routed_id, "fresh" if won.routed_id == b.routed_id else "binding", won)

    async def observe(self, route: Route, status: int, headers: Mapping[str, str]) -> str:
        """Feed a real response back (a store read and at most one write). Never raises."""
        if not route.observed:
            return "client"
        try:
            h = {str(k).lower(): str(v) for k, v in headers.items()}
            verdict = await observe_binding(self.store, route.key, route.routed_id, status, h.get("server-timing"),
                                            self.cfg, self.clock.now_ms(), self.counters)
            self._store_answered()
            return verdict
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if _is_store_fault(e):
                self._store_failed(e)     # the observation is lost; the binding stays as it was
            else:
                log.exception("sessionpin pool: observing a response failed")
            self.counters["errors"] += 1
            return "error"

    # ---- the background refresh -----------------------------------------------------------

    def request_refill(self) -> None:
        due = self.clock.now_ms() + self.cfg.refill_delay_ms
        if self.refill_at is None or due < self.refill_at:
            self.refill_at = due
        if self._wake is not None:
            self._wake.set()

    def _due(self) -> int:
        due = self.next_cycle_at if self.next_cycle_at is not None else self.clock.now_ms()
        return min(due, self.refill_at) if self.refill_at is not None else due

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the refresh loop in the running event loop (idempotent; sync, for running())."""
        if self.running:
            return
        if self.next_cycle_at is None:
            self.next_cycle_at = self.clock.now_ms() + self.cfg.refill_delay_ms   # first run delayed
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(self._previous), name="sessionpin-pool")
        log.info("sessionpin pool: refresh loop started (next cycle in %d ms)", max(0, self._due() - self.clock.now_ms()))

    def stop(self) -> None:
        """Cancel the loop (sync, for done()); an in-flight probe puts its claimed spare back."""
        if self._task is not None:
            self._task.cancel()
            self._previous, self._task = self._task, None
            log.info("sessionpin pool: refresh loop stopped")

    async def _loop(self, previous: asyncio.Task | None) -> None:
        if previous is not None and not previous.done():
            await asyncio.wait([previous])   # the old loop's cleanup first: never two cycles at once
        self.loops_alive += 1
        try:
            await self._cycles()
        finally:
            self.loops_alive -= 1

    async def _cycles(self) -> None:
        while True:
            try:
                wait = self._due() - self.clock.now_ms()
                if wait > 0:
                    assert self._wake is not None
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), wait / 1000)
                    except TimeoutError:
                        pass
                    continue
                self.refill_at = None
                self.next_cycle_at = self.clock.now_ms() + self.cfg.refresh_interval_ms
                await self.refresh_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("sessionpin pool: refresh cycle failed")
                self.counters["errors"] += 1
                await asyncio.sleep(1)

    async def refresh_once(self) -> int:
        plan = Plan(((p, m), self._probe_fn(t), t.state) for (o, p, m), t in self.targets.items())
        before = self.counters["probes_fast"]
        now = self.clock.now_ms()
        self._cooldown = {k: until for k, until in self._cooldown.items() if until > now}
        try:
            sent = await cycle(lambda: self.store, plan, self.cfg, self.clock, self.counters)
        except Exception as e:
            if not _is_store_fault(e):
                raise
            self._store_failed(e)        # the next cycle tries again
            return 0
        self._store_answered()
        log.debug("sessionpin pool: refresh cycle over %d target(s): %d probe(s)", len(plan.items), sent)
        if sent:
            log.info("sessionpin pool: refresh: %d probe(s), %d fast, over %d target(s)", sent,
                     self.counters["probes_fast"] - before, len(plan.items))
        return sent


def _is_store_fault(e: BaseException) -> bool:
    # The contract's errors (StoreUnavailable, NotDurable, WrongType: StoreError); an OSError
    # from a backend that leaks one is treated the same.
    return isinstance(e, (StoreError, OSError))
