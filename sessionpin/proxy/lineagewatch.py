"""LineageWatch: remember what later requests may name a conversation by.

A fork or resume under a new id (``claude --fork-session``, ``opencode --fork``, ``pi
--fork``, …) carries its parent's history; to find the parent, the router needs to have
remembered, from the parent's own traffic, the ids and hashes that history will hold
(``sessionpin.records.lineindex``). This addon does that after a request left, never on its path.
Rules it keeps:

- **A conversation's root is learnt from any of its requests that carries history**: the
  history's root key (``lineage.chain(turns=1)``: the first exchange, read on a thread of its
  own, ``offloop.OffLoop``, after the request left; a later request of the conversation whose
  body (or history) begins with the bytes that root was read from has it without a read:
  ``lineage.root_of``'s proof, ``_Proofs``; a request under ``HOLD_FROM``, not
  content-encoded, whose proof holds is proven here on the loop — one ``memcmp``, under a µs
  at 10 KB, where the hop to the thread cost the proxy more than the read) is recorded for the request's session —
  whether or not any answer of the conversation was seen whole (interrupted, a proxy killed
  before its records were written, a conversation begun before sessionpin). A fork (a pin
  that names a parent) records nothing from its requests: its root is its parent's, and
  stays its parent's. A root this proxy recorded for the same session within ``REFRESH`` is
  not written again (bounded memory, ``MAX_ROOTS``).
- An opening (and any request that pinned a conversation without history) has its
  streamed answer read as it passes (``lineage_stream.StreamReader``, every chunk
  forwarded unchanged and undelayed); once the answer completes, its history's head is
  read from the request (on the thread, after the answer) and the conversation's root key
  (``lineage.extend(head, answer.digest)``) is recorded for it.
- Every successful Claude Code response records its ``request-id`` header as an anchor
  (Claude Code names it in ``cc_prev_req`` when another process resumes or forks): a claim of
  the server that answered (the request's target, or the server it addressed when left alone),
  with the root of the conversation's history — the request's own root, or an opening's from
  its answer. Without a root (an opening whose answer was not seen whole) no anchor is
  recorded: it could never be corroborated (``lineindex``). A fork's requests do record
  their anchors (a fork of the fork names them), not their root.
- **A large request's root is read once its body has left** (from ``HOLD_FROM``, 256 KiB: at
  its answer's headers, or its error): read beside mitmproxy's sending of that body, the
  read's thread took the GIL from the event loop at every socket call of the send (issue 20:
  an 8 MiB pinned continuation cost other clients +158 ms over plain mitmdump, +1 ms once
  held; docs/benchmarks.md). A smaller one is read at once. A held read is kept in its flow
  (``perflow.LINEAGE_HELD``): released at the answer's headers or the error, gone with the flow.
- Only ids and hashes; records are not durable and never delay a request or a response
  (what an answer gives is read once mitmproxy has sent the answer: ``later.Later``).
- What it reads a response for is kept in the flow (``flow.metadata``, ``perflow.LINEAGE``)
  and taken out when the flow ends: it lives no longer than the flow. The
  reads waiting for the thread are bounded in number and bytes (``OffLoop.submit``: over it
  the record is skipped and counted). They gather for ``GATHER`` and go to the thread
  together: one hop per batch, not one per request with history.
- A clean stop (SIGTERM, ``q``) writes what is pending before the store closes: the answers
  that ended, their reads, the records (``drain``, awaited by ``bundle.Sessionpin.done``,
  ``DRAIN_TIMEOUT`` at most: then dropped, one warning). A ``kill -9`` loses them.
- Records are written in batches, a tenth of a second after the first of them (a hop to
  the store's writer thread per response cost more than the rest of this addon), one
  store write at a time: while a write waits (a
  store another process holds locked waits out its busy timeout), the records that
  follow gather into the next one instead of queueing a write each in front of a new
  conversation's pin. At most ``MAX_PENDING`` writes wait; beyond that the oldest are
  dropped and counted (a lost record costs a fork its parent link, nothing more).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque

from mitmproxy import http

from ..reader import facts as F
from ..reader.kinds import FINGERPRINT_PREFIX
from ..lineage import lineage
from ..records import lineindex
from ..lineage.lineage_stream import StreamReader
from ..decision.route import State
from ..store.base import Write
from . import perflow
from ..reader import headerview
from .later import Later
from .offloop import OffLoop
from .perflow import FlowState
from .storeruntime import StoreRuntime

log = logging.getLogger("sessionpin")

MAX_PENDING = 10_000
MAX_ROOTS = 10_000       # roots recorded lately, remembered so a conversation's turns do not rewrite them
REFRESH = 24 * 3600.0    # seconds: a root recorded this long ago is written again (its entry lives 30 days)
FLUSH_DELAY = 0.1        # seconds records gather before a write: one thread wakeup for many responses
GATHER = 0.05            # seconds the reads of roots and heads gather before one hop to their thread
HOLD_FROM = 256 * 1024   # bytes: a request body this large has its root read once it left (not beside its send)
_CHAINED = (F.ANTHROPIC_MESSAGES, F.OPENAI_CHAT, F.OPENAI_RESPONSES)


def _head(body: bytes, api: str, encoding: str) -> str | None:
    """The head of a short history (an opening's): the state its answer extends."""
    return lineage.chain(body, api, turns=1, content_encoding=encoding).head


class _Proofs:
    """The last root proof (``lineage.FirstRun``) of each conversation lately seen, so that its
    next request's root is its first bytes compared, not decoded and hashed again (a 1 MB
    opening: ~2.2 ms every continuation). Bounded in number and bytes; used from the reads'
    thread, hence the lock. Memory only: the proof holds the body's bytes through its first exchange."""

    MAX = 256                   # conversations
    MAX_BYTES = 32 * 1024 * 1024
    MAX_ONE = 4 * 1024 * 1024   # a larger first exchange is read again each time

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: OrderedDict[tuple[str, str], lineage.FirstRun] = OrderedDict()
        self._bytes = 0

    def root(self, key: tuple[str, str], body: bytes, api: str, encoding: str, members: dict | None) -> str | None:
        """The root key of a history: the state after its first model run (``members``: the
        router's decode of the body's top level, read instead of the body)."""
        with self._lock:
            known = self._by.get(key)
        root, proof = lineage.root_of(body, api, encoding, members, known)
        if proof is not known:
            self._keep(key, proof)
        return root

    def proven(self, key: tuple[str, str], body: bytes, api: str) -> str | None:
        """The root the conversation's last proof proves for ``body`` (not content-encoded), or
        None: nothing proven (none kept, or other first bytes) — read it with ``root``."""
        with self._lock:
            known = self._by.get(key)
        return lineage.proven_root(body, api, known) if known is not None else None

    def _keep(self, key: tuple[str, str], proof: lineage.FirstRun | None) -> None:
        with self._lock:
            old = self._by.pop(key, None)
            if old is not None:
                self._bytes -= len(old.first)
            if proof is None or len(proof.first) > self.MAX_ONE:
                return
            self._by[key] = proof
            self._bytes += len(proof.first)
            while len(self._by) > self.MAX or self._bytes > self.MAX_BYTES:
                self._bytes -= len(self._by.popitem(last=False)[1].first)


class _Watched(FlowState):
    __slots__ = ("agent", "session", "api", "opening", "reader", "anchors", "server", "root")

    def __init__(self, agent: str, session: str, api: str, opening: bool, server: str | None = None,
                 root: str | asyncio.Future | None = None) -> None:
        self.agent, self.session, self.api, self.opening = agent, session, api, opening
        self.server = server         # who answers it: the anchors' issuer
        self.root = root             # the request's root: known, being read, or None
        self.reader: StreamReader | None = None
        self.anchors: list[str] = []


class _Held(perflow.FlowState):
    """A large request's root read, held in its flow until the body has left."""

    __slots__ = ("future", "args")

    def __init__(self, future: asyncio.Future, args: tuple) -> None:
        self.future, self.args = future, args


class LineageWatch:
    def __init__(self, runtime: StoreRuntime) -> None:
        self.runtime = runtime
        self.recorded = 0            # records written
        self.dropped = 0             # records dropped: the store could not keep up, or failed
        self.reads = OffLoop("lineage-records", gather=GATHER)
        self._holding = 0            # large bodies' root reads held in their flows, not yet sent on
        self._roots: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()  # (agent, root) -> (session, when)
        self._proofs = _Proofs()     # (agent, session) -> the last root's proof
        self._pending: deque[list[Write]] = deque()
        self._writes = 0             # writes in _pending
        self._flusher: asyncio.Task | None = None
        self._failing = False        # the last batch failed (logged once per streak)
        self.later = Later("lineage")   # what an answer gives, read once it has left

    def done(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()       # (the exit's drain ran out of time: what is left is dropped)
        self.reads.close()

    def busy(self) -> bool:
        """Work a stop would lose: answers not yet read, reads, records not yet written."""
        return bool(self.later.pending or self.reads.jobs or self._pending
                    or (self._flusher is not None and not self._flusher.done()))

    async def drain(self) -> None:
        """At a clean stop, before the store closes (``bundle.Sessionpin.done``): what the answers
        that ended give, then the reads, then the records, written. The caller bounds the wait."""
        while self.busy() and self.runtime.store is not None:
            await asyncio.sleep(0.01)

    def counts(self) -> dict[str, int]:
        """For the metrics: records written, dropped, skipped; reads and records still pending."""
        flushing = self._flusher is not None and not self._flusher.done()
        return {"written": self.recorded, "dropped": self.dropped, "skipped": self.reads.skipped,
                "pending": self.reads.jobs + self._holding + len(self._pending) + int(flushing)}

    def watch(self, flow: http.HTTPFlow, state: State) -> None:
        """Called by the router once a request is decided and on its way."""
        f = state.request.facts
        d = state.decision
        if not state.session or f.agent not in F.AGENTS or f.api not in _CHAINED or d is None or d.refuse:
            return
        pin = state.loaded.pin
        if pin is None and d.pin_action != "create":
            return
        agent, session = f.agent, state.session
        fork = bool(pin.parent if pin is not None else state.parent)
        root: str | asyncio.Future | None = None
        if f.has_history and (not fork or agent == F.CLAUDE_CODE):
            root = self._request_root(flow, state)
            if not fork:
                _when(root, lambda r: self._learn_root(agent, session, r))
        # an opening's answer gives its root: the one that pinned it, and one retried under its
        # pin (the first try answered with an error or cut short: a 529, a pool member's 429, a
        # dropped stream), whose whole answer is the only one the conversation keeps
        opening = not f.has_history and f.turn in (F.OPENING, F.UNKNOWN_TURN) and (d.pin_action == "create"
                                                                                   or not fork)
        if not opening and agent != F.CLAUDE_CODE:
            return          # nothing to read from its answer: no root to learn, no anchor to keep
        source = state.request.source
        flow.metadata[perflow.LINEAGE] = _Watched(agent, session, f.api, opening,
                                                  d.target or (source.name if source else None), root)

    def _request_root(self, flow: http.HTTPFlow, state: State) -> str | asyncio.Future | None:
        """The root of the history this request carries: read already, or being read on the thread."""
        if state.lineage is not None:          # the request path read it already
            return state.lineage.root
        req = flow.request
        body = req.raw_content
        if not body:
            return None
        key, api = (state.request.facts.agent, state.session or ""), state.request.facts.api
        encoding = headerview.get(req.headers, "content-encoding")
        if len(body) < HOLD_FROM and not encoding and (root := self._proofs.proven(key, body, api)) is not None:
            return root         # proven by its first bytes, here: no hop for a few µs of memcmp
        args = (key, body, api, encoding, perflow.sent_members(flow))
        if len(body) < HOLD_FROM:
            return self.reads.submit(len(body), self._proofs.root, *args)
        held = asyncio.get_running_loop().create_future()
        flow.metadata[perflow.LINEAGE_HELD] = _Held(held, args)
        self._holding += 1
        return held

    def _release(self, flow: http.HTTPFlow) -> None:
        """A held read goes to the thread: the request's body has left (an answer came, or an error)."""
        got = flow.metadata.pop(perflow.LINEAGE_HELD, None)
        if got is None:
            return
        self._holding -= 1
        held, args = got.future, got.args
        fut = self.reads.submit(len(args[1]), self._proofs.root, *args)
        if fut is None:                  # over the reads' bound (counted there): no record
            held.set_result(None)
            return
        fut.add_done_callback(lambda done: held.done() or held.set_result(_result(done)))

    def _learn_root(self, agent: str, session: str, root: str | None) -> None:
        if not root:
            return
        seen = self._roots.get((agent, root))
        if seen is not None and seen[0] == session and time.monotonic() - seen[1] < REFRESH:
            return
        self._recorded_lately(agent, root, session)
        self._record(lineindex.record_writes(agent, session, root))

    def known_root(self, agent: str, root: str) -> str | None:
        """The conversation this proxy lately recorded ``root`` for — written to the store or
        still on its way there (the router asks when the store has no entry for it yet)."""
        seen = self._roots.get((agent, root))
        return seen[0] if seen is not None and time.monotonic() - seen[1] < REFRESH else None

    def _recorded_lately(self, agent: str, root: str, session: str) -> None:
        self._roots[(agent, root)] = (session, time.monotonic())
        self._roots.move_to_end((agent, root))
        while len(self._roots) > MAX_ROOTS:
            self._roots.popitem(last=False)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._release(flow)
        w = flow.metadata.get(perflow.LINEAGE)
        resp = flow.response
        if w is None or resp is None:
            return
        if not 200 <= resp.status_code < 300:
            del flow.metadata[perflow.LINEAGE]
            return
        if w.agent == F.CLAUDE_CODE:
            request_id = headerview.get(resp.headers, "request-id", None)
            if request_id and F.clean_id(request_id):
                w.anchors.append("req:" + request_id.strip())
        if w.opening and "text/event-stream" in headerview.get(resp.headers, "content-type").lower():
            # (the router turned streaming on; the reader streams it the same, and reads it)
            w.reader = StreamReader(w.api, headerview.get(resp.headers, "content-encoding"))
            resp.stream = w.reader

    def response(self, flow: http.HTTPFlow) -> None:
        self._release(flow)
        w = flow.metadata.pop(perflow.LINEAGE, None)
        if w is not None and (w.reader is not None or w.anchors):
            self.later.call(flow, self._answered, flow, w)     # once the answer has left (``later``)

    def _answered(self, flow: http.HTTPFlow, w: _Watched) -> None:
        """What an answer gives: an opening's root (its head read on the thread) and the
        anchors, recorded with the conversation's root."""
        if w.reader is not None:
            answer = w.reader.result()
            req = flow.request
            body = req.raw_content
            if answer.complete and not answer.overflow and body:
                encoding = headerview.get(req.headers, "content-encoding")

                def answered(head: str | None) -> None:
                    root = lineage.extend(head, answer.digest) if head is not None else None
                    if root:
                        self._recorded_lately(w.agent, root, w.session)
                        self._record(lineindex.record_writes(w.agent, w.session, root, w.anchors, w.server))
                if w.session.startswith(FINGERPRINT_PREFIX) and len(body) < HOLD_FROM and not encoding:
                    # a conversation without an id (pi's): its opening's head, here (a few KB, no
                    # history: µs), so its root is known to ``known_root`` before any later request
                    # of its client is read — its next turn, placed by its root, follows at once,
                    # before the records reach the store. (Others are placed by their ids: the
                    # thread, as before — a Claude Code opening's 100 KB would cost the loop more.)
                    answered(_head(body, w.api, ""))
                else:
                    _when(self.reads.submit(len(body), _head, body, w.api, encoding), answered)
            return
        if w.anchors:
            _when(w.root, lambda root: self._record(
                lineindex.record_writes(w.agent, w.session, root, w.anchors, w.server, owns_root=False)))

    def error(self, flow: http.HTTPFlow) -> None:
        self._release(flow)
        flow.metadata.pop(perflow.LINEAGE, None)

    async def settled(self, timeout: float = 10.0) -> None:
        """Wait until every read is done and every record written or dropped (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self.later.pending or self.reads.jobs or self._pending or \
                (self._flusher is not None and not self._flusher.done()):
            if time.monotonic() > deadline:
                raise TimeoutError("lineage records still pending")
            await asyncio.sleep(0.01)

    def _record(self, writes: list[Write]) -> None:
        if self.runtime.store is None or not writes:
            return
        self._pending.append(writes)
        self._writes += len(writes)
        while self._writes > MAX_PENDING and len(self._pending) > 1:
            self._writes -= len(self._pending.popleft())
            self.dropped += 1
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        await asyncio.sleep(FLUSH_DELAY)
        while self._pending and self.runtime.store is not None:
            batch = list(self._pending)
            self._pending.clear()
            self._writes = 0
            try:
                await self.runtime.store.apply([], [x for writes in batch for x in writes])
                self.recorded += len(batch)
                if self._failing:
                    log.info("sessionpin: lineage records are written again")
                self._failing = False
            except Exception as e:
                self.runtime.errors += 1
                self.dropped += len(batch)
                self._roots.clear()      # what was not written is not "recorded lately"
                if not self._failing:
                    log.warning("sessionpin: lineage records not written (%s); dropped until the store takes "
                                "writes again (forks of these conversations are then left alone)", e)
                self._failing = True


def _when(value: str | asyncio.Future | None, then) -> None:
    """``then(value)``, at once or once the read it stands for is done (a read skipped: None)."""
    if isinstance(value, asyncio.Future):
        if value.done():
            then(_result(value))
        else:
            value.add_done_callback(lambda done: then(_result(done)))
    else:
        then(value)


def _result(fut: asyncio.Future) -> str | None:
    """A read's answer; a read that failed (or was cancelled at shutdown) records nothing."""
    if fut.cancelled() or fut.exception() is not None:
        return None
    return fut.result()
