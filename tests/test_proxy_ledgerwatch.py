"""LedgerWatch in the shell: it reads each answer's usage as it streams (chained after the lineage
reader, every chunk unchanged), assesses the turn against its lane and writes the ledger off the
request path; the flow's comment and metadata gain the figures; Prometheus counts them."""

from __future__ import annotations

import asyncio
import json

import pytest
from mitmproxy import http
from mitmproxy.test import tutils

from sessionpin.accounting import ledger
from sessionpin.proxy import ledgerwatch, lineagewatch
from sessionpin.accounting.usage import Usage
from shellkit import SESSION, body, flow, start


def sse_with_usage(read: int, write: int, uncached: int = 3, out: int = 50, msg: str = "msg_1",
                   model: str = "glm-4.6", diagnostics: dict | None = None) -> list[bytes]:
    message = {"id": msg, "model": model, "content": [],
               "usage": {"input_tokens": uncached, "cache_read_input_tokens": read,
                         "cache_creation_input_tokens": write, "output_tokens": 1}}
    if diagnostics is not None:
        message["diagnostics"] = diagnostics
    events = [{"type": "message_start", "message": message},
              {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello."}},
              {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": out}},
              {"type": "message_stop"}]
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]


@pytest.fixture
async def proxy(tmp_path):
    from shellkit import CONFIG
    p = tmp_path / "config.toml"
    p.write_text(CONFIG)
    proxy = start(p)
    yield proxy
    proxy.close()


def watch_of(proxy) -> ledgerwatch.LedgerWatch:
    return next(a for a in proxy.addons if isinstance(a, ledgerwatch.LedgerWatch))


async def flushed(watch) -> None:
    await watch.settled()                  # the turns read beside their answers (large requests)
    for _ in range(300):
        if (watch._flusher is None or watch._flusher.done()) and not watch._pending:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the ledger records were not written")


async def answer(proxy, f, chunks, status=200, ctype=b"text/event-stream") -> bytes:
    """The response as mitmproxy hands it to the addons (in their order): headers, the stream, the end."""
    f.response = tutils.tresp(status_code=status, content=b"", headers=http.Headers(
        [(b"content-type", ctype), (b"request-id", b"req_1")]))
    f.response.headers.pop("content-length", None)
    for a in proxy.addons:
        if hasattr(a, "responseheaders"):
            a.responseheaders(f)
    stream, passed = f.response.stream, b""
    if callable(stream):
        for c in chunks:
            got = stream(c)
            assert got == c                 # every chunk forwarded unchanged, at once
            passed += got
        stream(b"")
    else:
        f.response.content = b"".join(chunks)
        passed = f.response.raw_content
    for a in proxy.addons:
        if hasattr(a, "response"):
            got = a.response(f)
            if asyncio.iscoroutine(got):   # mitmproxy awaits what a hook returns
                await got
    await flushed(watch_of(proxy))
    return passed


async def test_an_opening_and_a_continuation_are_read_chained_after_the_lineage_reader(proxy):
    f = flow("opening")
    await proxy.send(f)
    chunks = sse_with_usage(read=0, write=9000)
    assert await answer(proxy, f, chunks) == b"".join(chunks)
    assert isinstance(f.response.stream, ledgerwatch._Tee)          # the lineage reader still reads it
    assert isinstance(f.response.stream.first, lineagewatch.StreamReader)
    assert f.metadata["sessionpin"]["ledger"]["input"] == 9003
    assert "in 9003 out 50 cache 0%" in f.comment and f.comment.startswith("opening ")
    g = flow("continuation")
    await proxy.send(g)
    await answer(proxy, g, sse_with_usage(read=9000, write=200, msg="msg_2"))
    assert "cache 97%" in g.comment and "miss" not in g.comment
    s = await ledger.load(proxy.store, SESSION)
    assert s.turns == 2 and s.misses == 0 and s.agent == "claude-code"
    assert s.by == {("glm", "glm-4.6"): Usage(input=9003 + 9203, output=100, cache_read=9000, cache_write_5m=9200)}
    turns = await ledger.turns(proxy.store, SESSION)
    assert [t.id for t in turns] == ["msg_1", "msg_2"] and turns[1].limit == 9003 and turns[0].reason == "first_turn"
    assert await proxy.store.ttl(ledger.key(SESSION)) > ledger.TTL - 60


async def test_a_miss_gets_the_providers_reason_in_the_comment_and_the_counters(proxy):
    f = flow("opening")
    await proxy.send(f)
    await answer(proxy, f, sse_with_usage(read=0, write=9000))
    g = flow("continuation")
    await proxy.send(g)
    await answer(proxy, g, sse_with_usage(read=0, write=9200, msg="msg_2", diagnostics={
        "cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 9000}}))
    assert "miss: system_changed" in g.comment and "provider: system_changed" in g.comment
    text = await proxy.status.render_metrics()
    assert 'sessionpin_ledger_cache_misses_total{agent="claude-code",server="glm",reason="system_changed"} 1' in text
    assert 'sessionpin_ledger_tokens_total{agent="claude-code",server="glm",model="glm-4.6",kind="cache_read"}' \
        not in text     # nothing read from cache: no sample
    assert 'kind="cache_write_5m"} 18200' in text     # both turns: the first counted as it was written
    from prometheus_client.parser import text_string_to_metric_families
    names = {m.name for m in text_string_to_metric_families(text)}
    assert "sessionpin_ledger_cache_misses" in names


async def test_a_restarted_proxy_compares_with_the_stores_record_of_the_lane(proxy, tmp_path):
    f = flow("opening")
    await proxy.send(f)
    await answer(proxy, f, sse_with_usage(read=0, write=9000))
    watch = watch_of(proxy)
    watch._lanes.clear()                      # what a restart forgets
    g = flow("continuation")                  # its history begins with the opening's message
    await proxy.send(g)
    await answer(proxy, g, sse_with_usage(read=0, write=9200, msg="msg_2"))
    edited = json.loads(body("continuation"))
    edited["messages"][0]["content"] = "hi, edited"
    h = flow("continuation", content=json.dumps(edited, indent=1).encode())   # as the client writes it
    await proxy.send(h)
    watch._lanes.clear()
    await answer(proxy, h, sse_with_usage(read=0, write=9200, msg="msg_3"))
    turns = await ledger.turns(proxy.store, SESSION)
    assert turns[1].miss and turns[1].limit == 9003 and turns[1].reason == "unknown"   # nothing changed that it sees
    assert turns[2].miss and turns[2].reason == "messages_changed" and turns[2].detail == "before message 3"
    assert turns[2].limit < 9203


async def test_a_buffered_json_answer_and_an_error_answer(proxy):
    f = flow("opening")
    await proxy.send(f)
    body = json.dumps({"id": "msg_j", "model": "glm-4.6", "content": [],
                       "usage": {"input_tokens": 7, "cache_read_input_tokens": 0, "output_tokens": 4}}).encode()
    await answer(proxy, f, [body], ctype=b"application/json")
    assert f.metadata["sessionpin"]["ledger"]["output"] == 4
    g = flow("continuation")
    await proxy.send(g)
    await answer(proxy, g, [b'{"type":"error"}'], status=529, ctype=b"application/json")
    assert "ledger" not in g.metadata["sessionpin"]
    assert (await ledger.load(proxy.store, SESSION)).turns == 1


async def test_an_answer_without_usage_and_a_flow_the_router_left_alone(proxy):
    f = flow("opening")
    await proxy.send(f)
    await answer(proxy, f, [b'event: message_stop\ndata: {"type":"message_stop"}\n\n'])
    assert watch_of(proxy).unread == 1 and await ledger.load(proxy.store, SESSION) is None
    other = flow("opening", path="/api/claude_code/settings")     # not an inference request
    await proxy.send(other)
    await answer(proxy, other, sse_with_usage(read=0, write=1))
    assert "ledger" not in other.metadata.get("sessionpin", {})


async def codex_socket(tmp_path):
    """A Codex socket routed and accepted (101), the ledger watching it; ``say(value,
    from_client)`` passes one text message through every part's ``websocket_message``."""
    import time as _time

    from mitmproxy import websocket
    from wsproto.frame_protocol import Opcode

    from test_proxy_router import CODEX_CONFIG, upgrade
    p = tmp_path / "config.toml"
    p.write_text(CODEX_CONFIG)
    proxy = start(p)
    proxy.router.env["ALT_KEY"] = "alt-sentinel"
    f = upgrade()
    await proxy.send(f)
    f.response = tutils.tresp(status_code=101, content=b"")
    f.websocket = websocket.WebSocketData()
    watch = watch_of(proxy)
    watch.websocket_start(f)

    def say(value, from_client):
        f.websocket.messages.append(websocket.WebSocketMessage(Opcode.TEXT, from_client,
                                                               json.dumps(value).encode(), _time.time()))
        for a in proxy.addons:
            if hasattr(a, "websocket_message"):
                a.websocket_message(f)
    return proxy, f, watch, say


async def test_codexs_socket_gives_one_turn_per_completed_response(tmp_path):
    proxy, f, watch, say = await codex_socket(tmp_path)
    try:
        for i, cached in enumerate((0, 1800)):
            say({"type": "response.create", "model": "gpt-6.2-sol",
                 "input": [{"role": "user", "content": "x"}] * (i + 1)}, True)
            say({"type": "response.created", "response": {"id": f"resp_{i}", "usage": None}}, False)
            say({"type": "response.completed", "response": {
                "id": f"resp_{i}", "model": "alt-codex-1",
                "usage": {"input_tokens": 2000 + i, "input_tokens_details": {"cached_tokens": cached},
                          "output_tokens": 10, "output_tokens_details": {"reasoning_tokens": 4}}}}, False)
        assert f.comment.endswith(" | in 2001 out 10 cache 89%")      # the latest turn's figures, once
        assert f.comment.count(" | in ") == 1
        watch.websocket_end(f)
        await flushed(watch)
        session = f.metadata["sessionpin"]["session"]
        s = await ledger.load(proxy.store, session)
        assert s.turns == 2 and s.by == {("alt", "alt-codex-1"): Usage(input=4001, output=20, cache_read=1800,
                                                                      reasoning=8)}
        turns = await ledger.turns(proxy.store, session)
        assert [t.id for t in turns] == ["resp_0", "resp_1"] and turns[1].limit == 2000 and turns[1].miss is False
    finally:
        proxy.close()


async def test_an_opentelemetry_span_per_answered_turn_with_the_decision_on_it(proxy):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from sessionpin.proxy.otelspans import Spans
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    watch = watch_of(proxy)
    watch.spans = Spans.build("", processor=SimpleSpanProcessor(exporter), metric_reader=reader)
    f = flow("opening")
    await proxy.send(f)
    await answer(proxy, f, sse_with_usage(read=0, write=9000))
    g = flow("continuation")
    await proxy.send(g)
    await answer(proxy, g, sse_with_usage(read=9000, write=200, msg="msg_2"))
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["chat glm-4.6", "chat glm-4.6"]
    a = dict(spans[1].attributes)
    assert a["gen_ai.conversation.id"] == SESSION and a["gen_ai.usage.input_tokens"] == 9203
    assert a["gen_ai.usage.cache_read.input_tokens"] == 9000 and a["gen_ai.response.id"] == "msg_2"
    assert a["gen_ai.request.model"] == "claude-opus-4-1"       # as the client asked, before the server's map
    assert a["sessionpin.decision.target"] == "glm" and a["sessionpin.decision.rule"] == "pinned"
    assert a["sessionpin.cache.limit_tokens"] == 9003 and spans[1].end_time >= spans[1].start_time
    metrics = {m.name: m for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
               for m in sm.metrics}
    usage = {p.attributes["gen_ai.token.type"]: p.sum for p in metrics["gen_ai.client.token.usage"].data.data_points}
    assert usage == {"input": 9003 + 9203, "output": 100}
    assert "gen_ai.conversation.id" not in metrics["gen_ai.client.token.usage"].data.data_points[0].attributes
    assert metrics["gen_ai.client.operation.duration"].data.data_points[0].count == 2


def test_the_otel_option_refuses_what_it_cannot_build(proxy):
    from mitmproxy import exceptions
    watch = watch_of(proxy)
    with pytest.raises(exceptions.OptionsError, match="not one of console, otlp"):
        proxy.tctx.configure(watch, sessionpin_otel="zipkin")
    proxy.tctx.configure(watch, sessionpin_otel="console")
    assert watch.spans is not None
    proxy.tctx.configure(watch, sessionpin_otel="")
    assert watch.spans is None


async def test_a_request_that_gave_no_turn_has_a_span_with_its_decision(proxy):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from sessionpin.proxy.otelspans import Spans
    exporter = InMemorySpanExporter()
    watch_of(proxy).spans = Spans.build("", processor=SimpleSpanProcessor(exporter))
    f = flow("opening")
    await proxy.send(f)
    await answer(proxy, f, [b'{"type":"error"}'], status=529, ctype=b"application/json")
    g = flow("continuation")
    await proxy.send(g)
    from mitmproxy import flow as mflow
    g.error = mflow.Error("Client disconnected.")
    for a in proxy.addons:
        if hasattr(a, "error"):
            a.error(g)
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["chat", "chat"]
    a = dict(spans[0].attributes)
    assert a["http.response.status_code"] == 529 and a["sessionpin.decision.target"] == "glm"
    assert a["gen_ai.conversation.id"] == SESSION and a["gen_ai.request.model"] == "claude-opus-4-1"
    assert spans[0].status.status_code == StatusCode.ERROR
    assert spans[1].status.description == "Client disconnected." and "gen_ai.usage.input_tokens" not in a


async def test_a_conversations_ttl_is_renewed_at_most_once_a_day(proxy, monkeypatch):
    """Two store calls per conversation per batch were most of the store threads' work under
    load: a ledger's keys are renewed with its first batch, then at most daily (as pins are)."""
    renewed = []
    real = proxy.store.expire

    async def counted(key, ttl):
        renewed.append(key)
        return await real(key, ttl)
    monkeypatch.setattr(proxy.store, "expire", counted)
    for i, kind in enumerate(("opening", "continuation", "continuation")):
        f = flow(kind)
        await proxy.send(f)
        await answer(proxy, f, sse_with_usage(read=9000 * i, write=200, msg=f"msg_{i}"))
    assert sorted(renewed) == sorted([ledger.key(SESSION), ledger.turns_key(SESSION)])   # the first batch only
    assert await proxy.store.ttl(ledger.key(SESSION)) > ledger.TTL - 60
    assert await proxy.store.ttl(ledger.turns_key(SESSION)) > ledger.TTL - 60
    assert (await ledger.load(proxy.store, SESSION)).turns == 3
    watch_of(proxy)._renewed[SESSION] -= ledgerwatch.RENEW_EVERY          # a day later
    f = flow("continuation")
    await proxy.send(f)
    await answer(proxy, f, sse_with_usage(read=9000, write=200, msg="msg_9"))
    assert len(renewed) == 4


async def test_an_answer_cut_short_is_recorded_with_what_the_server_had_reported(proxy):
    # Anthropic states a turn's input and cache use in its first event: an answer the client
    # interrupted was billed for them, so the ledger keeps them, marked cut.
    from mitmproxy.flow import Error
    f = flow("opening")
    await proxy.send(f)
    chunks = sse_with_usage(read=0, write=9000)
    f.response = tutils.tresp(status_code=200, content=b"", headers=http.Headers(
        [(b"content-type", b"text/event-stream")]))
    f.response.headers.pop("content-length", None)
    for a in proxy.addons:
        if hasattr(a, "responseheaders"):
            a.responseheaders(f)
    for c in chunks[:3]:                       # message_start, a block: then the client goes away
        assert f.response.stream(c) == c
    f.error = Error("client disconnected")
    for a in proxy.addons:
        if hasattr(a, "error"):
            a.error(f)
    await flushed(watch_of(proxy))
    assert f.metadata["sessionpin"]["ledger"]["cut"] is True
    assert "(cut short)" in f.comment
    turns = await ledger.turns(proxy.store, SESSION)
    assert len(turns) == 1 and turns[0].cut and turns[0].usage.input == 9003 and turns[0].usage.output == 1
    assert (await ledger.load(proxy.store, SESSION)).usage.cache_write_5m == 9000


async def test_an_error_before_any_usage_gives_no_turn(proxy):
    from mitmproxy.flow import Error
    f = flow("opening")
    await proxy.send(f)
    f.response = tutils.tresp(status_code=200, content=b"", headers=http.Headers(
        [(b"content-type", b"text/event-stream")]))
    f.response.headers.pop("content-length", None)
    for a in proxy.addons:
        if hasattr(a, "responseheaders"):
            a.responseheaders(f)
    f.response.stream(b"event: ping\ndata: {}\n\n")
    f.error = Error("server disconnected")
    for a in proxy.addons:
        if hasattr(a, "error"):
            a.error(f)
    await flushed(watch_of(proxy))
    assert "ledger" not in f.metadata["sessionpin"]
    assert await ledger.load(proxy.store, SESSION) is None

async def test_a_large_requests_prompt_shape_is_read_off_the_event_loop(proxy, monkeypatch):
    """Issue 20: a continuation of a million-odd tiny messages had its prompt shape (a digest per
    message, in Python) read in the response hook, on the event loop: 10-20 s during which no
    other client was served. From 256 KiB it is read in the body reader's process; the turn is
    recorded and compared as before."""
    calls = []
    real = ledgerwatch.promptshape.shape
    monkeypatch.setattr(ledgerwatch.promptshape, "shape", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    one = b'{"role":"user","content":"x"},'
    f = flow("opening")
    await proxy.send(f)
    await answer(proxy, f, sse_with_usage(read=0, write=9000))
    calls.clear()
    big = body("continuation").replace(b'"messages": [', b'"messages": [' + one * 40_000, 1)
    assert len(big) >= 1024 * 1024
    g = flow("continuation", content=big)
    await proxy.send(g)
    await answer(proxy, g, sse_with_usage(read=9000, write=200, msg="msg_2"))
    assert g.metadata["sessionpin"]["ledger"]["input"] == 9203
    assert calls == []
    kept = watch_of(proxy)._lanes[(SESSION, "main")][1]      # the shape the child read, kept for the next turn
    assert kept is not None and len(kept.messages) == 40_003


def _json_answer(f, msg: str, read: int, write: int) -> None:
    """A buffered answer (a length: the router leaves it buffered)."""
    content = json.dumps({"id": msg, "model": "glm-4.6", "content": [],
                          "usage": {"input_tokens": 3, "cache_read_input_tokens": read,
                                    "cache_creation_input_tokens": write, "output_tokens": 4}}).encode()
    f.response = tutils.tresp(status_code=200, content=content, headers=http.Headers(
        [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]))


async def _respond(proxy, f) -> object:
    """The hooks of a buffered answer, as mitmproxy runs them; what the ledger's ``response`` returned."""
    for a in proxy.addons:
        if hasattr(a, "responseheaders"):
            a.responseheaders(f)
    got = None
    for a in proxy.addons:
        if hasattr(a, "response"):
            r = a.response(f)
            if isinstance(a, ledgerwatch.LedgerWatch):
                got = r
            elif asyncio.iscoroutine(r):
                await r
    return got


async def _large_turn_answered(proxy):
    """An opening answered (streamed), then a large continuation sent and given a buffered answer
    (its hooks not yet run)."""
    f = flow("opening")
    await proxy.send(f)
    await answer(proxy, f, sse_with_usage(read=0, write=9000))
    g = flow("continuation", content=_large_continuation())
    await proxy.send(g)
    _json_answer(g, "msg_2", read=9000, write=200)
    return g


def _large_continuation(n: int = 40_000) -> bytes:
    one = b'{"role":"user","content":"x"},'
    return body("continuation").replace(b'"messages": [', b'"messages": [' + one * n, 1)


async def test_a_buffered_answer_is_not_held_for_its_large_requests_shape(proxy, monkeypatch):
    """Issue 22: mitmproxy sends a buffered answer on once every response hook returned; the
    ledger's hook returned the shape's read in the body process, and the answer waited for it
    (1 MB: +2-4 ms a request). It returns at once; the turn is read beside the answer, lands
    as before, and mitmweb is told the flow changed."""
    told: list = []

    class View:                    # mitmweb's view (an addon named "view"): told the flows that changed
        name = "view"

        def update(self, flows):
            told.append(list(flows))
    proxy.tctx.master.addons.add(View())
    watch = watch_of(proxy)
    g = await _large_turn_answered(proxy)
    assert await _respond(proxy, g) is None                     # nothing for mitmproxy to wait for
    await flushed(watch)
    assert g.metadata["sessionpin"]["ledger"]["input"] == 9203
    assert [g] in told, told
    assert (await ledger.load(proxy.store, SESSION)).turns == 2


async def test_a_conversations_turns_are_taken_in_the_order_their_answers_ended(proxy, monkeypatch):
    """A turn read beside its answer (a large request) is still being read when the next turn of
    its conversation is answered: the next waits behind it, so each turn is compared with the
    one before it (taken out of order, the earlier turn would be compared with the later one's
    longer prompt: a miss that never was)."""
    watch = watch_of(proxy)
    gate = asyncio.Event()
    real = watch.bodies.shape

    calls = []

    async def slow_shape(*args):          # the first (g's) read is slow; any later one is not
        calls.append(len(args[0]))
        if len(calls) == 1:
            await gate.wait()
        return await real(*args)
    monkeypatch.setattr(watch.bodies, "shape", slow_shape)
    f = flow("opening")
    await proxy.send(f)
    await answer(proxy, f, sse_with_usage(read=0, write=9000))
    doc = json.loads(body("continuation"))
    doc["messages"] += [{"role": "assistant" if i % 2 else "user", "content": "x"} for i in range(1, 40_001)]
    g = flow("continuation", content=json.dumps(doc).encode())
    doc["messages"] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    h = flow("continuation", content=json.dumps(doc).encode())
    assert len(g.request.content) >= ledgerwatch.SHAPE_OFF_LOOP_MIN
    await proxy.send(g)
    _json_answer(g, "msg_2", read=9000, write=200)
    assert await _respond(proxy, g) is None
    await proxy.send(h)
    _json_answer(h, "msg_3", read=9200, write=30)
    assert await _respond(proxy, h) is None                     # behind g's read, not before it
    await asyncio.sleep(0.05)
    assert "ledger" not in g.metadata["sessionpin"] and "ledger" not in h.metadata["sessionpin"]
    assert len(calls) == 1                 # h's read has not begun: it waits for g's
    gate.set()
    await flushed(watch)
    assert (g.metadata["sessionpin"]["ledger"]["miss"], h.metadata["sessionpin"]["ledger"]["miss"]) == (False, False)
    assert sorted(t.id for t in await ledger.turns(proxy.store, SESSION))[-2:] == ["msg_2", "msg_3"]
    assert len(watch._lanes[(SESSION, "main")][1].messages) == len(doc["messages"])   # h's shape kept, last


async def test_over_max_behind_the_answer_waits_for_its_read_as_before(proxy, monkeypatch):
    monkeypatch.setattr(ledgerwatch, "MAX_BEHIND", 0)
    watch = watch_of(proxy)
    g = await _large_turn_answered(proxy)
    got = await _respond(proxy, g)
    assert asyncio.iscoroutine(got) and not watch._behind and watch.waited == 1
    await got
    assert g.metadata["sessionpin"]["ledger"]["input"] == 9203


async def test_over_the_bytes_held_beside_answers_the_answer_waits_for_its_read(proxy, monkeypatch):
    """Issue 22: turns read beside their answers each keep their flow's body until read; reads
    slower than the requests came (a steady 1 MB load, the body reader behind) kept them all —
    the proxy grew by 150 MB every 3 s. Past ``MAX_BEHIND_BYTES`` the answer waits for its read
    (the hook gives mitmproxy the read to await); the turn lands as before, and the count of
    bytes held goes back to nothing."""
    monkeypatch.setattr(ledgerwatch, "MAX_BEHIND_BYTES", 1024)
    watch = watch_of(proxy)
    g = await _large_turn_answered(proxy)
    got = await _respond(proxy, g)
    assert isinstance(got, asyncio.Task) and watch.waited == 1
    assert "sessionpin_ledger_answers_held_total 1" in watch.metrics()
    assert watch.behind_bytes == len(g.request.raw_content)
    await got
    await asyncio.sleep(0)                     # (the done callback)
    assert g.metadata["sessionpin"]["ledger"]["input"] == 9203 and watch.behind_bytes == 0
    monkeypatch.setattr(ledgerwatch, "MAX_BEHIND_BYTES", 1 << 30)
    h = flow("continuation", content=_large_continuation(40_001))
    await proxy.send(h)
    _json_answer(h, "msg_3", read=9200, write=30)
    assert await _respond(proxy, h) is None and watch.waited == 1   # within the bound: beside, as before
    await flushed(watch)
    assert watch.behind_bytes == 0 and (await ledger.load(proxy.store, SESSION)).turns == 3


async def test_a_turns_shape_being_read_does_not_hold_a_requests_facts(proxy, monkeypatch):
    """Issue 22: the router's facts of a large body (on the request's path) and the ledger's
    shapes (after answers) went to one body reader, a request at a time: a request waited
    behind every turn's shape queued before it — up to the reader's timeout for a hostile body.
    Each has its own reader; with the ledger's stuck, a large request is still routed."""
    watch = watch_of(proxy)
    assert watch.bodies is not proxy.router.bodies
    gate = asyncio.Event()

    async def stuck(*a):
        await gate.wait()
        return None
    monkeypatch.setattr(watch.bodies, "_ask", stuck)
    g = await _large_turn_answered(proxy)                 # 40,000 tiny messages: read apart
    assert await _respond(proxy, g) is None                # its shape's read is stuck beside it
    h = flow("continuation", content=_large_continuation(40_002))
    await asyncio.wait_for(proxy.send(h), 10)
    assert h.metadata["sessionpin"]["rule"] == "pinned" and proxy.router.bodies.reads >= 2
    gate.set()
    await flushed(watch)


async def test_a_turns_shape_is_read_from_the_members_the_router_decoded(proxy, monkeypatch):
    """Issue 22, the body decoded once: a Claude Code turn's prompt shape is read from the raw
    members the router's facts read made (``perflow.BODY``), the model as it was sent (renamed),
    and is the shape of the body as sent. A body another addon changed after the router is
    read afresh."""
    from sessionpin.proxy import perflow
    from sessionpin.reader import facts as F
    given = []
    real = ledgerwatch.promptshape.shape
    monkeypatch.setattr(ledgerwatch.promptshape, "shape",
                        lambda *a, **k: given.append(k.get("members")) or real(*a, **k))
    f = flow("opening")
    await proxy.send(f)
    await answer(proxy, f, sse_with_usage(read=0, write=9000))
    g = flow("continuation")
    await proxy.send(g)
    sent = g.request.raw_content
    assert b'"glm-4.6"' in sent and isinstance(g.metadata.get(perflow.BODY), perflow.Body)
    await answer(proxy, g, sse_with_usage(read=9000, write=200, msg="msg_2"))
    assert given[-1] is not None                                   # the router's members, not a decode
    kept = watch_of(proxy)._lanes[(SESSION, "main")][1]
    assert kept == real(sent, F.ANTHROPIC_MESSAGES) and kept.model == "glm-4.6"
    h = flow("continuation")
    await proxy.send(h)
    h.request.content = h.request.raw_content.replace(b'"max_tokens": 5', b'"max_tokens": 6')
    await answer(proxy, h, sse_with_usage(read=9000, write=200, msg="msg_3"))
    assert given[-1] is None                                       # changed since: read from the body


async def test_a_small_turns_shape_digests_only_the_messages_its_conversation_had_not_sent(proxy, monkeypatch):
    """Issue 22: on the event loop a turn's messages are compared with its conversation's last
    array (``promptshape.Runs`` by session), so a continuation digests only its new messages;
    the shape is the one read afresh. Another conversation's arrays are not compared with it."""
    from sessionpin.reader import facts as F
    from sessionpin.reader import promptshape

    def conv(n: int, first: str = "hi") -> bytes:      # compact, as clients send their bodies
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": first if i == 0 else f"m{i} " + "x" * 40}
                for i in range(n)]
        return json.dumps({"model": "claude-opus-4-1", "max_tokens": 5, "stream": True, "messages": msgs},
                          separators=(",", ":")).encode()
    stepped, compared = [], []
    digest, prefix = promptshape._message_digest, promptshape._common_prefix
    monkeypatch.setattr(promptshape, "_message_digest", lambda raw, seen: stepped.append(1) or digest(raw, seen))
    monkeypatch.setattr(promptshape, "_common_prefix", lambda a, b: compared.append(1) or prefix(a, b))
    watch = watch_of(proxy)
    for i, n in enumerate((1, 41, 43)):
        f = flow("opening" if n == 1 else "continuation", content=conv(n))
        await proxy.send(f)
        stepped.clear()
        await answer(proxy, f, sse_with_usage(read=9000 * i, write=200, msg=f"msg_{i}"))
        steps = len(stepped)
        assert watch._lanes[(SESSION, "main")][1] == promptshape.shape(f.request.raw_content, F.ANTHROPIC_MESSAGES)
    assert steps == 2                            # the two new messages of 43, not 43
    other = "0b0e0e0e-0000-4000-8000-00000000beef"
    f = flow("opening", session=other, content=conv(1, first="another"))
    await proxy.send(f)
    compared.clear()
    await answer(proxy, f, sse_with_usage(read=0, write=200, msg="msg_9"))
    assert compared == [] and watch._lanes[(other, "main")][1] is not None


async def test_a_small_requests_turn_is_read_once_its_answer_has_left(proxy):
    """The response hook returns before the turn is read (mitmproxy sends the answer when every
    response hook has returned); it is read at the loop's next turn, turns in the order their
    answers ended, and nothing of it is lost when the router's members have gone with the hook."""
    watch = watch_of(proxy)
    f = flow("opening")
    await proxy.send(f)
    f.response = tutils.tresp(status_code=200, content=b"", headers=http.Headers(
        [(b"content-type", b"text/event-stream")]))
    f.response.headers.pop("content-length", None)
    proxy.bundle.responseheaders(f)
    for c in sse_with_usage(read=0, write=9000):
        f.response.stream(c)
    f.response.stream(b"")
    assert proxy.bundle.response(f) is None                  # nothing for mitmproxy to wait for
    assert "ledger" not in f.metadata["sessionpin"] and watch.later.pending == 1
    g = flow("continuation")
    await proxy.send(g)
    _json_answer(g, "msg_2", read=9000, write=200)
    proxy.bundle.responseheaders(g)
    assert proxy.bundle.response(g) is None
    assert watch.later.pending == 2
    await flushed(watch)
    assert f.metadata["sessionpin"]["ledger"]["input"] == 9003 and "in 9003" in f.comment
    assert g.metadata["sessionpin"]["ledger"]["limit"] == 9003 and "cache 97%" in g.comment   # against f's
    turns = await ledger.turns(proxy.store, SESSION)
    assert [t.id for t in turns] == ["msg_1", "msg_2"]


async def test_a_large_requests_read_starts_once_its_answer_has_been_sent(proxy):
    """mitmproxy starts tasks eagerly: the task reading a large request's shape beside its answer
    ran, up to its first wait, inside the response hook, and its first wait came after the whole
    body's copy to the body process (4 MiB a step): milliseconds ahead of the answer. It now
    starts once mitmproxy has sent the answer (the flow no longer live)."""
    loop = asyncio.get_running_loop()
    loop.set_task_factory(asyncio.eager_task_factory)        # as mitmproxy runs its loop
    try:
        watch = watch_of(proxy)
        real, calls = watch.bodies.shape, []

        async def shape(*args):
            calls.append(len(args[0]))
            return await real(*args)
        watch.bodies.shape = shape
        g = await _large_turn_answered(proxy)
        assert await _respond(proxy, g) is None
        assert calls == []                                   # nothing of it ran in the hook
        g.live = False                                       # the answer is sent
        await flushed(watch)
        assert calls == [len(g.request.raw_content)]
        assert g.metadata["sessionpin"]["ledger"]["input"] == 9203
    finally:
        loop.set_task_factory(None)


async def test_a_large_socket_message_is_not_shaped_on_the_event_loop(tmp_path, monkeypatch):
    """A socket's ``response.create`` is shaped in its message hook, on the event loop, ahead of the
    message: a 16 MiB one of tiny items (the socket limit) took ~200 ms there, every other
    client waiting. From ``SHAPE_OFF_LOOP_MIN`` its turn is recorded without a shape, as a
    body's past ``MAX_SHAPE_ITEMS`` messages is; a small one is shaped as before."""
    shaped = []
    real = ledgerwatch.promptshape.shape
    monkeypatch.setattr(ledgerwatch.promptshape, "shape", lambda b, *a, **k: shaped.append(len(b)) or real(b, *a, **k))
    proxy, f, watch, say = await codex_socket(tmp_path)
    try:
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}
        for i, n in enumerate((3, 6000)):            # ~0.5 KB, then ~470 KB of tiny items
            say({"type": "response.create", "model": "gpt-6.2-sol", "input": [item] * n}, True)
            say({"type": "response.completed", "response": {
                "id": f"resp_{i}", "model": "alt-codex-1",
                "usage": {"input_tokens": 2000 + i, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": 10}}}, False)
        assert len(shaped) == 1 and shaped[0] < ledgerwatch.SHAPE_OFF_LOOP_MIN
        watch.websocket_end(f)
        await flushed(watch)
        turns = await ledger.turns(proxy.store, f.metadata["sessionpin"]["session"])
        assert [t.id for t in turns] == ["resp_0", "resp_1"]          # both recorded
    finally:
        proxy.close()


async def test_a_batch_the_store_refuses_for_one_conversation_costs_the_others_nothing(proxy):
    """A Redis script that fails midway (``HINCRBY`` on a sum an older version let reach int64's
    end) keeps the writes before the failing one. Each conversation not yet written (its last
    turn record absent) is then written alone: the others get their turns once, not twice and
    not never."""
    from collections import Counter

    from sessionpin.store import open_store
    from sessionpin.store.base import StoreError

    inner = open_store("memory:")

    class Midway:
        async def apply(self, checks, writes, durable=False):
            for w in writes:
                if w.key == ledger.key("poisoned"):
                    raise StoreError("ERR increment or decrement would overflow")
                await inner.apply([], [w])
            return True

        def __getattr__(self, name):
            return getattr(inner, name)

    watch = watch_of(proxy)
    per, turns = {}, Counter()
    for s in ("before", "poisoned", "after"):
        t = ledger.Turn(t=1.0, api="anthropic-messages", lane="main", kind="opening", server="glm", model="m",
                        id="x", usage=Usage(input=100, output=1))
        per.setdefault(s, ledger.Batch()).add(s, "claude-code", t, ledger.prior_of(t, None, None))
        turns[s] += 1
    assert await watch._apply(Midway(), per, turns) == ["before", "after"]
    for s in ("before", "after"):
        assert (await inner.hgetall(ledger.key(s)))["glm|m|input"] == "100"
        assert await inner.zcount(ledger.turns_key(s), float("-inf"), float("inf")) == 1
    assert watch.dropped == 1


async def test_a_server_naming_ever_new_models_does_not_grow_the_metrics_without_end(proxy):
    """The first 100 models named get a label of their own; any other counts as ``other``."""
    watch = watch_of(proxy)
    for i in range(250):
        t = ledger.Turn(t=1.0, api="anthropic-messages", lane="main", kind="opening", server="glm",
                        model=f"model-{i}", id="x", usage=Usage(input=10, output=1))
        watch._counted("claude-code", t)
    models = {k[2] for k in watch.tokens}
    assert len(models) == ledgerwatch.MAX_MODEL_LABELS + 1 and "other" in models and "model-0" in models
    assert watch.tokens[("claude-code", "glm", "other", "input")] == 10 * (250 - ledgerwatch.MAX_MODEL_LABELS)
    assert watch.metrics().count('model="') <= 2 * (ledgerwatch.MAX_MODEL_LABELS + 1)
