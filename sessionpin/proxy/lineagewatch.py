"""LineageWatch: remember what later requests may name a conversation by.

A fork or resume under a new id (``claude --fork-session``, ``opencode --fork``, ``pi
--fork``, …) carries its parent's history; to find the parent, the router needs to have
remembered, from the parent's own traffic, the ids and hashes that history will hold
(``sessionpin.lineindex``). This addon does that after a response, never on the
request's path. Rules it keeps:

- An opening (and any request that pinned a conversation without history) has its
  streamed answer read as it passes (``lineage_stream.StreamReader``, every chunk
  forwarded unchanged and undelayed); once the answer completes, its history's head is
  read from the request (``lineage.chain(turns=1)``: after the answer, never before the
  request leaves — a 1 MB opening message costs ~10 ms to hash) and the conversation's
  root key (``lineage.extend(head, answer.digest)``) is recorded for it.
- Every successful Claude Code response records its ``request-id`` header as an anchor
  (Claude Code names it in ``cc_prev_req`` when another process resumes or forks).
- Only ids and hashes; records are not durable and never delay a request or a response.
- Bounded: at most ``MAX_WATCHED`` responses are watched at once (the oldest dropped).
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
from collections import OrderedDict, deque

from mitmproxy import http

from .. import facts as F
from .. import lineage, lineindex
from ..lineage_stream import StreamReader
from ..route import State
from ..store.base import Write
from .storeruntime import StoreRuntime

log = logging.getLogger("sessionpin")

MAX_WATCHED = 10_000
MAX_PENDING = 10_000
FLUSH_DELAY = 0.1        # seconds records gather before a write: one thread wakeup for many responses
_CHAINED = (F.ANTHROPIC_MESSAGES, F.OPENAI_CHAT, F.OPENAI_RESPONSES)


class _Watched:
    __slots__ = ("agent", "session", "api", "opening", "reader", "anchors")

    def __init__(self, agent: str, session: str, api: str, opening: bool) -> None:
        self.agent, self.session, self.api, self.opening = agent, session, api, opening
        self.reader: StreamReader | None = None
        self.anchors: list[str] = []


class LineageWatch:
    def __init__(self, runtime: StoreRuntime) -> None:
        self.runtime = runtime
        self.recorded = 0            # records written
        self.dropped = 0             # records dropped: the store could not keep up, or failed
        self._watched: OrderedDict[str, _Watched] = OrderedDict()
        self._pending: deque[list[Write]] = deque()
        self._writes = 0             # writes in _pending
        self._flusher: asyncio.Task | None = None
        self._failing = False        # the last batch failed (logged once per streak)

    def watch(self, flow: http.HTTPFlow, state: State) -> None:
        """Called by the router once a request is decided and on its way."""
        f = state.request.facts
        d = state.decision
        if not state.session or f.agent not in F.AGENTS or f.api not in _CHAINED or d is None or d.refuse:
            return
        pinned = state.loaded.pin is not None or d.pin_action == "create"
        if not pinned:
            return
        opening = not f.has_history and f.turn in (F.OPENING, F.UNKNOWN_TURN) and d.pin_action == "create"
        if not opening and f.agent != F.CLAUDE_CODE:
            return          # nothing to record: no root to learn, no anchor to keep
        self._watched[flow.id] = _Watched(f.agent, state.session, f.api, opening)
        while len(self._watched) > MAX_WATCHED:
            self._watched.popitem(last=False)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        w = self._watched.get(flow.id)
        resp = flow.response
        if w is None or resp is None:
            return
        if not 200 <= resp.status_code < 300:
            self._watched.pop(flow.id, None)
            return
        if w.agent == F.CLAUDE_CODE:
            request_id = resp.headers.get("request-id")
            if request_id and F.clean_id(request_id):
                w.anchors.append("req:" + request_id.strip())
        if w.opening and "text/event-stream" in resp.headers.get("content-type", "").lower():
            # (the router turned streaming on; the reader streams it the same, and reads it)
            w.reader = StreamReader(w.api, resp.headers.get("content-encoding", ""))
            resp.stream = w.reader

    def response(self, flow: http.HTTPFlow) -> None:
        w = self._watched.pop(flow.id, None)
        if w is None:
            return
        root = None
        if w.reader is not None:
            answer = w.reader.result()
            if answer.complete and not answer.overflow:
                req = flow.request
                head = lineage.chain(req.raw_content, w.api, turns=1,
                                     content_encoding=req.headers.get("content-encoding", "")).head
                root = lineage.extend(head, answer.digest) if head is not None else None
        if root or w.anchors:
            self._record(w, root)

    def error(self, flow: http.HTTPFlow) -> None:
        self._watched.pop(flow.id, None)

    def _record(self, w: _Watched, root: str | None) -> None:
        if self.runtime.store is None:
            return
        writes = lineindex.record_writes(w.agent, w.session, root, w.anchors)
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
                if not self._failing:
                    log.warning("sessionpin: lineage records not written (%s); dropped until the store takes "
                                "writes again (forks of these conversations are then left alone)", e)
                self._failing = True
