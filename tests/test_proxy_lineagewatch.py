"""LineageWatch in the shell: what it records from responses for later forks, and when it
reads the request (after the answer, never on the request's path)."""

from __future__ import annotations

import asyncio
import json

import pytest
from mitmproxy import http
from mitmproxy.test import tutils

from sessionpin import facts as F
from sessionpin import lineage, lineindex
from sessionpin.lineage_stream import StreamReader
from sessionpin.proxy import lineagewatch
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
    await asyncio.gather(*list(watch._tasks))


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
    assert await proxy.store.get(lineindex.anchor_key("claude-code", "req:req_abc123")) == SESSION


async def test_an_answer_cut_short_records_no_root_and_a_continuation_only_its_anchor(proxy, monkeypatch):
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
    assert calls == [] and await proxy.store.keys("lin:claude-code:root:") == []
    assert await proxy.store.get(lineindex.anchor_key("claude-code", "req:req_abc123")) == SESSION


async def test_an_error_answer_records_nothing(proxy):
    f = flow()
    await proxy.send(f)
    await answer(proxy, f, [json.dumps({"type": "error"}).encode()], status=529)
    assert await proxy.store.keys("lin:") == []
