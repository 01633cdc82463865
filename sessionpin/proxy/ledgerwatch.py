"""LedgerWatch: every answered turn's tokens, read as the answer streams, kept in the ledger.

Rules it keeps (``sessionpin.accounting.ledger`` holds the rules of the figures, docs/ledger.md the meaning):
- A request the router decided (its flow has sessionpin metadata with a session, an inference
  api, no refusal) and answered 2xx has its answer read by a ``usage.UsageReader``: a streamed
  answer as it passes (the reader is chained after any stream callable already set, every
  chunk returned unchanged and undelayed), a buffered one from its body once complete, and
  Codex's socket from each server message (one turn per ``response.completed``).
- After the answer has left, the request's prompt shape is read (``promptshape.shape``, digests only;
  from ``SHAPE_OFF_LOOP_MIN`` in a body reader process of its own, ``offprocess.BodyProcess``:
  a digest per message of a two-million-message history held every other client for
  seconds; past ``bodyreader.MAX_SHAPE_ITEMS`` messages there is no shape) and the turn is assessed against the previous turn of its lane: this proxy's memory first,
  else the lane's last turn in the store (another proxy's, or before a restart).
- **A buffered answer is never held for the ledger** (issue 22): mitmproxy sends a buffered
  response on only once every ``response`` hook has returned, and a large request's shape read
  in the body process cost each such answer milliseconds (1 MB: the router's latency 1.3-1.7 ×
  plain mitmdump's with it, 1.0-1.4 × without). That read runs beside the answer
  (``_behind``): a conversation's turns are still taken in the order their answers ended (a
  turn whose conversation has one being read waits behind it, so each is compared with the
  one before it), and mitmweb is told the flow changed once its comment has the figures. A
  small request's turn (its answer's usage, its shape, the verdict) is read once mitmproxy
  has sent the answer (``later.Later``: ~55 µs a 10 KB turn no longer ahead of each answer's
  last bytes). At
  most ``MAX_BEHIND`` conversations' reads run so, holding at most ``MAX_BEHIND_BYTES`` of
  requests; beyond either the answer waits for its read as before (what a flood of large
  requests holds stays bounded: without the bytes' bound, reads slower than the requests came
  kept every waiting request's body — a 1 MB load grew the proxy by 150 MB every 3 s).
- The flow's comment gains the turn's tokens and cache read (``… | in 12.3k out 420 cache 97%``,
  and the miss's reason; a socket's comment, its latest turn's); the metadata gains ``ledger``.
- Records are written in batches off the request path, a fraction of a second after the first,
  one store write at a time (as ``LineageWatch`` does), and on a clean stop before the store
  closes (``drain``: as ``LineageWatch``'s, bounded by ``bundle.DRAIN_TIMEOUT``); a failed write is counted and logged once
  per outage, never retried (a lost turn costs the ledger that turn, nothing else). A batch of
  several conversations the store refuses is written again one conversation at a time (until
  two fail in a row): a conversation whose record the store refuses (sums an older version let
  reach int64's end) loses its own turns, never the others'. At most
  ``MAX_PENDING`` turns wait; the oldest are dropped and counted.
- Bounded memory: an answer's reader is kept in its flow (``flow.metadata``,
  ``perflow.LEDGER``) and taken out when the flow ends; at most ``MAX_LANES`` lanes' last
  prompt shapes kept (the oldest dropped: their next turn is compared with the store's compact
  record instead).
- Prometheus counters (``metrics()``, rendered by the status endpoint): tokens by agent, server,
  model and kind; turns; misses by reason; the sums of limits and of what was read within them.
  A model name is at most ``usage.MAX_NAME`` characters (cut where it is read); the first
  ``MAX_MODEL_LABELS`` models get a label of their own, the rest count as ``other``: a server
  naming huge or ever new models grows neither /metrics nor the process.
- With ``sessionpin_otel`` set, an OpenTelemetry span per answered turn (``otelspans``); a turn
  first judged when written (its lane unknown to this proxy) has its span without a verdict.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict, deque

from mitmproxy import http

from ..config.redact import unquoted
from ..reader import facts as F
from ..accounting import ledger
from ..reader import promptshape
from ..accounting.usage import APIS, FIELDS, MAX_NAME, Read, UsageReader
from .exposition import family, joined
from .otelspans import KINDS as OTEL_KINDS
from .otelspans import Spans
from . import perflow
from ..reader import headerview
from ..reader.ids import short
from .offprocess import BodyProcess
from .perflow import FlowState
from .later import Later, sent, tell_view
from .participants import Participant
from .storeruntime import StoreRuntime

log = logging.getLogger("sessionpin")
SHAPE_OFF_LOOP_MIN = 256 * 1024   # bytes: a request's prompt shape is read in the body reader's process from here
MAX_BEHIND = 64                     # conversations whose turn is read beside its answer, at most
MAX_BEHIND_BYTES = 256 * 1024 * 1024   # request bytes held by turns read beside their answers, at most

LOOP_RUNS = 64                      # conversations' messages arrays kept for the next turn's shape, at most
LOOP_RUNS_BYTES = 16 * 1024 * 1024  # their bytes, at most (each under SHAPE_OFF_LOOP_MIN)
MAX_LANES = 2_000
MAX_MODEL_LABELS = 100              # models with a Prometheus label of their own; the rest are OTHER_MODEL
OTHER_MODEL = "other"
MAX_PENDING = 10_000
FLUSH_DELAY = 0.2
TRIM_EVERY = 500         # batches written for one conversation between looks at its number of turns
# A ledger's keys live ``ledger.TTL`` (the pin's lifetime) from their last renewal, renewed at
# most once a day, as pins are: two store calls per conversation per batch were most of the
# store threads' work under load (docs/benchmarks.md, "After issues 18-23 were merged").
RENEW_EVERY = 86_400.0


class _Tee:
    """Two stream callables, one after the other (each returns the chunk unchanged)."""

    __slots__ = ("first", "second")

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second

    def __call__(self, chunk: bytes) -> bytes:
        chunk = self.first(chunk)
        self.second(chunk)
        return chunk


class _Watched(FlowState):
    __slots__ = ("agent", "session", "api", "kind", "server", "lane", "reader", "started", "shape")

    def __init__(self, agent: str, session: str, api: str, kind: str, server: str, lane: str, started: float) -> None:
        self.agent, self.session, self.api, self.kind, self.server, self.lane = agent, session, api, kind, server, lane
        self.started = started
        self.reader: UsageReader | None = None
        self.shape: promptshape.Shape | None = None       # a socket's last response.create


class _Pending:
    """A turn waiting to be written; ``assessed`` False: its lane's previous turn is read from the
    store first (this proxy had none in memory)."""
    __slots__ = ("agent", "session", "turn", "started", "shape", "diagnostic", "assessed", "prior")

    def __init__(self, agent, session, turn, started, shape, diagnostic, assessed: bool, prior) -> None:
        self.agent, self.session, self.turn, self.started = agent, session, turn, started
        self.shape, self.diagnostic, self.assessed, self.prior = shape, diagnostic, assessed, prior


class LedgerWatch:
    def __init__(self, runtime: StoreRuntime) -> None:
        self.runtime = runtime
        self.recorded = 0
        self.dropped = 0
        self._models: set[str] = set()          # the models with a label of their own
        self.unread = 0                  # answers that stated no usage
        self.tokens: Counter[tuple[str, str, str, str]] = Counter()   # (agent, server, model, kind)
        self.turns: Counter[tuple[str, str]] = Counter()              # (agent, server)
        self.misses: Counter[tuple[str, str, str]] = Counter()        # (agent, server, reason)
        self.limit: Counter[tuple[str, str]] = Counter()
        self.within: Counter[tuple[str, str]] = Counter()
        self._lanes: OrderedDict[tuple[str, str], tuple[ledger.Prior, promptshape.Shape | None]] = OrderedDict()
        self._pending: deque[_Pending] = deque()
        self._flusher: asyncio.Task | None = None
        self._failing = False
        self._written: dict[str, int] = {}   # batches written per conversation (when to trim its turns)
        self._renewed: dict[str, float] = {}  # when this proxy last renewed a conversation's TTL
        self._digests: promptshape.Seen = {}   # message digests already worked out (bounded)
        # the messages arrays of the conversations shaped lately, by session (bounded)
        self._runs = promptshape.Runs(limit=LOOP_RUNS, max_bytes=LOOP_RUNS_BYTES)
        self.spans: Spans | None = None      # OpenTelemetry, when sessionpin_otel names an exporter
        self._otel = ""
        self.bodies: BodyProcess | None = None   # a body reader of its own (make_addons): a large prompt's shape
        self._behind: dict[str, asyncio.Task] = {}   # session -> its last turn still being read beside its answer
        self.behind_bytes = 0            # the request bytes those turns hold
        self.waited = 0                  # answers held for their reading, over either bound
        self.later = Later("ledger")     # a small request's turn: read once its answer has left

    # ---- options ----------------------------------------------------------------------------
    def load(self, loader) -> None:
        loader.add_option("sessionpin_otel", str, "",
                          "sessionpin: an OpenTelemetry span per answered turn (GenAI conventions): "
                          "console, otlp (OTEL_EXPORTER_OTLP_* variables), or empty: off.")

    def configure(self, updated: set[str]) -> None:
        if "sessionpin_otel" not in updated:
            return
        from mitmproxy import ctx, exceptions
        kind = (ctx.options.sessionpin_otel or "").strip().lower()
        if kind == self._otel:
            return
        if kind not in OTEL_KINDS:
            raise exceptions.OptionsError(f"sessionpin_otel: {kind!r} is not one of console, otlp (or empty: off)")
        spans = None
        if kind:
            try:
                spans = Spans.build(kind)
            except ValueError as e:
                raise exceptions.OptionsError(f"sessionpin_otel={kind}: {e}") from None
        if self.spans is not None:
            self.spans.shutdown()
        self.spans, self._otel = spans, kind

    def done(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()       # (the exit's drain ran out of time: what is left is dropped)
        if self.spans is not None:
            self.spans.shutdown()
            self.spans = None
        if self.bodies is not None:
            self.bodies.close()

    # ---- hooks ------------------------------------------------------------------------------
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        try:
            w = self._watch(flow)
            if w is None:
                return
            resp = flow.response
            sse = "text/event-stream" in headerview.get(resp.headers, "content-type").lower()
            w.reader = UsageReader(w.api, headerview.get(resp.headers, "content-encoding"), whole=not sse)
            if callable(resp.stream):
                resp.stream = _Tee(resp.stream, w.reader)
            elif resp.stream:
                resp.stream = w.reader
            # else: buffered, read from the body in ``response``
        except Exception:
            log.exception("sessionpin: ledger: cannot watch a response")

    def response(self, flow: http.HTTPFlow):
        """Returns at once: a small request's turn is read once its answer has left
        (``_answered``, once the answer has been sent); a large one's beside it, in the body reader's
        process (``_beside``: the answer waits only past its bounds); one whose conversation
        has a turn still read beside its answer, after that turn."""
        w = flow.metadata.pop(perflow.LEDGER, None)
        if w is None or w.reader is None:
            self._request_span(flow, None)
            return None
        try:
            ended = time.time()                                   # the answer just ended
            req = flow.request
            raw = req.raw_content
            large = bool(raw) and len(raw) >= SHAPE_OFF_LOOP_MIN and self.bodies is not None
            if not large and w.session not in self._behind:
                # the rest once the answer has left (``later``); the router's members go with
                # this hook, so they are taken now
                self.later.call(flow, self._answered, flow, w, ended, perflow.sent_members(flow))
                return None
            read = self._read(flow, w)
            if read.usage is not None:
                encoding = headerview.get(req.headers, "content-encoding")
                if large:                                           # never on the event loop
                    return self._beside(w.session, flow, self._large(flow, w, read, ended, raw, encoding), len(raw))
                # its conversation's previous turn is still read beside its answer: after it
                shape = self._shape(w, raw, encoding, perflow.sent_members(flow))
                later = self._turn_later(flow, w, read, shape, ended)
                return self._beside(w.session, flow, later, len(raw or b""))
            self._turn(flow, w, read, None, ended)                  # no usage stated: counted
        except Exception:
            log.exception("sessionpin: ledger: cannot read an answer's usage")
        self._request_span(flow, None)          # (nothing when it gave a turn: that has its span)
        return None

    @staticmethod
    def _read(flow: http.HTTPFlow, w: _Watched) -> Read:
        """The answer's usage: a buffered answer's from its body, a streamed one's as it passed."""
        resp = flow.response
        if resp is not None and not resp.stream and resp.raw_content:
            w.reader.whole = False                  # type: ignore[union-attr]
            w.reader.body(resp.raw_content)         # type: ignore[union-attr]
        return w.reader.result()                    # type: ignore[union-attr]

    def _answered(self, flow: http.HTTPFlow, w: _Watched, ended: float, members) -> None:
        """A small request's turn, read once its answer has been sent (``later``)."""
        try:
            read = self._read(flow, w)
            shape = None
            if read.usage is not None:
                req = flow.request
                shape = self._shape(w, req.raw_content, headerview.get(req.headers, "content-encoding"), members)
            self._turn(flow, w, read, shape, ended)
        except Exception:
            log.exception("sessionpin: ledger: cannot read an answer's usage")
        self._request_span(flow, None)
        tell_view(flow)

    def _shape(self, w: _Watched, raw: bytes | None, encoding: str, members) -> promptshape.Shape | None:
        """A request's shape on the event loop (a small body): its messages compared with its
        conversation's last array, so only the new ones are read (``promptshape.Runs``);
        ``members``: the router's (``perflow.sent_members``), read instead of the body."""
        return promptshape.shape(raw, w.api, encoding, self._digests, members=members, runs=self._runs, key=w.session)

    async def _large(self, flow: http.HTTPFlow, w: _Watched, read: Read, ended: float, raw: bytes,
                     encoding: str, cut: bool = False) -> None:
        try:
            assert self.bodies is not None
            shape = await self.bodies.shape(raw, w.api, encoding)
            self._turn(flow, w, read, shape, ended, cut=cut)
        except Exception:
            log.exception("sessionpin: ledger: cannot read an answer's usage")
        self._request_span(flow, flow.error.msg if cut and flow.error else None)

    async def _turn_later(self, flow: http.HTTPFlow, w: _Watched, read: Read, shape, ended: float,
                          cut: bool = False) -> None:
        """``_turn`` once its conversation's earlier turn is read (``_beside``), then its span."""
        try:
            self._turn(flow, w, read, shape, ended, cut=cut)
        except Exception:
            log.exception("sessionpin: ledger: cannot read an answer's usage")
        self._request_span(flow, None if not cut else flow.error.msg if flow.error else "error")

    def _beside(self, session: str, flow: http.HTTPFlow, work, size: int):
        """Run ``work`` (a turn's reading, of a request of ``size`` bytes) beside its answer, after
        its conversation's turn being read (if any). Returns what the hook gives mitmproxy: None,
        the answer goes on; or what the answer waits for — ``work`` itself, not started, when
        ``MAX_BEHIND`` conversations are being read; the reading's task, when the requests being
        read beside their answers hold more than ``MAX_BEHIND_BYTES`` (reads slower than the
        requests come: each waiting one keeps its flow's body, so the answers then wait, and
        what is held stays bounded)."""
        before = self._behind.get(session)
        if before is None and len(self._behind) >= MAX_BEHIND:
            self.waited += 1
            return work
        task = asyncio.get_running_loop().create_task(_after(before, work, flow))
        self._behind[session] = task
        self.behind_bytes += size

        def gone(t: asyncio.Task) -> None:
            self.behind_bytes -= size
            if self._behind.get(session) is t:
                del self._behind[session]
        task.add_done_callback(gone)
        if not task.done() and self.behind_bytes > MAX_BEHIND_BYTES:
            self.waited += 1
            return task
        return None

    async def settled(self) -> None:
        """Wait for the turns being read beside or after their answers (tests, shutdown)."""
        await self.later.settled()
        while self._behind:
            await asyncio.gather(*list(self._behind.values()), return_exceptions=True)

    def busy(self) -> bool:
        """Work a stop would lose: turns not yet read, turns not yet written."""
        return bool(self.later.pending or self._behind or
                    (self._pending and self.runtime.store is not None)
                    or (self._flusher is not None and not self._flusher.done()))

    async def drain(self) -> None:
        """At a clean stop, before the store closes (``bundle.Sessionpin.done``): the turns being
        read, then their records, written. The caller bounds the wait."""
        while self.busy() and self.runtime.store is not None:
            await self.settled()
            await asyncio.sleep(0.01)

    def error(self, flow: http.HTTPFlow):
        # An answer cut short (the client went away, the connection broke) was still billed for
        # what the server had reported by then (Anthropic states a turn's input and cache use
        # in its first event): recorded as such, marked cut. Nothing reported: no turn.
        w = flow.metadata.pop(perflow.LEDGER, None)
        if w is not None and w.reader is not None:
            try:
                read = w.reader.result()
                if read.usage is not None:
                    raw, encoding = flow.request.raw_content, headerview.get(flow.request.headers, "content-encoding")
                    if raw and len(raw) >= SHAPE_OFF_LOOP_MIN and self.bodies is not None:
                        large = self._large(flow, w, read, time.time(), raw, encoding, cut=True)
                        return self._beside(w.session, flow, large, len(raw))
                    shape = self._shape(w, raw, encoding, perflow.sent_members(flow))
                    if w.session in self._behind:    # its conversation's previous turn is still read: after it
                        later = self._turn_later(flow, w, read, shape, time.time(), cut=True)
                        return self._beside(w.session, flow, later, len(raw or b""))
                    self._turn(flow, w, read, shape, time.time(), cut=True)
            except Exception:
                log.exception("sessionpin: ledger: cannot read a cut answer's usage")
        self._request_span(flow, flow.error.msg if flow.error else "error")
        return None

    def _request_span(self, flow: http.HTTPFlow, error: str | None) -> None:
        """The span of a decided request that gave no turn (OpenTelemetry on only)."""
        if self.spans is None:
            return
        meta = flow.metadata.get("sessionpin")
        if not meta or meta.get("agent") not in F.AGENTS or "ledger" in meta or flow.websocket is not None:
            return
        try:
            resp = flow.response
            # (a protocol error may quote a peer's bytes: said by their size, as in the log)
            self.spans.emit_request(meta, flow.request.timestamp_start or time.time(), time.time(),
                                    resp.status_code if resp is not None else None,
                                    unquoted(error) if error is not None else None)
        except Exception:
            log.exception("sessionpin: ledger: cannot emit a span")

    def websocket_start(self, flow: http.HTTPFlow) -> None:
        try:
            w = self._watch(flow, websocket=True)
            if w is not None:
                w.reader = UsageReader(w.api)
        except Exception:
            log.exception("sessionpin: ledger: cannot watch a socket")

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        w = flow.metadata.get(perflow.LEDGER)
        if w is None or w.reader is None or flow.websocket is None:
            return
        try:
            msg = flow.websocket.messages[-1]
            if msg.from_client:
                if msg.is_text and b'"response.create"' in msg.content[:200]:
                    # read here, ahead of the message (mitmproxy sends it on when the hook
                    # returns), so only a small one: a message of up to the socket limit's
                    # 16 MiB of tiny items took ~1 ms per 10,000 of them on the event loop.
                    # A larger one's turn is recorded without a shape, as a body's past
                    # MAX_SHAPE_ITEMS messages is (Codex's are incremental: 79 KB at most).
                    content = msg.content
                    w.shape = promptshape.shape(content, w.api, seen=self._digests) \
                        if len(content) < SHAPE_OFF_LOOP_MIN else None
                    w.started = msg.timestamp
                return
            read = w.reader.message(msg.content)
            if read is not None:
                self._turn(flow, w, read, w.shape, msg.timestamp)
        except Exception:
            log.exception("sessionpin: ledger: cannot read a socket message's usage")

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        flow.metadata.pop(perflow.LEDGER, None)

    # ---- a turn -----------------------------------------------------------------------------
    def _watch(self, flow: http.HTTPFlow, websocket: bool = False) -> _Watched | None:
        meta = flow.metadata.get("sessionpin")
        if not meta or meta.get("refused") or not meta.get("session") or meta.get("agent") not in F.AGENTS:
            return None
        api = meta.get("api")
        if api not in APIS:
            return None
        resp = flow.response
        if not websocket and (resp is None or not 200 <= resp.status_code < 300):
            return None
        server = meta.get("target") or meta.get("source") or flow.request.pretty_host
        headers = {k: headerview.get(flow.request.headers, k) for k in ("x-claude-code-agent-id", "thread-id")}
        lane = ledger.lane_of(meta["agent"], meta.get("turn"), None, headers)
        if lane.startswith("side:"):
            lane = "side"     # refined by the answer's model
        w = _Watched(meta["agent"], meta["session"], api, meta.get("turn") or "", server, lane,
                     flow.request.timestamp_start or time.time())
        flow.metadata[perflow.LEDGER] = w
        return w

    def _turn(self, flow: http.HTTPFlow, w: _Watched, read: Read, shape, ended: float | None,
              cut: bool = False) -> None:
        if read.usage is None:
            self.unread += 1
            return
        model = (read.model or (shape.model if shape is not None else "") or "")[:MAX_NAME]
        lane = f"side:{model}"[:ledger.MAX_LANE] if w.lane == "side" else w.lane
        turn = ledger.Turn(t=ended or time.time(), api=w.api, lane=lane, kind=w.kind, server=w.server, model=model,
                           id=(read.id or "")[:200], usage=read.usage, cut=cut)
        held = self._lanes.get((w.session, lane))
        if held is not None:
            turn = ledger.assess(turn, w.started, shape, held[0], held[1], read.diagnostic)
            self._counted(w.agent, turn)
        prior = self._remember(w.session, lane, turn, shape, held[0] if held else None)
        u = read.usage
        note = f"{_k(u.input)} out {_k(u.output)} cache {u.cache_read * 100 // u.input if u.input else 0}%"
        if turn.miss:
            note += f" miss: {turn.reason}" + (f" ({turn.detail})" if turn.detail else "")
        if cut:
            note += " (cut short)"
        # a socket carries many turns: its comment shows the latest one's figures
        base = flow.comment.split(_NOTE, 1)[0] if flow.comment else ""
        flow.comment = f"{base}{_NOTE}{note}" if base else f"in {note}"
        meta = flow.metadata.setdefault("sessionpin", {})
        meta["ledger"] = {"lane": lane, "model": model, **{f: getattr(u, f) for f in FIELDS},
                          "limit": turn.limit, "miss": turn.miss, "reason": turn.reason, "cut": cut}
        if self.spans is not None:
            try:
                renamed = meta.get("model")       # [as the client asked, as the server was sent]
                request_model = renamed[0] if isinstance(renamed, list) and renamed else \
                    shape.model if shape is not None and shape.model else None
                self.spans.emit(turn, w.session, w.agent, w.started, turn.t, meta, request_model)
            except Exception:
                log.exception("sessionpin: ledger: cannot emit a span")
        self._queue(_Pending(w.agent, w.session, turn, w.started, shape, read.diagnostic, held is not None, prior))

    def _label(self, model: str) -> str:
        """The model as a Prometheus label: the first ``MAX_MODEL_LABELS`` models named keep
        theirs, any other is ``OTHER_MODEL`` (a server naming a new model every answer would
        grow /metrics and the process without end)."""
        if model in self._models:
            return model
        if len(self._models) < MAX_MODEL_LABELS:
            self._models.add(model)
            return model
        return OTHER_MODEL

    def _counted(self, agent: str, turn: ledger.Turn) -> None:
        u = turn.usage
        model = self._label(turn.model)
        for f in FIELDS:
            v = getattr(u, f)
            if v:
                self.tokens[(agent, turn.server, model, f)] += v
        self.turns[(agent, turn.server)] += 1
        if turn.miss:
            self.misses[(agent, turn.server, turn.reason)] += 1
        if turn.limit:
            self.limit[(agent, turn.server)] += turn.limit
            self.within[(agent, turn.server)] += min(u.cache_read, turn.limit)

    def _remember(self, session: str, lane: str, turn: ledger.Turn, shape, before) -> ledger.Prior:
        k = (session, lane)
        prior = ledger.prior_of(turn, shape, before)
        self._lanes[k] = (prior, shape)
        self._lanes.move_to_end(k)
        while len(self._lanes) > MAX_LANES:
            self._lanes.popitem(last=False)
        return prior

    # ---- writing ----------------------------------------------------------------------------
    def _queue(self, p: _Pending) -> None:
        self._pending.append(p)
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()
            self.dropped += 1
        if self.runtime.store is None:
            return
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        await asyncio.sleep(FLUSH_DELAY)
        while self._pending and self.runtime.store is not None:
            store = self.runtime.store
            batch = list(self._pending)
            self._pending.clear()
            try:
                per: dict[str, ledger.Batch] = {}          # each conversation's writes (disjoint keys)
                turns: Counter = Counter()
                for p in batch:
                    turn, prior = p.turn, p.prior
                    if not p.assessed:
                        stored = await ledger.load_prior(store, p.session, turn.lane)
                        turn = ledger.assess(turn, p.started, p.shape, stored, None, p.diagnostic)
                        self._counted(p.agent, turn)
                        prior = ledger.prior_of(turn, p.shape, stored)
                    per.setdefault(p.session, ledger.Batch()).add(p.session, p.agent, turn, prior)
                    turns[p.session] += 1
                sessions = await self._apply(store, per, turns)
                now = time.time()
                for s in sessions:
                    if now - self._renewed.get(s, float("-inf")) >= RENEW_EVERY:
                        await store.expire(ledger.key(s), ledger.TTL)
                        await store.expire(ledger.turns_key(s), ledger.TTL)
                        self._renewed[s] = now
                    self._written[s] = self._written.get(s, 0) + 1
                    if self._written[s] % TRIM_EVERY == 0:     # a long conversation keeps its last turns
                        await ledger.trim(store, s)
                while len(self._written) > MAX_LANES:
                    del self._written[next(iter(self._written))]
                while len(self._renewed) > MAX_LANES:     # forgotten: renewed again at its next batch
                    del self._renewed[next(iter(self._renewed))]
                self.recorded += sum(turns[x] for x in sessions)
                if self._failing:
                    log.info("sessionpin: ledger records are written again")
                self._failing = False
            except Exception as e:
                self.runtime.errors += 1
                self.dropped += len(batch)
                if not self._failing:
                    log.warning("sessionpin: ledger records not written (%s); dropped until the store takes "
                                "writes again", e)
                self._failing = True

    async def _apply(self, store, per: dict[str, ledger.Batch], turns: Counter) -> list[str]:
        """The batch's writes in one store call, each conversation's together, its turn records
        last. If that fails and the batch holds several conversations, each conversation not
        written yet (its last record absent: a Redis script that fails midway keeps what it did
        before) is written alone: a conversation whose record the store refuses (sums an older
        version let reach int64's end) loses its own turns, not the others'. Two failures in a
        row: the store is failing, the rest are dropped. The conversations written; raises when
        none could be."""
        try:
            await store.apply([], [w for b in per.values() for w in b.writes()])
            return list(per)
        except Exception:
            if len(per) == 1:
                raise
        written: list[str] = []
        refused: list[str] = []
        failed, error = 0, None
        for session, b in per.items():
            if failed >= 2:
                refused.append(session)
                continue
            try:
                last = b.last_record()
                if last is None or await store.zscore(last.key, last.member) is None:
                    await store.apply([], b.writes())
                written.append(session)
                failed = 0
            except Exception as e:
                failed, error = failed + 1, e
                refused.append(session)
        if not written:                                   # the store is failing: the caller says so
            raise error if error is not None else RuntimeError("ledger batch not written")
        self.dropped += sum(turns[x] for x in refused)
        log.warning("sessionpin: ledger records of %d conversation(s) not written (%s), the others' were: %s",
                    len(refused), error, " ".join(short(x) for x in refused[:5]))
        return written

    # ---- Prometheus -------------------------------------------------------------------------
    def metrics(self) -> str:
        out: list[str] = []
        family(out, "sessionpin_ledger_tokens_total", "counter",
               "Tokens the servers reported, by agent, server, model and kind (input includes cache_read and "
               "cache_write_*; output includes reasoning).",
               ("agent", "server", "model", "kind"), sorted(self.tokens.items()))
        family(out, "sessionpin_ledger_turns_total", "counter", "Answered turns read, by agent and server.",
               ("agent", "server"), sorted(self.turns.items()))
        family(out, "sessionpin_ledger_cache_misses_total", "counter",
               "Turns that read more than 20% less from cache than the previous prompt of their lane, by reason.",
               ("agent", "server", "reason"), sorted(self.misses.items()))
        family(out, "sessionpin_ledger_cache_limit_tokens_total", "counter",
               "Tokens turns could have read from cache (the previous prompt's repeated prefix).",
               ("agent", "server"), sorted(self.limit.items()))
        family(out, "sessionpin_ledger_cache_read_within_limit_tokens_total", "counter",
               "Tokens read from cache, up to each turn's limit (divide by the limit: cache efficiency).",
               ("agent", "server"), sorted(self.within.items()))
        family(out, "sessionpin_ledger_dropped_total", "counter", "Ledger records not written (store failing or "
               "too many waiting).", (), [((), self.dropped)])
        family(out, "sessionpin_ledger_answers_held_total", "counter", "Answers held until their turn's prompt "
               "shape was read: too many turns were waiting to be read beside their answers.", (),
               [((), self.waited)])
        return joined(out)


class LedgerMetrics(Participant):
    """The ledger's counters as a participant (the status endpoint renders participants'
    ``metrics()``); it takes no part in routing."""

    name = "ledger"

    def __init__(self, watch: LedgerWatch) -> None:
        self.watch = watch

    def metrics(self) -> str:
        return self.watch.metrics()


_NOTE = " | in "       # where the ledger's part of a comment begins


def _k(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 10_000 else str(n)


async def _after(before: asyncio.Task | None, work, flow: http.HTTPFlow) -> None:
    """``work`` once the answer has been sent and ``before`` (the conversation's previous turn
    being read) is done; then tell mitmweb the flow changed (its comment and metadata gained
    the turn's figures after the response hook had returned). (mitmproxy's tasks start eagerly:
    without the wait, a large request's first copy to the body process ran inside the hook.)"""
    await sent(flow)
    if before is not None:
        try:
            await before
        except BaseException:      # (it logged its own failure; a cancelled one: this goes on)
            pass
    await work
    tell_view(flow)
