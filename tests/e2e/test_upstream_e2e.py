"""The whole chain behind a corporate proxy: a sessionpin router in mitmproxy's upstream mode.

    agent --> mitmdump --mode upstream:http://corp -s addons/route.py --> corp (mitmdump, proxyauth) --> gateway

The "corporate proxy" is a second, plain mitmdump: regular mode, ``proxyauth``, TLS
interception with its own CA, every flow it carries written to ``corp.flow``. The OpenCode
gateway (tests/fakegateway.py) can be reached **only through it**: the gateway's address as
the agent, the router and the pool know it is a port where nothing listens, and a small
script in the corporate proxy sends tunnels for that port to the gateway's real port. A
connection that went around the corporate proxy would be refused; what went through it is
read back from its flow file (with the user its ``proxyauth`` let in), not inferred.

The router trusts the corporate proxy's CA (``ssl_verify_upstream_trusted_ca``) and
authenticates with ``upstream_auth``; the pool is given no CA and no proxy of its own. Shown:
the OpenCode agent's requests, the pool's probes and a Claude Code conversation the router
moves to the gateway all pass the corporate proxy, authenticated; the start line says how
probes go out; an upstream they cannot use (SOCKS) stops the start with the mode named.
"""

from __future__ import annotations

import json
import socket
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from fakegateway import FakeGateway, is_fast_id
from sessionpin.opencode_ids import state
from sessionpin.store import open_store

from .harness import Client, Mitmdump, MitmdumpError, free_port

RUN = uuid.uuid4().hex[:6]
KEY = "good-key"
MODEL = "deepseek-v4.1-flash"
USER, PASSWORD = "alice", f"corp-{RUN}-pw"
CHAT = "/zen/go/v1/chat/completions"
OPENCODE = [("user-agent", "opencode/1.18.33"), ("authorization", f"Bearer {KEY}"),
            ("content-type", "application/json")]

# Claude Code's conversations are moved to the gateway (a server the agent did not address).
CONFIG = '''
[servers.anthropic]
url = "https://api.anthropic.com"

[servers.gateway]
url = "{origin}/zen/go"
key_env = "GATEWAY_KEY"

[agents.claude-code]
server = "gateway"
'''

# The corporate proxy's only addition to plain mitmdump: the gateway's published port leads to
# its real one (for CONNECT tunnels and for the requests inside them).
CORP_SCRIPT = '''
PUBLISHED, REAL = {published}, {real}


class Gateway:
    def http_connect(self, flow):
        if flow.request.port == PUBLISHED:
            flow.request.port = REAL

    def requestheaders(self, flow):
        if flow.request.port == PUBLISHED:
            flow.request.port = REAL


addons = [Gateway()]
'''


@pytest.fixture(scope="module")
def world():
    with tempfile.TemporaryDirectory(prefix="sessionpin-upstream-e2e-") as tmp:
        work = Path(tmp)
        gw = FakeGateway(keys={KEY}).start(work)
        published = free_port()                       # nothing listens here
        origin = f"https://127.0.0.1:{published}"
        (work / "corp.py").write_text(CORP_SCRIPT.format(published=published, real=gw.port))
        (work / "config.toml").write_text(CONFIG.format(origin=origin))
        store_url = f"file:{work / 'state.db'}"
        corp = Mitmdump(work / "corp", script=work / "corp.py", args=["-w", str(work / "corp.flow")],
                        options={"proxyauth": f"{USER}:{PASSWORD}", "ssl_verify_upstream_trusted_ca": str(gw.ca)})
        router = None
        try:
            corp.start()
            router = Mitmdump(work / "router", env={"GATEWAY_KEY": KEY}, options={
                "sessionpin_config": str(work / "config.toml"),
                "sessionpin_store": store_url,
                "upstream_auth": f"{USER}:{PASSWORD}",
                "ssl_verify_upstream_trusted_ca": str(corp.mitm_ca),
                "sessionpin_pool_gateways": origin,
                "sessionpin_pool_size": 2,
                "sessionpin_pool_refill_delay_ms": 200,
                "sessionpin_pool_min_probe_interval_ms": 0,
                "sessionpin_pool_refresh_interval_ms": 1000,
            }, modes=[f"upstream:http://127.0.0.1:{corp.port}"])
            router.start()
            yield {"gw": gw, "corp": corp, "router": router, "origin": origin, "published": published,
                   "flows": work / "corp.flow", "store_url": store_url, "work": work,
                   "client": Client.via_proxy(router.port, router.mitm_ca)}
        finally:
            if router is not None:
                router.stop()
            corp.stop()
            gw.stop()


def carried(world) -> list:
    """The flows the corporate proxy wrote so far (a flow being written as we read: left out)."""
    from mitmproxy import exceptions, http
    from mitmproxy.io import FlowReader

    out = []
    if not world["flows"].exists():
        return out
    with world["flows"].open("rb") as f:
        try:
            for flow in FlowReader(f).stream():
                if isinstance(flow, http.HTTPFlow):
                    out.append(flow)
        except exceptions.FlowReadException:
            pass
    return out


def wait_carried(world, sid: str, sender: str, timeout: float = 10.0):
    """The corporate proxy's flow of a request with ``x-opencode-session: sid`` from ``sender``
    (its user-agent's first word: "opencode" for the agent, "sessionpin-pool" for a probe)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for flow in carried(world):
            h = flow.request.headers
            if h.get("x-opencode-session") == sid and h.get("user-agent", "").split("/")[0] == sender \
                    and flow.response is not None:
                return flow
        time.sleep(0.1)
    raise AssertionError(f"the corporate proxy carried nothing with id {sid}:\n{world['corp'].tail(20)}")


def spares(world) -> dict:
    import asyncio

    async def read():
        store = open_store(world["store_url"])
        try:
            return await state.spares(store, "opencode-go", MODEL, drop_bad=False)
        finally:
            await store.close()
    return asyncio.run(read())


def wait_spares(world, n: int, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = spares(world)
        if len(got) >= n:
            return got
        time.sleep(0.25)
    raise AssertionError(f"pool did not fill: {spares(world)}\n{world['router'].tail(30)}")


def chat(world, session: str, text: str):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True}).encode()
    return world["client"].request("POST", world["origin"] + CHAT, headers=[*OPENCODE, ("x-opencode-session", session)],
                                   body=body)


def test_the_gateway_is_reachable_only_through_the_corporate_proxy(world):
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", world["published"]), timeout=5).close()


def test_the_router_says_at_start_how_probes_go_out(world):
    router, corp = world["router"], world["corp"]
    line = router.wait_output(r"sessionpin pool: probes go .*", timeout=10)
    assert line, router.tail(30)
    assert line.group(0).startswith(f"sessionpin pool: probes go through the upstream proxy "
                                    f"http://127.0.0.1:{corp.port} (mitmproxy's upstream mode, with upstream_auth), "
                                    f"trusting {corp.mitm_ca}"), line.group(0)
    said = [ln for ln in router.output.splitlines() if not ln.startswith("---- start:")]   # the harness' own line
    assert not [ln for ln in said if PASSWORD in ln]


def test_the_agents_requests_and_the_pools_probes_go_through_the_corporate_proxy(world):
    gw = world["gw"]
    own = f"ses_{RUN}_first"
    r = chat(world, own, "hi")
    assert r.status == 200 and r.events, r.text
    assert gw.requests()[-1].session == own                           # no spare yet: its own id
    flow = wait_carried(world, own, "opencode")                        # the agent's request, at the corporate proxy
    assert list(flow.metadata.get("proxyauth", ())) == [USER, PASSWORD]         # let in with upstream_auth
    assert flow.response.status_code == 200

    pool = wait_spares(world, 2)                                       # probes with the client's key
    assert all(is_fast_id(sid) for sid in pool)
    for sid in pool:
        probe = wait_carried(world, sid, "sessionpin-pool")            # each kept id was probed through it
        assert json.loads(probe.request.content)["max_tokens"] == 1
        assert list(probe.metadata.get("proxyauth", ())) == [USER, PASSWORD]
        assert sid in {p.session for p in gw.probes()}                 # ...and reached the gateway
    probed = {p.session for p in gw.probes()}
    through = {f.request.headers.get("x-opencode-session") for f in carried(world)}
    assert probed <= through                                           # no probe went around it

    other = f"ses_{RUN}_second"
    assert chat(world, other, "hello").status == 200
    routed = gw.requests()[-1].session
    assert routed in pool and routed != other                          # a new conversation got a verified spare
    assert wait_carried(world, routed, "opencode").response.status_code == 200


def test_a_request_the_router_moves_goes_through_the_corporate_proxy_too(world):
    # the router's connect check must not try the gateway directly (it would be refused here)
    session = str(uuid.uuid4())
    body = json.dumps({"model": "claude-opus-4-1", "max_tokens": 5, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}],
                       "tools": [{"name": "Bash", "input_schema": {"type": "object"}}]}).encode()
    r = world["client"].request("POST", "https://api.anthropic.com/v1/messages?beta=true", body=body, headers=[
        ("user-agent", "claude-cli/2.1.332 (external, cli)"), ("content-type", "application/json"),
        ("x-api-key", "the-agents-own-key"), ("anthropic-version", "2023-06-01"),
        ("x-claude-code-request-class", "main"), ("x-claude-code-session-id", session)])
    assert "cannot be reached" not in r.text, r.text
    assert world["router"].wait_output(rf"claude-code opening {session[:8]} anthropic → gateway", timeout=5), \
        world["router"].tail(20)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        flows = [f for f in carried(world) if f.request.path.startswith("/zen/go/v1/messages")
                 and f.request.headers.get("user-agent", "").startswith("claude-cli/") and f.response is not None]
        if flows:
            break
        time.sleep(0.1)
    assert flows, world["corp"].tail(20)
    assert list(flows[0].metadata.get("proxyauth", ())) == [USER, PASSWORD]
    assert flows[0].request.headers.get("x-api-key") != "the-agents-own-key"      # the gateway's key, not the agent's
    assert flows[0].response.status_code == r.status                              # the gateway's answer, relayed
    assert "/zen/go/v1/messages" in {s.path for s in world["gw"].requests()}


def test_an_upstream_the_probes_cannot_use_is_named_at_start(world):
    # mitmproxy has no SOCKS upstream; it refuses the mode itself, before any addon runs
    m = Mitmdump(world["work"] / "socks", modes=["upstream:socks5://127.0.0.1:1080"],
                 options={"sessionpin_config": str(world["work"] / "config.toml"), "sessionpin_store": "memory:",
                          "sessionpin_pool_gateways": world["origin"]})
    with pytest.raises(MitmdumpError):
        m.start(timeout=20)
    assert m.wait_exit(10) not in (None, 0)
    assert "upstream:socks5://127.0.0.1:1080" in m.output and "socks5" in m.output.lower(), m.tail(20)

    # two upstream proxies (one per listener): the probes follow the first, and the start line says so
    corp = world["corp"]
    two = Mitmdump(world["work"] / "two", modes=[f"upstream:http://127.0.0.1:{corp.port}",
                                                  f"upstream:http://127.0.0.1:9@127.0.0.1:{free_port()}"],
                   options={"sessionpin_config": str(world["work"] / "config.toml"), "sessionpin_store": "memory:",
                            "sessionpin_pool_gateways": world["origin"]})
    two.start()
    try:
        line = two.wait_output(r"sessionpin pool: probes go .*", timeout=10)
        assert line and f"through the upstream proxy http://127.0.0.1:{corp.port}" in line.group(0), two.tail(30)
        assert "other upstream proxies not used by probes: http://127.0.0.1:9" in line.group(0), line.group(0)
    finally:
        two.stop()
