"""The probe against a real TLS server (the fake gateway): request shape and classification."""
import json

import pytest

from fakegateway import FakeGateway, is_fast_id
from sessionpin.opencode_ids.prober import ProbeTarget, body_for, probe, ssl_context


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = FakeGateway().start(tmp_path_factory.mktemp("gw"))
    yield g
    g.stop()


def target(gw, key="good-key", kind="chat/completions", header="authorization"):
    value = f"Bearer {key}" if header == "authorization" else key
    return ProbeTarget(gw.origin, f"/zen/go/v1/{kind}", kind, "kimi", ((header, value),))


def ids(fast: bool, n=1):
    out, i = [], 0
    while len(out) < n:
        sid = f"id-{i}"
        if is_fast_id(sid) == fast:
            out.append(sid)
        i += 1
    return out


@pytest.mark.parametrize("kind", ["chat/completions", "messages", "responses"])
def test_probe_bodies_are_one_token(kind):
    doc = json.loads(body_for(kind, "m"))
    assert doc["model"] == "m" and (doc.get("max_tokens") == 1 or doc.get("max_output_tokens") == 16)


async def test_fast_and_slow_ids_by_server_timing(gw):
    ctx = ssl_context(str(gw.ca))
    fast = await probe(target(gw), ids(True)[0], 5000, max_upstream_ms=2500, ssl_ctx=ctx)
    slow = await probe(target(gw, header="x-api-key"), ids(False)[0], 5000, max_upstream_ms=2500, ssl_ctx=ctx)
    assert (fast.kind, fast.ms, fast.source) == ("fast", 900, "upstream")
    assert (slow.kind, slow.ms) == ("slow", 20_000)
    seen = gw.probes()[-2:]
    assert [s.session for s in seen] == [ids(True)[0], ids(False)[0]]
    assert [s.credential for s in seen] == ["authorization", "x-api-key"]


async def test_bad_key_is_unauthorized(gw):
    r = await probe(target(gw, key="bad"), "x", 5000, max_upstream_ms=2500, ssl_ctx=ssl_context(str(gw.ca)))
    assert r.kind == "unauthorized" and r.status == 401


async def test_429_carries_retry_after(gw):
    ctx = ssl_context(str(gw.ca))
    gw.overload(1, retry_after_ms=1234)
    gw.overload(1, retry_after="7")
    a = await probe(target(gw), "x", 5000, max_upstream_ms=2500, ssl_ctx=ctx)
    b = await probe(target(gw), "x", 5000, max_upstream_ms=2500, ssl_ctx=ctx)
    assert (a.kind, a.retry_after_ms, b.retry_after_ms) == ("overloaded", 1234, 7000)


async def test_wall_clock_without_server_timing_and_timeout(tmp_path):
    g = FakeGateway(server_timing=False, fast_ms=100, slow_ms=3000, delay_scale=1.0).start(tmp_path)
    try:
        ctx = ssl_context(str(g.ca))
        fast = await probe(target(g), ids(True)[0], 5000, max_upstream_ms=2500, ssl_ctx=ctx)
        assert fast.kind == "fast" and fast.source == "wall" and fast.ms >= 100
        late = await probe(target(g), ids(False)[0], 1500, max_upstream_ms=2500, ssl_ctx=ctx)
        assert late.kind == "timeout" and late.ms == 1500
    finally:
        g.stop()


async def test_untrusted_certificate_and_refused_connection_are_failures(gw):
    r = await probe(target(gw), "x", 5000, max_upstream_ms=2500, ssl_ctx=ssl_context())
    assert r.kind == "failed"
    dead = ProbeTarget("https://127.0.0.1:1", "/zen/v1/messages", "messages", "m", (("x-api-key", "k"),))
    assert (await probe(dead, "x", 2000, max_upstream_ms=2500)).kind == "failed"


def test_credentials_never_in_repr(gw):
    assert "good-key" not in repr(target(gw))


async def test_balance_mode_answers_regardless_of_the_id(tmp_path):
    # The 2026-11-11 gateway: one id probed again and again is sometimes fast, sometimes slow.
    g = FakeGateway(balance=True).start(tmp_path)
    try:
        ctx = ssl_context(str(g.ca))
        kinds = [(await probe(target(g), "one-id", 5000, max_upstream_ms=2500, ssl_ctx=ctx)).kind for _ in range(12)]
    finally:
        g.stop()
    assert set(kinds) == {"fast", "slow"}
