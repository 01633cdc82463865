"""LineageWatch in the shell: what it records from requests and responses for later forks, when
it reads the request (after it left, on a thread of its own, never on the request's path), and
how it writes: in batches that never queue a write each in front of a new conversation's pin."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading

import pytest
from mitmproxy import http
from mitmproxy.test import tutils

from sessionpin.reader import facts as F
from sessionpin.lineage import lineage
from sessionpin.records import lineindex
from sessionpin.lineage.lineage_stream import StreamReader
from sessionpin.proxy import lineagewatch, perflow
from sessionpin.store import StoreUnavailable
from sessionpin.store.aio import Threaded
from sessionpin.store.memory import MemoryStore
from shellkit import SESSION, flow, start


SSE = [
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","content":[]}}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hello from glm."}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
]


@pytest.fixture
async def proxy(tmp_path):
    from shellkit import CONFIG
    p = tmp_path / "config.toml"
    p.write_text(CONFIG)
    proxy = start(p)
    yield proxy
    proxy.close()


def watch_of(proxy) -> lineagewatch.LineageWatch:
    return next(a for a in proxy.addons if isinstance(a, lineagewatch.LineageWatch))


async def answer(proxy, f, chunks=SSE, status=200) -> None:
    """The response as mitmproxy hands it to the addons: headers, the stream, the end."""
    f.response = tutils.tresp(status_code=status, content=b"", headers=http.Headers(
        [(b"content-type", b"text/event-stream"), (b"request-id", b"req_abc123")]))
    f.response.headers.pop("content-length", None)
    proxy.router.responseheaders(f)
    watch = watch_of(proxy)
    watch.responseheaders(f)
    stream = f.response.stream
    if callable(stream):
        for c in chunks:
            assert stream(c) == c                 # every chunk forwarded unchanged, at once
    watch.response(f)
    await watch.settled()


async def test_an_openings_root_is_read_after_its_answer_never_before_it_leaves(proxy, monkeypatch):
    calls = []
    real = lineage.chain
    monkeypatch.setattr(lineagewatch.lineage, "chain", lambda *a, **k: calls.append(1) or real(*a, **k))
    f = flow()
    await proxy.send(f)
    assert f.request.host == "api.z.ai" and calls == [], "the request left without its history hashed"
    await answer(proxy, f)
    assert calls == [1]
    reader = StreamReader(F.ANTHROPIC_MESSAGES)
    for c in SSE:
        reader(c)
    root = lineage.extend(real(f.request.raw_content, F.ANTHROPIC_MESSAGES, turns=1).head, reader.result().digest)
    assert await proxy.store.get(lineindex.root_key("claude-code", root)) == SESSION
    # the anchor: a claim of the server that answered (glm), with the conversation's root
    assert await proxy.store.get(lineindex.anchor_key("claude-code", "req:req_abc123", "glm")) == f"{root} {SESSION}"


@pytest.mark.parametrize("session, at_once", [("fp:0123abcd.89ab4567", True), (SESSION, False)])
async def test_an_openings_root_is_known_as_its_answer_has_left_for_a_conversation_without_an_id(
        proxy, session, at_once):
    """A conversation keyed by a fingerprint (pi's) is placed by its root: its opening's head is
    read at once when its answer has left (a small body, no history), so the root is known in
    memory (``known_root``) before its client can send the next turn, whose lookup would
    otherwise race the batched store write. Others are placed by their ids: read on the thread."""
    f = flow()
    await proxy.send(f)
    watch = watch_of(proxy)
    w = lineagewatch._Watched("pi" if at_once else "claude-code", session, F.ANTHROPIC_MESSAGES, True, "glm")
    w.reader = StreamReader(F.ANTHROPIC_MESSAGES)
    for c in SSE:
        w.reader(c)
    root = lineage.extend(lineage.chain(f.request.raw_content, F.ANTHROPIC_MESSAGES, turns=1).head,
                          w.reader.result().digest)
    watch._answered(f, w)
    assert watch.known_root(w.agent, root) == (session if at_once else None)
    assert watch.reads.jobs == (0 if at_once else 1)
    await watch.settled()
    assert watch.known_root(w.agent, root) == session
    assert await proxy.store.get(lineindex.root_key(w.agent, root)) == session
    assert watch.known_root(w.agent, "0" * 32) is None


async def test_an_answer_cut_short_records_no_root_but_the_next_request_carrying_it_does(proxy, monkeypatch):
    """Issue 18: the opening's answer was interrupted; the continuation that carries the
    history as the client kept it names the conversation by its root all the same."""
    calls = []
    real = lineage.chain
    monkeypatch.setattr(lineagewatch.lineage, "chain", lambda *a, **k: calls.append(1) or real(*a, **k))
    f = flow()
    await proxy.send(f)
    await answer(proxy, f, SSE[:-1])               # no message_stop: not a whole answer
    assert calls == [] and await proxy.store.keys("lin:claude-code:root:") == []
    g = flow("continuation")
    await proxy.send(g)
    assert g.metadata["sessionpin"]["rule"] == "pinned"
    await answer(proxy, g)
    root = real(g.request.raw_content, F.ANTHROPIC_MESSAGES, turns=1).keys[0]
    assert calls == [1] and await proxy.store.keys("lin:claude-code:root:") == [lineindex.root_key("claude-code", root)]
    assert await proxy.store.get(lineindex.root_key("claude-code", root)) == SESSION
    # the opening's anchor had no root to be corroborated by: not recorded; the continuation's has
    assert await proxy.store.get(lineindex.anchor_key("claude-code", "req:req_abc123", "glm")) == f"{root} {SESSION}"
    assert await proxy.store.keys("lin:claude-code:req:") == [lineindex.anchor_key("claude-code", "req:req_abc123", "glm")]


@pytest.mark.parametrize("first", ["error", "cut short"])
async def test_an_opening_retried_under_its_pin_records_its_root_from_the_whole_answer(proxy, first):
    """The first try pinned the conversation and was answered with an error (a 529) or cut
    short; the client sent the same opening again under the same session, now pinned: its
    whole answer is the one the conversation keeps, and gives the root its forks carry."""
    f = flow()
    await proxy.send(f)
    if first == "error":
        await answer(proxy, f, [json.dumps({"type": "error"}).encode()], status=529)
    else:
        await answer(proxy, f, SSE[:-1])
    assert await proxy.store.keys("lin:claude-code:root:") == []
    g = flow()
    await proxy.send(g)
    assert g.metadata["sessionpin"]["rule"] == "pinned"
    await answer(proxy, g)
    reader = StreamReader(F.ANTHROPIC_MESSAGES)
    for c in SSE:
        reader(c)
    root = lineage.extend(lineage.chain(g.request.raw_content, F.ANTHROPIC_MESSAGES, turns=1).head,
                          reader.result().digest)
    assert await root_recorded(proxy, root)
    assert await proxy.store.get(lineindex.anchor_key("claude-code", "req:req_abc123", "glm")) == f"{root} {SESSION}"


async def test_an_error_answer_records_nothing(proxy):
    f = flow()
    await proxy.send(f)
    await answer(proxy, f, [json.dumps({"type": "error"}).encode()], status=529)
    assert await proxy.store.keys("lin:") == []


def answered(f, request_id: str, status: int = 200) -> None:
    f.response = tutils.tresp(status_code=status, headers=http.Headers(
        [(b"content-type", b"application/json"), (b"request-id", request_id.encode())]), content=b"{}")


async def root_recorded(proxy, root: str, session: str = SESSION) -> bool:
    """The root's record names ``session`` within 2 s: a read's answer, the record it makes and
    the record's write each take a turn of the loop or more after ``settled`` saw no read
    pending (waiting for the writer alone raced them: failed in a fresh-clone run)."""
    for _ in range(200):
        if await proxy.store.get(lineindex.root_key("claude-code", root)) == session:
            return True
        await asyncio.sleep(0.01)
    return False


async def flushed(watch: lineagewatch.LineageWatch) -> None:
    """No read pending and no record unwritten, three looks in a row 10 ms apart: a read's
    answer reaches its record a few turns of the loop after the read is done, so one look
    could come before the record was queued."""
    quiet = 0
    for _ in range(300):
        busy = watch.reads.jobs or watch._pending or (watch._flusher is not None and not watch._flusher.done())
        quiet = 0 if busy else quiet + 1
        if quiet >= 3:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the lineage records were not written")


async def test_a_claude_code_response_names_its_session_by_its_request_id(proxy):
    await proxy.send(flow("opening"))
    f = flow("continuation")
    await proxy.send(f)
    watch = proxy.router.lineage
    answered(f, "req_011abc")
    watch.responseheaders(f)
    recorded = watch.recorded
    watch.response(f)
    assert watch.later.pending == 1          # what the answer gives: read once it has left
    await watch.settled()
    assert watch.recorded > recorded
    root = lineage.chain(f.request.raw_content, F.ANTHROPIC_MESSAGES, turns=1).keys[0]
    assert await proxy.store.get(lineindex.anchor_key("claude-code", "req:req_011abc", "glm")) == f"{root} {SESSION}"
    assert (watch.recorded, watch.dropped) == (2, 0)          # the root, then the anchor


async def test_a_failed_response_names_nothing(proxy):
    await proxy.send(flow("opening"))
    f = flow("continuation")
    await proxy.send(f)
    watch = proxy.router.lineage
    answered(f, "req_011bad", status=529)
    watch.responseheaders(f)
    watch.response(f)
    await watch.settled()
    assert await proxy.store.keys("lin:claude-code:req:") == []


class Held(MemoryStore):
    """A store whose writes wait while ``hold`` is clear (another process holds its lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = threading.Event()
        self.applies = 0

    def apply(self, checks, writes, *, durable=False):
        self.applies += 1
        self.hold.wait(10)
        return super().apply(checks, writes, durable=durable)


class Runtime:
    def __init__(self, store) -> None:
        self.store = store
        self.errors = 0


ROOT = "ab" * 16


def writes(w: lineagewatch._Watched):
    return lineindex.record_writes(w.agent, w.session, ROOT, w.anchors, "glm", owns_root=False)


def watched(n: int) -> list[lineagewatch._Watched]:
    out = []
    for i in range(n):
        w = lineagewatch._Watched("claude-code", f"s{i}", "anthropic-messages", None)
        w.anchors.append(f"req:r{i}")
        out.append(w)
    return out


async def test_records_that_come_while_a_write_waits_go_in_one_write():
    backend = Held()
    store = Threaded(backend)
    watch = lineagewatch.LineageWatch(Runtime(store))
    try:
        first, *rest = watched(200)
        watch._record(writes(first))
        for _ in range(300):
            if backend.applies:
                break
            await asyncio.sleep(0.01)
        assert backend.applies == 1          # the first write waits for the store
        for w in rest:
            watch._record(writes(w))
            await asyncio.sleep(0)
        backend.hold.set()
        await flushed(watch)
        assert backend.applies == 2          # the 199 that came meanwhile: one write
        assert (watch.recorded, watch.dropped) == (200, 0)
        assert await store.get(lineindex.anchor_key("claude-code", "req:r199", "glm")) == f"{ROOT} s199"
    finally:
        backend.hold.set()
        await store.close()


async def test_records_close_together_go_in_one_write():
    backend = Held()
    backend.hold.set()
    store = Threaded(backend)
    watch = lineagewatch.LineageWatch(Runtime(store))
    try:
        for w in watched(20):
            watch._record(writes(w))
        await flushed(watch)
        assert backend.applies == 1 and watch.recorded == 20
    finally:
        await store.close()


async def test_the_records_waiting_are_bounded(monkeypatch):
    monkeypatch.setattr(lineagewatch, "MAX_PENDING", 10)
    backend = Held()
    store = Threaded(backend)
    watch = lineagewatch.LineageWatch(Runtime(store))
    try:
        for w in watched(50):
            watch._record(writes(w))
            await asyncio.sleep(0)
        assert watch._writes <= 10
        backend.hold.set()
        await flushed(watch)
        assert watch.recorded + watch.dropped == 50 and watch.dropped >= 39
        assert await store.get(lineindex.anchor_key("claude-code", "req:r49", "glm")) == f"{ROOT} s49"   # the newest kept
    finally:
        backend.hold.set()
        await store.close()


class Failing(MemoryStore):
    def apply(self, checks, writes, *, durable=False):
        raise StoreUnavailable("store memory: locked by another process")


async def test_a_failing_store_drops_records_with_one_warning(caplog):
    store = Threaded(Failing())
    runtime = Runtime(store)
    watch = lineagewatch.LineageWatch(runtime)
    try:
        with caplog.at_level(logging.WARNING, logger="sessionpin"):
            for w in watched(5):
                watch._record(writes(w))
                await flushed(watch)
        assert watch.dropped == 5 and watch.recorded == 0
        assert sum("lineage records not written" in r.getMessage() for r in caplog.records) == 1
        assert runtime.errors == 5
    finally:
        await store.close()


async def test_nothing_is_recorded_without_a_store():
    watch = lineagewatch.LineageWatch(Runtime(None))
    for w in watched(3):
        watch._record(writes(w))
    assert watch._flusher is None and not watch._pending


# ---- issue 18: a parent is found from any request of it -------------------------------------

FORK = "abcd1234-0000-4000-8000-0000000000f0"


async def test_a_parent_whose_answers_were_never_seen_is_found_by_a_request_carrying_its_history(proxy):
    """The opening's answer never reached the watch (interrupted, or the proxy died before its
    records were written); a later request of the conversation carried the history: a fork of it
    reaches its server. Before issue 18 the fork was "a continuation never seen begin"."""
    f = flow()
    await proxy.send(f)
    assert f.request.host == "api.z.ai"
    watch = watch_of(proxy)
    watch.error(f)                                   # no answer seen
    g = flow("continuation")
    await proxy.send(g)
    await watch.settled()
    fork = flow("continuation", session=FORK)
    await proxy.send(fork)
    meta = fork.metadata["sessionpin"]
    assert (meta["rule"], meta.get("parent"), fork.request.host) == ("fork", SESSION, "api.z.ai")


async def test_the_requests_root_is_read_on_a_thread_after_it_left(proxy, monkeypatch):
    threads = []
    real = lineage.chain
    monkeypatch.setattr(lineagewatch.lineage, "chain",
                        lambda *a, **k: threads.append(threading.current_thread().name) or real(*a, **k))
    await proxy.send(flow())
    g = flow("continuation")
    await proxy.send(g)
    assert g.request.host == "api.z.ai"
    await watch_of(proxy).settled()
    assert threads and all(t.startswith("sessionpin-lineage") for t in threads), threads


@pytest.mark.parametrize("ends", ["answered", "error"])
async def test_a_large_requests_root_is_read_once_its_body_left(proxy, monkeypatch, ends):
    """Issue 20: a large body's root is not read beside mitmproxy's sending of it (the read's
    thread took the GIL from the event loop at each socket call of the send): it is held until
    the answer's headers come, or the flow's error. A small one is read at once (above)."""
    monkeypatch.setattr(lineagewatch, "HOLD_FROM", 1)       # the test's continuation counts as large
    calls = []
    real = lineage.chain
    monkeypatch.setattr(lineagewatch.lineage, "chain", lambda *a, **k: calls.append(1) or real(*a, **k))
    await proxy.send(flow())
    watch = watch_of(proxy)
    await answer(proxy, flow())            # (an opening of another flow: its own head read, not this one)
    calls.clear()
    g = flow("continuation")
    await proxy.send(g)
    assert g.request.host == "api.z.ai"
    await asyncio.sleep(lineagewatch.GATHER * 3)
    await watch.settled()
    assert calls == [] and watch.counts()["pending"] == 1, "the root was read while the body was being sent"
    if ends == "answered":
        await answer(proxy, g)
    else:
        watch.error(g)
        await watch.settled()
    await flushed(watch)
    root = real(g.request.raw_content, F.ANTHROPIC_MESSAGES, turns=1).keys[0]
    assert await root_recorded(proxy, root) and calls == [1]
    assert watch.counts()["pending"] == 0 and perflow.LINEAGE_HELD not in g.metadata


async def test_held_reads_live_in_their_flows_and_go_with_them(proxy, monkeypatch):
    monkeypatch.setattr(lineagewatch, "HOLD_FROM", 1)
    await proxy.send(flow())
    watch = watch_of(proxy)
    flows = [flow("continuation") for _ in range(3)]
    for g in flows:
        await proxy.send(g)
    assert all(perflow.LINEAGE_HELD in g.metadata for g in flows) and watch.counts()["pending"] >= 3
    assert copy.deepcopy(flows[0].metadata)[perflow.LINEAGE_HELD] is None   # a saved flow holds no future
    for g in flows:
        watch.error(g)
    await watch.settled()
    assert not any(perflow.LINEAGE_HELD in g.metadata for g in flows) and watch.counts()["pending"] == 0


async def test_a_forks_requests_leave_the_root_to_its_parent(proxy):
    await proxy.send(flow())
    await proxy.send(flow("continuation"))
    watch = watch_of(proxy)
    await watch.settled()
    [key] = await proxy.store.keys("lin:claude-code:root:")
    recorded = watch.recorded
    for _ in range(2):
        fork = flow("continuation", session=FORK)
        await proxy.send(fork)
        await watch.settled()
    assert fork.metadata["sessionpin"]["rule"] == "pinned"       # the fork's own pin, naming its parent
    assert await proxy.store.get(key) == SESSION and watch.recorded == recorded


async def test_a_conversations_turns_write_its_root_once(proxy):
    await proxy.send(flow())
    watch = watch_of(proxy)
    for _ in range(5):
        await proxy.send(flow("continuation"))
        await watch.settled()
    assert watch.recorded == 1 and len(await proxy.store.keys("lin:claude-code:root:")) == 1


async def test_reads_over_the_bound_are_skipped_and_counted(proxy):
    await proxy.send(flow())
    watch = watch_of(proxy)
    watch.reads.max_jobs = 0
    await proxy.send(flow("continuation"))
    await watch.settled()
    assert watch.reads.skipped == 1 and await proxy.store.keys("lin:") == []


async def test_the_metrics_count_records_and_what_is_pending(proxy):
    await proxy.send(flow())
    await proxy.send(flow("continuation"))
    await watch_of(proxy).settled()
    text = await proxy.status.render_metrics()
    assert 'sessionpin_lineage_records_total{outcome="written"} 1' in text      # its root
    assert 'sessionpin_lineage_records_total{outcome="skipped"} 0' in text
    assert "sessionpin_lineage_pending 0" in text


async def test_the_roots_recorded_lately_are_bounded(monkeypatch):
    monkeypatch.setattr(lineagewatch, "MAX_ROOTS", 3)
    store = Threaded(MemoryStore())
    watch = lineagewatch.LineageWatch(Runtime(store))
    try:
        for i in range(5):
            watch._learn_root("claude-code", f"s{i}", f"{i:032x}")
        watch._learn_root("claude-code", "s4", f"{4:032x}")       # recorded lately: not again
        await watch.settled()
        assert len(watch._roots) == 3 and watch.recorded == 5
        assert await store.get(lineindex.root_key("claude-code", f"{0:032x}")) == "s0"
    finally:
        await store.close()


async def test_a_continuations_root_is_read_from_the_members_the_router_decoded(proxy, monkeypatch):
    """Issue 22, the body decoded once: the root of a Claude Code continuation is read from the
    raw members the router's facts read made (its history's bytes only, on the reads' thread),
    and is the root of the body as sent."""
    given = []
    real = lineage.chain
    monkeypatch.setattr(lineagewatch.lineage, "chain", lambda *a, **k: given.append(k.get("members")) or real(*a, **k))
    f = flow()
    await proxy.send(f)
    await answer(proxy, f, SSE[:-1])
    g = flow("continuation")
    await proxy.send(g)
    await answer(proxy, g)
    await watch_of(proxy).settled()
    assert given and given[-1] is not None
    root = real(g.request.raw_content, F.ANTHROPIC_MESSAGES, turns=1).keys[0]
    assert await proxy.store.get(lineindex.root_key("claude-code", root)) == SESSION


def continuation(first: str, extra: list) -> bytes:
    """A Claude Code continuation whose first message is ``first``, with ``extra`` messages after."""
    from shellkit import body as make_body
    doc = json.loads(make_body("continuation"))
    doc["messages"][0]["content"] = first
    doc["messages"] += extra
    return json.dumps(doc).encode()


async def test_a_small_continuations_root_is_proven_on_the_loop_without_a_hop(proxy, monkeypatch):
    """Issue 22: every continuation of a conversation of a few KB had its root read on the
    reads' thread — a hop per request, for a read its first bytes prove. Its first
    continuation is read there and leaves a proof; the next whose history begins with those
    bytes is proven here (nothing submitted to the thread), with the same root recorded; one
    whose first message changed goes to the thread again."""
    calls, submitted = [], []
    real = lineage.chain
    monkeypatch.setattr(lineagewatch.lineage, "chain", lambda *a, **k: calls.append(1) or real(*a, **k))
    watch = watch_of(proxy)
    real_submit = watch.reads.submit
    monkeypatch.setattr(watch.reads, "submit", lambda *a: submitted.append(a[0]) or real_submit(*a))

    def turn(extra: list, first: str = "Fix the failing test. ") -> bytes:
        return continuation(first, extra)
    f = flow()
    await proxy.send(f)
    await answer(proxy, f, SSE[:-1])
    g = flow("continuation", content=turn([]))
    await proxy.send(g)
    await answer(proxy, g)
    await watch.settled()
    assert len(g.request.raw_content) < lineagewatch.HOLD_FROM
    assert calls == [1] and len(submitted) == 1          # read on the thread once, a proof kept
    h = flow("continuation", content=turn([{"role": "assistant", "content": "more"}, {"role": "user", "content": "go"}]))
    await proxy.send(h)
    await answer(proxy, h)
    await watch.settled()
    await flushed(watch)
    assert calls == [1] and len(submitted) == 1          # proven here: no read, no hop
    root = real(h.request.raw_content, F.ANTHROPIC_MESSAGES, turns=1).keys[0]
    assert await root_recorded(proxy, root)
    edited = flow("continuation", content=turn([], first="Fix the failing tests."))
    await proxy.send(edited)
    await answer(proxy, edited)
    await watch.settled()
    assert calls == [1, 1] and len(submitted) == 2       # not the proven bytes: read on the thread again


async def test_a_long_conversations_root_is_proven_by_its_first_bytes_not_read_again(proxy, monkeypatch):
    """Issue 22: a conversation opened with a megabyte message had its root decoded and hashed
    again on every continuation (~2.2 ms on the reads' thread). Its first continuation's root
    leaves a proof (the history's bytes through the item that ended the first model run); the
    next continuation whose history begins with those bytes has that root without a read — and
    records the same root, anchors and all."""
    calls = []
    real = lineage.chain
    monkeypatch.setattr(lineagewatch.lineage, "chain", lambda *a, **k: calls.append(1) or real(*a, **k))
    big = "x" * (300 * 1024)

    def turn(extra: list) -> bytes:
        return continuation(big, extra)
    f = flow()
    await proxy.send(f)
    await answer(proxy, f, SSE[:-1])
    watch = watch_of(proxy)
    g = flow("continuation", content=turn([]))
    await proxy.send(g)
    await answer(proxy, g)
    await watch.settled()
    assert calls == [1]                                # read once, a proof kept
    h = flow("continuation", content=turn([{"role": "assistant", "content": "more"}, {"role": "user", "content": "go"}]))
    await proxy.send(h)
    await answer(proxy, h)
    await watch.settled()
    await flushed(watch)
    assert calls == [1]                                # proven by its first bytes: not read again
    root = real(h.request.raw_content, F.ANTHROPIC_MESSAGES, turns=1).keys[0]
    assert await root_recorded(proxy, root)
    edited = flow("continuation", content=turn([]).replace(b"xxxx", b"xxxy", 1))    # the first message edited
    await proxy.send(edited)
    await answer(proxy, edited)
    await watch.settled()
    assert calls == [1, 1]                             # not the proven bytes: read again
