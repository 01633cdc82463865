"""The lineage index: which conversation a history root or an earlier response belongs to.

Rules it keeps (docs/facts.md "Lineage", docs/router.md):
- Keys hold ids and hashes only, never content: ``lin:<agent>:root:<key>`` → the session
  whose first exchange has that chain key (``lineage.extend`` of its opening's head and its
  first answer); ``lin:<agent>:req:<request-id>`` → the session a response with that
  ``request-id`` header answered (Claude Code names it in ``cc_prev_req`` when it resumes
  or forks a conversation in a new process); ``lin:<agent>:opening:<fingerprint>`` → the
  latest conversation that began with that opening (pi, which sends no id): a turn whose
  root is not known (its opening's answer was not seen whole) goes there.
- Written after a request left (the root of the history it carries) or after a response
  completes (an opening's root, an anchor), never on the request's path; not durable (a lost
  entry costs a fork its parent link: the fork is then left alone, as before lineage).
- Bounded: one root per conversation (30 days, like its pin; a compaction that rewrites
  the first exchange makes a second) and one anchor per Claude
  Code response (7 days: a fork or resume names the last response of its parent, and a
  conversation continued later is found by its root). The newest writer of a key wins.
- Looking up a parent tries the client's explicit links first (parent session ids, then
  anchors), then the root; a candidate counts only if it is not the request's own
  session and has a pin of the same agent.
"""

from __future__ import annotations

from typing import Iterable

from . import pins
from .pins import Loaded
from .store.base import Set, Store, Write

PREFIX = "lin:"
ROOT_TTL = pins.PIN_TTL
ANCHOR_TTL = 7 * pins.DAY


def root_key(agent: str, key: str) -> str:
    return f"{PREFIX}{agent}:root:{key}"


def anchor_key(agent: str, anchor: str) -> str:
    return f"{PREFIX}{agent}:{anchor}"


def opening_key(agent: str, fingerprint: str) -> str:
    return f"{PREFIX}{agent}:opening:{fingerprint}"


async def find_conversation(store: Store, agent: str, root: str | None, fingerprint: str) -> str | None:
    """The conversation a turn named by a fingerprint belongs to: the one whose history has
    this root, else the latest that began with this opening."""
    keys = ([root_key(agent, root)] if root else []) + [opening_key(agent, fingerprint)]
    return next((s for s in await store.mget(keys) if s), None)


async def remember_opening(store: Store, agent: str, fingerprint: str, session: str) -> None:
    await store.set(opening_key(agent, fingerprint), session, ROOT_TTL)


async def find_parent(store: Store, agent: str, own: str, sessions: Iterable[str], anchors: Iterable[str],
                      root: str | None) -> tuple[str, Loaded] | None:
    """The conversation a request without a pin forks or resumes, with its pin: explicit
    links first, then the history's root. None when none is known."""
    candidates = [s for s in sessions if s and s != own]
    lookups = [anchor_key(agent, a) for a in anchors]
    if root:
        lookups.append(root_key(agent, root))
    if lookups:
        candidates += [s for s in await store.mget(lookups) if s and s != own]
    for session in dict.fromkeys(candidates):
        loaded = await pins.load(store, session)
        if loaded.pin is not None and loaded.pin.agent == agent:
            return session, loaded
    return None


def record_writes(agent: str, session: str, root: str | None = None, anchors: Iterable[str] = ()) -> list[Write]:
    """What later requests may name this conversation by, as writes (batched by the caller)."""
    writes: list[Write] = [Set(anchor_key(agent, a), session, ANCHOR_TTL) for a in anchors]
    if root:
        writes.append(Set(root_key(agent, root), session, ROOT_TTL))
    return writes


async def record(store: Store, agent: str, session: str, root: str | None = None,
                 anchors: Iterable[str] = ()) -> None:
    """Remember what later requests may name this conversation by (one transaction)."""
    writes = record_writes(agent, session, root, anchors)
    if writes:
        await store.apply([], writes)
