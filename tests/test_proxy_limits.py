"""BodyLimit: mitmproxy's stream_large_bodies is the body limit, and no other value."""

from __future__ import annotations

import asyncio
from typing import Optional

import pytest
from mitmproxy import exceptions, http
from mitmproxy.test import tflow, tutils

from sessionpin.proxy import perflow
from sessionpin.proxy.limits import TOKEN_HEADER, BodyLimit
from shellkit import start


@pytest.fixture
def proxy(tmp_path):
    p = start(tmp_path / "none.toml")
    yield p
    p.close()


def _limit(proxy) -> BodyLimit:
    return next(a for a in proxy.addons if isinstance(a, BodyLimit))


def test_stream_large_bodies_follows_the_body_limit(proxy):
    b = _limit(proxy)
    proxy.tctx.options.add_option("stream_large_bodies", Optional[str], None, "proxyserver's")
    proxy.tctx.configure(b, sessionpin_max_body_mb=8)
    assert proxy.tctx.options.stream_large_bodies == "8m"
    proxy.tctx.configure(b, sessionpin_max_body_mb=64)
    assert proxy.tctx.options.stream_large_bodies == "64m"


def test_another_stream_large_bodies_is_refused(proxy):
    """A smaller value would stream inference bodies under the limit to the addressed
    server before the router read them."""
    b = _limit(proxy)
    proxy.tctx.options.add_option("stream_large_bodies", Optional[str], None, "proxyserver's")
    proxy.tctx.configure(b, sessionpin_max_body_mb=64)
    with pytest.raises(exceptions.OptionsError, match="stream_large_bodies"):
        proxy.tctx.configure(b, stream_large_bodies="1m")
    assert proxy.tctx.options.stream_large_bodies == "64m"


def test_a_new_limit_holds_from_the_next_request(proxy):
    """The limit is read when the option changes (``configure``), not per request: a change
    made while the proxy runs holds at once, both ways."""
    b = _limit(proxy)
    proxy.tctx.options.add_option("stream_large_bodies", Optional[str], None, "proxyserver's")
    b._port = 9          # as if its sink listened
    two_mib = str(2 * 1024 * 1024).encode()
    proxy.tctx.configure(b, sessionpin_max_body_mb=1)
    over = _over(two_mib)
    b.requestheaders(over)
    assert over.request.stream, "2 MiB over a 1 MiB limit: to the sink"
    proxy.tctx.configure(b, sessionpin_max_body_mb=4)
    under = _over(two_mib)
    b.requestheaders(under)
    assert not under.request.stream and not b._answers.keys() - {over.metadata.get(perflow.SINK)}
    proxy.tctx.configure(b, sessionpin_max_body_mb=1)
    again = _over(two_mib)
    b.requestheaders(again)
    assert again.request.stream


# --------------------------------------------------------------------------- nothing outlives its flow (issue 20)

def _over(length=b"999999999", path=b"/v1/messages", host="api.anthropic.com"):
    req = tutils.treq(method=b"POST", scheme=b"https", host=host, port=443, path=path,
                      headers=http.Headers([(b"host", host.encode()), (b"content-type", b"application/json"),
                                            (b"x-api-key", b"agent-key"), *([(b"content-length", length)]
                                                                            if length else [])]),
                      content=b"")
    return tflow.tflow(req=req)


def _running(proxy) -> BodyLimit:
    b = _limit(proxy)
    proxy.tctx.options.add_option("stream_large_bodies", Optional[str], None, "proxyserver's")
    proxy.tctx.configure(b, sessionpin_max_body_mb=1)
    b._port = 9          # as if its sink listened
    return b


@pytest.mark.parametrize("end", ["error", "response"])
def test_a_prepared_413_goes_when_its_flow_ends(proxy, end):
    """5,000 requests with an over-limit Content-Length whose client went away kept 5,000
    prepared 413s: each goes when its flow ends, however it ends."""
    b = _running(proxy)
    flows = [_over() for _ in range(200)]
    for f in flows:
        b.requestheaders(f)
    assert len(b._answers) == 200 and all(f.request.stream for f in flows)
    for f in flows:
        getattr(b, end)(f)
    assert b._answers == {}
    assert not any(_kept(f) for f in flows)


@pytest.mark.parametrize("end", ["error", "response"])
def test_a_held_request_goes_when_its_flow_ends(proxy, end):
    b = _running(proxy)
    flows = [_over(length=None) for _ in range(100)]
    for f in flows:
        b.requestheaders(f)
    assert len(b._answers) == 100 and all(_kept(f) == {perflow.HELD, perflow.SINK} for f in flows)
    for f in flows:
        getattr(b, end)(f)
    assert b._answers == {} and not any(_kept(f) for f in flows)


def test_a_held_request_within_the_limit_leaves_nothing_behind(proxy):
    b = _running(proxy)
    f = _over(length=None)
    b.requestheaders(f)
    b.request(f)            # its body ended within the limit: back to its destination
    assert f.request.host == "api.anthropic.com" and b._answers == {}
    assert not _kept(f)


def _kept(f) -> set[str]:
    """What the parts keep in this flow (``perflow``): their own keys, not the decision's."""
    return {k for k in f.metadata if k.startswith("sessionpin.")}


async def test_the_sink_drops_the_answer_of_a_request_that_breaks_off(proxy):
    b = _running(proxy)
    await b._start()
    try:
        f = _over()
        b.requestheaders(f)
        [token] = b._answers
        reader, writer = await asyncio.open_connection("127.0.0.1", b._port)
        writer.write(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n"
                     + f"{TOKEN_HEADER}: {token}\r\n\r\n".encode() + b"x" * 1000)
        await writer.drain()
        writer.close()      # the client (mitmproxy, for a client that went away) breaks off
        for _ in range(200):
            if not b._answers:
                break
            await asyncio.sleep(0.01)
        assert b._answers == {}
    finally:
        b.done()


# --------------------------------------------------------------------------- the router's scope (issue 19)

# Servers written each way a server's URL is (its API's base): the body limit must see every
# request the router routes, by the router's own rule (config.Config.scope).
SERVERS = """
[servers.anthropic]
url = "https://api.anthropic.com"
[servers.zai]
url = "https://api.z.ai/api/paas/v4"
[servers.coding]
url = "https://open.bigmodel.cn/api/coding/paas/v4"
[servers.glm]
url = "https://glm.example/api/anthropic"
[servers.zen]
url = "https://opencode.ai/zen/v1"
"""
# (host, path, whether the router routes it, whether it guards it unrouted: ``paths.guarded``)
REQUESTS = [
    ("api.z.ai", "/api/paas/v4/chat/completions", True, False),          # the server's own base (no /v1)
    ("api.z.ai", "/api/paas/v4/responses?x=1", True, False),
    ("open.bigmodel.cn", "/api/coding/paas/v4/chat/completions", True, False),
    ("glm.example", "/api/anthropic/v1/messages?beta=true", True, False),
    ("opencode.ai", "/zen/v1/chat/completions", True, False),
    ("api.anthropic.com", "/v1/messages", True, False),
    ("api.anthropic.com", "/api/paas/v4/chat/completions", False, True),  # not this server's base
    ("api.z.ai", "/api/paas/v4/threads/x/messages", False, True),         # a look-alike
    ("api.z.ai", "/api/paas/v4/chat/completions/", False, True),          # spelled otherwise (the router's 400)
    ("elsewhere.example", "/api/paas/v4/chat/completions", False, True),  # no server there: the path alone
    ("elsewhere.example", "/v1/chat/completions", True, False),
    ("bedrock.example", "/model/anthropic.claude-x/invoke", False, True),  # another API's endpoint
    ("api.z.ai", "/api/paas/v4/files", False, False),                     # neither
    ("api.anthropic.com", "/v1/messages/batches", False, False),
]


@pytest.fixture
def servers(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text(SERVERS)
    p = start(cfg)
    yield p
    p.close()


@pytest.mark.parametrize("host,path,routed,guarded", REQUESTS)
def test_the_limit_sees_exactly_what_the_router_routes_or_guards(servers, host, path, routed, guarded):
    """A server written ``…/api/paas/v4`` had its ``/api/paas/v4/chat/completions`` routed, yet
    a 300 MB body was buffered whole: the limit went by the path alone. A path the router
    guards (a conversation pinned elsewhere is refused there) had its body over the limit
    streamed to the server it addressed before the router could read the pin."""
    b = _running(servers)
    f = _over(path=path.encode(), host=host)
    b.requestheaders(f)
    bounded = routed or guarded
    assert bool(f.request.stream) is bounded and (f.request.host == "127.0.0.1") is bounded
    assert (f.metadata.get("sessionpin", {}).get("refused") == 413) is bounded
    assert servers.config.config.scope("POST", "https", host, 443, path)[1].inference is routed   # the router's
