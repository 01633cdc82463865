"""Router: runs the request stepper (``sessionpin.decision.route``) on each flow.

One request: ``route.ambiguous`` → ``facts.read`` → ``route.begin`` → perform each effect
(a pin read, the request's bytes for the rewrite plan, a durable pin write, a connect
check) and feed its answer back with ``route.step`` → answer the flow as the last step
says (forward rewritten, leave alone, refuse) → comment, 📌, metadata, one log line. The
rules of where a request goes, and of what it is answered, are the stepper's (route.py
lists them: the ambiguous path, the unreachable server and the redirect among them); the
participants' turn after the decision (the OpenCode id pool) is still the shell's. Rules
this module keeps, about performing and showing:

- An inference request of a known agent either leaves decided and rewritten as a whole,
  or is answered here in its API's error format (``sessionpin.decision.answers``): an exception
  never drops a flow and never lets such a request leave half-done. Anything else
  passes untouched.
- A large body's lineage (its links and its history's root, when a rule needs them) is read
  on a thread of the router's own (``offloop.OffLoop``), bounded per request by the reader's
  budget: the request waits for it, every other client's bytes do not.
- A large body's facts are first read here by its parts (``read_in_parts``: from 256 KiB,
  under 8 MiB, not compressed; ``facts.read_parts``): bounded work whatever the body holds,
  building at most 20,000 objects. Only a body its parts do not tell is read whole, and then
  (``read_apart``: more than 20,000 JSON objects, compressed, or from 8 MiB) in a process of
  the router's own (``offprocess.BodyProcess``): a whole-body decode is one long C call
  holding the GIL, so a thread would not spare the event loop. Any other body's are read
  inline (no hop).
- A POST at a path that ends with an endpoint after a version segment (``paths.lookalike``:
  another API's resource, or a gateway's versioned path) has its facts read, and is guarded as
  a path sessionpin does not route when its body is an inference request (a model) or cannot
  be read; otherwise it passes as any request out of scope.
- A store that lost what it held (``StoreGuard``) routes nothing: every request that would
  read or write a pin is refused (503 naming the store and the loss), and nothing is
  written over the loss.
- Store calls go through the store's async facade; the pin's renewal, a title's memory
  and a "not routed" pin are written after the request left (never waited for).
- ``CheckReachable`` is ``ConnectCheck``'s: with no open connection to that server it tries
  a TCP connect, riding out a blip.
- Streamed responses (SSE, NDJSON, and any routed response without a length) pass
  through as they arrive: ``responseheaders`` turns streaming on.
- After the decision, each participant (``participants.Participant``: the OpenCode id pool,
  the server pools, the ledger's counters) has its ``request`` called, in order; one that
  returns a ``Refuse`` gets it answered like the router's own refusals, and the request is
  not sent. A participant's exception is logged and the request goes on without it.
- A redirect the stepper refuses (``route.redirect_refused``) is answered in
  ``responseheaders``, before anything of it can leave: its status and headers become the
  502's (no ``Location``), its body a stream that drops the upstream's bytes and gives the
  refusal's at the end, whether mitmproxy streams the body (past ``stream_large_bodies``) or
  not. One refusal, counted once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections import Counter
from typing import Any, Mapping

import msgspec
from mitmproxy import ctx, http
from mitmproxy.net.http import url

from ..config.redact import scrub, unquoted
from ..decision import answers, ladder, rewrite, route
from ..records import lineindex, pins
from ..reader import facts as F
from ..reader.ids import short
from ..store import StoreError
from . import perflow, websocket
from ..reader import headerview, paths, scan
from .allocations import Allocations
from .configwatch import ConfigWatch
from .defaults import DecisionLog
from .later import after_hook
from .offloop import OffLoop
from .offprocess import BodyProcess
from .participants import Participant
from .connect import ConnectCheck
from .storeruntime import StoreRuntime
from .unrouted import Unrouted

log = logging.getLogger("sessionpin")

INTERNAL_PREFIX = "/__sessionpin/"
TITLE_PREFIX = "title:"
STREAM_TYPES = ("text/event-stream", "application/x-ndjson", "application/ndjson", "application/jsonl",
                "application/stream+json")
OFF_LOOP_MIN = 256 * 1024  # bytes: a body's lineage is read on a thread from here (a hop costs ~0.1 ms)
FACTS_OFF_LOOP_MIN = 256 * 1024   # bytes: a body's facts may be read in the body reader's process from here
                                 # (a whole-body decode of tiny messages: ~70 ms per MiB on this loaded machine)
FACTS_INLINE_ITEMS = 20_000       # JSON objects: a plain body with fewer is read here (~10 ms at most)
FACTS_INLINE_MAX = 8 * 1024 * 1024  # bytes: from here a body always goes to the process
STORE_READS = (route.ReadPin, route.ReadTitle, route.FindConversation, route.FindParent)
STORE_RETRY_STEP = 0.2     # seconds between reads while riding out a store's blip
STORE_DOWN_FOR = 10.0      # seconds a store that failed a whole budget is said at once


class Metrics:
    """What the router counts (rendered by the status addon)."""

    def __init__(self) -> None:
        self.decisions: Counter[tuple[str, str, str]] = Counter()   # (agent, turn, outcome)
        self.rules: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self.store_errors = 0
        self.store_lost = 0          # requests refused because the store lost what it held
        self.pin_writes = 0          # pins this proxy wrote or tried to: the status's counts are stale
        self.lineage = None          # () -> the lineage watch's counts (LineageWatch.counts), set by make_addons
        self.unrouted = Unrouted()   # looked like inference at a configured origin, left alone


class Router:
    def __init__(self, config: ConfigWatch, runtime: StoreRuntime, connect: ConnectCheck, metrics: Metrics,
                 participants: list[Participant] | None = None, env: Mapping[str, str] | None = None,
                 allocations: Allocations | None = None, decisions: DecisionLog | None = None,
                 bodies: BodyProcess | None = None) -> None:
        self.config = config
        self.decisions = decisions if decisions is not None else DecisionLog()   # Defaults sets where lines go
        self.allocations = allocations or Allocations(config, runtime, connect)   # server pools' effects
        self.runtime = runtime
        self.connect = connect
        self.metrics = metrics
        self.participants = list(participants or [])
        self.env = env if env is not None else os.environ
        self.lineage = None          # a LineageWatch, set by make_addons: it records what forks name
        self.reads = OffLoop("lineage-request", workers=2)    # a large body's lineage, off the event loop
        self.bodies = bodies or BodyProcess()    # a large body's facts, in a process of its own
        self._background: set[asyncio.Task] = set()
        self._store_down: float | None = None   # when a store read last failed a whole budget (monotonic)

    def load(self, loader) -> None:
        loader.add_option(
            "sessionpin_store_retry_ms", int, 2000,
            "sessionpin: how long a pin read may fail (a store restarting, a blip) before the agent is told "
            "the store cannot be read; 0: tell at once.",
        )

    def done(self) -> None:
        self.reads.close()
        self.bodies.close()

    # ---- the request hook -------------------------------------------------------------------
    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or flow.metadata.get("sessionpin", {}).get("refused"):
            return
        if flow.metadata.pop(perflow.PAGE, None) is not None:
            return      # a web page browsing a host no server names (browsers.PageGuard): never routed
        req = flow.request
        if req.path.startswith(INTERNAL_PREFIX):
            return
        facts: F.Facts | None = None
        decision: ladder.Decision | None = None
        try:
            # the one scope rule (BodyLimit and ConnectCheck ask the same: config.Config.scope);
            # a WebSocket upgrade is scoped as the POST its socket's turns stand for
            upgrade = websocket.is_upgrade(req)
            source, scope = self.config.config.scope("POST" if upgrade else req.method, req.scheme, req.host,
                                                     req.port, req.path)
            # (an upgrade only when its path looks like inference: a configured origin's other
            # sockets, whatever their paths, are not sessionpin's)
            if refusal := route.ambiguous(req.path, scope.refuse, source is not None and not upgrade):
                self._refuse(flow, None, refusal)
                return
            if upgrade:
                decision = await self._websocket(flow)
            elif scope.inference:
                facts = await self._facts(req, scope.api, flow)
                decision = await self._route(flow, facts, source)
            elif req.method == "POST" and (named := paths.named(req.method, req.path,
                                                                source.prefix if source else None)) is not None:
                # a path it does not route, which a server may serve as inference: its
                # conversation's pin is read, so one pinned elsewhere is refused, never sent here
                if source is not None:
                    self.metrics.unrouted.note(source, req.method, req.path)   # said once, never silent
                facts = await self._facts(req, named[1], flow)
                decision = await self._route(flow, facts, source, unnamed=named[0])
            elif req.method == "POST" and (alike := paths.lookalike(req.method, req.path,
                                                                   source.prefix if source else None)) is not None:
                # ends with an endpoint after a version segment: another API's resource
                # (/v1/threads/x/messages) or a gateway's versioned path (Cloudflare's
                # /v1/ACCT/GW/anthropic/v1/messages). Its body tells: an inference request (a
                # model, or a conversation's history or tools: an Azure deployment's body names
                # no model), or one that cannot be read, is guarded as a path it does not route
                read = await self._facts(req, alike[1])
                if read.agent in F.AGENTS and (read.model or read.has_history or read.has_tools or not read.parsed):
                    facts = read
                    decision = await self._route(flow, facts, source, unnamed=alike[0])
            if facts is None and decision is None and not upgrade and not scope.inference \
                    and any(_wants(p, req.method, req.url) for p in self.participants):
                facts = await self._facts(req, None)
        except Exception as e:
            if facts is None or facts.agent not in F.AGENTS:
                log.exception("sessionpin: passing %s through after an error", req.pretty_host)
            else:
                log.exception("sessionpin: cannot decide %s %s", req.method, req.path.split("?")[0])
                self._refuse(flow, facts, route.Refuse(
                    502, "error", f"sessionpin could not decide this request ({type(e).__name__}: {_said(e)}); "
                                  "it was not sent"))
                return
        if flow.response is None:
            for p in self.participants:
                try:
                    refusal = await p.request(flow, facts, decision)
                except Exception:
                    log.exception("sessionpin: participant %s failed", type(p).__name__)
                    continue
                if isinstance(refusal, route.Refuse):   # e.g. the OpenCode id pool's store failed
                    self._refuse(flow, facts, refusal)
                    return

    async def _facts(self, req: http.Request, api: str | None, flow: http.HTTPFlow | None = None) -> F.Facts:
        """The request's facts: read here for a small body (no hop: most requests are a few KB),
        in the body reader's process for a large one (never on the event loop, nor on a thread,
        which would hold the GIL in the same long C calls). The body's top level, when the read
        made it as raw members, is kept in ``flow`` for the readers after it (``perflow.Body``).
        A large body is first read by its parts here (``read_in_parts``), whatever it holds: only
        one they cannot tell is counted for where its whole read runs (``read_apart``)."""
        raw, encoding = req.raw_content, _content_encoding(req)
        if raw is not None and read_in_parts(raw, encoding):
            facts = F.read_parts(req.method, req.url, req.headers.fields, raw, api=api, objects=FACTS_INLINE_ITEMS)
            if facts is not None:
                return facts
        if raw is not None and read_apart(raw, encoding):
            return await self.bodies.facts(req.method, req.url, req.headers.fields, raw, encoding, api)
        members: list | None = [] if flow is not None else None
        facts = F.read(req.method, req.url, req.headers.fields, raw, encoding, api=api,
                       locate_model=self.config.config.renames, members=members)
        if members:
            flow.metadata[perflow.BODY] = perflow.Body(members[0])   # type: ignore[union-attr]
        return facts

    async def _route(self, flow: http.HTTPFlow, facts: F.Facts, source, unnamed: str = "") -> ladder.Decision | None:
        cfg = self.config.config
        nonce = secrets.token_hex(4) if facts.session_source == "fingerprint" else ""
        req = flow.request
        s = route.begin(route.Request(facts=facts, source=source, config=cfg, now=time.time(), nonce=nonce,
                                      scheme=req.scheme, host=req.host, port=req.port, path=req.path,
                                      upgrade=websocket.is_upgrade(req), env=self.env, unnamed=unnamed))
        while not s.done:
            s = route.step(s.state, await self._perform(flow, s.state, s.effect))
        await self._finish(flow, s)
        return s.state.decision

    async def _perform(self, flow: http.HTTPFlow, state: route.State, effect: route.Effect) -> route.Event:
        store = self.runtime.store
        if isinstance(effect, route.Plan):
            req = flow.request
            body = None
            if effect.body:     # as sent when it has no content-encoding (what get_content would return)
                body = req.get_content(strict=False) if _content_encoding(req) else req.raw_content
            return route.Planned(route.plan(state, effect, lambda: headerview.pairs(req.headers), body))
        if isinstance(effect, route.CheckReachable):
            where = (effect.host, effect.port)
            self.connect.moved_to(where, effect.target)
            return route.Reachable(await self.connect.reachable(flow.client_conn.id, where))
        if isinstance(effect, (route.CreatePin, route.Allocate)):
            self.metrics.pin_writes += 1
        if isinstance(effect, route.ReadLineage):
            req = flow.request
            raw, encoding = req.raw_content, headerview.get(req.headers, "content-encoding")
            if raw is not None and len(raw) >= OFF_LOOP_MIN:      # never on the event loop
                return await self.reads.run(route.lineage_of, req.headers.fields, raw, encoding,
                                            state.request.facts.api)
            return route.lineage_of(req.headers.fields, raw, encoding, state.request.facts.api)
        guard = self.runtime.guard
        if store is not None:
            try:
                lost = await guard.gate(store)      # a store that lost what it held decides nothing
            except StoreError as e:
                return self._store_failed(store, effect, e)
            if lost is not None:
                self.metrics.store_lost += 1
                return route.StoreLost(lost)
        if isinstance(effect, (route.Allocate, route.CheckMember)):
            return await self.allocations.perform(flow, state, effect)
        if store is None:
            return route.StoreFailed("no store is open")
        if isinstance(effect, STORE_READS):
            return await self._read(store, effect, state)
        return await self._store_call(store, effect, state)

    async def _read(self, store, effect: route.Effect, state: route.State) -> route.Event:
        """A store read that fails is tried again every ``STORE_RETRY_STEP`` within
        ``sessionpin_store_retry_ms`` (a store restarting, a blip), unless the store failed a
        whole budget in the last ``STORE_DOWN_FOR`` seconds: then it is said at once."""
        got = await self._store_call(store, effect, state)
        if not isinstance(got, route.StoreFailed):
            self._store_down = None
            return got
        now = time.monotonic()
        if self._store_down is not None and now - self._store_down < STORE_DOWN_FOR:
            return got
        deadline = now + max(0, _option("sessionpin_store_retry_ms", 2000)) / 1000
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(STORE_RETRY_STEP, left))
            again = await self._store_call(self.runtime.store or store, effect, state)
            if not isinstance(again, route.StoreFailed):
                self._store_down = None
                return again
            got = again
        self._store_down = time.monotonic()
        return got

    async def _store_call(self, store, effect: route.Effect, state: route.State) -> route.Event:
        guard = self.runtime.guard
        try:
            if isinstance(effect, route.ReadPin):
                loaded = await pins.load(store, effect.session)
                now = time.time()
                if loaded.pin is not None:
                    guard.saw(effect.session, loaded.pin, now)
                elif lost := await guard.missed(store, effect.session, state.request.facts.agent, now):
                    self.metrics.store_lost += 1
                    return route.StoreLost(lost)    # a pin it had (or the whole store) is gone: not "no pin"
                return route.PinRead(loaded)
            if isinstance(effect, route.ReadTitle):
                return route.TitleRead(await store.get(TITLE_PREFIX + effect.session))
            if isinstance(effect, route.FindConversation):
                found = await lineindex.find_conversation(store, effect.agent, effect.root, effect.fingerprint)
                if not found.by_root and effect.root and self.lineage is not None \
                        and (mine := self.lineage.known_root(effect.agent, effect.root)):
                    # this proxy saw that root made (an opening's answer a moment ago) and its
                    # record is still on its way to the store: the conversation is known
                    return route.ConversationFound(mine)
                return route.ConversationFound(found.session, found.apart)
            if isinstance(effect, route.FindParent):
                async def missing(session: str) -> str | None:     # a parent's missing pin: lost, or never?
                    return await guard.missed(store, session, effect.agent, time.time())
                found = await lineindex.find_parent(store, effect.agent, effect.session, effect.sessions,
                                                    effect.anchors, effect.root, state.request.config.servers,
                                                    missing)
                for anchor, issuers in found.voided:
                    log.warning("sessionpin: %s %s: the anchor %s was issued by %d servers (%s); it names no "
                                "conversation (an anchor belongs to the one server that issued it)", effect.agent,
                                short(effect.session), anchor, len(issuers), ", ".join(issuers))
                if found.lost:
                    self.metrics.store_lost += 1
                    # its parent's pin is gone: not "no parent". The parent by its short id on the
                    # agent's screen, as the session's own (``_refuse``); the guard logged the whole one
                    parent = found.lost_parent or ""
                    return route.StoreLost(found.lost.replace(parent, short(parent)) if parent else found.lost)
                return route.ParentFound(found.session, found.loaded) if found.session else route.ParentFound(None)
            if isinstance(effect, route.CreatePin):
                got = await pins.create(store, effect.session, effect.pin, effect.seen)
                guard.saw(effect.session, got.pin, time.time(), made=got.pin == effect.pin)
                return route.PinCreated() if got.pin == effect.pin else route.PinLost(got)
        except StoreError as e:
            return self._store_failed(store, effect, e)
        raise TypeError(f"unexpected effect {effect!r}")

    def _store_failed(self, store, effect: route.Effect, e: StoreError) -> route.Event:
        self.metrics.store_errors += 1
        msg = f"{store.url}: {e}" if store.url not in str(e) else str(e)
        return route.NotSaved(msg) if isinstance(effect, route.CreatePin) else route.StoreFailed(msg)

    async def _finish(self, flow: http.HTTPFlow, s: route.Step) -> None:
        state, effect = s.state, s.effect
        facts = state.request.facts
        if isinstance(effect, route.Refuse):
            self._decided(flow, state, effect.changes, refused=effect)
            self._refuse(flow, facts, effect)
            return
        changes = effect.changes if isinstance(effect, route.Forward) else None
        if changes is not None:
            _apply(flow.request, changes)
        body = flow.metadata.get(perflow.BODY)
        if body is not None:            # the body as it leaves, for the readers after it
            if changes is not None and changes.model is not None:
                body.members = {**body.members, "model": msgspec.Raw(msgspec.json.encode(changes.model[1]))}
            body.sent = flow.request.raw_content
        for after in s.after:
            self._later(after)
        self._decided(flow, state, changes)
        if changes is not None and websocket.is_upgrade(flow.request):
            flow.metadata["sessionpin"][websocket.MODELS] = websocket.socket_models(state)
        if self.lineage is not None:
            self.lineage.watch(flow, state)

    # ---- effects that run after the request left --------------------------------------------
    def _later(self, after: route.After) -> None:
        store = self.runtime.store
        if store is None or self.runtime.guard.lost is not None:
            return          # nothing is written over a loss

        async def run() -> None:
            await after_hook()      # (mitmproxy's tasks start eagerly: not inside the hook, before the request left)
            if self.runtime.guard.lost is not None:
                return              # (a loss seen in the meantime: nothing is written over it)
            try:
                if isinstance(after, route.RenewPin):
                    await pins.renew(store, after.session, after.seen, time.time())
                elif isinstance(after, route.RememberTitle):
                    await store.set(TITLE_PREFIX + after.session, after.server, after.ttl)
                elif isinstance(after, route.WritePin):
                    self.metrics.pin_writes += 1
                    await pins.create(store, after.session, after.pin, after.seen)
                elif isinstance(after, route.RememberOpening):
                    await lineindex.remember_opening(store, after.agent, after.fingerprint, after.session)
            except Exception as e:
                self.metrics.store_errors += 1
                log.warning("sessionpin: %s for %s: %s", type(after).__name__, short(getattr(after, "session", "")), e)
        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- answering and showing ---------------------------------------------------------------
    def _refuse(self, flow: http.HTTPFlow, facts: F.Facts | None, r: route.Refuse) -> None:
        api = r.api
        if api is None:
            api = facts.api if facts and facts.api in F.INFERENCE_APIS else F.api_of("POST", flow.request.path)
        meta = flow.metadata.setdefault("sessionpin", {})
        message = r.message
        if r.status == answers.NO_RETRY_STATUS:
            # On the agent's screen the session is its short id (what `sessionpin sessions` shows
            # and `move` takes): pi retries an error whose text holds "429", "500"…"504", which a
            # long hex id often does. The log line keeps the whole id.
            ids = {meta.get("session"), meta.get("parent"), facts.session if facts else None} - {None, ""}
            for sid in sorted(ids, key=len, reverse=True):
                message = message.replace(sid, short(sid))
        if r.status == answers.NO_RETRY_STATUS:
            # as each agent shows it at once: Codex's 400 in plain text, an upgrade's 426 (Codex:
            # to HTTPS now, not seven upgrades first), everyone else's 424
            status, body, headers = answers.no_retry(facts.agent if facts else F.UNKNOWN_AGENT, api, r.kind,
                                                     message, upgrade=websocket.is_upgrade(flow.request))
        else:
            status = r.status
            body, headers = answers.refusal(api, r.status, r.kind, message, r.retry_after)
        flow.response = http.Response.make(status, body, headers)
        self.metrics.refusals[r.kind] += 1
        meta.update({"refused": r.status, "refusal": r.kind, "message": r.message})
        if not flow.comment:
            flow.comment = f"refused {r.status}: {r.kind}"
        rule = meta.get("rule")
        log.warning("sessionpin: refused %d (%s) %s %s%s%s: %s", r.status, r.kind, facts.agent if facts else "-",
                    f"{facts.turn} " if facts and facts.turn else "", short(meta.get("session") or
                                                                           (facts.session if facts else None)),
                    f" [{rule}]" if rule else "", r.message)

    def _decided(self, flow: http.HTTPFlow, state: route.State, changes: rewrite.Changes | None,
                 refused: route.Refuse | None = None) -> None:
        r, d = state.request, state.decision
        facts = r.facts
        if d is None:     # refused before a decision (the pin could not be read)
            d = ladder.Decision(None, ladder.NONE, ladder.Rule.STORE_UNREADABLE, "pin store unreadable")
        turn = facts.turn or "-"
        session = state.session or facts.session
        sid = short(session)
        where = f"refused {refused.status}" if refused else (d.target or "left alone")
        why = refused.kind if refused and not d.refuse else d.why
        if state.parent:
            why = f"fork of {short(state.parent)}" + (f": {why}" if d.refuse or refused else "")
        flow.comment = f"{turn} {sid} → {where} ({why})"
        if d.target is not None and refused is None:
            flow.marked = ":pushpin:"
        pin = state.loaded.pin
        outcome = ladder.REFUSED if refused else d.outcome
        meta: dict[str, Any] = {
            "agent": facts.agent, "session": session, "session_source": facts.session_source,
            "turn": facts.turn, "api": facts.api, "rule": d.rule, "why": d.why, "outcome": outcome,
            "target": d.target, "source": r.source.name if r.source else None, "pin_action": d.pin_action,
            "pinned": pin.server if pin else None, "reason": facts.reason,
            "pool": pin.pool if pin is not None and pin.pool else None,     # a server pool's allocation
            "moved": changes is not None and refused is None and d.target != (r.source.name if r.source else None),
        }
        if changes is not None and changes.model:
            meta["model"] = list(changes.model)
        if state.parent:
            meta["parent"] = state.parent
        flow.metadata.setdefault("sessionpin", {}).update(meta)
        self.metrics.decisions[(facts.agent, facts.turn or "none", outcome)] += 1
        self.metrics.rules[d.rule] += 1
        if session and facts.agent in F.AGENTS and (pin is not None or d.pin_action == ladder.CREATE):
            counted = d.target if d.pin_action == ladder.CREATE else pin.server
            if websocket.is_upgrade(flow.request):
                # a socket's requests are its turns (``websocket.SocketTurns``), not its upgrade
                self.runtime.seen(session, facts.agent, counted, r.now, requests=0)
                if refused is None:
                    flow.metadata["sessionpin"][websocket.COUNTED] = counted
            else:
                self.runtime.seen(session, facts.agent, counted, r.now)

        if self.decisions.on and refused is None:      # a refusal's one line is its warning (``_refuse``)
            model = f" model {changes.model[0]}→{changes.model[1]}" if changes is not None and changes.model else ""
            source = r.source.name if r.source else flow.request.pretty_host
            self.decisions.write(f"sessionpin: {facts.agent} {turn} {sid} {source} → {where} [{d.rule}: {why}]{model}")

    # ---- responses ---------------------------------------------------------------------------
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        resp = flow.response
        if resp is None:
            return
        if route.redirect_refused(resp.status_code, flow.metadata.get("sessionpin")):
            # Answered here, before any of it can leave: mitmproxy may already have marked the
            # response streamed (a body past ``stream_large_bodies``), or would switch to
            # streaming once a chunked body grows past it, and a streamed response's headers go
            # out right after this hook. The 502's status and headers replace the redirect's
            # now; its body is a stream that drops the upstream's bytes and gives the refusal's
            # at the end (an answer with no body at all gets it in ``response``).
            self._refuse_redirect(flow)
            return
        if not resp.stream:
            ctype = headerview.get(resp.headers, "content-type").lower()
            if any(t in ctype for t in STREAM_TYPES):
                resp.stream = True
            elif "sessionpin" in flow.metadata and not headerview.has(resp.headers, "content-length") \
                    and not flow.metadata["sessionpin"].get("refused"):
                resp.stream = True
        for p in self.participants:
            try:
                p.responseheaders(flow)
            except Exception:
                log.exception("sessionpin: participant %s failed", type(p).__name__)

    def response(self, flow: http.HTTPFlow) -> None:
        meta = flow.metadata.get("sessionpin")
        resp = flow.response
        if resp is None or not meta:
            return
        held = resp.stream if isinstance(resp.stream, _RedirectRefused) else None
        if held is not None:
            # refused in ``responseheaders``; a streamed body already gave the refusal's bytes
            resp.stream = False
            resp.trailers = None
            if not held.sent:
                resp.content = held.body
            return
        if route.redirect_refused(resp.status_code, meta):
            self._refuse_redirect(flow)      # never seen in ``responseheaders``: answered whole
            held = flow.response.stream
            flow.response.stream = False
            flow.response.trailers = None
            flow.response.content = held.body

    def _refuse_redirect(self, flow: http.HTTPFlow) -> None:
        """The redirect's status and headers replaced by its 502 in place (no ``Location``), its
        body by a ``_RedirectRefused`` stream; counted and logged once."""
        meta = flow.metadata["sessionpin"]
        resp = flow.response
        location = headerview.get(resp.headers, "location")
        try:
            target_host = url.parse_authority(location.split("://", 1)[-1].split("/", 1)[0], False)[0] \
                if "://" in location else (flow.request.host + " (same origin)")
        except ValueError:
            target_host = "an unreadable address"
        refusal = route.redirect_refusal(resp.status_code, target_host, meta)
        api = refusal.api or F.api_of("POST", flow.request.path)
        body, headers = answers.refusal(api, refusal.status, refusal.kind, refusal.message)
        made = http.Response.make(refusal.status, body, headers)
        resp.status_code, resp.reason, resp.headers = made.status_code, made.reason, made.headers
        resp.stream = _RedirectRefused(made.raw_content or b"")
        meta.update({"refused": 502, "refusal": "redirect", "message": refusal.message})
        flow.comment = f"{flow.comment}\nrefused 502: redirect to {target_host}"
        self.metrics.refusals["redirect"] += 1
        log.warning("sessionpin: refused 502 (redirect) %s: %s", short(meta.get("session")), refusal.message)

    def error(self, flow: http.HTTPFlow) -> None:
        self.allocations.failed(flow)
        meta = flow.metadata.get("sessionpin")
        if not meta or not meta.get("target") or flow.response is not None:
            return
        log.warning("sessionpin: %s %s → %s failed: %s (the conversation stays on %s)", meta.get("turn"),
                    short(meta.get("session")), meta.get("target"), unquoted(flow.error.msg) if flow.error else "?",
                    meta.get("target"))

    # ---- Codex's WebSocket -----------------------------------------------------------------------
    async def _websocket(self, flow: http.HTTPFlow) -> ladder.Decision | None:
        """Codex opens its Responses turns on a WebSocket: it is decided at the upgrade, like
        an HTTPS request of its thread, and routed there — the socket then goes to the chosen
        server with its key; ``websocket.WebSocketModels`` renames the model in each
        ``response.create`` the client sends, with the map recorded here."""
        read = websocket.upgrade_facts(self.config.config, flow.request)
        return await self._route(flow, *read) if read else None


class _RedirectRefused:
    """A refused redirect's body as a ``flow.response.stream`` callable: the upstream's chunks
    are dropped as they come (nothing kept), and the refusal's body is given at the end
    (mitmproxy calls the callable with ``b""`` then)."""

    __slots__ = ("body", "sent")

    def __init__(self, body: bytes) -> None:
        self.body, self.sent = body, False

    def __call__(self, chunk: bytes) -> bytes:
        if chunk or self.sent:
            return b""
        self.sent = True
        return self.body


def _said(e: Exception) -> str:
    """An exception's text as an answer may carry it: what it quotes (a header's value, a piece
    of a body) said by its size, key-looking words hidden, at most 300 characters."""
    return scrub(unquoted(str(e)))[:300]


def _option(name: str, default: int) -> int:
    try:
        return int(getattr(ctx.options, name))
    except (AttributeError, KeyError, ValueError, TypeError):   # not loaded (a test's bare Router)
        return default


def _wants(participant: Participant, method: str, url: str) -> bool:
    """Does a participant want this request's facts? (Reading them costs ~1 ms on a large
    body: only pay it for requests someone acts on.)"""
    try:
        return bool(participant.wants(method, url))
    except Exception:
        log.exception("sessionpin: participant %s failed", type(participant).__name__)
        return False


def _apply(req: http.Request, c: rewrite.Changes) -> None:
    """Apply a plan in one pass over the headers (the header API costs a lookup per call):
    the new origin (Host, or HTTP/2's :authority, follows it), the path, the headers
    dropped and set, the body with the model renamed. A new body sent as is (no
    content-encoding, no transfer-encoding: what ``req.content = body`` would store
    unchanged) gets its Content-Length in that same pass, as ``req.content`` would set it
    (the first one's place, or last); any other goes through ``req.content``."""
    hostport = None
    if (c.scheme, c.host, c.port) != (req.scheme, req.host, req.port):
        req.scheme = c.scheme
        req.data.host = c.host
        req.data.port = c.port
        hostport = url.hostport(c.scheme, c.host, c.port)
        if req.data.authority:
            req.authority = hostport
    if c.path != req.path:
        req.path = c.path
    length = None
    if c.body is not None and not (headerview.has(req.headers, "content-encoding")
                                   or headerview.has(req.headers, "transfer-encoding")):
        length = str(len(c.body)).encode()
    if hostport is not None or c.drop_headers or c.set_headers or length is not None:
        drop = {n.lower().encode("latin-1") for n in c.drop_headers}
        drop.update(n.lower().encode("latin-1") for n, _ in c.set_headers)
        fields = []
        for name, value in req.headers.fields:
            low = name.lower()
            if low == b"host" and hostport is not None:
                fields.append((name, hostport.encode("idna")))
            elif low == b"content-length" and length is not None and low not in drop:
                if length:
                    fields.append((name, length))
                    length = b""                # set once: later duplicates go
            elif low not in drop:
                fields.append((name, value))
        fields.extend((n.encode("latin-1"), v.encode("latin-1")) for n, v in c.set_headers)
        if length:
            fields.append((b"content-length", length))
        req.headers.fields = tuple(fields)
    if c.body is not None:
        if length is None:
            req.content = c.body
        else:
            req.data.content = c.body           # the bytes as they go (req.raw_content)


def _content_encoding(req: http.Request) -> str | None:
    """``req.headers.get("content-encoding")`` read off the fields in one pass (the header API
    costs a lookup through its mapping layers): every value of the name joined by ", ", or None."""
    return headerview.get(req.headers, "content-encoding", None)  # type: ignore[arg-type]


def read_in_parts(raw: bytes, encoding: str | None) -> bool:
    """Whether a body's facts are first read here by its parts (``facts.read_parts``): a large
    one (from 256 KiB) under 8 MiB, not compressed. Reading the parts costs a bounded number of
    Python steps and a few C scans of the bytes, and builds at most ``FACTS_INLINE_ITEMS``
    objects: a long history of many small messages (a real session's thousands of tool calls)
    no longer makes the trip to the body reader, nor is every byte counted first (~0.09 ms per
    MB), when its head, first messages and tail tell its facts — as they do for every client's
    real bodies. One they do not tell goes on to ``read_apart``."""
    n = len(raw)
    return FACTS_OFF_LOOP_MIN <= n < FACTS_INLINE_MAX and (not encoding or encoding.strip().lower() in ("", "identity"))


def read_apart(raw: bytes, encoding: str | None) -> bool:
    """Whether a body's facts are read in the body reader's process. What holds the loop is the
    number of JSON objects a whole-body decode builds and frees (a million tiny messages: a
    second and more), not the bytes: an ordinary history of 1 MB has a few thousand and is read
    here in about a millisecond, faster than the trip to the process. So: from 256 KiB, a body
    with more than 20,000 objects (``_more_than``: ~0.09 ms per MB), a compressed one
    (its objects cannot be counted before it is inflated), and any from 8 MiB go there."""
    n = len(raw)
    if n < FACTS_OFF_LOOP_MIN:
        return False
    if n >= FACTS_INLINE_MAX or (encoding and encoding.strip().lower() not in ("", "identity")):
        return True
    return _more_than(raw, b"{", FACTS_INLINE_ITEMS)


def _more_than(raw: bytes, byte: bytes, limit: int) -> bool:
    """``raw.count(byte) > limit``, at memchr's speed and stopping after the ``limit + 1``-th
    (``scan.count``: 0.09 ms per MB, where ``bytes.count`` of one byte took 0.3)."""
    return scan.count(raw, byte, limit) > limit
