"""The mitmproxy shell, with mitmproxy's own test helpers (taddons/tflow) and a real memory store."""

import asyncio
import json
import re
from typing import Optional

import pytest
from mitmproxy import exceptions, http
from mitmproxy.test import taddons, tflow, tutils

from sessionpin import addon as A
from sessionpin import pins
from sessionpin.addon import Router

CONFIG = '''
[servers.anthropic]
url = "https://api.anthropic.com"

[servers.glm]
url = "https://api.z.ai/api/anthropic"
key_env = "ZAI_API_KEY"
models = { "claude-opus-*" = "glm-4.6" }

[servers.nokey]
url = "https://nokey.example"

[agents.claude-code]
server = "glm"
'''
ENV = {"ZAI_API_KEY": "zai-sentinel"}


def quiet_env(config_path, **more):
    """An environment whose defaults are not the user's own config file and store."""
    return {**ENV, "SESSIONPIN_CONFIG": str(config_path), "SESSIONPIN_STORE": "memory:", **more}
SESSION = "abcd1234-0000-4000-8000-000000000001"
TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}}]


def body(kind="opening", model="claude-opus-4-1"):
    messages = [{"role": "user", "content": "hi"}]
    if kind == "continuation":
        messages += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    b = {"model": model, "max_tokens": 5, "stream": True, "messages": messages}
    if kind in ("opening", "continuation"):
        b["tools"] = TOOLS
    return json.dumps(b, indent=1).encode()


def flow(kind="opening", session=SESSION, host="api.anthropic.com", path="/v1/messages?beta=true", content=None,
         headers=None, method=b"POST", peer=("127.0.0.1", 5555)):
    h = [
        (b"host", host.encode()),
        (b"user-agent", b"claude-cli/2.1.332 (external, cli)"),
        (b"content-type", b"application/json"),
        (b"x-api-key", b"agent-sentinel"),
        (b"cookie", b"sid=agent"),
        (b"anthropic-version", b"2023-06-01"),
        (b"x-claude-code-request-class", {"opening": b"main", "continuation": b"main", "title": b"auxiliary",
                                          "subagent": b"subagent"}[kind]),
    ]
    if session:
        h.append((b"x-claude-code-session-id", session.encode()))
    h += headers or []
    req = tutils.treq(method=method, scheme=b"https", host=host, port=443, path=path.encode(),
                      headers=http.Headers(h), content=body(kind) if content is None else content)
    f = tflow.tflow(req=req)
    f.client_conn.peername = peer
    return f


def reload(r):
    """What the background loop does: a new text is applied when two looks in a row find it."""
    r._check_config()
    r._check_config()


@pytest.fixture
def cfg_path(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text(CONFIG)
    return p


@pytest.fixture
async def setup(cfg_path):
    r = Router(env=quiet_env(cfg_path))
    with taddons.context(r) as tctx:
        tctx.configure(r, sessionpin_config=str(cfg_path), sessionpin_store="memory:")
        yield r, tctx
        r.done()


async def test_opening_turn_is_routed_and_pinned_before_it_leaves(setup):
    r, _ = setup
    f = flow()
    original = f.request.content
    await r.request(f)
    req = f.request
    assert f.response is None
    assert (req.scheme, req.host, req.port, req.path) == ("https", "api.z.ai", 443, "/api/anthropic/v1/messages?beta=true")
    assert req.headers["host"] == "api.z.ai"
    assert req.headers["x-api-key"] == "zai-sentinel" and "cookie" not in req.headers
    assert req.content == original.replace(b'"claude-opus-4-1"', b'"glm-4.6"')
    assert req.headers["content-length"] == str(len(req.content))
    pin = pins.load(r.store, SESSION)
    assert (pin.agent, pin.server, pin.rule, pin.turn) == ("claude-code", "glm", "opening", "opening")
    assert f.comment == "opening abcd1234 → glm (pinned)"
    assert f.marked == ":pushpin:"
    meta = f.metadata["sessionpin"]
    assert meta["rule"] == "opening" and meta["target"] == "glm" and meta["model"] == ["claude-opus-4-1", "glm-4.6"]
    assert r.activity[SESSION][1] == 1


async def test_the_pin_holds_after_the_current_server_changes(setup, cfg_path):
    r, _ = setup
    await r.request(flow())
    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = "anthropic"'))
    reload(r)
    assert r.config.current("claude-code") == "anthropic"
    f = flow("continuation")
    await r.request(f)
    assert f.request.host == "api.z.ai" and f.metadata["sessionpin"]["rule"] == "pinned"
    assert f.comment == "continuation abcd1234 → glm (pin)"
    new = flow(session="ffff0000-0000-4000-8000-000000000002")
    await r.request(new)
    assert new.request.host == "api.anthropic.com" and new.request.headers["x-api-key"] == "agent-sentinel"
    assert new.metadata["sessionpin"]["target"] == "anthropic"


async def test_continuation_never_seen_begin_is_left_alone_and_pinned_so(setup):
    r, _ = setup
    f = flow("continuation")
    before = (f.request.url, f.request.content, f.request.headers.fields)
    await r.request(f)
    assert (f.request.url, f.request.content, f.request.headers.fields) == before
    assert pins.load(r.store, SESSION).server is None
    assert f.comment == "continuation abcd1234 → left alone (not seen begin)"
    assert not f.marked


async def test_pinned_server_gone_is_refused_503_in_anthropic_format(setup):
    r, _ = setup
    pins.create(r.store, SESSION, pins.Pin(agent="claude-code", server="ete", since=1, renewed=1))
    f = flow("continuation")
    await r.request(f)
    assert f.response.status_code == 503
    assert f.response.headers["x-should-retry"] == "false"
    err = json.loads(f.response.content)
    assert err["type"] == "error" and err["error"]["type"] == "api_error"
    assert SESSION in err["error"]["message"] and "'ete'" in err["error"]["message"]
    assert "sessionpin move" in err["error"]["message"]
    assert f.request.host == "api.anthropic.com"
    assert r.metrics.refusals["pinned-server-gone"] == 1


async def test_refusal_in_openai_format_for_openai_apis(setup):
    r, _ = setup
    f = flow(path="/v1/chat/completions")
    r._refuse(f, None, 502, "nope", "error")
    err = json.loads(f.response.content)
    assert err["error"]["message"] == "nope" and err["error"]["code"] == "error"


async def test_missing_key_refuses_without_pinning(setup):
    r, _ = setup
    r.env.pop("ZAI_API_KEY")
    f = flow()
    await r.request(f)
    assert f.response.status_code == 502
    assert "ZAI_API_KEY is not set" in json.loads(f.response.content)["error"]["message"]
    assert pins.load(r.store, SESSION) is None


async def test_server_without_key_env_refuses_foreign_requests(setup, cfg_path):
    r, _ = setup
    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = "nokey"'))
    reload(r)
    f = flow()
    await r.request(f)
    assert f.response.status_code == 502 and "nokey has no key_env" in f.response.text
    assert b"agent-sentinel" not in f.response.content


async def test_side_request_before_the_opening_follows_the_current_server_without_a_pin(setup):
    r, _ = setup
    f = flow("title")
    await r.request(f)
    assert f.request.host == "api.z.ai"
    assert pins.load(r.store, SESSION) is None


@pytest.mark.parametrize("path, method", [("/api/claude_code/settings", b"GET"), ("/api/event_logging/batch", b"POST"),
                                          ("/v1/models", b"GET")])
async def test_non_model_paths_pass_untouched(setup, path, method):
    r, _ = setup
    f = flow(path=path, method=method)
    before = (f.request.url, f.request.content, f.request.headers.fields)
    await r.request(f)
    assert (f.request.url, f.request.content, f.request.headers.fields) == before
    assert "sessionpin" not in f.metadata and f.response is None


async def test_unconfigured_origin_passes_untouched(setup):
    r, _ = setup
    f = flow(host="example.com")
    before = (f.request.url, f.request.content, f.request.headers.fields)
    await r.request(f)
    assert (f.request.url, f.request.content, f.request.headers.fields) == before


@pytest.mark.parametrize("content", [b"", b"{not json", bytes(range(256)), b"[1,2]"])
async def test_garbage_body_is_left_alone(setup, content):
    r, _ = setup
    f = flow(content=content)
    await r.request(f)
    assert f.response is None and f.request.host == "api.anthropic.com" and f.request.content == content
    assert pins.load(r.store, SESSION) is None


async def test_an_exception_answers_502_and_never_sends(setup, monkeypatch):
    r, _ = setup

    def boom(*a, **k):
        raise RuntimeError("bug")
    monkeypatch.setattr(A.ladder, "decide", boom)
    f = flow()
    await r.request(f)
    assert f.response.status_code == 502 and "RuntimeError: bug" in f.response.text
    assert f.request.host == "api.anthropic.com"


class BrokenStore:
    url = "broken:"

    def __getattr__(self, name):
        def fail(*a, **k):
            raise OSError("disk on fire")
        return fail


async def test_store_failure_answers_502(setup):
    r, _ = setup
    r.store = BrokenStore()
    f = flow()
    await r.request(f)
    assert f.response.status_code == 502 and "pin store" in f.response.text
    assert r.metrics.store_errors == 1 and f.request.host == "api.anthropic.com"


class DegradedStore:
    """A memory store that says what the file store says while its file fails."""

    degraded = True

    def __init__(self):
        from sessionpin.store import open_store
        self._s = open_store("memory:")
        self.url = "file:full-disk/state.db"

    def __getattr__(self, name):
        return getattr(self._s, name)


async def test_degraded_store_refuses_to_move_a_new_conversation(setup):
    r, _ = setup
    r.store = DegradedStore()
    f = flow()
    await r.request(f)
    assert f.response.status_code == 502 and "cannot save pins" in f.response.text
    assert SESSION in f.response.text and "glm" in f.response.text
    assert pins.load(r.store, SESSION) is None, "no pin is invented"
    # A conversation left where the agent sent it is safe to pin in memory: losing that
    # pin leaves its next turn where it is anyway.
    f = flow("continuation", session="other-session")
    await r.request(f)
    assert f.response is None and f.request.host == "api.anthropic.com"


async def test_pin_race_the_first_pin_wins(setup):
    r, _ = setup
    real_create = pins.create

    def other_proxy_first(store, session, pin):
        real_create(store, session, pins.Pin(agent="claude-code", server="anthropic", since=1, renewed=1))
        return real_create(store, session, pin)
    A.pins.create, saved = other_proxy_first, A.pins.create
    try:
        f = flow()
        await r.request(f)
    finally:
        A.pins.create = saved
    assert f.request.host == "api.anthropic.com" and f.metadata["sessionpin"]["rule"] == "pinned"
    assert f.request.headers["x-api-key"] == "agent-sentinel"


async def test_participants_see_routed_requests_and_response_headers(cfg_path):
    seen = []

    class Pool:
        async def request(self, flow, facts, decision):
            seen.append(("request", flow.request.host, facts.turn if facts else None, decision.rule if decision else None))

        def responseheaders(self, flow):
            seen.append(("responseheaders", flow.response.stream))

        def configure_store(self, store):
            seen.append(("store", store.url))

        def status(self):
            return {"enabled": True}

        def metrics(self):
            return "sessionpin_pool_ids 3"

    r = Router([Pool()], env=quiet_env(cfg_path))
    with taddons.context(r) as tctx:
        tctx.configure(r, sessionpin_config=str(cfg_path), sessionpin_store="memory:")
        f = flow()
        await r.request(f)
        f.response = tutils.tresp(headers=http.Headers(content_type="text/event-stream"))
        r.responseheaders(f)
        out = flow(host="example.com")
        await r.request(out)
        st = flow(path="/__sessionpin/status", method=b"GET", content=b"")
        await r.request(st)
        assert json.loads(st.response.content)["participants"] == {"Pool": {"enabled": True}}
        m = flow(path="/__sessionpin/metrics", method=b"GET", content=b"")
        await r.request(m)
        assert m.response.text.endswith("sessionpin_pool_ids 3\n")
        r.done()
    assert seen == [("store", "memory:"), ("request", "api.z.ai", "opening", "opening"),
                    ("responseheaders", True), ("request", "example.com", "opening", None)]


@pytest.mark.parametrize("ctype, length, in_scope, streamed", [
    ("text/event-stream; charset=utf-8", True, False, True),
    ("application/x-ndjson", True, False, True),
    ("application/json", True, True, False),
    ("application/json", False, True, True),     # an in-scope response of unknown length
    ("application/json", False, False, False),   # not ours: mitmproxy's default
])
def test_responseheaders_streams(ctype, length, in_scope, streamed):
    r = Router()
    f = tflow.tflow(resp=True)
    f.response.headers["content-type"] = ctype
    if not length:
        del f.response.headers["content-length"]
    if in_scope:
        f.metadata["sessionpin"] = {"target": "glm"}
    r.responseheaders(f)
    assert bool(f.response.stream) is streamed


async def test_websocket_upgrade_refused_for_a_routed_agent(setup):
    r, _ = setup
    f = flow(path="/v1/responses", method=b"GET", content=b"",
             headers=[(b"upgrade", b"websocket"), (b"connection", b"Upgrade")])
    await r.request(f)
    assert f.response.status_code == 404


async def test_status_and_metrics_for_loopback_only(setup):
    r, _ = setup
    await r.request(flow())
    f = flow(path="/__sessionpin/status", method=b"GET", content=b"")
    await r.request(f)
    status = json.loads(f.response.content)
    assert status["agents"]["claude-code"] == "glm" and status["pins"] == {"glm": 1}
    assert status["servers"]["glm"]["key_set"] is True and status["store"] == "memory:"
    assert "zai-sentinel" not in f.response.text
    f = flow(path="/__sessionpin/metrics", method=b"GET", content=b"", peer=("::ffff:127.0.0.1", 1, 0, 0))
    await r.request(f)
    text = f.response.text
    assert 'sessionpin_pins{server="glm"} 1' in text
    assert 'sessionpin_decisions_total{agent="claude-code",turn="opening",outcome="routed"} 1' in text
    assert "sessionpin_store_errors_total 0" in text
    for line in text.splitlines():
        assert line.startswith("#") or re.match(r'^sessionpin_[a-z_]+(\{[^}]*\})? -?\d+$', line), line
    f = flow(path="/__sessionpin/status", method=b"GET", content=b"", peer=("10.0.0.5", 1))
    await r.request(f)
    assert f.response.status_code == 403
    f = flow(path="/__sessionpin/nope", method=b"GET", content=b"")
    await r.request(f)
    assert f.response.status_code == 404


async def test_bad_config_is_refused_and_the_previous_one_stays(setup, cfg_path, caplog):
    r, _ = setup
    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = "glmm"'))
    reload(r)
    assert r.config.current("claude-code") == "glm"
    assert r.config_problem.startswith("config.toml:")
    assert "agents.claude-code.server: no server named 'glmm'" in caplog.text
    assert r.metrics.config_rejected == 1
    cfg_path.unlink()   # a vanished file keeps the config in force
    reload(r)
    assert r.config.current("claude-code") == "glm"
    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = ""'))
    reload(r)
    assert r.config.current("claude-code") is None and r.config_problem is None


async def test_bad_config_option_raises_options_error(setup, tmp_path):
    r, tctx = setup
    bad = tmp_path / "bad.toml"
    bad.write_text('[agents.claude-code]\nserver = "x"\n')
    with pytest.raises(exceptions.OptionsError, match=r"bad.toml:2: agents.claude-code.server: no server named 'x'"):
        tctx.configure(r, sessionpin_config=str(bad))
    assert r.config.current("claude-code") == "glm"


async def test_missing_config_file_routes_nothing(tmp_path):
    r = Router(env=quiet_env(tmp_path / "none.toml"))
    with taddons.context(r) as tctx:
        tctx.configure(r, sessionpin_config=str(tmp_path / "none.toml"), sessionpin_store="memory:")
        f = flow()
        await r.request(f)
        assert f.request.host == "api.anthropic.com" and "sessionpin" not in f.metadata
        r.done()


async def test_options_are_validated(setup):
    r, tctx = setup
    tctx.options.add_option("stream_large_bodies", Optional[str], None, "proxyserver's")
    with pytest.raises(exceptions.OptionsError, match="stream_large_bodies"):
        tctx.configure(r, stream_large_bodies="1m")
    with pytest.raises(exceptions.OptionsError, match="sessionpin_store"):
        tctx.configure(r, sessionpin_store="nope:x")


async def test_background_reload_heartbeat_and_activity(setup, cfg_path):
    r, tctx = setup
    tctx.configure(r, sessionpin_reload_ms=20)
    await r.request(flow())
    r.running()
    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = "anthropic"'))
    for _ in range(200):
        await asyncio.sleep(0.02)
        if r.config.current("claude-code") == "anthropic" and r.store.keys("proxy:"):
            break
    assert r.config.current("claude-code") == "anthropic"
    beat = json.loads(r.store.get(f"proxy:{__import__('os').getpid()}") or "{}")
    assert beat["store"] == "memory:" and beat["config"] == str(cfg_path)
    assert 0 < r.store.ttl(f"proxy:{beat['pid']}") <= A.HEARTBEAT_TTL
    store = r.store
    r.done()
    assert pins.seen(store, SESSION).requests == 1
    assert store.get(f"proxy:{beat['pid']}") is None


def test_short_and_loopback():
    assert A.short("fp:0123456789") == "01234567" and A.short("ses_abcdefghij") == "abcdefgh" and A.short(None) == "-"
    assert A.is_loopback(("127.0.0.1", 1)) and A.is_loopback(("::1", 1, 0, 0)) and A.is_loopback(("::ffff:127.0.0.1", 1))
    assert not A.is_loopback(("192.168.1.2", 1)) and not A.is_loopback(None) and not A.is_loopback(("host", 1))


async def test_a_followed_pin_is_renewed_at_most_daily(setup):
    r, _ = setup
    import time
    now = time.time()
    pins.create(r.store, SESSION, pins.Pin(agent="claude-code", server="glm", since=1, renewed=now - 2 * pins.DAY))
    await r.request(flow("continuation"))
    renewed = pins.load(r.store, SESSION).renewed
    assert renewed >= now
    pins.put(r.store, SESSION, pins.Pin(agent="claude-code", server="glm", since=1, renewed=now - 3600))
    await r.request(flow("continuation"))
    assert pins.load(r.store, SESSION).renewed == now - 3600


async def test_a_server_requests_were_moved_to_is_named_when_unreachable(setup):
    import socket

    from mitmproxy.proxy import server_hooks

    r, _ = setup
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    down = closed.getsockname()[1]
    closed.close()
    try:
        def data(port):
            d = server_hooks.ServerConnectionHookData(client=tflow.tclient_conn(), server=tflow.tserver_conn())
            d.server.address = ("127.0.0.1", port)
            d.server.error = None
            return d

        untouched = data(down)
        await r.server_connect(untouched)          # not a server the router moved anything to
        assert untouched.server.error is None
        r.moved_to[("127.0.0.1", down)] = "glm"
        r.moved_to[("127.0.0.1", listening.getsockname()[1])] = "glm"
        failed = data(down)
        await r.server_connect(failed)
        assert failed.server.error.startswith("sessionpin: server glm (https://api.z.ai) cannot be reached")
        up = data(listening.getsockname()[1])
        await r.server_connect(up)
        assert up.server.error is None
        # a connection to it is open: no check (and so no error) for a new one
        r.server_connected(data(down))
        again = data(down)
        await r.server_connect(again)
        assert again.server.error is None
        r.server_disconnected(data(down))
        again = data(down)
        await r.server_connect(again)
        assert again.server.error is not None
    finally:
        listening.close()


async def test_an_early_connect_check_stands_once_for_its_client_and_a_failed_one_is_redone(setup):
    import socket

    from mitmproxy.proxy import server_hooks

    r, _ = setup
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    port = listening.getsockname()[1]
    addr = ("127.0.0.1", port)
    r.moved_to[addr] = "glm"
    client = tflow.tclient_conn()

    def data():
        d = server_hooks.ServerConnectionHookData(client=client, server=tflow.tserver_conn())
        d.server.address = addr
        d.server.error = None
        return d

    try:
        r._check_early(client.id)                   # the client's CONNECT or request headers
        assert await r._probes[(client.id, addr)][1] is None
        listening.close()                           # down after the early check succeeded
        first = data()
        await r.server_connect(first)
        assert first.server.error is None           # the early check stood: no second connect
        second = data()
        await r.server_connect(second)              # it stands once: this one is checked now
        assert second.server.error.startswith("sessionpin: server glm (https://api.z.ai) cannot be reached")

        r._check_early(client.id)                   # fails: nothing listens
        assert await r._probes[(client.id, addr)][1] is not None
        back = socket.socket()
        back.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        back.bind(addr)
        back.listen()
        try:
            third = data()
            await r.server_connect(third)           # the failed early check is redone: it is back
            assert third.server.error is None
        finally:
            back.close()
    finally:
        listening.close()


async def test_a_text_seen_once_is_not_applied(setup, cfg_path):
    r, _ = setup
    cfg_path.write_text("")                  # an editor truncated the file, about to write
    r._check_config()
    assert r.config.current("claude-code") == "glm"
    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = "anthropic"'))
    r._check_config()
    assert r.config.current("claude-code") == "glm"
    r._check_config()
    assert r.config.current("claude-code") == "anthropic"


async def test_codex_zstd_body_keeps_its_encoding_and_only_the_model_changes(tmp_path):
    from mitmproxy.net import encoding

    p = tmp_path / "config.toml"
    p.write_text('''
[servers.openai]
url = "https://api.openai.com"
[servers.router]
url = "https://openrouter.example/api"
key_env = "OR_KEY"
models = { "gpt-5*" = "openai/gpt-5" }
[agents.codex]
server = "router"
''')
    plain = json.dumps({"model": "gpt-5-codex", "instructions": "x", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "tools": [], "stream": True}).encode()
    sid = "0199a0b0-0000-7000-8000-000000000001"
    h = http.Headers([(b"host", b"api.openai.com"), (b"user-agent", b"codex_cli_rs/0.171.0 (Linux; x86_64)"),
                      (b"session-id", sid.encode()), (b"content-encoding", b"zstd"),
                      (b"authorization", b"Bearer sk-agent"), (b"chatgpt-account-id", b"acct")])
    r = Router(env={"OR_KEY": "or-sentinel", "SESSIONPIN_CONFIG": str(p), "SESSIONPIN_STORE": "memory:"})
    with taddons.context(r) as tctx:
        tctx.configure(r, sessionpin_config=str(p), sessionpin_store="memory:")
        req = tutils.treq(method=b"POST", scheme=b"https", host="api.openai.com", port=443, path=b"/v1/responses",
                          headers=h, content=b"")
        req.raw_content = encoding.encode(plain, "zstd")
        f = tflow.tflow(req=req)
        await r.request(f)
        assert f.response is None
        assert f.request.url == "https://openrouter.example/api/v1/responses"
        assert f.request.headers["content-encoding"] == "zstd"
        assert encoding.decode(f.request.raw_content, "zstd") == plain.replace(b'"gpt-5-codex"', b'"openai/gpt-5"')
        assert f.request.headers["authorization"] == "Bearer or-sentinel"
        assert f.request.headers["chatgpt-account-id"] == "acct"   # an account id, not a credential
        r.done()


async def test_a_script_reload_while_the_file_is_bad_keeps_the_running_config(setup, cfg_path):
    r, _ = setup
    A._state["running"] = True           # as after mitmdump started
    try:
        running = (cfg_path, r.config, r.config_text)
        cfg_path.write_text("[agents.claude-code]\nserver = 'x'\n")
        fresh = Router(env=quiet_env(cfg_path.parent / "other.toml"))   # mitmproxy builds a new one when route.py is edited
        with taddons.context(fresh) as tctx:
            A._state["config"] = running
            # as the script loader does on a reload: configure with the options in force
            # (no option change, so no rollback to an older value)
            tctx.options._options["sessionpin_config"].set(str(cfg_path))
            with pytest.raises(exceptions.OptionsError):
                fresh.configure({"sessionpin_config"})
            assert fresh.config.current("claude-code") == "glm" and fresh.config_problem
            cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = "anthropic"'))
            reload(fresh)
            assert fresh.config.current("claude-code") == "anthropic"
            fresh.done()
    finally:
        A._state["running"] = False


async def test_a_side_threads_later_round_follows_its_first(setup):
    # Codex's title thread: its own session, side requests only; the second round carries
    # the first's tool call as history. Both rounds go to the current server, no pin.
    r, _ = setup
    first = flow("title", session="title-thread")
    await r.request(first)
    assert first.request.host == "api.z.ai" and pins.load(r.store, "title-thread") is None
    later = flow("title", session="title-thread", content=body("continuation"))
    await r.request(later)
    assert later.request.host == "api.z.ai" and "follows" in later.comment
    assert pins.load(r.store, "title-thread") is None
    # Without that first round, a side request with history is left alone (not seen begin).
    unseen = flow("title", session="never-seen", content=body("continuation"))
    await r.request(unseen)
    assert unseen.request.host == "api.anthropic.com"


class DegradesOnWrite(DegradedStore):
    """Healthy until a write finds the file failing (another process holds its lock)."""

    degraded = False

    def set(self, *a, **k):
        self.degraded = True
        return self._s.set(*a, **k)


async def test_a_pin_write_that_only_reached_memory_does_not_send_the_conversation_away(setup):
    r, _ = setup
    r.store = DegradesOnWrite()
    f = flow()
    await r.request(f)
    assert f.response.status_code == 502 and "cannot save pins" in f.response.text
    assert f.request.host == "api.anthropic.com"


async def test_a_continuation_right_after_a_side_opening_follows_it_and_pins(setup):
    # opencode with every tool disabled: its opening has no tools and reads as a side
    # request (like its title). The next turn carries history; it must not be left alone.
    r, _ = setup
    first = flow("title", session="toolless")
    await r.request(first)
    assert first.request.host == "api.z.ai" and pins.load(r.store, "toolless") is None
    second = flow("continuation", session="toolless")
    await r.request(second)
    assert second.request.host == "api.z.ai"
    assert pins.load(r.store, "toolless").server == "glm"


async def test_status_is_not_for_scripts_on_web_pages(setup):
    r, _ = setup
    f = flow(path="/__sessionpin/status", method=b"GET", content=b"", host="evil.example",
             headers=[(b"sec-fetch-site", b"same-origin"), (b"sec-fetch-mode", b"cors")])
    await r.request(f)
    assert f.response.status_code == 403 and b"config" not in f.response.content
    typed = flow(path="/__sessionpin/status", method=b"GET", content=b"", headers=[(b"sec-fetch-site", b"none")])
    await r.request(typed)
    assert typed.response.status_code == 200
