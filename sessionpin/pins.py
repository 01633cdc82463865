"""Pins: which server a session's requests go to, kept in the store.

Rules this module keeps (seeds/000, made stronger):
- One pin per session, under ``pin:<session>``; it records the agent that made it, so a
  pin of another agent is neither followed nor overwritten by the router.
- ``server`` None means "not routed": the session's requests are left alone.
- A pin lives 30 days from its last renewal and is renewed at most once a day, so a
  busy session does not write the store on every request.
- A new pin is written durably and only if absent (``set nx``): if two proxies race to
  pin one session, the first pin wins and the second reads it back.
- A stored value that is not a valid pin (bad JSON, wrong shape, no agent) reads as no pin.
- Activity (last seen, requests seen) is not part of the pin: it changes on every
  request, so the router counts it in memory and flushes it lazily under ``seen:<session>``.
"""

from __future__ import annotations

from typing import Iterator

import msgspec

from .store.base import Store

PIN_PREFIX = "pin:"
SEEN_PREFIX = "seen:"
DAY = 86_400.0
PIN_TTL = 30 * DAY
RENEW_AFTER = DAY


class Pin(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    agent: str
    server: str | None          # None: not routed
    since: float                # when the pin was made (epoch seconds)
    renewed: float              # when its TTL was last renewed
    rule: str = ""              # the ladder rule that made it (or "operator")
    turn: str = ""              # the turn that made it
    v: int = 1


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Pin)


def key(session: str) -> str:
    return PIN_PREFIX + session


def encode(pin: Pin) -> str:
    return _encoder.encode(pin).decode()


def decode(text: str | None) -> Pin | None:
    if not text:
        return None
    try:
        pin = _decoder.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not pin.agent:
        return None
    return pin


def load(store: Store, session: str) -> Pin | None:
    return decode(store.get(key(session)))


def create(store: Store, session: str, pin: Pin) -> Pin:
    """Write a new pin durably unless one exists; return the pin now in force."""
    if store.set(key(session), encode(pin), PIN_TTL, nx=True, durable=True):
        return pin
    existing = load(store, session)
    if existing is None:
        # The value there is not a valid pin: it reads as no pin, so replace it.
        store.set(key(session), encode(pin), PIN_TTL, durable=True)
        return pin
    return existing


def renew_due(pin: Pin, now: float) -> bool:
    return now - pin.renewed >= RENEW_AFTER


def renew(store: Store, session: str, pin: Pin, now: float) -> Pin:
    """Renew the pin the request followed — unless it changed since it was read (an
    operator's move or forget in between must not be undone by a busy session)."""
    current = load(store, session)
    if current != pin:
        return current if current is not None else pin
    fresh = msgspec.structs.replace(pin, renewed=now)
    store.set(key(session), encode(fresh), PIN_TTL)
    return fresh


def put(store: Store, session: str, pin: Pin) -> None:
    """Overwrite (the operator's explicit move): durable, fresh TTL."""
    store.set(key(session), encode(pin), PIN_TTL, durable=True)


def forget(store: Store, session: str) -> bool:
    found = store.delete(key(session), durable=True)
    store.delete(SEEN_PREFIX + session)
    return found


def sessions(store: Store) -> Iterator[tuple[str, Pin]]:
    """Every valid pin in the store, as (session, pin)."""
    for k in store.keys(PIN_PREFIX):
        pin = load(store, k[len(PIN_PREFIX):])
        if pin is not None:
            yield k[len(PIN_PREFIX):], pin


class Seen(msgspec.Struct, frozen=True):
    last: float = 0.0
    requests: int = 0


def seen(store: Store, session: str) -> Seen:
    h = store.hgetall(SEEN_PREFIX + session)
    try:
        return Seen(float(h.get("last", 0) or 0), int(h.get("requests", 0) or 0))
    except ValueError:
        return Seen()


def record_seen(store: Store, session: str, last: float, requests: int) -> None:
    """Flush activity counted in memory: a non-durable write, TTL as a pin's."""
    k = SEEN_PREFIX + session
    store.hincr(k, "requests", requests)
    if float(store.hget(k, "last") or 0) < last:
        store.hset(k, "last", repr(last))
    store.expire(k, PIN_TTL)
