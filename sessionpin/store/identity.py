"""A store's identity, and what this machine remembers of it: a store that lost what it
held is not a new store (issue 18).

Rules it keeps:
- A store has an identity (``store:identity``: a random id, when it was made, and the
  identities the operator accepted it in place of), made the first time a proxy or the
  CLI uses the store and kept with the data — in a file store's database and its copy, in
  Redis as one more key — so a backup or a ``store copy`` carries it.
- Outside the store, each machine remembers which identity a store URL last had and how
  many pins it held (``Memory``: one small 0600 JSON file per store under
  ``$SESSIONPIN_STORE_MEMORY``, else the user's config dir's ``sessionpin/stores/``: not
  the state dir, where the default file store lives, so deleting the store's directory
  does not delete what was remembered of it). The file is named by a hash of the store's
  location (a file's absolute path; a Redis server, db, prefix), never its password.
- ``judge``: nothing remembered and no identity → new (made now); nothing remembered and
  an identity → first sight (taken as it is); the same identity → ok; an identity that
  accepts the remembered one (the operator ran ``store accept-loss``, or a ``store copy``
  put another in place) → taken; no identity (empty, flushed, deleted, restarted without
  its AOF) → **lost**; another identity → **replaced**. A lost or replaced store is never
  taken for new: the caller refuses until the operator decides.
- A proxy that finds its store lost says so in the store too (``store:losses``: the
  identity it expected, how much it held and how it was lost), so ``accept-loss`` run from
  any machine accepts what every proxy remembers — and every other proxy refuses too,
  whatever its machine remembers (``pending_loss``: a machine that never saw the store
  whole would otherwise take it as it is). A pin a proxy found lost is recorded there as
  well (``PARTIAL`` + session: where it was pinned, until when), and refused by every proxy
  by that record until the operator decides.
- A Redis that evicted keys since this machine last saw it whole (``evictions``: its own
  count, ``evicted_keys`` per ``run_id``, against the count remembered, or the count the
  operator settled by ``accept-loss`` or a restore, kept in the identity) lost keys nobody
  can name: it is **evicted**, a loss like the others, whatever ``durability=`` says. A
  count never seen before is taken as it is only with the store (first sight); a new
  ``run_id`` of a store this machine knows (a restart) counts from 0.
- A store rolled back to an older copy of itself keeps its identity: the store counts the
  pins made in it (``MADE_KEY``, no TTL, in the same durable ``apply`` as each creation,
  pool allocation, move and forget), the machine remembers the count it last saw, and a
  store that counts fewer under the same decision of the operator is **rolled back**
  (``rolled_back``), a loss like the others. A new decision (``accept-loss``) takes the
  count as it is.
- A remembered file that cannot be read is an error, never "nothing remembered".
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import msgspec
import platformdirs

from .base import Check, Delete, HIncr, NotDurable, Set, Store, StoreError

IDENTITY_KEY = "store:identity"
LOSSES_KEY = "store:losses"   # hash: a lost identity -> what it held; PARTIAL + session -> a lost pin
PARTIAL = "pin:"
MEMORY_ENV = "SESSIONPIN_STORE_MEMORY"
KEEP_ACCEPTED = 50          # identities an identity remembers accepting (older ones fall off)

OK, NEW, FIRST, ACCEPTED, LOST, REPLACED = "ok", "new", "first-sight", "accepted", "lost", "replaced"
EVICTED = "evicted"                 # the store is there, but Redis evicted keys nobody can name
ROLLED_BACK = "rolled-back"         # the store is there, but as an older copy of itself
LOSSES = frozenset({LOST, REPLACED, EVICTED, ROLLED_BACK})
# Pins made in this store, ever (created, moved, forgotten; a hash: "n" -> count), no TTL:
# incremented in the same durable ``apply`` as each of them, so an older copy of the store
# holds a smaller count. Not under ``store:``: ``store copy`` carries it as data (a restored
# backup holds the backup's count).
MADE_KEY = "made:pins"
MADE_FIELD = "n"
KEEP_RUN_IDS = 64                   # eviction counts remembered (a cluster's nodes, restarts)


class Identity(msgspec.Struct, frozen=True, omit_defaults=True):
    id: str
    created: float
    accepts: tuple[str, ...] = ()   # identities the operator took this one in place of
    accepted: float = 0.0           # when the operator last accepted a loss (proxies then forget
                                    # the served pins missing at that moment)
    evicted: dict[str, int] = {}    # Redis' eviction counts (run_id -> evicted_keys) the operator
                                    # settled: by ``accept-loss``, or a restore by ``store copy``


class Remembered(msgspec.Struct, frozen=True, omit_defaults=True):
    store: str                      # the store's safe URL, for the operator reading the file
    id: str
    pins: int = 0                   # live pins when last counted
    seen: float = 0.0               # when this machine last saw the store whole
    evicted: dict[str, int] = {}    # Redis' eviction counts (run_id -> evicted_keys) when last seen
                                    # whole: a count grown since is keys lost (``evictions``)
    made: int = 0                   # the store's count of pins made (``MADE_KEY``) when last seen whole
    accepted: float = 0.0           # its identity's ``accepted`` then (a new decision: counts start again)


_id_decoder = msgspec.json.Decoder(Identity)
_mem_decoder = msgspec.json.Decoder(Remembered)


def encode(obj: msgspec.Struct) -> str:
    return msgspec.json.encode(obj).decode()


def decode_identity(raw: str | None) -> Identity | None:
    """The identity a store holds; a value that is not one reads as an identity nobody
    made (``unreadable``): never as "no identity", which would make the store new."""
    if raw is None:
        return None
    try:
        return _id_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Identity(id="unreadable", created=0.0)


def judge(remembered: Remembered | None, found: Identity | None) -> str:
    if remembered is None:
        return NEW if found is None else FIRST
    if found is None:
        return LOST
    if found.id == remembered.id:
        return OK
    if remembered.id in found.accepts:
        return ACCEPTED
    return REPLACED


def describe_loss(url: str, kind: str, remembered: Remembered, found: Identity | None) -> str:
    """What was lost, for the refusal, the log and the CLI (ids and counts only)."""
    held = f"{remembered.pins} pin{'s' if remembered.pins != 1 else ''}"
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(remembered.seen)) if remembered.seen else "?"
    now = ("answers empty, without its identity" if kind == LOST
           else f"answers with another identity ({found.id if found else '?'})")
    return (f"store {url} lost what it held: it {now}, but when last seen whole ({when}) it was store "
            f"{remembered.id} holding {held}. sessionpin does not take it for a new store: every routed request "
            f"is refused until you restore it (`sessionpin store copy BACKUP {url}`) or start over "
            f"(`sessionpin store accept-loss --store {url}`)")


def evictions(remembered: Mapping[str, int], settled: Mapping[str, int], now: Mapping[str, int] | None,
              ) -> tuple[int, dict[str, int]]:
    """(keys Redis evicted since this machine last saw the store whole, the counts to
    remember now). ``remembered``: the counts this machine saw (empty: it never saw any —
    the counts are taken as they are); ``settled``: the counts the operator settled (the
    identity's ``evicted``); ``now``: the server's (None: nobody can tell, nothing changes).

    Per ``run_id``: the count it is measured from is the remembered one (0 for a run_id
    this machine never saw, when it saw others: the server restarted after it last looked,
    so all it evicted since is after), raised to the settled one when that is not above the
    count now (a higher settled count is of before a ``CONFIG RESETSTAT``). A count not
    above it is remembered as it is (a reset counter too); a count above it is not: the
    keys stay lost until the operator settles them. A run_id not in ``now`` keeps its
    count (a cluster node that did not answer this time); at most ``KEEP_RUN_IDS``."""
    if now is None:
        return 0, dict(remembered)
    if not remembered:
        return 0, dict(now)
    # a node not in this reading (down for now, or a server since restarted) keeps its count
    grown, keep = 0, {k: v for k, v in remembered.items() if k not in now}
    for run_id, n in now.items():
        base = remembered.get(run_id, 0)
        s = settled.get(run_id)
        if s is not None and base < s <= n:
            base = s
        if n > base:
            grown += n - base
            keep[run_id] = base
        else:
            keep[run_id] = n
    return grown, dict(list(keep.items())[-KEEP_RUN_IDS:])


def describe_evictions(url: str, grown: int, since: float) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if since else "this machine last saw it"
    return (f"store {url} may have lost pins: Redis evicted {grown} key{'s' if grown != 1 else ''} since {when} "
            "(when this machine last saw it whole) and cannot say which; a pin it evicted would read as a "
            "conversation never seen begin. sessionpin does not guess: every routed request is refused until you "
            f"restore it (`sessionpin store copy BACKUP {url}`) or start over (`sessionpin store accept-loss --store "
            f"{url}`); set maxmemory-policy noeviction in the server's configuration file")


def judge_evictions(url: str, kind: str, remembered: Remembered | None, found: Identity | None,
                    now: Mapping[str, int] | None, since: float = 0.0) -> tuple[int, dict[str, int], str]:
    """``evictions`` for a store judged ``kind`` (not a loss): (keys evicted, the counts to
    remember, the message if any were). A store new or first seen takes its counts as
    they are."""
    known = remembered.evicted if remembered is not None and kind not in (NEW, FIRST) else {}
    settled = found.evicted if found is not None else {}
    grown, keep = evictions(known, settled, now)
    since = since or (remembered.seen if remembered is not None else 0.0)
    return grown, keep, describe_evictions(url, grown, since) if grown else ""


def made_writes() -> list:
    """The write that counts one pin made, for the ``apply`` that makes it (durable)."""
    return [HIncr(MADE_KEY, MADE_FIELD, 1)]


async def made(store: Store) -> int:
    """The store's count of pins made (0: none counted; a value that is not a count reads as
    0: a store rolled back, if this machine saw more)."""
    raw = await store.hget(MADE_KEY, MADE_FIELD)
    try:
        return int(raw) if raw is not None else 0
    except ValueError:
        return 0


def rolled_back(remembered: Remembered | None, kind: str, found: Identity | None, now: int) -> bool:
    """A store that answers with the identity this machine remembers, under the same
    decision of the operator, but has counted fewer pins made than this machine saw, is an
    older copy of itself (a directory restored from a backup, a Redis restarted on an older
    snapshot): the pins made since read as never made."""
    return (remembered is not None and kind == OK and found is not None
            and found.accepted == remembered.accepted and now < remembered.made)


def describe_rollback(url: str, remembered: Remembered, now: int) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(remembered.seen)) if remembered.seen else "?"
    return (f"store {url} was rolled back: it is store {remembered.id} as it was when {now} pins had been made in it "
            f"(or its count, `{MADE_KEY}`, was deleted), but when this machine last saw it whole ({when}) "
            f"{remembered.made} had been; the pins made since read "
            "as conversations never seen begin. sessionpin does not guess: every routed request is refused until "
            f"you restore a copy at least that recent (`sessionpin store copy BACKUP {url}`) or start over "
            f"(`sessionpin store accept-loss --store {url}`)")


# ---- what a machine remembers ------------------------------------------------------------

def memory_dir(env: Mapping[str, str] | None = None) -> Path:
    given = (env or {}).get(MEMORY_ENV) or os.environ.get(MEMORY_ENV)    # the caller's, else the process's
    return Path(given).expanduser() if given else Path(platformdirs.user_config_dir("sessionpin")) / "stores"


def location(url: str) -> str | None:
    """Where a store URL's data is, without its password or options that do not change it
    (None: ``memory:``, which nobody can lose across processes)."""
    scheme, _, rest = url.partition(":")
    scheme = scheme.lower()
    if scheme == "memory":
        return None
    if scheme == "file":
        path = rest[2:] if rest.startswith("//") else rest
        return "file:" + str(Path(path).expanduser().absolute())
    from .redisurl import parse

    c = parse(url)
    where = c.path if c.path else f"{c.host}:{c.port}"
    return f"redis:{where}/{c.db}/{c.prefix}{'/cluster' if c.cluster else ''}"


class Memory:
    """The remembered identity of one store URL (a small file, written whole by rename)."""

    def __init__(self, url: str, env: Mapping[str, str] | None = None) -> None:
        where = location(url)
        self.path = None if where is None else memory_dir(env) / (
            hashlib.sha256(where.encode()).hexdigest()[:32] + ".json")

    def load(self) -> Remembered | None:
        if self.path is None:
            return None
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read what this machine remembers of the store ({self.path}): "
                             f"{e.strerror or e}") from None
        try:
            return _mem_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise StoreError(f"what this machine remembers of the store ({self.path}) is unreadable ({e}); "
                             "move it away only if you know the store is whole") from None

    def save(self, r: Remembered) -> None:
        """Write ``r``; a writer that does not count pins made (``made`` 0: the CLI) leaves the
        count remembered of that identity as it was."""
        if self.path is None:
            return
        if r.made == 0:
            try:
                old = self.load()
            except StoreError:
                old = None
            if old is not None and old.id == r.id and old.made:
                r = msgspec.structs.replace(r, made=old.made, accepted=old.accepted)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, msgspec.json.encode(r) + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)


REMEMBERED_LIVE = 30 * 86_400.0     # a store seen whole this recently may still hold live pins (their TTL)


def others(memory: Memory, now: float) -> list[Remembered]:
    """The other stores this machine remembers holding live pins when last seen whole, within
    a pin's life (most pins first): when a proxy makes a new store's identity, its
    conversations may be pinned in one of these — a wrong database, prefix or path, an
    environment without ``SESSIONPIN_STORE`` — and would be read here as never pinned.
    Unreadable files are skipped (this only informs)."""
    if memory.path is None:
        return []
    found = []
    try:
        paths = sorted(memory.path.parent.glob("*.json"))
    except OSError:
        return []
    for path in paths:
        if path == memory.path:
            continue
        try:
            r = _mem_decoder.decode(path.read_bytes())
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue
        if r.pins > 0 and now - r.seen < REMEMBERED_LIVE:
            found.append(r)
    return sorted(found, key=lambda r: (-r.pins, r.store))


# ---- what a store holds ------------------------------------------------------------------

@dataclass(frozen=True)
class Settled:
    kind: str                       # OK, NEW, FIRST, ACCEPTED, LOST, REPLACED
    identity: Identity | None       # what the store holds now
    raw: str | None                 # its text (a change of it is the operator's decision)
    message: str = ""               # for LOST and REPLACED


async def read(store: Store) -> tuple[Identity | None, str | None]:
    raw = await store.get(IDENTITY_KEY)
    return decode_identity(raw), raw


async def _write(store: Store, checks: list, writes: list) -> bool:
    """Durable where the store can be; a store that cannot (a Redis without fsync) gets the
    identity anyway: it is what lets a later loss be seen."""
    try:
        return await store.apply(checks, writes, durable=True)
    except NotDurable as e:
        if getattr(e, "applied", False):
            return True
        return await store.apply(checks, writes)


async def settle(store: Store, url: str, remembered: Remembered | None, now: float,
                 recorded: Mapping[str, str] | None = None, make: bool = True) -> Settled:
    """Read the store's identity and judge it against what was remembered; a new store gets
    its identity now (the first of two racing makers wins; the other takes it) — unless a
    loss is ``recorded`` in it (its ``store:losses`` as read): nothing is made over that —
    or ``make`` is False (a command that only reads: ``Settled(NEW, None, None)``)."""
    found, raw = await read(store)
    kind = judge(remembered, found)
    if kind == NEW and (not make or (recorded and pending_loss(recorded, None) is not None)):
        return Settled(NEW, None, None)
    if kind == NEW:
        made = Identity(id=uuid.uuid4().hex, created=now)
        text = encode(made)
        if await _write(store, [Check(IDENTITY_KEY, None)], [Set(IDENTITY_KEY, text)]):
            found, raw = made, text
        else:
            found, raw = await read(store)
            kind = judge(None, found)
    message = describe_loss(url, kind, remembered, found) if kind in LOSSES and remembered else ""
    return Settled(kind, found, raw, message)


async def record_loss(store: Store, remembered: Remembered | None, who: str, now: float, kind: str | None = None,
                      found: Identity | None = None) -> None:
    """Say in the store which identity was expected (``accept-loss`` accepts it), and how it
    was lost (``kind``; with the ``accepted`` time of the identity ``found``, for an
    eviction): every other proxy and machine then refuses too (``pending_loss``). Nothing
    is said by a machine that remembers nothing (it found the loss in the store itself)."""
    if remembered is None:
        return
    said: dict = {"store": remembered.store, "pins": remembered.pins, "seen": remembered.seen, "by": who, "at": now}
    if kind is not None:
        said["kind"] = kind
    if kind == ROLLED_BACK:
        said["made"] = remembered.made
    if found is not None:
        said["accepted"] = found.accepted
    await store.hsetnx(LOSSES_KEY, remembered.id, msgspec.json.encode(said).decode())


async def losses(store: Store) -> dict[str, str]:
    return await store.hgetall(LOSSES_KEY)


def _record(raw: str) -> dict:
    try:
        got = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return {}
    return got if isinstance(got, dict) else {}


def pending_loss(said: Mapping[str, str], found: Identity | None, made_now: int | None = None
                 ) -> tuple[str, dict] | None:
    """A loss a proxy (or the CLI) recorded in the store (``store:losses``) that still waits
    for the operator: (the identity it expected, its record), else None. Whatever this
    machine remembers — it may never have seen the store whole — such a store is lost:
    ``accept-loss`` clears the records, a restore (``store copy``) the one it brings back.

    Not pending: an identity the store's now accepts (the operator decided); and a store
    that answers with the very identity recorded lost or replaced (its data came back). A
    store evicted or rolled back keeps its identity, so such a record stays pending — unless
    it was made before the operator's last decision (its ``accepted`` is not the store's
    now), or, rolled back, the store counts again as many pins made as the record says
    were (``made_now``: a newer copy was restored). A
    record that does not say how (an older one, unreadable) stays pending: nobody can
    tell."""
    for key in sorted(said):
        if key.startswith(PARTIAL):
            continue
        rec = _record(said[key])
        if found is not None:
            if key in found.accepts:
                continue
            if key == found.id:
                kind = rec.get("kind")
                if kind in (LOST, REPLACED):
                    continue
                if kind in (EVICTED, ROLLED_BACK) and rec.get("accepted") is not None \
                        and rec.get("accepted") != found.accepted:
                    continue
                if kind == ROLLED_BACK and made_now is not None and isinstance(rec.get("made"), int) \
                        and made_now >= rec["made"]:
                    continue
        return key, rec
    return None


def _when(t: object) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if isinstance(t, (int, float)) and t else "?"


def describe_recorded(url: str, key: str, rec: Mapping) -> str:
    """The refusal for a loss found recorded in the store (``pending_loss``)."""
    pins_held = rec.get("pins")
    held = f" holding {pins_held} pin{'s' if pins_held != 1 else ''}" if isinstance(pins_held, int) else ""
    kind = rec.get("kind")
    what = {EVICTED: f"Redis evicted keys of store {key}{held} and cannot say which",
            LOST: f"it answered empty, without its identity, when it had been store {key}{held}",
            REPLACED: f"it answered with another identity, when it had been store {key}{held}",
            ROLLED_BACK: f"it was rolled back to an older copy of store {key} ({rec.get('made', '?')} pins had been "
                         "made in it)",
            }.get(kind, f"it was store {key}{held} when last seen whole")
    return (f"store {url} lost what it held, as {rec.get('by') or 'a proxy'} recorded in it at {_when(rec.get('at'))}: "
            f"{what}. sessionpin does not take it for a new store: every routed request is refused until you "
            f"restore it (`sessionpin store copy BACKUP {url}`) or start over (`sessionpin store accept-loss "
            f"--store {url}`)")


class PartialLoss(msgspec.Struct, frozen=True, omit_defaults=True):
    """A pin a proxy found lost, as it recorded it in the store (``store:losses``,
    ``PARTIAL + session``)."""
    server: str | None = None       # where it was pinned (None: not routed)
    agent: str = ""                 # whose session id it is ("": not said)
    expires: float = 0.0            # when the pin would have expired (0: not said)
    by: str = ""
    at: float = 0.0                 # when it was recorded (0: not said)


async def record_partial(store: Store, session: str, lost: PartialLoss) -> None:
    """A proxy says the store lost a pin (``accept-loss`` counts them; every other proxy
    refuses the session by it, ``partial_loss``)."""
    await store.hsetnx(LOSSES_KEY, PARTIAL + session, encode(lost))


def decode_partial(raw: str | None) -> PartialLoss | None:
    """A recorded lost pin; an older record (``server (by who at time)``, text) says only
    where it was pinned."""
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=PartialLoss)
    except (msgspec.DecodeError, msgspec.ValidationError):
        server = raw.split(" (by ", 1)[0].strip()
        return PartialLoss(server=None if server in ("", "not routed") else server)


async def partial_loss(store: Store, session: str) -> PartialLoss | None:
    return decode_partial(await store.hget(LOSSES_KEY, PARTIAL + session))


async def accept_loss(store: Store, remembered: Remembered | None, now: float,
                      evicted: Mapping[str, int] | None = None) -> tuple[Identity, list[str], int]:
    """The operator starts over: the store keeps (or gets) an identity that accepts every
    identity a proxy said it lost and the one this machine remembers, and a new
    ``accepted`` time (its text changes: proxies forget the pins they served). Returns it,
    the identities accepted now, and how many lost pins proxies had reported. ``evicted``:
    Redis' eviction counts read before (the keys it evicted until then are accepted)."""
    for _ in range(3):
        found, raw = await read(store)
        said = await losses(store)
        partial = sum(1 for k in said if k.startswith(PARTIAL))
        lost = {k for k in said if not k.startswith(PARTIAL)}
        if remembered is not None:
            lost.add(remembered.id)
        base = found or Identity(id=uuid.uuid4().hex, created=now)
        lost.discard(base.id)
        accepts = [a for a in base.accepts if a not in lost] + sorted(lost)
        new = msgspec.structs.replace(base, accepts=tuple(accepts[-KEEP_ACCEPTED:]), accepted=now)
        if evicted is not None:
            new = msgspec.structs.replace(new, evicted=dict(evicted))
        if await _write(store, [Check(IDENTITY_KEY, raw)], [Set(IDENTITY_KEY, encode(new)), Delete(LOSSES_KEY)]):
            return new, sorted(lost), partial
    raise StoreError(f"{store.url}: its identity changed three times while it was being accepted; run it again")


async def carry(dst: Store, src_identity: Identity | None) -> Identity | None:
    """After a ``store copy``: the destination takes the source's identity (a restore brings
    back the store the proxies remember), accepting the one it had (its keys are still
    there: nothing of it was lost). Returns the destination's identity."""
    if src_identity is None:
        return (await read(dst))[0]
    for _ in range(3):
        found, raw = await read(dst)
        if found is not None and found.id == src_identity.id:
            return found
        accepts = list(src_identity.accepts)
        if found is not None:
            accepts += [a for a in (found.id, *found.accepts) if a not in accepts and a != src_identity.id]
        # ``accepted`` stays the source's: a restore accepts no loss (pins made after the
        # backup are still refused by the proxies that served them, until accept-loss)
        new = msgspec.structs.replace(src_identity, accepts=tuple(accepts[-KEEP_ACCEPTED:]))
        if await _write(dst, [Check(IDENTITY_KEY, raw)], [Set(IDENTITY_KEY, encode(new))]):
            await dst.hdel(LOSSES_KEY, src_identity.id)    # it is back
            return new
    raise StoreError(f"{dst.url}: its identity changed three times during the copy; run it again")


async def settle_evictions(store: Store, evicted: Mapping[str, int] | None) -> None:
    """After a restore by ``store copy``: the keys Redis evicted until the copy began are
    back (as far as the backup had them); its counts then are settled in the identity
    (``accepted`` stays: a restore accepts no loss)."""
    if evicted is None:
        return
    for _ in range(3):
        found, raw = await read(store)
        if found is None:
            return
        new = msgspec.structs.replace(found, evicted=dict(evicted))
        if await _write(store, [Check(IDENTITY_KEY, raw)], [Set(IDENTITY_KEY, encode(new))]):
            await store.hdel(LOSSES_KEY, found.id)       # what was evicted is back
            return
    raise StoreError(f"{store.url}: its identity changed three times during the copy; run it again")
