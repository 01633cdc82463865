"""The request path as a stepper: what is known so far and one event in, the next effect out.

As h11 is to an HTTP server, this module is to the router addon: pure (no store, no
clock, no mitmproxy), so every rule, every store answer and the race with another proxy
is a table row (tests/test_route.py). The shell drives it::

    step = route.begin(request)
    while not step.done:
        step = route.step(step.state, await perform(step.effect))
    answer the flow as step.effect says; run step.after without delaying it

Effects the shell performs, and the events that answer them:

    ReadPin(session)        -> PinRead(loaded) | StoreFailed(error)
    ReadTitle(session)      -> TitleRead(server | None) | StoreFailed(error)
    ReadLineage()           -> LineageRead(signals, root)   (lineage.signals/chain of the body)
    FindConversation(root, fingerprint) -> ConversationFound(session | None) | StoreFailed(error)
    FindParent(links)       -> ParentFound(session | None, loaded) | StoreFailed(error)
    Plan(target)            -> Planned(changes)          (rewrite.plan with the body)
    CreatePin(session, pin) -> PinCreated | PinLost(loaded) | NotSaved(error)
    Allocate(session, pool) -> Allocated(member) | PinLost(loaded) | NotAllocated | NotSaved
    CheckMember(pool, member) -> MemberChecked(exhausted until, missing)

Terminal effects: ``Forward(changes)`` (send it, rewritten as planned), ``Leave`` (send
it untouched), ``Refuse(status, …)`` (answer it here). ``after`` holds what the shell
does once the request is on its way and never waits for: renew a pin, remember a title,
write a "not routed" pin.

Rules this module keeps beyond the ladder's:
- A pin that could not be read is a refusal (424 naming the store, no retry signals: the shell
  rode out a short blip first), never "no pin".
- A store that lost what it held (``StoreLost``: emptied, replaced, a served pin gone) is
  a refusal (424 ``store-lost``, no retry signals: only the operator can decide) naming the
  store, the loss and the command that decides, never "a conversation never seen begin".
- A conversation is sent away from the server it addressed only once its pin is durable
  in the store: a pin that could not be saved is a refusal (503 with ``retry-after``),
  on the first try and on every retry — nothing of it is remembered anywhere.
- Another proxy that pinned the session first decides: its pin is followed.
- The rewrite is planned before the pin is written: a request that cannot be rewritten
  (no key, model not found) is refused and pins nothing.
- Only an opencode title-shaped request is remembered (in the store, with a TTL, so
  several proxies agree); every other side request is not.
- A conversation is its lineage (docs/facts.md "Lineage"). A request with no pin that
  carries history may fork or resume a conversation the router knows under a new id:
  its parent is looked for by the client's explicit links first (a parent session id,
  an earlier response's id), then by the root of its history; found, the ladder's rule 7
  makes it follow the parent. A conversation pi names by a fingerprint of its opening is
  told apart by its lineage: an opening is always a new conversation (a fresh id: the
  fingerprint plus the request's nonce), a later turn belongs to the conversation whose
  root its history extends — else to the latest conversation that began with that opening
  (its answer was not seen whole), else to a pin of the fingerprint alone (made before
  this rule).
  The body's lineage is read only when a rule needs it.
- Server pools (docs/pools.md): a target that is a pool is allocated a member, the pin
  written by the allocation itself (``members.allocate``); a side request with no pin
  goes where the allocator would send the opening, pinning nothing. A turn pinned to a
  pool member known exhausted is answered 429 with the reset as ``retry-after`` — never
  moved. In a soft pool, a pinned member that is gone, drained or unreachable is a clean
  miss: the conversation is allocated afresh (compare-and-set over its pin), the move
  recorded; a hard pool's pin never moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from . import facts as F
from . import ladder
from .answers import NO_RETRY_STATUS
from .ladder import Decision
from .pins import Loaded, Pin, renew_due
from .rewrite import Changes
# The stepper's vocabulary lives in steps.py; route.ReadPin, route.Forward … are its API.
from .steps import (TERMINAL, TITLE_TTL, After, Allocate, Allocated, CheckMember, ConversationFound,  # noqa: F401
                    CreatePin, Effect, Event, FindConversation, FindParent, Forward, Leave, LineageRead,
                    MemberChecked, NotAllocated, NotSaved, ParentFound, PinCreated, PinLost, PinRead, Plan, Planned,
                    ReadLineage, ReadPin, ReadTitle, Refuse, RememberOpening, RememberTitle, RenewPin, Request,
                    StoreFailed, StoreLost, TitleRead, WritePin)

RETRY_AFTER = 1         # seconds: a store that cannot save may well be back by then


# ---- state ------------------------------------------------------------------------------

_UNREAD = Loaded(None, None)


class State(msgspec.Struct, frozen=True):
    """What is known so far about one request (a msgspec struct: a step copies it in C)."""
    request: Request
    session: str | None = None       # the conversation's id (a pi fingerprint's is resolved)
    loaded: Loaded = _UNREAD         # the pin as read (pin None: none)
    title: str | None = None         # where this session's title-shaped request went
    lineage: LineageRead | None = None
    parent: str | None = None        # the conversation this one forks or resumes
    parent_pin: Pin | None = None
    looked: bool = False             # the parent was looked for
    decision: Decision | None = None
    changes: Changes | None = None
    raced: bool = False              # another proxy's pin was taken once already
    allocated: bool = False          # a pool's allocation wrote the pin (no CreatePin)
    checked: str | None = None       # the pool member CheckMember answered for
    missed: frozenset[str] = frozenset()   # soft pool members missed


@dataclass(frozen=True)
class Step:
    state: State
    effect: Effect
    after: tuple[After, ...] = ()

    @property
    def done(self) -> bool:
        return isinstance(self.effect, TERMINAL)


_replace = msgspec.structs.replace


def begin(request: Request) -> Step:
    f = request.facts
    state = State(request, session=f.session)
    if not ladder.in_scope(f):
        return _decided(state, ladder.decide(f, None, request.config, request.source))
    if f.session_source == "fingerprint":
        if not f.has_history:     # an opening is always a new conversation
            session = f"{f.session}.{request.nonce}" if request.nonce else f.session
            return Step(_replace(state, session=session), ReadPin(session))
        return Step(_replace(state, session=None), ReadLineage())
    return Step(state, ReadPin(f.session))


def _fingerprint(state: State) -> bool:
    return state.request.facts.session_source == "fingerprint"


def _after_read(state: State) -> Step:
    """No pin (or its pin read): look for a parent, then the opencode title rule, then decide."""
    r, f = state.request, state.request.facts
    if state.loaded.pin is None and f.has_history and not state.looked and not _fingerprint(state):
        if state.lineage is None:
            return Step(state, ReadLineage())
        sig = state.lineage.signals
        return Step(_replace(state, looked=True), FindParent(f.agent, state.session or "", sig.sessions,
                                                             sig.anchors, state.lineage.root))
    if state.loaded.pin is None and state.parent_pin is None and r.source is not None \
            and f.agent == F.OPENCODE and f.turn == F.CONTINUATION:
        return Step(state, ReadTitle(state.session or ""))
    return _decide(state)


def step(state: State, event: Event) -> Step:
    r = state.request
    f = r.facts
    if isinstance(event, StoreFailed):
        # The shell rode out a short blip before saying so: answered so that no agent keeps
        # retrying for minutes (answers.NO_RETRY_STATUS, docs/traffic.md).
        return Step(state, Refuse(NO_RETRY_STATUS, "store", f"sessionpin cannot read its pin store ({event.error}), "
                                  f"so {f.agent} session {state.session or f.session} was not sent anywhere: its pin "
                                  f"decides where it goes. Send it again once the store is back; 'sessionpin doctor' "
                                  f"says what is wrong."))
    if isinstance(event, StoreLost):
        # the operator decides (accept-loss or a restore): no agent's retry can help
        return Step(state, Refuse(NO_RETRY_STATUS, "store-lost", f"sessionpin: {event.error}. {f.agent} session "
                                  f"{state.session or f.session} was not sent anywhere."))
    if isinstance(event, PinRead):
        return _after_read(_replace(state, loaded=event.loaded))
    if isinstance(event, LineageRead):
        state = _replace(state, lineage=event)
        if state.session is None:          # a pi fingerprint with history: which conversation?
            return Step(state, FindConversation(f.agent, event.root, f.session or ""))
        return _after_read(state)
    if isinstance(event, ConversationFound):
        session = event.session or f.session     # else a pin of the fingerprint alone (older pins)
        return Step(_replace(state, session=session), ReadPin(session))
    if isinstance(event, ParentFound):
        if event.session is not None and event.loaded.pin is not None:
            state = _replace(state, parent=event.session, parent_pin=event.loaded.pin)
        return _after_read(state)
    if isinstance(event, TitleRead):
        return _decide(_replace(state, title=event.server))
    if isinstance(event, Planned):
        return _planned(_replace(state, changes=event.changes))
    if isinstance(event, PinCreated):
        return Step(state, Forward(state.changes), _remember_opening(state))
    if isinstance(event, PinLost):
        if state.raced:     # a second loss in one request cannot happen; refuse rather than loop
            return Step(state, Refuse(503, "store", f"sessionpin: session {state.session} changed pins twice "
                                      "while this request was decided; retry", RETRY_AFTER))
        return _decide(_replace(state, loaded=event.loaded, raced=True, changes=None))
    if isinstance(event, (Allocated, NotAllocated, MemberChecked)):
        return _pooled(state, event)
    if isinstance(event, NotSaved):
        d = state.decision
        if r.source is not None and d is not None and d.target == r.source.name:
            # It stays on the server it addressed: should the pin be lost, its next turn
            # (never seen begin) is left alone — and goes to that same server.
            return Step(state, Forward(state.changes))
        return Step(state, Refuse(503, "store", (
            f"sessionpin cannot save the pin of new {f.agent} session {state.session} ({event.error}), so it was "
            f"not sent to {d.target if d else '?'}: a restart could otherwise move the conversation. "
            f"Free space, fix the store's permissions or stop the process holding it, and retry; or run "
            f"'sessionpin use {f.agent} --not-routed'."), RETRY_AFTER))
    raise TypeError(f"unexpected event {event!r}")


def _decide(state: State) -> Step:
    r = state.request
    return _decided(state, ladder.decide(r.facts, state.loaded.pin, r.config, r.source, state.title,
                                         state.parent_pin))


def _decided(state: State, d: Decision) -> Step:
    state = _replace(state, decision=d)
    r = state.request
    f = r.facts
    session = state.session or ""
    if d.rule == "pinned-server-gone" and _soft_pool(r, state.loaded.pin) is not None:
        return _soft_miss(state, state.loaded.pin.server, "gone")
    if d.refuse:
        pin = state.loaded.pin or state.parent_pin
        pinned = pin.server if pin else "?"
        where = r.config.path or "the sessionpin config"
        whose = f"session {session}" if state.loaded.pin else f"session {session} (a fork of {state.parent})"
        return Step(state, Refuse(d.refuse, d.rule, (
            f"sessionpin: {whose} is pinned to server '{pinned}', which is no longer configured. "
            f"It is not moved to another server. Add [servers.{pinned}] back to {where}, or move the "
            f"conversation yourself with `sessionpin move {state.parent or session} SERVER` "
            f"(or start a new conversation).")))
    if d.target is None:
        after: tuple[After, ...] = ()
        if d.pin_action == ladder.CREATE and not (_fingerprint(state) and f.has_history):
            after = (WritePin(session, _new_pin(state, d), state.loaded), *_remember_opening(state))
        elif d.pin_action == ladder.RENEW and state.loaded.pin is not None and renew_due(state.loaded.pin, r.now):
            after = (RenewPin(session, state.loaded),)
        return Step(state, Leave(), after)
    pin = state.loaded.pin
    if d.target in r.config.pools:
        return Step(state, Allocate(session, d.target, _new_pin(state, d), state.loaded,
                                    commit=d.pin_action == ladder.CREATE))
    if d.rule == "pinned" and pin is not None and pin.pool and state.checked != d.target:
        return Step(state, CheckMember(pin.pool, d.target, _soft_pool(r, pin) is not None))
    return Step(state, Plan(d.target))


def _planned(state: State) -> Step:
    r, d, c = state.request, state.decision, state.changes
    f = r.facts
    if c.refuse:
        return Step(state, Refuse(502, "rewrite", f"sessionpin: {c.refuse}; the request was not sent"))
    session = state.session or ""
    if d.pin_action == ladder.CREATE and not state.allocated:
        return Step(state, CreatePin(session, _new_pin(state, d), state.loaded))
    after: tuple[After, ...] = ()
    if d.pin_action == ladder.CREATE:          # the allocation wrote the pin
        after = _remember_opening(state)
    elif d.pin_action == ladder.RENEW and state.loaded.pin is not None and renew_due(state.loaded.pin, r.now):
        after = (RenewPin(session, state.loaded),)
    elif d.rule == "side-current" and ladder.is_title_shaped(f):
        after = (RememberTitle(session, d.target),)
    return Step(state, Forward(c), after)


def _remember_opening(state: State) -> tuple[After, ...]:
    f = state.request.facts
    if _fingerprint(state) and not f.has_history and state.session and state.session != f.session:
        return (RememberOpening(f.agent, f.session or "", state.session),)
    return ()


def _new_pin(state: State, d: Decision) -> Pin:
    r = state.request
    return Pin(agent=r.facts.agent, server=d.target, since=r.now, renewed=r.now, rule=d.rule,
               turn=r.facts.turn or "", source=r.source.name if r.source else "", parent=state.parent or "")


# ---- server pools -----------------------------------------------------------------------

def _soft_pool(r: Request, pin: Pin | None):
    """The soft pool a pin was allocated in (as configured now), else None."""
    pool = r.config.pools.get(pin.pool) if pin is not None and pin.pool else None
    return pool if pool is not None and pool.affinity == "soft" else None


def _soft_miss(state: State, member: str, reason: str) -> Step:
    """A soft pool's pinned member cannot take the request: allocate afresh over the pin read."""
    r, pin = state.request, state.loaded.pin
    state = _replace(state, missed=state.missed | {member}, checked=None)
    fresh = Pin(agent=pin.agent, server=None, since=r.now, renewed=r.now, rule="soft-move", turn=pin.turn,
                source=pin.source)
    return Step(state, Allocate(state.session or "", pin.pool, fresh, state.loaded, exclude=state.missed, reason=reason))


def _pooled(state: State, event: Allocated | NotAllocated | MemberChecked) -> Step:
    r, d = state.request, state.decision
    f = r.facts
    if isinstance(event, NotAllocated):
        return Step(state, Refuse(event.status, event.kind, event.message, event.retry_after))
    if isinstance(event, Allocated):
        pin = event.loaded.pin
        moved = pin is not None and pin.rule == "soft-move"
        decision = Decision(event.member, ladder.NONE if moved else d.pin_action, "soft-move" if moved else d.rule,
                            event.why)
        state = _replace(state, decision=decision, allocated=True, loaded=event.loaded if pin else state.loaded)
        if _soft_pool(r, pin) is not None:      # a soft pin's member is checked before it is used
            return Step(state, CheckMember(pin.pool, event.member, True))
        return Step(state, Plan(event.member))
    member, pin = d.target, state.loaded.pin
    if event.exhausted_until > r.now:           # deferred, never moved
        wait = max(1, math.ceil(event.exhausted_until - r.now))
        return Step(state, Refuse(429, "member-exhausted", (
            f"sessionpin: server {member} (pool {pin.pool if pin else '?'}) is out of quota for another {wait}s "
            f"({event.exhausted_why or 'it said so'}); {f.agent} session {state.session} stays on {member} and is not "
            f"moved. Retry after {wait}s."), wait))
    if event.missing and member not in state.missed and _soft_pool(r, pin) is not None:
        return _soft_miss(state, member, event.missing)
    return Step(_replace(state, checked=member), Plan(member))
