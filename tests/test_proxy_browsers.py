"""PageGuard: a web page's request never drives the proxy (issue 20)."""

from __future__ import annotations

import json

import pytest
from mitmproxy import exceptions
from mitmproxy.proxy import mode_specs

from sessionpin.records import pins
from sessionpin.proxy.browsers import PageGuard
from shellkit import CONFIG, SESSION, flow, internal, start

CROSS_SITE = [(b"sec-fetch-site", b"cross-site"), (b"sec-fetch-mode", b"no-cors")]
PI_METADATA = [(b"sec-fetch-mode", b"cors"), (b"anthropic-dangerous-direct-browser-access", b"true")]


@pytest.fixture
def cfg_path(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text(CONFIG)
    return p


@pytest.fixture
async def proxy(cfg_path):
    p = start(cfg_path)
    yield p
    p.close()


def _guard(proxy) -> PageGuard:
    return next(a for a in proxy.addons if isinstance(a, PageGuard))


def _reverse(f, to="https://api.anthropic.com"):
    f.client_conn.proxy_mode = mode_specs.ProxyMode.parse(f"reverse:{to}")
    return f


@pytest.mark.parametrize("extra", [CROSS_SITE, [(b"origin", b"https://evil.example")],
                                   [(b"sec-fetch-site", b"same-site")], [(b"origin", b"null")]])
async def test_a_page_s_request_to_a_configured_server_is_refused_and_never_routed(proxy, extra):
    f = flow(headers=extra)
    await proxy.send(f)
    assert f.response is not None and f.response.status_code == 403
    err = json.loads(f.response.content)
    assert err["error"]["type"] == "permission_error" and "sessionpin_allow_origins" in err["error"]["message"]
    assert f.response.headers["x-sessionpin-refused"] == "web-page"
    # nothing was decided: the request still addresses its own origin with its own headers, no pin
    assert (f.request.host, f.request.headers["x-api-key"]) == ("api.anthropic.com", "agent-sentinel")
    assert (await pins.load(proxy.store, SESSION)).pin is None
    assert proxy.router.metrics.refusals["web-page"] == 1


async def test_pi_s_fetch_metadata_is_routed_as_ever(proxy):
    f = flow(headers=PI_METADATA)
    await proxy.send(f)
    assert f.response is None and f.request.host == "api.z.ai"


async def test_every_request_of_a_page_on_a_reverse_mode_listener_is_refused(proxy):
    for path in ("/v1/messages", "/v1/models", "/"):
        f = _reverse(flow(path=path, headers=CROSS_SITE))
        await proxy.send(f)
        assert f.response is not None and f.response.status_code == 403, path
    f = _reverse(flow(headers=PI_METADATA))
    await proxy.send(f)
    assert f.response is None and f.request.host == "api.z.ai"


async def test_a_page_browsing_other_sites_through_the_proxy_passes_untouched(proxy):
    f = flow(host="example.org", path="/v1/messages", headers=[(b"origin", b"https://example.org"),
                                                               (b"sec-fetch-site", b"same-origin")])
    await proxy.send(f)
    assert f.response is None and f.request.host == "example.org"


@pytest.mark.parametrize("extra", [CROSS_SITE, [(b"origin", b"https://example.org")]])
async def test_a_page_s_request_to_another_host_is_never_routed_even_continuing_a_pinned_conversation(proxy, extra):
    """The router follows a pin whatever origin a request addressed: a page's request to its own
    host, naming a pinned conversation, went to that conversation's server with its key."""
    f = flow()
    await proxy.send(f)
    assert f.request.host == "api.z.ai" and (await pins.load(proxy.store, SESSION)).pin is not None
    agent = flow("continuation", host="example.org")                 # the agent's own: follows the pin
    await proxy.send(agent)
    assert agent.request.host == "api.z.ai"
    page = flow("continuation", host="example.org", headers=extra)
    await proxy.send(page)
    assert page.response is None and page.request.host == "example.org"
    assert page.request.headers["x-api-key"] == "agent-sentinel" and "sessionpin" not in page.metadata
    assert not any(k.startswith("sessionpin.") for k in page.metadata)


async def test_the_status_endpoints_refuse_a_page_with_an_origin(proxy):
    f = internal("/__sessionpin/status", headers=[(b"origin", b"http://127.0.0.1:8080")])
    await proxy.send(f)
    assert f.response.status_code == 403


async def test_an_allowed_origin_is_routed(proxy):
    proxy.tctx.configure(_guard(proxy), sessionpin_allow_origins=["https://app.example"])
    f = flow(headers=[(b"origin", b"https://app.example"), (b"sec-fetch-site", b"cross-site")])
    await proxy.send(f)
    assert f.response is None and f.request.host == "api.z.ai"
    f = flow(headers=[(b"origin", b"https://other.example")])
    await proxy.send(f)
    assert f.response.status_code == 403


@pytest.mark.parametrize("bad", ["app.example", "ftp://app.example", "https://app.example/path", "https://"])
async def test_an_allowed_origin_must_be_an_origin(proxy, bad):
    with pytest.raises(exceptions.OptionsError, match="sessionpin_allow_origins"):
        proxy.tctx.configure(_guard(proxy), sessionpin_allow_origins=[bad])


def test_the_headers_read_for_a_page_are_those_a_whole_decode_gives():
    """Issue 22: only names holding "origin" or "sec-fetch-site" are decoded; what
    ``from_web_page`` says is the same as from every header decoded (a name with spaces or
    other whitespace around it, any case, a value not UTF-8)."""
    from mitmproxy import http as mhttp
    from sessionpin.decision import headers as H
    from sessionpin.proxy.browsers import _page_headers
    cases = [
        [(b"Origin", b"https://evil.example")],
        [(b" origin\x1c", b"https://evil.example")],
        [(b"SEC-FETCH-SITE", b"cross-site"), (b"x-api-key", b"k")],
        [(b"sec-fetch-site", b"none"), (b"content-type", b"application/json")],
        [(b"origin", b"\xff\xfe"), (b"Origin", b"https://second")],
        [(b"x-origin-note", b"a"), (b"user-agent", b"claude-cli/2")],
        [],
    ]
    for fields in cases:
        h = mhttp.Headers(fields)
        for allowed in ((), ("https://evil.example",)):
            assert H.from_web_page(_page_headers(h.fields), allowed) == \
                H.from_web_page(h.items(multi=True), allowed), fields
