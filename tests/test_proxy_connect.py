"""ConnectCheck: an unreachable server a request was moved to is named, in the agent's format."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from mitmproxy.proxy import server_hooks
from mitmproxy.test import tflow

from sessionpin.reader.ids import short
from shellkit import CONFIG, SESSION, flow, start


def free_port() -> int:
    import ports
    return ports.free_port()        # below the ephemeral range: nobody else takes it meanwhile


@pytest.fixture
def cfg_path(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text(CONFIG)
    return p


@pytest.fixture
def proxy(cfg_path):
    p = start(cfg_path, sessionpin_connect_check=True, sessionpin_connect_retry_ms=0)
    yield p
    p.close()


async def test_a_moved_request_to_a_server_that_is_down_gets_an_error_naming_it(proxy, cfg_path):
    down = free_port()
    cfg_path.write_text(CONFIG.replace("https://api.z.ai/api/anthropic", f"https://127.0.0.1:{down}/api/anthropic"))
    proxy.reload()
    f = flow()
    await proxy.send(f)
    # no client retries it (docs/traffic.md): 424, x-should-retry false, no retry-after
    assert f.response.status_code == 424 and f.response.headers["x-should-retry"] == "false"
    assert f.response.headers["content-type"] == "application/json" and "retry-after" not in f.response.headers
    err = json.loads(f.response.content)
    assert err["type"] == "error"
    msg = err["error"]["message"]
    assert "server glm" in msg and f"127.0.0.1:{down}" in msg and short(SESSION) in msg
    assert f.request.host == "api.anthropic.com", "nothing was sent anywhere"
    assert proxy.connect.unreachable["glm"]
    # the pin stays: the conversation stays on glm
    from sessionpin.records import pins
    assert (await pins.load(proxy.store, SESSION)).pin.server == "glm"


async def test_the_check_turned_off_while_running_holds_from_the_next_request(proxy, cfg_path):
    """The option is read when it changes (``configure``), not per request: off, a moved
    request to a server that is down is not checked (mitmproxy says what it says); on again,
    it is."""
    down = free_port()
    cfg_path.write_text(CONFIG.replace("https://api.z.ai/api/anthropic", f"https://127.0.0.1:{down}/api/anthropic"))
    proxy.reload()
    proxy.tctx.options.update(sessionpin_connect_check=False)
    f = flow()
    await proxy.send(f)
    assert f.response is None and f.request.port == down, "not checked: sent on"
    proxy.tctx.options.update(sessionpin_connect_check=True)
    f = flow()
    await proxy.send(f)
    assert f.response is not None and f.response.status_code == 424


async def test_a_server_requests_were_moved_to_is_named_by_server_connect(proxy):
    r = proxy.connect
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    down = free_port()
    try:
        def data(port):
            d = server_hooks.ServerConnectionHookData(client=tflow.tclient_conn(), server=tflow.tserver_conn())
            d.server.address = ("127.0.0.1", port)
            d.server.error = None
            return d

        untouched = data(down)
        await r.server_connect(untouched)          # not a server the router moved anything to
        assert untouched.server.error is None
        r.moved_to(("127.0.0.1", down), "glm")
        r.moved_to(("127.0.0.1", listening.getsockname()[1]), "glm")
        failed = data(down)
        await r.server_connect(failed)
        assert failed.server.error.startswith("sessionpin: server glm (https://api.z.ai) cannot be reached")
        up = data(listening.getsockname()[1])
        await r.server_connect(up)
        assert up.server.error is None
        r.server_connected(data(down))             # a connection to it is open: no check
        again = data(down)
        await r.server_connect(again)
        assert again.server.error is None
        r.server_disconnected(data(down))
        again = data(down)
        await r.server_connect(again)
        assert again.server.error is not None
    finally:
        listening.close()


async def test_a_check_the_router_made_stands_once_for_the_connection_that_follows(proxy):
    r = proxy.connect
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    addr = ("127.0.0.1", listening.getsockname()[1])
    r.moved_to(addr, "glm")
    client = tflow.tclient_conn()

    def data():
        d = server_hooks.ServerConnectionHookData(client=client, server=tflow.tserver_conn())
        d.server.address = addr
        d.server.error = None
        return d
    try:
        assert await r.reachable(client.id, addr) is None
        listening.close()                           # down after the check
        first = data()
        await r.server_connect(first)
        assert first.server.error is None           # the router's check stood: no second connect
        second = data()
        await r.server_connect(second)              # once: this one is checked now
        assert second.server.error is not None
        assert await r.reachable(client.id, addr) is not None
    finally:
        listening.close()


async def test_behind_an_upstream_proxy_nothing_is_tried_directly(proxy, cfg_path):
    """Clients of an upstream: listener reach servers through that proxy: a direct connect tells nothing."""
    from mitmproxy.proxy import mode_specs

    down = free_port()
    cfg_path.write_text(CONFIG.replace("https://api.z.ai/api/anthropic", f"https://127.0.0.1:{down}/api/anthropic"))
    proxy.reload()
    f = flow()
    f.client_conn.proxy_mode = mode_specs.ProxyMode.parse("upstream:http://127.0.0.1:3128")
    proxy.connect.client_connected(f.client_conn)
    await proxy.send(f)
    assert f.response is None and f.request.host == "127.0.0.1" and f.request.port == down   # sent on, via the proxy
    assert proxy.connect.unreachable == {}
    # mitmproxy's own connection through that proxy: not checked either
    d = server_hooks.ServerConnectionHookData(client=f.client_conn, server=tflow.tserver_conn())
    d.server.address, d.server.error = ("127.0.0.1", down), None
    d.server.via = ("http", ("127.0.0.1", 3128))
    await proxy.connect.server_connect(d)
    assert d.server.error is None
    proxy.connect.client_disconnected(f.client_conn)
    assert not proxy.connect.via_proxy
    g = flow(session="abcd1234-0000-4000-8000-000000000002")           # a regular client: checked as before
    await proxy.send(g)
    assert g.response.status_code == 424 and "cannot be reached" in g.response.text


async def test_a_client_connection_s_checks_go_when_it_closes(proxy):
    """Issue 20: no per-request (or per-connection) state outlives what it was for. A check
    kept for a connection mitmproxy never made, and an early one no request took, are
    dropped (and stopped) when the client connection closes."""
    r = proxy.connect
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    addr = ("127.0.0.1", listening.getsockname()[1])
    r.moved_to(addr, "glm")
    try:
        clients = [tflow.tclient_conn() for _ in range(50)]
        for c in clients:
            assert await r.reachable(c.id, addr) is None     # kept for the connection that follows
        early = tflow.tclient_conn()
        r._start(early.id)                                    # started, never taken
        assert len(r._checks) == 51
        task = r._checks[(early.id, addr)][1]
        for c in clients + [early]:
            r.client_disconnected(c)
        assert r._checks == {}
        await asyncio.sleep(0)
        assert task.done()
    finally:
        listening.close()


async def test_a_blip_is_ridden_out_within_the_budget_then_the_address_is_known_down(cfg_path):
    import asyncio
    import time

    from sessionpin.proxy import connect as C

    p = start(cfg_path, sessionpin_connect_check=True, sessionpin_connect_retry_ms=600)
    try:
        r = p.connect
        port = free_port()
        addr = ("127.0.0.1", port)
        r.moved_to(addr, "glm")
        client = tflow.tclient_conn()
        server = None

        async def listen_later():
            nonlocal server
            await asyncio.sleep(0.3)
            server = await asyncio.start_server(lambda rd, wr: wr.close(), *addr)

        later = asyncio.ensure_future(listen_later())
        t0 = time.monotonic()
        assert await r.reachable(client.id, addr) is None          # back within the budget: no error
        assert 0.25 < time.monotonic() - t0 < 0.6 + 0.5
        await later
        server.close()
        await server.wait_closed()
        t0 = time.monotonic()
        err = await r.reachable(client.id, addr)                   # down for the whole budget
        assert err == "it refuses connections: nothing listens there"
        assert 0.55 < time.monotonic() - t0 < 0.6 + 0.5 and addr in r.down
        t0 = time.monotonic()
        assert await r.reachable(client.id, addr) == err            # known down: one attempt, no budget
        assert time.monotonic() - t0 < 0.3
        assert r.unreachable["glm"] == err
        assert C.why(TimeoutError(), 2.0) == "no answer within 2 s"
        assert C.why(OSError(113, "No route to host"), 2.0) == "no route to host"
    finally:
        p.close()


@pytest.mark.parametrize("path,routed", [("/api/paas/v4/chat/completions", True),
                                         ("/api/paas/v4/threads/x/messages", False),
                                         ("/v1/messages", True)])
async def test_the_early_check_starts_for_what_the_router_routes(cfg_path, path, routed):
    """Issue 19: a server written ``…/api/paas/v4`` has ``/api/paas/v4/chat/completions``
    routed; the early check went by the path alone and never started for it."""
    cfg_path.write_text(CONFIG + '\n[servers.zai]\nurl = "https://api.z.ai/api/paas/v4"\n')
    p = start(cfg_path, sessionpin_connect_check=True, sessionpin_connect_retry_ms=0)
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    try:
        addr = ("127.0.0.1", listening.getsockname()[1])
        p.connect.moved_to(addr, "glm")
        f = flow(host="api.z.ai", path=path)
        assert p.config.config.scope("POST", "https", "api.z.ai", 443, path)[1].inference is routed
        p.connect.requestheaders(f)
        assert bool(p.connect._checks) is routed
        p.connect.client_disconnected(f.client_conn)
    finally:
        listening.close()
        p.close()
