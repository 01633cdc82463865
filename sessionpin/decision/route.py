"""The request path as a stepper: what is known so far and one event in, the next effect out.

As h11 is to an HTTP server, this module is to the router addon: pure (no store, no
clock, no mitmproxy), so every rule, every store answer and the race with another proxy
is a table row (tests/test_route.py). The shell drives it::

    step = route.begin(request)
    while not step.done:
        step = route.step(step.state, await perform(step.effect))
    answer the flow as step.effect says; run step.after without delaying it

Each step leaves the request in a named ``Phase``: waiting for the answer to one effect, or
done. ``TRANSITIONS`` lists, phase by phase, the events that may come and the phases each
may lead to, as h11's ``_state.py`` does; which of them is taken is the rules' choice
below, and ``step`` refuses a move the table does not hold (tests/test_route.py walks
every row). Effects the shell performs (the phase that waits for each), and the events
that answer them:

    ReadPin(session)         READING_PIN          -> PinRead(loaded) | StoreFailed | StoreLost
    ReadLineage()            READING_LINEAGE      -> LineageRead(signals, root)   (``lineage_of`` the body)
    FindConversation(root, fingerprint) FINDING_CONVERSATION -> ConversationFound(session | None, apart) | …
    FindParent(links)        FINDING_PARENT       -> ParentFound(session | None, loaded) | …
    ReadTitle(session)       READING_TITLE        -> TitleRead(server | None) | …
    Plan(target, body)       PLANNING             -> Planned(changes)   (``plan`` with the request's bytes)
    CreatePin(session, pin)  CREATING_PIN         -> PinCreated | PinLost(loaded) | NotSaved(error) | …
    Allocate(session, pool)  ALLOCATING           -> Allocated(member) | PinLost | NotAllocated | NotSaved | …
    CheckMember(pool, member) CHECKING_MEMBER     -> MemberChecked(exhausted until, missing) | …
    CheckReachable(target, host, port) CHECKING_REACHABLE -> Reachable(error | None)

("…": a store effect may also be answered ``StoreFailed`` or ``StoreLost``.) Terminal
effects: ``Forward(changes)`` (send it, rewritten as planned; FORWARDED), ``Leave`` (send
it untouched; LEFT), ``Refuse(status, …)`` (answer it here; REFUSED). ``after`` holds
what the shell does once the request is on its way and never waits for: renew a pin,
remember a title, write a "not routed" pin.

The rules at the request path's two ends are pure functions here too, so the shell only
performs and shows: ``ambiguous`` (before the stepper), ``plan`` and ``lineage_of`` (the
work on the body an effect asks for), ``redirect_refused``/``redirect_refusal`` (the answer).

Rules this module keeps beyond the ladder's:
- A request addressed to a configured server (or whose path looks like inference) whose
  path is ambiguous (dot segments, encoded slashes…) is refused 400 in the format of the
  API its path names (``/../../v1/messages`` is Anthropic's), and sent nowhere.
- A request at a path sessionpin does not route that ends with an endpoint (``Request.unnamed``,
  ``paths.named``: a server may serve it as inference) is only guarded: its conversation's pin
  is read (its parent's, for a fork), and pinned to another server it is refused (424 naming
  the session, the server and the path); otherwise it goes where it was addressed, untouched,
  pinning and renewing nothing (``_guard``).
- A request that names its session in a header sent twice with different values, or whose
  agent's own session header holds no usable id (``Facts.conflict``), is refused 400 before
  any pin is read: which conversation it is cannot be told, and following the first value's
  pin (or the fingerprint's, the body's) would be a guess.
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
  (no key, model not found) is refused and pins nothing. The body is decoded for the plan
  only when the target renames the model (a WebSocket upgrade has none: each message's
  model is renamed as it passes); a pool pin's member keeps the model map it was
  allocated with.
- A request sent to another origin than the one it addressed is first checked reachable
  (``CheckReachable``: the shell's ``ConnectCheck`` rides out a blip); an unreachable
  server is a refusal naming the session, the server and its address (no retry signals),
  never mitmproxy's HTML 502. The pin stays: nothing written "after" runs.
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
- Server pools (docs/serverpools.md): a target that is a pool is allocated a member, the pin
  written by the allocation itself (``members.allocate``); a side request with no pin
  goes where the allocator would send the opening, pinning nothing. A turn pinned to a
  pool member known exhausted is answered 429 with the reset as ``retry-after`` — never
  moved, but for the opening asked again while its pin is still its allocation (nothing
  began there: allocated afresh, the member left out); so is an opening whose member is
  unreachable (``CheckReachable``), its first request or asked again. In a soft pool, a pinned member
  that is gone, out of the pool's members, drained or unreachable is a clean miss (before
  its exhaustion is looked at): the conversation is allocated afresh (compare-and-set over
  its pin), the move recorded; a hard pool's pin never moves.
- A redirect answered by a server the request was moved to is not passed on: the agent
  would follow it with its own key (to another host, or to that server's origin, where
  requests keep the agent's headers). It gets a 502 naming the server and the host the
  redirect pointed to.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Callable, Mapping
from urllib.parse import unquote

import msgspec

from ..serverpools import allocate
from ..lineage import lineage
from . import rewrite
from ..reader import facts as F
from ..reader import paths
from . import ladder
from .answers import NO_RETRY_STATUS
from ..reader.ids import short
from .ladder import Decision, Rule
from ..records.pins import Loaded, Pin, renew_due
from .rewrite import Changes
# The stepper's vocabulary lives in steps.py; route.ReadPin, route.Forward … are its API.
from .steps import (TERMINAL, TITLE_TTL, After, Allocate, Allocated, CheckMember, CheckReachable,  # noqa: F401
                    ConversationFound, CreatePin, Effect, Event, FindConversation, FindParent, Forward, Leave,
                    LineageRead, MemberChecked, NotAllocated, NotSaved, ParentFound, PinCreated, PinLost, PinRead,
                    Plan, Planned, Reachable, ReadLineage, ReadPin, ReadTitle, Refuse, RememberOpening, RememberTitle,
                    RenewPin, Request, StoreFailed, StoreLost, TitleRead, WritePin)

RETRY_AFTER = 1         # seconds: a store that cannot save may well be back by then
REDIRECTS = frozenset({301, 302, 303, 307, 308})


# ---- the phases and the table -----------------------------------------------------------

class Phase(enum.StrEnum):
    """Where one request is: waiting for the answer to one effect, or done."""
    START = "start"
    READING_PIN = "reading-pin"
    READING_LINEAGE = "reading-lineage"
    FINDING_CONVERSATION = "finding-conversation"
    FINDING_PARENT = "finding-parent"
    READING_TITLE = "reading-title"
    PLANNING = "planning"
    CREATING_PIN = "creating-pin"
    ALLOCATING = "allocating"
    CHECKING_MEMBER = "checking-member"
    CHECKING_REACHABLE = "checking-reachable"
    FORWARDED = "forwarded"
    LEFT = "left"
    REFUSED = "refused"


START, READING_PIN, READING_LINEAGE, FINDING_CONVERSATION, FINDING_PARENT, READING_TITLE, PLANNING, CREATING_PIN, \
    ALLOCATING, CHECKING_MEMBER, CHECKING_REACHABLE, FORWARDED, LEFT, REFUSED = Phase

# The phase each effect leaves the request in.
PHASE_OF: dict[type, Phase] = {
    ReadPin: READING_PIN, ReadLineage: READING_LINEAGE, FindConversation: FINDING_CONVERSATION,
    FindParent: FINDING_PARENT, ReadTitle: READING_TITLE, Plan: PLANNING, CreatePin: CREATING_PIN,
    Allocate: ALLOCATING, CheckMember: CHECKING_MEMBER, CheckReachable: CHECKING_REACHABLE,
    Forward: FORWARDED, Leave: LEFT, Refuse: REFUSED,
}

# (phase, event) -> the phases it may lead to; ``begin`` is the START row (its event: the
# Request). A store effect may also be answered StoreFailed or StoreLost: a refusal.
_DECIDED = frozenset({LEFT, REFUSED, PLANNING, ALLOCATING, CHECKING_MEMBER})  # a pin read: ``_decided``
_STORE = {StoreFailed: frozenset({REFUSED}), StoreLost: frozenset({REFUSED})}

TRANSITIONS: dict[Phase, dict[type, frozenset[Phase]]] = {
    START: {Request: frozenset({LEFT, REFUSED, READING_PIN, READING_LINEAGE})},
    READING_PIN: {PinRead: _DECIDED | {READING_LINEAGE, READING_TITLE}, **_STORE},
    READING_LINEAGE: {LineageRead: frozenset({FINDING_CONVERSATION, FINDING_PARENT})},
    FINDING_CONVERSATION: {ConversationFound: frozenset({READING_PIN, REFUSED}), **_STORE},
    FINDING_PARENT: {ParentFound: frozenset({LEFT, REFUSED, PLANNING, READING_TITLE}), **_STORE},
    READING_TITLE: {TitleRead: frozenset({LEFT, PLANNING}), **_STORE},
    PLANNING: {Planned: frozenset({REFUSED, CREATING_PIN, CHECKING_REACHABLE, FORWARDED})},
    CREATING_PIN: {PinCreated: frozenset({CHECKING_REACHABLE, FORWARDED}), PinLost: _DECIDED,
                   NotSaved: frozenset({REFUSED, CHECKING_REACHABLE, FORWARDED}), **_STORE},
    ALLOCATING: {Allocated: frozenset({PLANNING, CHECKING_MEMBER}), PinLost: _DECIDED,
                 NotAllocated: frozenset({REFUSED}), NotSaved: frozenset({REFUSED}), **_STORE},
    CHECKING_MEMBER: {MemberChecked: frozenset({PLANNING, ALLOCATING, REFUSED}), **_STORE},
    CHECKING_REACHABLE: {Reachable: frozenset({FORWARDED, REFUSED, ALLOCATING})},
}


class BadTransition(RuntimeError):
    """A move ``TRANSITIONS`` does not hold: a bug in a rule or in the shell (never a request's fault)."""


# ---- state ------------------------------------------------------------------------------

_UNREAD = Loaded(None, None)


class State(msgspec.Struct, frozen=True):
    """What is known so far about one request (a msgspec struct: a step copies it in C)."""
    request: Request
    phase: Phase = START
    session: str | None = None       # the conversation's id (a pi fingerprint's is resolved)
    loaded: Loaded = _UNREAD         # the pin as read (pin None: none)
    title: str | None = None         # where this session's title-shaped request went
    lineage: LineageRead | None = None
    parent: str | None = None        # the conversation this one forks or resumes
    parent_pin: Pin | None = None
    decision: Decision | None = None
    changes: Changes | None = None
    pending: tuple[After, ...] = ()  # what runs after a forward that waits for CheckReachable
    raced: bool = False              # another proxy's pin was taken once already
    allocated: bool = False          # a pool's allocation wrote the pin (no CreatePin)
    checked: str | None = None       # the pool member CheckMember answered for
    missed: frozenset[str] = frozenset()   # soft pool members missed


class Step(msgspec.Struct, frozen=True):
    state: State
    effect: Effect
    after: tuple[After, ...] = ()

    @property
    def done(self) -> bool:
        return isinstance(self.effect, TERMINAL)


_replace = msgspec.structs.replace


def _go(state: State, effect: Effect, after: tuple[After, ...] = ()) -> Step:
    """The step that asks for ``effect``: the request waits in that effect's phase."""
    return Step(_replace(state, phase=PHASE_OF[type(effect)]), effect, after)


def begin(request: Request) -> Step:
    return step(State(request, session=request.facts.session), request)


def step(state: State, event: Event) -> Step:
    row = _ROWS.get((state.phase, type(event)))
    if row is None:
        if type(event) not in _ON:
            raise TypeError(f"unexpected event {event!r}")
        raise BadTransition(f"{type(event).__name__} while {state.phase.name}")
    on, allowed = row
    s = on(state, event)
    if s.state.phase not in allowed:
        raise BadTransition(f"{state.phase.name} --{type(event).__name__}--> {s.state.phase.name}")
    return s


# ---- the rules, event by event ----------------------------------------------------------

def _begin(state: State, request: Request) -> Step:
    f = request.facts
    if not ladder.in_scope(f):
        return _decided(state, ladder.decide(f, None, request.config, request.source))
    if f.conflict:      # two sessions named, or one unreadable: following any pin would be a guess
        return _go(state, Refuse(400, "session-conflict", (
            f"sessionpin: {f.conflict}, so which {f.agent} conversation this request belongs to cannot be "
            f"told; it was not sent anywhere and no pin was read or written. Send the session's id once, "
            f"as the agent does.")))
    if f.session_source == "fingerprint":
        if not f.has_history:     # an opening is always a new conversation
            if request.unnamed:
                return _guard(state)
            session = f"{f.session}.{request.nonce}" if request.nonce else f.session
            return _go(_replace(state, session=session), ReadPin(session))
        return _go(_replace(state, session=None), ReadLineage())
    return _go(state, ReadPin(f.session))


def _fingerprint(state: State) -> bool:
    return state.request.facts.session_source == "fingerprint"


def _on_store_failed(state: State, event: StoreFailed) -> Step:
    # The shell rode out a short blip before saying so: answered so that no agent keeps
    # retrying for minutes (answers.NO_RETRY_STATUS, docs/traffic.md).
    f = state.request.facts
    return _go(state, Refuse(NO_RETRY_STATUS, "store", f"sessionpin cannot use its pin store ({event.error}), "
                             f"so {f.agent} session {state.session or f.session} was not sent anywhere: its pin "
                             f"decides where it goes. Send it again once the store is back; 'sessionpin doctor' "
                             f"says what is wrong."))


def _on_store_lost(state: State, event: StoreLost) -> Step:
    # the operator decides (accept-loss or a restore): no agent's retry can help
    f = state.request.facts
    return _go(state, Refuse(NO_RETRY_STATUS, "store-lost", f"sessionpin: {event.error}. {f.agent} session "
                             f"{state.session or f.session} was not sent anywhere."))


def _on_pin_read(state: State, event: PinRead) -> Step:
    """No pin and a history: look for a parent (its lineage first); else the title rule, then decide."""
    state = _replace(state, loaded=event.loaded)
    if event.loaded.pin is None and state.request.facts.has_history and not _fingerprint(state):
        return _go(state, ReadLineage())
    return _title_or_decide(state)


def _on_lineage_read(state: State, event: LineageRead) -> Step:
    f = state.request.facts
    state = _replace(state, lineage=event)
    if state.session is None:          # a pi fingerprint with history: which conversation?
        return _go(state, FindConversation(f.agent, event.root, f.session or ""))
    sig = event.signals
    return _go(state, FindParent(f.agent, state.session or "", sig.sessions, sig.anchors, event.root))


def _on_conversation_found(state: State, event: ConversationFound) -> Step:
    if event.apart:
        return _apart(state, event.apart)
    session = event.session or state.request.facts.session     # else a pin of the fingerprint alone (older pins)
    return _go(_replace(state, session=session), ReadPin(session))


def _apart(state: State, apart: tuple[tuple[str, str | None], ...]) -> Step:
    """A turn whose history's root is not known, of an opening several conversations began with,
    pinned to different places: it continues one of them, which one cannot be told. Sent to the
    latest of them (as before) it would move an older one, running on its own server; left
    alone it would go where the agent addresses, perhaps another server still. Refused, naming
    them: nothing is pinned or moved."""
    f = state.request.facts
    where = ", ".join(f"{s} on {server if server else '(not routed)'}" for s, server in apart)
    return _go(state, Refuse(NO_RETRY_STATUS, "lineage-apart", (
        f"sessionpin: this {f.agent} turn continues one of {len(apart)} conversations that began with the "
        f"same opening and are pinned to different servers ({where}), and sessionpin cannot tell which: "
        f"the first answer its history carries is not in its lineage index (not seen whole, or its record "
        f"was lost). It was not sent anywhere, so no "
        f"conversation is moved. If they may share one server, move them there "
        f"(`sessionpin move ID SERVER`, then send it again); otherwise start the conversation afresh.")))


def _on_parent_found(state: State, event: ParentFound) -> Step:
    if event.session is not None and event.loaded.pin is not None:
        state = _replace(state, parent=event.session, parent_pin=event.loaded.pin)
    return _title_or_decide(state)


def _title_or_decide(state: State) -> Step:
    r, f = state.request, state.request.facts
    if r.unnamed:
        return _guard(state)
    if state.loaded.pin is None and state.parent_pin is None and r.source is not None \
            and f.agent == F.OPENCODE and f.turn == F.CONTINUATION:
        return _go(state, ReadTitle(state.session or ""))
    return _decide(state)


def _on_title_read(state: State, event: TitleRead) -> Step:
    return _decide(_replace(state, title=event.server))


def _on_planned(state: State, event: Planned) -> Step:
    return _planned(_replace(state, changes=event.changes))


def _on_pin_created(state: State, event: PinCreated) -> Step:
    return _forward(state, state.changes, _remember_opening(state))


def _on_pin_lost(state: State, event: PinLost) -> Step:
    if state.raced:     # a second loss in one request cannot happen; refuse rather than loop
        return _go(state, Refuse(503, "store", f"sessionpin: session {state.session} changed pins twice "
                                 "while this request was decided; retry", RETRY_AFTER))
    return _decide(_replace(state, loaded=event.loaded, raced=True, changes=None))


def _on_not_saved(state: State, event: NotSaved) -> Step:
    r, f, d = state.request, state.request.facts, state.decision
    if r.source is not None and d is not None and d.target == r.source.name:
        # It stays on the server it addressed: should the pin be lost, its next turn
        # (never seen begin) is left alone — and goes to that same server.
        return _forward(state, state.changes)
    return _go(state, Refuse(503, "store", (
        f"sessionpin cannot save the pin of new {f.agent} session {state.session} ({event.error}), so it was "
        f"not sent to {d.target if d else '?'}: a restart could otherwise move the conversation. "
        f"Free space, fix the store's permissions or stop the process holding it, and retry; or run "
        f"'sessionpin use {f.agent} --not-routed'."), RETRY_AFTER))


def _on_reachable(state: State, event: Reachable) -> Step:
    if event.error is None:
        return _go(state, Forward(state.changes), state.pending)
    r, d, c = state.request, state.decision, state.changes
    if d.target and _opening_unbegun(state):     # a pool's member down before the opening began
        return _reallocate(state, d.target, "unreachable before the opening began")
    f = r.facts
    server = r.config.servers.get(d.target)
    session = state.session or f.session
    # The budget to ride out a blip is spent: answered so no agent retries for minutes
    # (answers.NO_RETRY_STATUS; docs/traffic.md has each client's rules). Nothing "after" runs.
    return _go(state, Refuse(NO_RETRY_STATUS, "unreachable", (
        f"sessionpin: server {d.target} ({server.origin if server else '?'}, "
        f"{c.host}:{c.port}) cannot be reached: {event.error}. {f.agent} session "
        f"{session} is pinned to {d.target} and stays there: send it again once "
        f"{d.target} is back (`sessionpin status` shows it), or move the conversation "
        f"(`sessionpin move {short(session)} SERVER`)."), changes=c))


def _guard(state: State) -> Step:
    """A request at a path sessionpin does not route (``Request.unnamed``: it ends with that
    endpoint) goes where it was addressed, as if the router were not there — unless its
    conversation (or the one it forks) is pinned to another server: then the server it
    addressed may well serve it as inference, and it is refused, never sent there. Nothing is
    pinned or renewed."""
    r, f = state.request, state.request.facts
    pin = state.loaded.pin or state.parent_pin
    addressed = r.source.name if r.source is not None else None
    if pin is None or pin.server is None or (pin.server == addressed and not ladder.moved(pin, r.config)):
        why = ("no pin" if pin is None else "pinned not routed" if pin.server is None
               else f"pinned to {pin.server}, which it addresses")
        return _decided(state, Decision(None, ladder.NONE, Rule.UNNAMED_PATH,
                                        f"a path sessionpin does not route ({r.unnamed}), {why}"))
    session = state.session or f.session
    whose = f"session {session}" if state.loaded.pin else f"session {session} (a fork of {state.parent})"
    at = f"server {addressed}" if addressed else f"{r.scheme}://{r.host}:{r.port}"
    d = Decision(None, ladder.NONE, Rule.UNNAMED_PATH, f"pinned to {pin.server}, at a path sessionpin does not route",
                 refuse=NO_RETRY_STATUS)
    return _go(_replace(state, decision=d), Refuse(NO_RETRY_STATUS, Rule.UNNAMED_PATH, (
        f"sessionpin: {f.agent} {whose} is pinned to server '{pin.server}', but this request's path "
        f"{r.path.partition('?')[0]} at {at} is not one sessionpin routes (it ends with {r.unnamed}), so it "
        f"was not sent: that server might answer it, and the conversation must not leave '{pin.server}'. "
        f"Point the agent's base URL at a configured server's URL (`sessionpin servers` lists them), "
        f"or add a server with the URL the agent uses.")))


def _decide(state: State) -> Step:
    r = state.request
    return _decided(state, ladder.decide(r.facts, state.loaded.pin, r.config, r.source, state.title,
                                         state.parent_pin))


def _decided(state: State, d: Decision) -> Step:
    state = _replace(state, decision=d)
    r = state.request
    f = r.facts
    session = state.session or ""
    if d.rule in (Rule.PINNED_SERVER_GONE, Rule.PINNED_SERVER_MOVED) and _soft_pool(r, state.loaded.pin) is not None:
        return _soft_miss(state, state.loaded.pin.server, "gone" if d.rule is Rule.PINNED_SERVER_GONE else "moved")
    if d.refuse and d.rule is Rule.OTHER_AGENT_PIN:
        pin = state.loaded.pin
        return _go(state, Refuse(d.refuse, d.rule, (
            f"sessionpin: session {session} is pinned to server '{pin.server if pin else '?'}' by "
            f"{pin.agent if pin else '?'}, but this request reads as {f.agent}'s, so which conversation it is "
            f"cannot be told; it was not sent anywhere, and the pin is unchanged. If it is that "
            f"{pin.agent if pin else '?'} conversation sent by another client (a provider that sends another "
            f"agent's User-Agent), move it yourself with `sessionpin move {short(session)} SERVER`, or start a "
            f"new conversation.")))
    if d.refuse:
        pin = state.loaded.pin or state.parent_pin
        pinned = pin.server if pin else "?"
        where = r.config.path or "the sessionpin config"
        whose = f"session {session}" if state.loaded.pin else f"session {session} (a fork of {state.parent})"
        if d.rule in (Rule.PINNED_SERVER_MOVED, Rule.FORK_OF_MOVED) and pin is not None:
            now_at = r.config.servers[pinned].origin
            return _go(state, Refuse(d.refuse, d.rule, (
                f"sessionpin: {whose} is pinned to server '{pinned}' at {pin.at}, but '{pinned}' in {where} is "
                f"now {now_at}, another host: the conversation is not sent there. Point [servers.{pinned}] "
                f"url back at {pin.at} to carry on where it began, or move it to the new address yourself "
                f"with `sessionpin move {state.parent or session} {pinned}` (or start a new conversation).")))
        return _go(state, Refuse(d.refuse, d.rule, (
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
        return _go(state, Leave(), after)
    pin = state.loaded.pin
    if d.target in r.config.pools:
        return _go(state, Allocate(session, d.target, _new_pin(state, d), state.loaded,
                                   commit=d.pin_action == ladder.CREATE))
    if d.rule is Rule.PINNED and pin is not None and pin.pool and state.checked != d.target:
        soft = _soft_pool(r, pin)
        if soft is not None and d.target not in soft.members and d.target not in state.missed:
            # a soft pin is a hint over the pool's members as configured now: one taken out of
            # `members` is out of the candidate set (seed 004), though it may stay a server
            return _soft_miss(state, d.target, "left the pool")
        return _go(state, CheckMember(pin.pool, d.target, soft is not None))
    return _plan(state, d.target)


def _plan(state: State, target: str) -> Step:
    """Ask for the request's bytes to plan the rewrite with; the decoded body only when the
    target renames the model (a WebSocket upgrade has none: ``websocket.WebSocketModels``)."""
    r = state.request
    server = allocate.snapshot(r.config, state.loaded.pin).servers.get(target)
    model = None if r.upgrade else r.facts.model
    return _go(state, Plan(target, body=server is not None and model is not None and server.map_model(model) != model))


def _planned(state: State) -> Step:
    r, d, c = state.request, state.decision, state.changes
    f = r.facts
    if c.refuse and c.operator:
        # Only the operator can help (a key the proxy's environment lacks): no client retries it.
        pinned = state.loaded.pin is not None and state.loaded.pin.server == d.target
        return _go(state, Refuse(NO_RETRY_STATUS, "no-key", (
            f"sessionpin: {f.agent} session {state.session or f.session}: {c.refuse}. The request was not sent "
            f"anywhere{f', and the conversation stays pinned to {d.target}' if pinned else ''}; "
            f"send it again once that is fixed.")))
    if c.refuse:
        return _go(state, Refuse(502, "rewrite", f"sessionpin: {c.refuse}; the request was not sent"))
    session = state.session or ""
    if d.pin_action == ladder.CREATE and not state.allocated:
        return _go(state, CreatePin(session, _new_pin(state, d), state.loaded))
    after: tuple[After, ...] = ()
    if d.pin_action == ladder.CREATE:          # the allocation wrote the pin
        after = _remember_opening(state)
    elif d.pin_action == ladder.RENEW and state.loaded.pin is not None and renew_due(state.loaded.pin, r.now):
        after = (RenewPin(session, state.loaded),)
    elif d.rule is Rule.SIDE_CURRENT and ladder.is_title_shaped(f):
        after = (RememberTitle(session, d.target),)
    return _forward(state, c, after)


def _forward(state: State, c: Changes, after: tuple[After, ...] = ()) -> Step:
    """Sent to another origin than the one it addressed: checked reachable first."""
    r, d = state.request, state.decision
    if d.target and (c.host, c.port) != (r.host, r.port):
        return _go(_replace(state, pending=after), CheckReachable(d.target, c.host, c.port))
    return _go(state, Forward(c), after)


def _remember_opening(state: State) -> tuple[After, ...]:
    f = state.request.facts
    if _fingerprint(state) and not f.has_history and state.session and state.session != f.session:
        return (RememberOpening(f.agent, f.session or "", state.session),)
    return ()


def _new_pin(state: State, d: Decision) -> Pin:
    r = state.request
    server = r.config.servers.get(d.target) if d.target else None   # a pool's name: its allocation says
    return Pin(agent=r.facts.agent, server=d.target, since=r.now, renewed=r.now, rule=d.rule,
               turn=r.facts.turn or "", source=r.source.name if r.source else "", parent=state.parent or "",
               at=server.origin if server else "")


# ---- server pools -----------------------------------------------------------------------

def _soft_pool(r: Request, pin: Pin | None):
    """The soft pool a pin was allocated in (as configured now), else None."""
    pool = r.config.pools.get(pin.pool) if pin is not None and pin.pool else None
    return pool if pool is not None and pool.affinity == "soft" else None


def _soft_miss(state: State, member: str, reason: str) -> Step:
    """A soft pool's pinned member cannot take the request: allocate afresh over the pin read."""
    r, pin = state.request, state.loaded.pin
    state = _replace(state, missed=state.missed | {member}, checked=None)
    fresh = Pin(agent=pin.agent, server=None, since=r.now, renewed=r.now, rule=Rule.SOFT_MOVE, turn=pin.turn,
                source=pin.source)
    return _go(state, Allocate(state.session or "", pin.pool, fresh, state.loaded, exclude=state.missed, reason=reason))


def _opening_unbegun(state: State) -> bool:
    """The request is the conversation's opening (no history: its agent used no answer of
    it, if it was asked before) and its pin is still the pool's allocation of that opening,
    to the member it is headed for: nothing of the conversation began there, so the member
    being out of quota or unreachable is no reason to keep it there."""
    r, pin, d = state.request, state.loaded.pin, state.decision
    f = r.facts
    return (pin is not None and d is not None and pin.rule == Rule.OPENING and pin.pool in r.config.pools
            and pin.server == d.target and d.target not in state.missed
            and f.turn == F.OPENING and not f.has_history
            and (d.rule is Rule.PINNED or (d.rule is Rule.OPENING and state.allocated)))


def _reallocate(state: State, member: str, reason: str) -> Step:
    """An opening whose member cannot take it: allocated afresh over its pin, the member left
    out (compare-and-set over the pin read, recorded as a move), hard pool or soft."""
    r, pin = state.request, state.loaded.pin
    state = _replace(state, missed=state.missed | {member}, checked=None)
    fresh = Pin(agent=pin.agent, server=None, since=r.now, renewed=r.now, rule=Rule.OPENING, turn=pin.turn,
                source=pin.source)
    return _go(state, Allocate(state.session or "", pin.pool, fresh, state.loaded, exclude=state.missed,
                               reason=reason))


def _on_not_allocated(state: State, event: NotAllocated) -> Step:
    return _go(state, Refuse(event.status, event.kind, event.message, event.retry_after))


def _on_allocated(state: State, event: Allocated) -> Step:
    r, d = state.request, state.decision
    pin = event.loaded.pin
    moved = pin is not None and pin.rule == Rule.SOFT_MOVE
    decision = Decision(event.member, ladder.NONE if moved else d.pin_action, Rule.SOFT_MOVE if moved else d.rule,
                        event.why)
    state = _replace(state, decision=decision, allocated=True, loaded=event.loaded if pin else state.loaded)
    if _soft_pool(r, pin) is not None:      # a soft pin's member is checked before it is used
        return _go(state, CheckMember(pin.pool, event.member, True))
    return _plan(state, event.member)


def _on_member_checked(state: State, event: MemberChecked) -> Step:
    r, d = state.request, state.decision
    f = r.facts
    member, pin = d.target, state.loaded.pin
    # a soft pool's miss (gone, drained, unreachable) comes before its exhaustion: the member
    # cannot take the turn after its reset either, and draining it is how the operator moves
    # its conversations off
    if event.missing and member not in state.missed and _soft_pool(r, pin) is not None:
        return _soft_miss(state, member, event.missing)
    if event.exhausted_until > r.now and _opening_unbegun(state):
        return _reallocate(state, member, "out of quota before the opening began")
    if event.exhausted_until > r.now:           # deferred, never moved
        wait = max(1, math.ceil(event.exhausted_until - r.now))
        return _go(state, Refuse(429, "member-exhausted", (
            f"sessionpin: server {member} (pool {pin.pool if pin else '?'}) is out of quota for another {wait}s "
            f"({event.exhausted_why or 'it said so'}); {f.agent} session {state.session} stays on {member} and is not "
            f"moved. Retry after {wait}s."), wait))
    return _plan(_replace(state, checked=member), member)


_ON = {
    PinRead: _on_pin_read, LineageRead: _on_lineage_read, ConversationFound: _on_conversation_found,
    ParentFound: _on_parent_found, TitleRead: _on_title_read, Planned: _on_planned, PinCreated: _on_pin_created,
    PinLost: _on_pin_lost, NotSaved: _on_not_saved, Allocated: _on_allocated, NotAllocated: _on_not_allocated,
    MemberChecked: _on_member_checked, Reachable: _on_reachable, StoreFailed: _on_store_failed,
    StoreLost: _on_store_lost, Request: _begin,
}
# (phase, event type) -> (its rule, the phases it may lead to): one lookup a step
_ROWS = {(phase, event): (_ON[event], allowed) for phase, row in TRANSITIONS.items() for event, allowed in row.items()}


# ---- the work an effect asks for on the request's bytes (pure; the shell reads them) -------

def plan(state: State, effect: Plan, headers: tuple[tuple[str, str], ...] | Callable[[], tuple[tuple[str, str], ...]],
         body: bytes | None) -> Changes:
    """The rewrite for ``effect.target`` (``Planned``'s changes), from the request's headers
    and, when ``effect.body`` asked for it, its decoded body. ``headers`` may be a function
    that returns them: it is called only when the request moves (a request that stays on
    the server it addressed keeps its headers as sent, and the rewrite reads none)."""
    r = state.request
    config = allocate.snapshot(r.config, state.loaded.pin)    # a pool pin's model map
    source = allocate.addressed_as(config, r.source, effect.target)   # pool members sharing one URL
    if callable(headers):     # read by rewrite.plan only for a move (its own test of one)
        d = state.decision
        headers = headers() if d is None or source is None or source.name != d.target else ()
    view = rewrite.RequestView(
        scheme=r.scheme, host=r.host, port=r.port, path=r.path, headers=headers, body=body, api=r.facts.api,
        model=None if r.upgrade else r.facts.model, unreadable=None if r.facts.parsed else r.facts.reason,
        model_span=r.facts.model_span,
    )
    return rewrite.plan(state.decision, view, source, config, r.env)


def lineage_of(headers: Any, raw: bytes | None, encoding: str, api: str) -> LineageRead:
    """``ReadLineage``'s answer: the links the request states and its history's root key
    (pure work on the body: the shell runs it on a thread for a large one)."""
    signals = lineage.signals(headers, raw, encoding, api)
    chain = lineage.chain(raw, api, turns=1, content_encoding=encoding)
    return LineageRead(signals, chain.keys[0] if chain.keys else None)


# ---- before the stepper: a path that may mean something else -----------------------------

def ambiguous(path: str, why: str | None, addressed: bool) -> Refuse | None:
    """A request whose path is ambiguous (``why``: dot segments, encoded slashes…; from
    ``paths.scope``), addressed to a configured server or looking like inference: refused,
    never routed, never sent under another server's key — and not sent where it might mean
    something else."""
    if not why or not (addressed or _looks_inference(path)):
        return None
    return Refuse(400, "ambiguous-path", (
        f"sessionpin: the request path is ambiguous ({why}); it was not sent. "
        "Inference requests must use a plain path such as /v1/messages."), api=_api_looked_like(path))


def _looks_inference(path: str) -> bool:
    """Read as a lenient server reads it: ``/v1%2Fmessages`` is ``/v1/messages`` to uvicorn."""
    p = unquote(path.partition("?")[0]).replace("\\", "/").lower()
    return any(e in p for e in ("/messages", "/chat/completions", "/responses"))


def _api_looked_like(path: str) -> str:
    """The api whose error format a refused ambiguous path gets: the one its last segments
    name (``/../../v1/messages`` is Claude Code's, answered in Anthropic's format)."""
    return paths.endpoint_api(path)


# ---- after the answer: a redirect from a server the request was moved to -----------------

def redirect_refused(status: int, decided: Mapping[str, Any] | None) -> bool:
    """Is this answer a redirect from a server the request was moved to (``decided``: the
    flow's decision metadata)? Then it is held (not streamed) and answered by ``redirect_refusal``."""
    return status in REDIRECTS and bool(decided) and bool(decided.get("moved"))


def redirect_refusal(status: int, pointed_to: str, decided: Mapping[str, Any]) -> Refuse:
    """The 502 in place of that redirect (``pointed_to``: the host it named, as the shell read it)."""
    return Refuse(502, "redirect", (
        f"sessionpin: server {decided.get('target')} answered {status} redirecting to {pointed_to}; "
        f"sessionpin does not pass a redirect on from a server it moved a request to (the agent would "
        f"follow it with its own key). {decided.get('agent')} session {decided.get('session')} stays on "
        f"{decided.get('target')}."), api=decided.get("api") or None)
