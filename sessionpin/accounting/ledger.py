"""The ledger: what each conversation's turns cost, how much of each was read from cache, and
why a turn missed.

A *turn* here is one answered inference request (a main turn, a subagent's, a side request):
its tokens as the server reported them (``usage.Usage``), where it went, and how it compares
with the request before it in the same *lane* — the requests of one conversation that share a
prompt prefix (the main turns; one subagent; one kind of side request). docs/ledger.md says
what each figure means.

Rules it keeps:
- **Limit**: what a turn could have read from cache is the part of the previous request's
  prompt (of its lane) that this one repeats from the start: the previous prompt's tokens
  times the share of its bytes repeated (``promptshape.compare``); none after a model change
  or a move to another server (a cache belongs to one model on one server). A first turn
  has no limit.
- **Miss**: a turn whose cache read is below ``MISS_SHARE`` (0.8) of the previous prompt's
  tokens: it read more than 20 % less than the conversation had cached. Every miss gets a
  reason: the provider's own (Anthropic ``cache_miss_reason``, Responses
  ``prompt_cache_diagnostics``) when it sent one that names a change, else the proxy's, in
  this order: the server changed (an operator's move or a pool; first, as a move renames the
  model too), the model changed, the tools changed, the system prompt changed, the history
  was rewritten at message N (compaction, an edit), idle longer than the cache's lifetime
  (5 minutes, or 1 hour once the lane wrote 1-hour cache), a previous prompt under 4,096
  tokens (some models' minimum cacheable prefix: ``too_short``), else ``unknown``. After a
  prompt under 1,024 tokens (the shortest any provider caches) nothing can be missed: no
  limit, no miss.
- The store holds, per conversation, with a pin's lifetime: ``ledger:<session>`` (a hash of
  sums: tokens per server and model, turns, misses per reason, the sums of limits and of
  what was read within them; the last turn of each lane, compact) and
  ``ledger:turns:<session>`` (a sorted set, one member per turn, scored by time; the last
  ``MAX_TURNS``, trimmed by the writer now and then). Ids,
  digests, names and numbers only. Sums are ``hincr``: several proxies add to one ledger; a
  turn adds at most ``MAX_ADD`` to any of them, so none passes an int64.
- Pure (no I/O here): the proxy's shell performs the writes this module describes.
"""

from __future__ import annotations

import hashlib

import msgspec

from ..reader import facts as F
from ..records import pins
from ..reader.promptshape import Shape, compare
from ..store.base import HIncr, HSet, Store, Write, ZAdd
from .usage import FIELDS, MAX_TOKENS, Diagnostic, Usage

PREFIX = "ledger:"
TURNS_PREFIX = "ledger:turns:"
TTL = pins.PIN_TTL
MISS_SHARE = 0.8
CACHE_TTL = 300.0            # a prompt cache's default lifetime (refreshed by each read)
CACHE_TTL_1H = 3600.0
MAX_LANE = 64
MAX_TURNS = 10_000           # turns kept per conversation (the oldest go; the sums stay whole)
# The most one turn adds to any sum: a turn's figures are at most ``usage.MAX_TOKENS`` each (its
# input three of them); a limit comes from a stored record, maybe another version's. A sum then
# stays an int64 (the store's ``hincr``) for more than 10**9 turns of a conversation.
MAX_ADD = 3 * MAX_TOKENS
# The shortest prompt a provider caches: 1,024 tokens (OpenAI, and Anthropic's larger models);
# some Anthropic models need 2,048 or 4,096 (``SHORT_PREFIX``): a miss after a shorter prompt
# than that is said to be "too_short" when nothing else explains it.
MIN_CACHEABLE = 1024
SHORT_PREFIX = 4096
# the provider's reasons that name a change (the others say it could not compare)
_PROVIDER_CHANGES = frozenset({"model_changed", "system_changed", "tools_changed", "messages_changed"})
REASONS = ("first_turn", "model_changed", "server_changed", "tools_changed", "system_changed", "messages_changed",
           "idle", "too_short", "unknown")


class Prior(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a lane's last turn leaves for the next one to be compared with (kept in the store)."""
    t: float
    model: str = ""
    server: str = ""
    input: int = 0             # its prompt's tokens (cached or not)
    ttl: float = CACHE_TTL     # its cache's lifetime
    tools: str = ""
    system: str = ""
    n: int = 0                 # its messages
    head: str = ""             # a digest of its messages' digests
    size: int = 0              # its prompt's bytes
    fixed: int = 0             # bytes of its tools and system prompt
    partial: bool = False
    shaped: bool = False       # its request's shape was read


class Turn(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One answered request, as the ledger keeps it (ids and numbers only)."""
    t: float                   # when the answer ended
    api: str
    lane: str = "main"
    kind: str = ""             # the router's turn: opening, continuation, side, subagent, unknown
    server: str = ""
    model: str = ""
    id: str = ""               # the server's message / response id
    usage: Usage = Usage()
    limit: int | None = None   # tokens the turn could have read from cache (None: first turn)
    miss: bool = False
    reason: str = ""           # one of REASONS ("" a hit)
    detail: str = ""           # e.g. "at message 12", "idle 7 min", "provider: messages_changed"
    cut: bool = False          # the answer was cut short: its figures are what the server had reported

    @property
    def efficiency(self) -> float | None:
        """Cache read as a share of the limit (capped at 1), None without a limit."""
        if not self.limit:
            return None
        return min(1.0, self.usage.cache_read / self.limit)


_turn_encoder = msgspec.json.Encoder()
_turn_decoder = msgspec.json.Decoder(Turn)
_prior_decoder = msgspec.json.Decoder(Prior)


def key(session: str) -> str:
    return PREFIX + session


def turns_key(session: str) -> str:
    return TURNS_PREFIX + session


def lane_of(agent: str, turn: str | None, model: str | None, headers: dict[str, str]) -> str:
    """The requests of a conversation that share a prompt prefix: a Claude Code subagent by
    its agent id, a Codex thread by its id, side requests by model; the rest is "main"."""
    if agent == F.CLAUDE_CODE and headers.get("x-claude-code-agent-id"):
        return "agent:" + headers["x-claude-code-agent-id"][:MAX_LANE]
    if agent == F.CODEX and headers.get("thread-id"):
        return "thread:" + headers["thread-id"][:MAX_LANE]
    if turn == F.SIDE:
        return ("side:" + (model or ""))[:MAX_LANE]
    if turn == F.SUBAGENT:
        return "subagent"
    return "main"


def _head(messages: tuple[str, ...]) -> str:
    return hashlib.blake2b("".join(messages).encode(), digest_size=8).hexdigest()


def prior_of(turn: Turn, shape: Shape | None, before: Prior | None) -> Prior:
    """What ``turn`` leaves for the next turn of its lane."""
    u = turn.usage
    ttl = CACHE_TTL_1H if u.cache_write_1h else CACHE_TTL if u.cache_write_5m else (before.ttl if before else CACHE_TTL)
    if shape is None:
        return Prior(t=turn.t, model=turn.model, server=turn.server, input=u.input, ttl=ttl)
    return Prior(t=turn.t, model=turn.model, server=turn.server, input=u.input, ttl=ttl, tools=shape.tools,
                 system=shape.system, n=len(shape.messages), head=_head(shape.messages), size=shape.size,
                 fixed=shape.tools_len + shape.system_len, partial=shape.partial, shaped=True)


def assess(turn: Turn, started: float, shape: Shape | None, prior: Prior | None,
           prior_shape: Shape | None = None, diagnostic: Diagnostic | None = None) -> Turn:
    """The turn with its limit, miss and reason, against the lane's previous turn.

    ``started`` is when the request was sent (idleness is measured from the previous answer
    to it); ``prior_shape`` the previous request's full shape when this proxy still holds it
    (it names the first message that differs; the stored ``prior`` only says whether the
    history was rewritten)."""
    u = turn.usage
    if prior is None:
        return msgspec.structs.replace(turn, limit=None, miss=False, reason="first_turn" if not u.cache_read else "",
                                       detail="")
    share, kind, at = 1.0, "", None
    if turn.server != prior.server:       # first: a move renames the model too (the server's model map)
        share, kind = 0.0, "server_changed"
    elif turn.model and prior.model and turn.model != prior.model:
        share, kind = 0.0, "model_changed"
    elif shape is not None and prior_shape is not None:
        d = compare(prior_shape, shape)
        share, at = d.share, d.at
        kind = {"tools": "tools_changed", "system": "system_changed", "messages": "messages_changed",
                "model": "model_changed"}.get(d.kind, "")
        if d.kind == "model":
            share = 0.0
    elif shape is not None and prior.shaped:
        share, kind = _compare_stored(prior, shape)
    limit = round(prior.input * share)
    if prior.input < MIN_CACHEABLE:     # no provider caches a prompt this short: nothing to miss
        return msgspec.structs.replace(turn, limit=0, miss=False, reason="", detail="")
    miss = u.cache_read < MISS_SHARE * prior.input
    if not miss:
        return msgspec.structs.replace(turn, limit=limit, miss=False, reason="", detail="")
    reason, detail = kind, ""
    if kind == "messages_changed":
        detail = f"at message {at}" if at is not None else f"before message {prior.n}"
    elif kind == "server_changed":
        detail = f"from {prior.server or '?'}"
    elif kind == "model_changed":
        detail = f"from {prior.model}"
    idle = started - prior.t
    if not reason and idle > prior.ttl:
        reason, detail = "idle", f"idle {_duration(idle)} (cache lifetime {_duration(prior.ttl)})"
    if not reason and prior.input < SHORT_PREFIX:
        reason, detail = "too_short", f"the previous prompt had {prior.input} tokens: under some models' minimum"
    if diagnostic is not None and diagnostic.reason:
        said = f"provider: {diagnostic.reason}"
        if diagnostic.reason in _PROVIDER_CHANGES:
            reason = diagnostic.reason
        detail = f"{detail}; {said}" if detail else said
    return msgspec.structs.replace(turn, limit=limit, miss=True, reason=reason or "unknown", detail=detail)


def _compare_stored(prior: Prior, shape: Shape) -> tuple[float, str]:
    """The stored (compact) prior against a full shape: no message index, but whether the
    history only grew."""
    size = prior.size or 1
    if prior.tools != shape.tools:
        return 0.0, "tools_changed"
    if prior.system != shape.system:
        return prior.fixed / size if prior.tools else 0.0, "system_changed"
    if prior.partial or shape.partial:
        return 1.0, ""
    if len(shape.messages) < prior.n or _head(shape.messages[:prior.n]) != prior.head:
        return prior.fixed / size, "messages_changed"
    return 1.0, ""


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min" if seconds >= 60 else \
        f"{seconds:.0f} s"


# ---------------------------------------------------------------- the store


def _name(value: str) -> str:
    return (value or "-").replace("|", "_")[:200]


def writes(session: str, agent: str, turn: Turn, prior: Prior) -> list[Write]:
    """The store writes that add ``turn`` to its conversation's ledger (with ``prior``, what the
    lane's next turn is compared with). The caller sets both keys' TTL (``TTL``). A batch of
    turns: ``Batch``."""
    batch = Batch()
    batch.add(session, agent, turn, prior)
    return batch.writes()


class Batch:
    """A batch's ledger writes, folded as each turn is added: each (key, field)'s increments
    summed into one, each hash field set once (its last value, in the place of its last set),
    every turn's record kept, in order. The store ends as the turns' ``writes`` applied one by
    one would leave it, in a fraction of the operations (a busy conversation's turns share
    their fields), and without a write object per field of every turn (~10 µs a turn, issue
    22): the writes are made once, for the batch (``writes``). The lane's record (``Prior``) is
    encoded only for the last turn of its lane in the batch."""

    __slots__ = ("_sets", "_incrs", "_records")

    def __init__(self) -> None:
        self._sets: dict[tuple[str, str], str | Prior] = {}
        self._incrs: dict[tuple[str, str], int] = {}
        self._records: list[ZAdd] = []

    def add(self, session: str, agent: str, turn: Turn, prior: Prior) -> None:
        """Add ``turn`` of ``session`` (and ``prior``, what its lane's next turn is compared with)."""
        k = key(session)
        sets, incrs = self._sets, self._incrs
        group = f"{_name(turn.server)}|{_name(turn.model)}|"
        _set(sets, (k, "agent"), agent)
        adds = [("turns", 1)]
        u = turn.usage
        for name in FIELDS:
            v = getattr(u, name)
            if v:
                adds.append((group + name, v))
        adds.append((group + "turns", 1))
        if turn.limit:
            adds += [("limit", turn.limit), ("within", min(u.cache_read, turn.limit))]
        if turn.miss:
            adds += [("misses", 1), ("miss:" + turn.reason, 1)]
        for field, by in adds:
            incrs[(k, field)] = incrs.get((k, field), 0) + max(0, min(by, MAX_ADD))
        _set(sets, (k, "lane:" + turn.lane), prior)
        self._records.append(ZAdd(turns_key(session), _turn_encoder.encode(turn).decode(), turn.t))

    def last_record(self) -> ZAdd | None:
        """The batch's last turn record: its writes end with it (a store that applied it applied
        everything before it)."""
        return self._records[-1] if self._records else None

    def writes(self) -> list[Write]:
        return [*(HSet(k, f, v if isinstance(v, str) else _turn_encoder.encode(v).decode())
                  for (k, f), v in self._sets.items()),
                *(HIncr(k, f, by) for (k, f), by in self._incrs.items()), *self._records]


def _set(sets: dict, at: tuple[str, str], value: object) -> None:
    sets.pop(at, None)          # the last value, in the place of the last set
    sets[at] = value


async def trim(store: Store, session: str, keep: int = MAX_TURNS) -> int:
    """Drop a conversation's oldest turns beyond ``keep`` (its sums stay whole); how many went."""
    k = turns_key(session)
    n = await store.zcount(k, float("-inf"), float("inf"))
    if n <= keep:
        return 0
    oldest = await store.zrange(k, float("-inf"), float("inf"), n - keep)
    return await store.zremrange(k, float("-inf"), oldest[-1][1]) if oldest else 0


async def load_prior(store: Store, session: str, lane: str) -> Prior | None:
    raw = await store.hget(key(session), "lane:" + lane)
    return decode_prior(raw)


def decode_prior(raw: str | None) -> Prior | None:
    if not raw:
        return None
    try:
        return _prior_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    """A conversation's ledger, as the store sums it."""
    agent: str = ""
    turns: int = 0
    misses: int = 0
    by: dict[tuple[str, str], Usage] = {}      # (server, model) -> tokens
    turns_by: dict[tuple[str, str], int] = {}
    reasons: dict[str, int] = {}
    limit: int = 0
    within: int = 0

    @property
    def usage(self) -> Usage:
        total = Usage()
        for u in self.by.values():
            total = total + u
        return total

    @property
    def efficiency(self) -> float | None:
        """What the conversation read from cache as a share of what it could have (None: no turn had a limit)."""
        return self.within / self.limit if self.limit else None


def summary(h: dict[str, str]) -> Summary:
    """A ledger hash, read (unknown or bad fields are skipped)."""
    by: dict[tuple[str, str], dict[str, int]] = {}
    turns_by: dict[tuple[str, str], int] = {}
    reasons: dict[str, int] = {}

    def num(v: str) -> int:
        try:
            return int(v)
        except (TypeError, ValueError):
            return 0
    for field, value in h.items():
        if field.startswith("miss:"):
            reasons[field[5:]] = num(value)
        elif field.count("|") == 2:
            server, model, name = field.split("|")
            if name == "turns":
                turns_by[(server, model)] = num(value)
            elif name in FIELDS:
                by.setdefault((server, model), {})[name] = num(value)
    return Summary(agent=h.get("agent", ""), turns=num(h.get("turns", "0")), misses=num(h.get("misses", "0")),
                   by={g: Usage(**f) for g, f in by.items()}, turns_by=turns_by, reasons=reasons,
                   limit=num(h.get("limit", "0")), within=num(h.get("within", "0")))


async def load(store: Store, session: str) -> Summary | None:
    h = await store.hgetall(key(session))
    return summary(h) if h else None


async def load_many(store: Store, sessions: list[str], batch: int = 500) -> dict[str, Summary | None]:
    """``load`` of many conversations, a store call per ``batch`` (the CLI's listings)."""
    out: dict[str, Summary | None] = {}
    for i in range(0, len(sessions), batch):
        chunk = sessions[i:i + batch]
        for session, h in zip(chunk, await store.hgetall_many([key(s) for s in chunk])):
            out[session] = summary(h) if h else None
    return out


async def turns(store: Store, session: str, limit: int | None = None) -> list[Turn]:
    """The conversation's turns, oldest first (bad members skipped)."""
    out = []
    for member, _ in await store.zrange(turns_key(session), float("-inf"), float("inf"), limit):
        try:
            out.append(_turn_decoder.decode(member))
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    return out
