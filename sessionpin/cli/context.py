"""Where the config and the store are, and the store's pins as the commands read them.

Rules it keeps:
- A command opens the store only when it needs it, and a file store that does not exist
  yet is not created by a read command (``store(create=False)`` is None). A store that
  is not a file (Redis) always "exists": whether it answers is the store's to say — but a
  read command does not make its identity either: one that holds none and no pin index,
  that this machine never used and no proxy recorded lost, is ``unused`` (nothing
  sessionpin made is there: a wrong database or prefix, or no proxy yet), and the commands
  say so, as "no file yet" for a file — not "no pinned conversations" over a store that was
  never the proxies'.
- The store URL is shown only as ``store_shown`` (a password as ``***``), in every line
  and every error a command prints.
- The store is the async ``Store`` every part uses; the CLI runs it on one event loop
  it owns for the command's life (``run``), and closes both at the end.
- A store the command opens is judged by its identity against what this machine remembers
  of it (``store.identity``): a new one is remembered, one that lost what it held fails
  the command with what was lost and what to run — except for the commands that show it
  or decide about it (``lost_ok``: status, doctor, store; and use, which changes only the
  config and then says the loss). On Redis, keys it evicted since this machine last saw the
  store whole (its ``evicted_keys``) are such a loss too.
- Every store change a command makes is compare-and-set against the pin it showed the
  operator (``pins.move``/``pins.forget`` with what ``resolve`` read): a pin that changed
  meanwhile is not overwritten — the command says so.
- A pin the store lost is not "no pin" here either (``lost_pins``): one whose index entry
  outlives it, or that a proxy recorded lost (``store:losses``), not expired and not
  forgotten since — exactly what the proxies refuse — is found by ``resolve`` (a ``Row``
  with ``lost`` set, its pin as the index or record says it was), so ``move`` puts that
  conversation back and ``forget`` lets it be decided afresh, one at a time; ``sessions``
  lists them.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, TypeVar

from ..config import config as configmod
from ..records import pins
from ..reader.ids import matches, short, typed
from ..store import Store, StoreError, default_store_url, open_store, safe_url
from ..store import identity
from .common import HOUR, NOT_SEEN_BEGIN, Fail, iso, plural, where, why

T = TypeVar("T")


@dataclass
class Ctx:
    config_path: Path
    store_url: str
    _store: Store | None = None
    lost_ok: bool = False                        # the command shows or decides a loss: do not fail on one
    unused: bool = False                         # a store with no identity this machine never used (not made)
    settled: identity.Settled | None = None      # the store's identity, judged when it was opened
    _runner: asyncio.Runner | None = field(default=None, repr=False)

    # config
    def config(self) -> configmod.Config:
        try:
            return configmod.load(self.config_path)
        except configmod.ConfigError as e:
            raise Fail(f"{e}; fix {self.config_path} first (`sessionpin doctor` checks it)") from None

    def config_text(self) -> str:
        """The text an edit starts from, read as the proxy reads it (``read_trusted``: a FIFO,
        a directory or a file of another size than a config's is refused, not waited on)."""
        try:
            raw = configmod.read_trusted(self.config_path)
            return raw.decode("utf-8") if raw is not None else ""
        except configmod.ConfigError as e:
            raise Fail(f"{e}; fix {self.config_path} first (`sessionpin doctor` checks it)") from None
        except UnicodeDecodeError as e:
            raise Fail(f"cannot read {self.config_path}: not UTF-8 text ({e.reason})") from None
        except OSError as e:
            raise Fail(f"cannot read {self.config_path}: {e.strerror or e}") from None

    # the store
    def run(self, coro: Awaitable[T]) -> T:
        if self._runner is None:
            self._runner = asyncio.Runner()
        return self._runner.run(coro)

    @property
    def store_shown(self) -> str:
        """The store URL as it may be printed (a password as ``***``)."""
        return safe_url(self.store_url)

    def opened_store_url(self) -> str | None:
        """The open store's own (safe) URL, if a store was opened."""
        return self._store.url if self._store is not None else None

    def store_file(self) -> Path | None:
        return store_file(self.store_url)

    def store_exists(self) -> bool:
        """A file store exists if its database does, or its copy alone (the store then
        rebuilds the database from it when opened)."""
        f = self.store_file()
        return f is None or f.exists() or f.with_name(f.name + ".copy").exists()

    def store(self, create: bool = False) -> Store | None:
        """The store; None when it is a file that does not exist yet and ``create`` is False."""
        if self._store is not None:
            return self._store
        if not create and not self.store_exists():
            self._gone()
            return None
        try:
            # a file store's pages are checked on its thread while the command reads
            # (quick_check of a 1M-pin store takes seconds); ``settle`` waits for the verdict
            options = {} if self.store_file() is None else {"check_at_open": False}
            self._store = open_store(self.store_url, **options)
            self._make = create
        except StoreError as e:
            raise Fail(f"cannot open the store {self.store_shown}: {e}; check --store or SESSIONPIN_STORE") from None
        except OSError as e:
            raise Fail(f"cannot open the store {self.store_shown}: {e.strerror or e}; "
                       "check --store or SESSIONPIN_STORE") from None
        self._judge(self._store)
        return self._store

    def _gone(self) -> None:
        """A file store with no file: new — unless this machine remembers it (its files were
        deleted: a loss, not a store that was never made)."""
        try:
            remembered = identity.Memory(self.store_url).load()
        except StoreError as e:
            raise Fail(str(e)) from None
        if remembered is None:
            return
        message = identity.describe_loss(self.store_shown, identity.LOST, remembered, None)
        self.settled = identity.Settled(identity.LOST, None, None, message)
        if not self.lost_ok:
            raise Fail(message)

    def _judge(self, store: Store) -> None:
        memory = identity.Memory(self.store_url)
        try:
            remembered = memory.load()
        except StoreError as e:
            raise Fail(str(e)) from None
        now = time.time()
        try:
            # what proxies (or another CLI) recorded lost, read first: nothing is made over it
            said = self.run(identity.losses(store))
            s = self.settled = self.run(identity.settle(store, store.url, remembered, now, said,
                                                        make=getattr(self, "_make", True)))
        except StoreError:
            if self.lost_ok:
                return                  # status and doctor show the fault themselves
            raise
        if s.kind in identity.LOSSES:
            self._lost(store, remembered, s, now)
            return
        if s.identity is None and identity.pending_loss(said, None) is None:
            if not self.run(store.hgetall(pins.INDEX_NAMES)):
                self.unused = True      # read, not made: nothing sessionpin made is there (yet)
                return
            # pins with no identity (an older release made them): made now, as before
            s = self.settled = self.run(identity.settle(store, store.url, remembered, now, said))
        try:
            made = self.run(identity.made(store))
        except StoreError:
            if not self.lost_ok:
                raise
            made = None
        if made is not None and identity.rolled_back(remembered, s.kind, s.identity, made):  # an older copy
            self.settled = identity.Settled(identity.ROLLED_BACK, s.identity, s.raw,
                                            identity.describe_rollback(store.url, remembered, made))
            self._lost(store, remembered, self.settled, now)
            return
        pending = identity.pending_loss(said, s.identity, made)
        if pending is not None:         # a loss a proxy on any machine recorded, still waiting
            kind = pending[1].get("kind")
            self.settled = identity.Settled(kind if kind in identity.LOSSES else identity.LOST, s.identity, s.raw,
                                            identity.describe_recorded(store.url, *pending))
            self._lost(store, remembered, self.settled, now, recorded=True)
            return
        evicted = remembered.evicted if remembered is not None else {}
        if hasattr(store, "evictions"):     # Redis: did it evict keys since this machine last looked?
            try:
                counts = self.run(store.evictions())
            except StoreError:
                if not self.lost_ok:
                    raise
                counts = None
            grown, evicted, message = identity.judge_evictions(store.url, s.kind, remembered, s.identity, counts)
            if grown:
                self.settled = identity.Settled(identity.EVICTED, s.identity, s.raw, message)
                self._lost(store, remembered, self.settled, now)
                return
        try:
            n = sum(c[0] for c in self.run(pins.counts(store, now)).values())
            memory.save(identity.Remembered(store.url, s.identity.id, n, now, evicted))
        except (StoreError, OSError):
            pass                        # remembering is best effort here; the proxy remembers too

    def _lost(self, store: Store, remembered, s, now: float, recorded: bool = False) -> None:
        """A loss the CLI found: recorded in the store for every proxy (best effort), then the
        command stops with its message (status and doctor, ``lost_ok``, show it themselves)."""
        if not recorded:
            try:
                self.run(identity.record_loss(store, remembered, f"the CLI (pid {os.getpid()})", now, s.kind,
                                              s.identity))
            except StoreError:
                pass
        if not self.lost_ok:
            raise Fail(s.message)

    def settle(self, code: int) -> int:
        """``code``, once the store's pages were found whole; a Fail naming the damage if
        its check (run while the command read, ``check_at_open``) found them damaged."""
        verdict = getattr(getattr(self._store, "backend", None), "verdict", None)
        if verdict is None:
            return code
        found = self.run(asyncio.to_thread(verdict))
        if found is not None:
            raise Fail(f"the store {self.store_shown} was found damaged while this command read it ({found}); "
                       "what it printed may be incomplete; the store rebuilds the damaged file from its "
                       "copy: run the command again (`sessionpin doctor` shows the repair)")
        return code

    def need_store(self) -> Store:
        s = self.store()
        if s is None:
            raise Fail(f"no store at {self.store_file()} yet: no proxy has pinned a conversation with it; "
                       "check --store or SESSIONPIN_STORE (a proxy started with `sessionpin run` creates it)")
        return s

    def close(self) -> None:
        try:
            if self._store is not None:
                self.run(self._store.close())
                self._store = None
        finally:
            if self._runner is not None:
                self._runner.close()
                self._runner = None

    # pins
    def rows(self) -> list["Row"]:
        store = self.store()
        return [] if store is None else self.run(_rows(store))

    def groups(self, agent: str | None = None, server: str | None = None, *, any_server: bool = True) -> list[str]:
        """The pin index's groups of that agent and server (``pins.groups``)."""
        store = self.store()
        return [] if store is None else self.run(pins.groups(store, agent, server, any_server=any_server))

    def indexed(self, names: list[str]) -> int:
        """How many live pins those index groups hold (``pins.indexed``: no walk)."""
        store = self.store()
        return 0 if store is None or not names else self.run(pins.indexed(store, time.time(), names))

    def listing(self, names: list[str], batch: int = 1000) -> Iterator[list["Row"]]:
        """The pins of those index groups as rows, a batch at a time, most recently renewed
        first (``pins.listing``): memory for one batch, whatever the store holds."""
        store = self.store()
        if store is None or not names:
            return
        walk = pins.listing(store, time.time(), names, batch)
        try:
            while True:
                try:
                    found = self.run(walk.__anext__())
                except StopAsyncIteration:
                    return
                yield [Row(session, loaded, seen) for session, loaded, seen in found]
        finally:
            self.run(walk.aclose())

    def counts(self, active_window: float = HOUR) -> dict[tuple[str, str | None], tuple[int, int]]:
        """Live pins and active ones per (agent, server), from the store's index (no walk)."""
        store = self.store()
        if store is None:
            return {}
        now = time.time()
        return self.run(pins.counts(store, now, now - active_window))


def make_ctx(config: str | None, store: str | None) -> Ctx:
    cfg = config or os.environ.get("SESSIONPIN_CONFIG") or str(configmod.default_path())
    url = store or os.environ.get("SESSIONPIN_STORE") or default_store_url()
    return Ctx(Path(cfg).expanduser(), url)


def store_file(url: str) -> Path | None:
    scheme, sep, rest = url.partition(":")
    if scheme.lower() != "file" or not sep:
        return None
    path = rest[2:] if rest.startswith("//") else rest
    return Path(path).expanduser().absolute() if path else None


@dataclass(frozen=True)
class Row:
    session: str
    loaded: pins.Loaded
    seen: pins.Seen
    lost: str = ""              # the store lost this pin: how it is known ("" : it is there)

    @property
    def pin(self) -> pins.Pin:
        assert self.loaded.pin is not None
        return self.loaded.pin

    def as_json(self) -> dict[str, Any]:
        return {
            "session": self.session, "short": short(self.session), "agent": self.pin.agent,
            "server": self.pin.server, "pinned_since": iso(self.pin.since), "last_seen": iso(self.seen.last),
            "requests": self.seen.requests, "rule": self.pin.rule or None, "why": why(self.pin),
            "turn": self.pin.turn or None, "parent": self.pin.parent or None,
            "since_epoch": self.pin.since, "last_seen_epoch": self.seen.last or None,
        }


async def _rows(store: Store, keep: Callable[[str], bool] | None = None) -> list[Row]:
    """Every pin as a row, most recently seen first; ``keep``: only the sessions it keeps
    (chosen by id before anything else is read)."""
    out = []
    names = await store.keys(pins.PIN_PREFIX)
    if keep is not None:
        names = [k for k in names if keep(k[len(pins.PIN_PREFIX):])]
    for i in range(0, len(names), 500):
        chunk = names[i:i + 500]
        sessions = [k[len(pins.PIN_PREFIX):] for k in chunk]
        # the activity records of the chunk in one call (one at a time was 92 s at 1M pins)
        records = await store.hgetall_many([pins.SEEN_PREFIX + session for session in sessions])
        for session, raw, h in zip(sessions, await store.mget(chunk), records):
            pin = pins.decode(raw)
            if pin is not None:
                out.append(Row(session, pins.Loaded(pin, raw), pins.seen_of(h)))
    out.sort(key=lambda r: (-(r.seen.last or r.pin.since), r.session))
    return out


async def lost_pins(store: Store, now: float, names: list[str] | None = None,
                    keep: Callable[[str], bool] | None = None) -> list[Row]:
    """The pins the store lost that proxies refuse (docs/store.md, "Partial loss"), as rows
    whose pin is what was known of it (``lost`` says how): a live entry of the index groups
    ``names`` (None: every group) whose pin is gone, and a pin a proxy recorded lost whose
    group is among them, of its agent, not expired, with no ``forget`` made after the record
    and no pin now (``keep``: only the sessions it keeps, chosen by id before a pin is read).
    A walk of those groups: for the CLI, never the proxy."""
    every = sorted(await store.hgetall(pins.INDEX_NAMES))
    names = every if names is None else names
    found: dict[str, Row] = {}
    for session, agent, server, expires in await pins.lost(store, now, names, keep=keep):
        found.setdefault(session, _lost_row(session, agent, server, expires, "its pin index still holds it"))
    for row in await recorded_lost(store, now, None if names is every else set(names), keep, found):
        found[row.session] = row
    return sorted(found.values(), key=lambda r: (-r.pin.renewed, r.session))


async def recorded_lost(store: Store, now: float, wanted: set[str] | None = None,
                        keep: Callable[[str], bool] | None = None, known: Any = ()) -> list[Row]:
    """The lost pins proxies recorded in the store (``store:losses``) that still stand — what
    every proxy refuses by the record — of the index groups ``wanted`` (None: any), not in
    ``known``. One read of the records, and one ``mget`` per 500 of them: cheap enough for
    ``doctor`` and ``status``."""
    standing: list[tuple[str, identity.PartialLoss]] = []
    for field_name, raw in (await identity.losses(store)).items():
        if not field_name.startswith(identity.PARTIAL):
            continue
        session = field_name[len(identity.PARTIAL):]
        if keep is not None and not keep(session):
            continue
        rec = identity.decode_partial(raw)
        if session in known or rec is None or not rec.agent or (rec.expires and rec.expires <= now):
            continue
        if wanted is not None and pins.group(rec.agent, rec.server) not in wanted:
            continue
        standing.append((session, rec))
    found: list[Row] = []
    for i in range(0, len(standing), 500):          # the pins and tombstones a batch at a time
        batch = standing[i:i + 500]
        got = await store.mget([pins.key(s) for s, _ in batch] + [pins.FORGOT_PREFIX + s for s, _ in batch])
        for (session, rec), pin, tomb in zip(batch, got[:len(batch)], got[len(batch):]):
            if pin is not None:
                continue                    # it is there (put back, or made anew)
            if pins.forgot_after(tomb, 0.0, rec.expires, rec.at):
                continue                    # forgotten since (as the proxies read it)
            found.append(_lost_row(session, rec.agent, rec.server, rec.expires or now + pins.PIN_TTL,
                                   f"{rec.by or 'a proxy'} recorded it lost"))
    return found


def _lost_row(session: str, agent: str, server: str | None, expires: float, how: str) -> Row:
    pin = pins.Pin(agent=agent, server=server, since=0.0, renewed=expires - pins.PIN_TTL, rule="lost")
    return Row(session, pins.Loaded(pin, None), pins.Seen(), how)


def resolve(ctx: Ctx, given: str) -> Row:
    """A pinned conversation by its id, a unique prefix of it, or the short form shown —
    or one whose pin the store lost (``lost_pins``: the proxies refuse it; the operator
    decides it here)."""
    given = typed(given)
    if not given:
        raise Fail("give a session id, or its first characters (see `sessionpin sessions`)")
    store = ctx.store()
    if store is not None:
        # a whole id: one read, not a walk of every pin
        loaded = ctx.run(pins.load(store, given))
        if loaded.pin is not None:
            return Row(given, loaded, ctx.run(pins.seen(store, given)))
    # a prefix: the ids are matched first, and only the matching pins read (at a million
    # pins, reading every pin and its activity took minutes)
    rows = [] if store is None else ctx.run(_rows(store, lambda session: matches(session, given)))
    exact = [r for r in rows if r.session == given]
    if exact:
        return exact[0]
    candidates = [r for r in rows if matches(r.session, given)]
    if not candidates and store is not None:
        # not pinned: perhaps lost (a walk of the index, only when nothing pinned matched)
        candidates = ctx.run(lost_pins(store, time.time(), keep=lambda session: matches(session, given)))
        exact = [r for r in candidates if r.session == given]
        if exact:
            return exact[0]
    if not candidates:
        raise Fail(f"no pinned conversation matches {given!r}; list them with `sessionpin sessions`")
    if len(candidates) > 1:
        shown = ", ".join(f"{r.session} ({r.pin.agent}, {where(r.pin.server)})" for r in candidates[:6])
        more = f" and {len(candidates) - 6} more" if len(candidates) > 6 else ""
        raise Fail(f"{given!r} matches {len(candidates)} conversations: {shown}{more}; give more characters")
    return candidates[0]


def describe_running(ctx: Ctx, agent: str) -> str:
    counts = {server: n for (a, server), n in ctx.counts().items() if a == agent and n[0]}
    if ctx.settled is not None and ctx.settled.message:     # (`use` changes the config all the same)
        return f"But: {ctx.settled.message}."
    if not counts:
        return (f"No running {agent} conversation is pinned. One the proxy has not seen yet stays where "
                f"it is: {NOT_SEEN_BEGIN}.")
    order = sorted(counts, key=lambda s: (s is None, -counts[s][0], s or ""))
    parts = ", ".join(f"{counts[s][0]} on {s}" if s is not None else f"{counts[s][0]} not routed" for s in order)
    n = sum(c[0] for c in counts.values())
    active = sum(c[1] for c in counts.values())
    verb = "stays where it is" if n == 1 else "stay where they are"
    return (f"{plural(n, 'running conversation')} {verb}: {parts}.\n"
            f"  (running = {agent} conversations with a pin, i.e. seen by the proxy in the last 29 to 30 days; "
            f"{active} active in the last hour. One it has not seen yet stays where it is too: {NOT_SEEN_BEGIN}.)")
