"""The lineage index: which conversation a history root or an earlier response belongs to.

Rules it keeps (docs/facts.md "Lineage", docs/router.md):
- Keys hold ids and hashes only, never content: ``lin:<agent>:root:<key>`` → the session
  whose history has that root (the chain key after its first exchange: ``lineage.extend`` of
  its opening's head and its first answer, or ``chain(turns=1)`` of any later request);
  ``lin:<agent>:opening:<fingerprint>`` → the conversations that began with that opening
  (pi, which sends no id), newest first, at most ``OPENINGS_KEPT``: a turn whose root is not
  known goes to the latest of them — **only when every one of them that is pinned is pinned
  to the same place**. Two conversations that began alike and are pinned apart (the agent's
  server was switched between them) cannot be told apart by their opening: the turn is not
  given to either (``Found.apart``: the router refuses it), never to the latest by guess.
- **An anchor is a server's claim, and counts only when corroborated.** An anchor is an id a
  server issued (the ``request-id`` of a response, which Claude Code names in ``cc_prev_req``
  when it resumes or forks in a new process; a message or response id named in a body). It is
  recorded per issuing server — ``lin:<agent>:<anchor>@<server>`` → ``"<root> <session>"``,
  the root of the history of the conversation it answered — so that:
  - it belongs to the one server that issued it: when two servers or more hold a claim on the
    same id, the anchor is void (``Lookup.voided``: the shell logs it) — a server that echoes
    an id it was sent as its own cannot take another server's conversation;
  - it counts only when the request's history agrees with the conversation it names: the
    request's root is the root recorded with the claim. A claim recorded without a root (an
    opening whose answer was not seen whole) is not recorded at all.
  Parent session ids the client names (Codex's thread ids, which the client makes) are the
  client's own claim, not a server's: they count as named.
- Written after a request left (the root of the history it carries) or after a response
  completes (an opening's root, an anchor), never on the request's path; not durable (a lost
  entry costs a fork its parent link: the fork is then left alone, as before lineage).
- Bounded: one root per conversation (30 days, like its pin; a compaction that rewrites
  the first exchange makes a second) and one anchor per Claude Code response (7 days: a fork
  or resume names the last response of its parent, and a conversation continued later is
  found by its root). The newest writer of a key wins.
- Looking up a parent tries the client's explicit links first (parent session ids, then
  corroborated anchors), then the root; a candidate counts only if it is not the request's
  own session and has a pin of the same agent. A candidate whose pin is missing is asked
  about (``missing``): a pin that was lost (the store lost it) stops the lookup — the fork is
  refused as its parent's turn would be, never taken for one with no parent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

from . import pins
from .pins import Loaded
from ..reader.kinds import FINGERPRINT_PREFIX
from ..store.base import Set, Store, Write

PREFIX = "lin:"
ROOT_TTL = pins.PIN_TTL
ANCHOR_TTL = 7 * pins.DAY


def root_key(agent: str, key: str) -> str:
    return f"{PREFIX}{agent}:root:{key}"


def anchor_key(agent: str, anchor: str, server: str) -> str:
    """The claim of ``server`` on ``anchor`` (server names hold no ``@``)."""
    return f"{PREFIX}{agent}:{anchor}@{server}"


def claim_value(root: str, session: str) -> str:
    return f"{root} {session}"


def _claim(value: str) -> tuple[str, str]:
    """(root, session) of a claim's value."""
    root, _, session = value.partition(" ")
    return root, session


def opening_key(agent: str, fingerprint: str) -> str:
    return f"{PREFIX}{agent}:opening:{fingerprint}"


def root_of_key(agent: str, session: str) -> str:
    """A conversation keyed by a fingerprint → its history's root: tells apart conversations that
    began with the same opening (``find_conversation``)."""
    return f"{PREFIX}{agent}:rootof:{session}"


OPENINGS_KEPT = 16      # conversations remembered per opening (newest first): scripted runs open alike
_CAS_TRIES = 5


def _listed(value: str | None) -> list[str]:
    """The sessions an opening entry names, newest first (an entry written before the list was
    kept names one)."""
    return value.split() if value else []


@dataclass(frozen=True)
class Found:
    """Which conversation a turn named by a fingerprint belongs to."""
    session: str | None                                  # None: none known
    by_root: bool = False                                # found by its history's root entry
    apart: tuple[tuple[str, str | None], ...] = ()       # (session, server) of conversations begun
    #                                                      alike and pinned apart: which one cannot be told


async def find_conversation(store: Store, agent: str, root: str | None, fingerprint: str) -> Found:
    """The conversation a turn named by a fingerprint belongs to: the one whose history has
    this root; else the latest that began with this opening — if the conversations that began
    with it are all pinned to one place (or just one began with it). Pinned apart, the turn
    could be any of them: ``apart`` names them and no session is given (a guess would move
    a running conversation to another's server)."""
    keys = ([root_key(agent, root)] if root else []) + [opening_key(agent, fingerprint)]
    values = await store.mget(keys)
    if root and values[0]:
        return Found(values[0], by_root=True)
    listed = _listed(values[-1])
    if len(listed) <= 1:
        return Found(listed[0] if listed else None)
    got = await store.mget([pins.key(s) for s in listed] + [root_of_key(agent, s) for s in listed])
    loaded, roots = [pins.decode(raw) for raw in got[:len(listed)]], got[len(listed):]
    pinned = [(s, p.server, r) for s, p, r in zip(listed, loaded, roots) if p is not None and p.agent == agent]
    if len({server for _, server, _ in pinned}) > 1 and root:
        # pinned apart: a conversation whose root is known, and is not this history's, is not
        # this one (its opening's answer was seen, this history's was not: another conversation)
        pinned = [c for c in pinned if not c[2] or c[2] == root] or pinned
    if len({server for _, server, _ in pinned}) > 1:
        return Found(None, apart=tuple((s, server) for s, server, _ in pinned))
    return Found(pinned[0][0] if pinned else listed[0])


async def remember_opening(store: Store, agent: str, fingerprint: str, session: str) -> None:
    """Add ``session`` to the conversations that began with this opening (newest first, bounded),
    by compare-and-set: two proxies on one store that open alike at once both stay listed —
    a conversation lost from the list could be taken for the other one."""
    key = opening_key(agent, fingerprint)
    for _ in range(_CAS_TRIES):
        old = await store.get(key)
        new = " ".join(([session] + [s for s in _listed(old) if s != session])[:OPENINGS_KEPT])
        if await store.cas(key, old, new, ROOT_TTL):
            return
    await store.set(key, new, ROOT_TTL)      # contended past reason: ours is the latest (newest writer wins)


@dataclass(frozen=True)
class Lookup:
    """What looking up a parent found."""
    session: str | None = None          # the parent, with a pin of the agent
    loaded: Loaded = Loaded(None, None)
    voided: tuple[tuple[str, tuple[str, ...]], ...] = ()      # (anchor, the servers that all claim it)
    refuted: tuple[tuple[str, str], ...] = ()                 # (anchor, session) whose history disagrees
    lost: str | None = None             # the parent's pin is missing and was lost (``missing``'s message)
    lost_parent: str | None = None      # … that parent


async def find_parent(store: Store, agent: str, own: str, sessions: Iterable[str], anchors: Iterable[str],
                      root: str | None, servers: Iterable[str] = (),
                      missing: Callable[[str], Awaitable[str | None]] | None = None) -> Lookup:
    """The conversation a request without a pin forks or resumes, with its pin: explicit
    links first (anchors only as corroborated, see the module's rules), then the history's
    root. ``servers``: every server that may have issued an anchor (the configured ones).
    ``missing(session)``: whether a candidate's missing pin was lost (a message) or never was
    (None) — a parent whose pin was lost is not "no parent": the lookup stops there, ``lost``."""
    candidates = [s for s in sessions if s and s != own]
    anchors = list(dict.fromkeys(a for a in anchors if a))
    servers = sorted(set(servers))
    lookups = [anchor_key(agent, a, s) for a in anchors for s in servers]
    if root:
        lookups.append(root_key(agent, root))
    values = await store.mget(lookups) if lookups else []
    voided: list[tuple[str, tuple[str, ...]]] = []
    refuted: list[tuple[str, str]] = []
    n = len(servers)
    for i, anchor in enumerate(anchors):
        claims = [(servers[j], v) for j, v in enumerate(values[i * n:(i + 1) * n]) if v]
        if len(claims) > 1:
            voided.append((anchor, tuple(s for s, _ in claims)))
        elif claims:
            claimed_root, session = _claim(claims[0][1])
            if not root or claimed_root != root:
                refuted.append((anchor, session))
            elif session and session != own:
                candidates.append(session)
    if root and values[-1] and values[-1] != own:
        candidates.append(values[-1])
    for session in dict.fromkeys(candidates):
        loaded = await pins.load(store, session)
        if loaded.pin is not None and loaded.pin.agent == agent:
            return Lookup(session, loaded, tuple(voided), tuple(refuted))
        if loaded.pin is None and missing is not None and (lost := await missing(session)):
            return Lookup(None, Loaded(None, None), tuple(voided), tuple(refuted), lost, session)
    return Lookup(None, Loaded(None, None), tuple(voided), tuple(refuted))


def record_writes(agent: str, session: str, root: str | None = None, anchors: Iterable[str] = (),
                  server: str | None = None, owns_root: bool = True) -> list[Write]:
    """What later requests may name this conversation by, as writes (batched by the caller):
    its root (``owns_root``: not for a fork, whose root is its parent's) and the anchors
    ``server`` issued for it, each with that root (no root or no server: no anchor)."""
    writes: list[Write] = []
    if root and server:
        writes += [Set(anchor_key(agent, a, server), claim_value(root, session), ANCHOR_TTL) for a in anchors]
    if root and owns_root:
        writes.append(Set(root_key(agent, root), session, ROOT_TTL))
        if session.startswith(FINGERPRINT_PREFIX):
            writes.append(Set(root_of_key(agent, session), root, ROOT_TTL))
    return writes


async def record(store: Store, agent: str, session: str, root: str | None = None,
                 anchors: Iterable[str] = (), server: str | None = None, owns_root: bool = True) -> None:
    """Remember what later requests may name this conversation by (one transaction)."""
    writes = record_writes(agent, session, root, anchors, server, owns_root)
    if writes:
        await store.apply([], writes)
