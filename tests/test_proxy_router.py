"""The router addon: the stepper's effects performed on real flows, with a real store."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from mitmproxy import http
from mitmproxy.test import tflow, tutils

from sessionpin.records import pins
from sessionpin.decision import route
from sessionpin.reader.ids import short
from sessionpin.proxy.participants import Participant
from sessionpin.store import NotDurable, StoreUnavailable
from shellkit import CONFIG, SESSION, body, flow, start


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


async def pin_of(proxy, session=SESSION):
    return (await pins.load(proxy.store, session)).pin


async def put(proxy, server, session=SESSION, renewed=None):
    now = time.time() if renewed is None else renewed
    await pins.create(proxy.store, session, pins.Pin(agent="claude-code", server=server, since=now, renewed=now))


async def test_opening_turn_is_routed_and_pinned_before_it_leaves(proxy):
    f = flow()
    original = f.request.content
    await proxy.send(f)
    req = f.request
    assert f.response is None
    assert (req.scheme, req.host, req.port, req.path) == ("https", "api.z.ai", 443, "/api/anthropic/v1/messages?beta=true")
    assert req.headers["host"] == "api.z.ai"
    assert req.headers["x-api-key"] == "zai-sentinel" and "cookie" not in req.headers
    assert req.content == original.replace(b'"claude-opus-4-1"', b'"glm-4.6"')
    pin = await pin_of(proxy)
    assert (pin.agent, pin.server, pin.rule, pin.turn) == ("claude-code", "glm", "opening", "opening")
    assert f.comment == "opening abcd1234 → glm (pinned)"
    assert f.marked == ":pushpin:"
    meta = f.metadata["sessionpin"]
    assert meta["rule"] == "opening" and meta["target"] == "glm" and meta["model"] == ["claude-opus-4-1", "glm-4.6"]
    assert proxy.runtime._activity[SESSION][3] == 1


def pins_written(monkeypatch) -> list[str]:
    """The sessions whose pins ``pins.create`` writes from now on, in order."""
    written, real = [], pins.create

    async def create(store, session, pin, seen=None):
        written.append(session)
        return await real(store, session, pin, seen)
    monkeypatch.setattr(pins, "create", create)
    return written


async def test_the_writes_after_a_request_wait_until_it_has_left(proxy, monkeypatch):
    """A "not routed" pin (and a renewal, a title, an opening's memory) is written after the
    request left, never waited for. mitmproxy starts tasks eagerly: such a write ran inside the
    request hook, a store write ahead of the request. It now waits the two turns of the loop
    in which mitmproxy sends what the hook let go."""
    written = pins_written(monkeypatch)
    loop = asyncio.get_running_loop()
    loop.set_task_factory(asyncio.eager_task_factory)        # as mitmproxy runs its loop
    try:
        f = flow("continuation")
        await proxy.send(f)
        assert written == [] and f.comment.endswith("(not seen begin)")
        await asyncio.sleep(0)
        assert written == []                                 # (the turn mitmproxy sends it in)
        await proxy.settle()
        assert written == [SESSION] and (await pin_of(proxy)).server is None
    finally:
        loop.set_task_factory(None)


async def test_a_loss_seen_before_a_write_after_a_request_goes_stops_it(proxy, monkeypatch):
    """The write after a request waits for the request to leave; a store loss the guard saw in
    the meantime stops it (nothing is written over a loss)."""
    written = pins_written(monkeypatch)
    loop = asyncio.get_running_loop()
    loop.set_task_factory(asyncio.eager_task_factory)
    try:
        await proxy.send(flow("continuation"))
        proxy.runtime.guard.lost = "the store was emptied"       # as the guard says it
        await proxy.settle()
        assert written == []
    finally:
        loop.set_task_factory(None)
        proxy.runtime.guard.lost = None


async def test_the_pin_holds_after_the_current_server_changes(proxy, cfg_path):
    await proxy.send(flow())
    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = "anthropic"'))
    proxy.reload()
    assert proxy.config.config.current("claude-code") == "anthropic"
    f = flow("continuation")
    await proxy.send(f)
    assert f.request.host == "api.z.ai" and f.metadata["sessionpin"]["rule"] == "pinned"
    new = flow(session="ffff0000-0000-4000-8000-000000000002")
    await proxy.send(new)
    assert new.request.host == "api.anthropic.com" and new.request.headers["x-api-key"] == "agent-sentinel"


async def test_a_pin_is_followed_when_its_origin_left_the_config(proxy, cfg_path):
    await proxy.send(flow())
    cfg_path.write_text("")           # emptied: valid, routes no new conversation
    proxy.reload()
    f = flow("continuation")
    await proxy.send(f)
    assert f.response.status_code == 424 and "'glm'" in f.response.text   # its server is gone: refused, not moved
    cfg_path.write_text(CONFIG.replace("[servers.anthropic]\nurl = \"https://api.anthropic.com\"\n", ""))
    proxy.reload()
    f = flow("continuation")
    await proxy.send(f)
    assert f.response is None and f.request.host == "api.z.ai"      # the addressed origin is no longer configured
    assert f.request.headers["x-api-key"] == "zai-sentinel"
    new = flow(session="ffff0000-0000-4000-8000-000000000003")
    await proxy.send(new)
    assert new.request.host == "api.anthropic.com" and "sessionpin" in new.metadata


async def test_continuation_never_seen_begin_is_left_alone_and_pinned_so(proxy):
    f = flow("continuation")
    before = (f.request.url, f.request.content, f.request.headers.fields)
    await proxy.send(f)
    await proxy.settle()
    assert (f.request.url, f.request.content, f.request.headers.fields) == before
    assert (await pin_of(proxy)).server is None
    assert f.comment == "continuation abcd1234 → left alone (not seen begin)"
    assert not f.marked


async def test_count_tokens_before_an_unseen_continuation_does_not_adopt_it(proxy):
    # A resumed Claude Code session (never seen begin) sends /context's count_tokens first.
    ct = flow("title", path="/v1/messages/count_tokens?beta=true")
    await proxy.send(ct)
    assert ct.request.host == "api.z.ai"           # a side request goes to the current server...
    await proxy.settle()
    main = flow("continuation")
    await proxy.send(main)
    assert main.request.host == "api.anthropic.com"   # ...and adopts nothing
    assert main.metadata["sessionpin"]["rule"] == "continuation-unseen"


async def test_pinned_server_gone_is_refused_so_no_client_retries_it(proxy):
    """Only the operator can bring the server back or move the conversation: the answer is
    the no-retry 424 (a 503 was retried for minutes: docs/traffic.md), with no retry signal,
    the session by its short id (pi reads "503" in a long hex id as a reason to retry)."""
    await put(proxy, "ete")
    f = flow("continuation")
    await proxy.send(f)
    assert f.response.status_code == 424 and f.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in f.response.headers
    assert f.response.headers["x-sessionpin-refused"] == "pinned-server-gone"
    err = json.loads(f.response.content)
    assert err["type"] == "error" and err["error"]["type"] == "api_error"
    assert short(SESSION) in err["error"]["message"] and "'ete'" in err["error"]["message"]
    assert f.request.host == "api.anthropic.com"
    assert proxy.router.metrics.refusals["pinned-server-gone"] == 1


async def test_missing_key_refuses_without_pinning(proxy):
    proxy.router.env.pop("ZAI_API_KEY")
    f = flow()
    await proxy.send(f)
    # only the operator can fix it: the no-retry answer (424, x-should-retry: false), not a 502
    assert f.response.status_code == 424 and f.response.headers["x-should-retry"] == "false"
    assert f.response.headers["x-sessionpin-refused"] == "no-key" and "retry-after" not in f.response.headers
    assert "ZAI_API_KEY is not set" in json.loads(f.response.content)["error"]["message"]
    assert await pin_of(proxy) is None


async def test_server_without_key_env_refuses_foreign_requests(proxy, cfg_path):
    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = "nokey"'))
    proxy.reload()
    f = flow()
    await proxy.send(f)
    assert f.response.status_code == 424 and "nokey has no key_env" in f.response.text
    assert b"agent-sentinel" not in f.response.content


@pytest.mark.parametrize("path, method", [("/api/claude_code/settings", b"GET"), ("/api/event_logging/batch", b"POST"),
                                          ("/v1/models", b"GET")])
async def test_non_model_paths_pass_untouched(proxy, path, method):
    f = flow(path=path, method=method)
    before = (f.request.url, f.request.content, f.request.headers.fields)
    await proxy.send(f)
    assert (f.request.url, f.request.content, f.request.headers.fields) == before
    assert "sessionpin" not in f.metadata and f.response is None


@pytest.mark.parametrize("content, refused", [
    (json.dumps({"role": "user", "content": "hi"}).encode(), False),   # the Assistants API's message: no model
    (body("continuation"), True),                                      # an inference request
    (b"{not json", True),                                              # cannot tell: not sent where it may be one
    (json.dumps({k: v for k, v in json.loads(body("continuation")).items() if k != "model"}).encode(), True),
    # ^ a conversation's turn naming no model (an Azure deployment's, through a gateway's versioned path)
])
async def test_a_lookalike_path_is_guarded_when_its_body_is_or_may_be_inference(proxy, content, refused):
    """A path ending with an endpoint after a version segment (another API's resource, or a
    gateway's versioned path such as Cloudflare's) is told by its body: a session pinned to glm
    is refused there when the body is an inference request or cannot be read; else it passes."""
    await put(proxy, "glm")
    f = flow("continuation", path="/v1/acct/gw/anthropic/v1/messages", content=content)
    await proxy.send(f)
    if refused:
        assert f.response.status_code == 424 and f.response.headers["x-sessionpin-refused"] == "unnamed-path"
    else:
        assert f.response is None and f.request.host == "api.anthropic.com" and f.request.content == content
    assert f.request.host == "api.anthropic.com" and (await pin_of(proxy)).server == "glm"


async def test_unconfigured_origin_without_a_pin_passes_untouched(proxy):
    f = flow(host="example.com")
    before = (f.request.url, f.request.content, f.request.headers.fields)
    await proxy.send(f)
    assert (f.request.url, f.request.content, f.request.headers.fields) == before


@pytest.mark.parametrize("content", [b"", b"{not json", bytes(range(256)), b"[1,2]"])
async def test_garbage_body_is_left_alone(proxy, content):
    f = flow(content=content)
    await proxy.send(f)
    assert f.response is None and f.request.host == "api.anthropic.com" and f.request.content == content
    assert await pin_of(proxy) is None


async def test_an_exception_answers_502_and_never_sends(proxy, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("bug")
    monkeypatch.setattr(route.ladder, "decide", boom)
    f = flow()
    await proxy.send(f)
    assert f.response.status_code == 502 and "RuntimeError: bug" in f.response.text
    assert f.request.host == "api.anthropic.com"


class Faulty:
    """A real memory store whose chosen operations fail as a failing backend's do."""

    def __init__(self, store, fail: dict[str, Exception]):
        self._s, self.fail, self.url = store, fail, store.url

    def __getattr__(self, name):
        if name in self.fail:
            async def raises(*a, **k):
                raise self.fail[name]
            return raises
        return getattr(self._s, name)


async def test_a_pin_that_cannot_be_read_is_refused_never_no_pin(cfg_path):
    """Refused so that no agent keeps retrying (issue 19: 503 with retry-after kept them at it for
    minutes): 424, x-should-retry false, no retry-after, after the budget to ride out a blip."""
    proxy = start(cfg_path, sessionpin_store_retry_ms=400)
    try:
        await put(proxy, "glm")
        good = proxy.store
        proxy.runtime.store = Faulty(good, {"get": StoreUnavailable("file:x: disk I/O error")})
        f = flow("continuation")
        t0 = time.monotonic()
        await proxy.send(f)
        assert 0.35 < time.monotonic() - t0 < 1.5                   # the budget, ridden out, then told
        assert f.response.status_code == 424 and f.response.headers["x-should-retry"] == "false"
        assert "retry-after" not in f.response.headers
        assert "disk I/O error" in f.response.text and f.request.host == "api.anthropic.com"
        assert proxy.router.metrics.store_errors >= 2
        t0 = time.monotonic()
        g = flow("continuation")
        await proxy.send(g)                                           # known down: said at once
        assert g.response.status_code == 424 and time.monotonic() - t0 < 0.3
    finally:
        proxy.close()


async def test_a_store_blip_within_the_budget_is_ridden_out(cfg_path):
    proxy = start(cfg_path, sessionpin_store_retry_ms=2000)
    try:
        await put(proxy, "glm")
        good = proxy.store
        proxy.runtime.store = Faulty(good, {"get": StoreUnavailable("file:x: disk I/O error")})
        asyncio.get_running_loop().call_later(0.3, setattr, proxy.runtime, "store", good)   # back
        f = flow("continuation")
        await proxy.send(f)
        assert f.response is None and f.request.host == "api.z.ai"   # followed its pin
    finally:
        proxy.close()


async def test_a_pin_that_cannot_be_saved_never_sends_the_conversation_away(proxy):
    real = proxy.store
    proxy.runtime.store = Faulty(real, {"apply": NotDurable("file:x: database is locked")})
    for _ in range(2):          # the first try and the client's retry
        f = flow()
        await proxy.send(f)
        assert f.response.status_code == 503 and "database is locked" in f.response.text
        assert SESSION in f.response.text and "glm" in f.response.text
        assert f.request.host == "api.anthropic.com"
    assert (await pins.load(real, SESSION)).pin is None, "no pin is invented"


async def test_pin_race_the_first_pin_wins(proxy):
    real = proxy.store

    class OtherProxyFirst(Faulty):
        async def apply(self, checks, writes, durable=False):
            now = time.time()
            await pins.create(real, SESSION, pins.Pin(agent="claude-code", server="anthropic", since=now, renewed=now))
            return await real.apply(checks, writes, durable=durable)
    proxy.runtime.store = OtherProxyFirst(real, {})
    f = flow()
    await proxy.send(f)
    assert f.request.host == "api.anthropic.com" and f.metadata["sessionpin"]["rule"] == "pinned"
    assert f.request.headers["x-api-key"] == "agent-sentinel"


async def test_a_followed_pin_is_renewed_at_most_daily_and_never_over_a_move(proxy):
    now = time.time()
    await put(proxy, "glm", renewed=now - 2 * pins.DAY)
    await proxy.send(flow("continuation"))
    await proxy.settle()
    assert (await pin_of(proxy)).renewed >= now
    seen = await pins.load(proxy.store, SESSION)
    await pins.move(proxy.store, SESSION, seen, pins.Pin(agent="claude-code", server="glm", since=1,
                                                         renewed=now - 3600))
    await proxy.send(flow("continuation"))
    await proxy.settle()
    assert (await pin_of(proxy)).renewed == now - 3600


async def test_opencode_title_then_toolless_opening_then_continuation(proxy, cfg_path):
    # opencode with every tool disabled: its opening reads like its title (side). The next
    # turn carries history; it follows where the title went and pins.
    cfg_path.write_text(CONFIG + '[agents.opencode]\nserver = "glm"\n')
    proxy.reload()
    oc = [(b"x-opencode-session", b"ses_toolless")]
    title = flow("title", session=None, headers=oc, agent=b"opencode/1.18.33", content=body("title"))
    await proxy.send(title)
    await proxy.settle()
    assert title.request.host == "api.z.ai" and await pin_of(proxy, "ses_toolless") is None
    nxt = flow("continuation", session=None, headers=oc, agent=b"opencode/1.18.33",
               content=body("continuation").replace(b'"tools"', b'"x_tools"'))
    await proxy.send(nxt)
    assert nxt.request.host == "api.z.ai"
    assert (await pin_of(proxy, "ses_toolless")).server == "glm"


async def test_participants_see_routed_requests_and_response_headers(cfg_path):
    seen = []

    class Pool(Participant):
        name = "pool"

        async def request(self, flow, facts, decision):
            seen.append(("request", flow.request.host, facts.turn if facts else None, decision.rule if decision else None))

        def responseheaders(self, flow):
            seen.append(("responseheaders", flow.response.stream))

        def configure_store(self, store):
            seen.append(("store", store.url))

        async def status(self):
            return {"enabled": True}

        def metrics(self):
            return "sessionpin_pool_ids 3"

    p = start(cfg_path, participants=[Pool()])
    try:
        f = flow()
        await p.send(f)
        f.response = tutils.tresp(headers=http.Headers(content_type="text/event-stream"))
        p.router.responseheaders(f)
        out = flow(host="example.com", session="another-session")
        await p.send(out)
        st = (await p.status.status())
        assert st.participants["pool"] == {"enabled": True}
        assert (await p.status.render_metrics()).endswith("sessionpin_pool_ids 3\n")
    finally:
        p.close()
    assert seen == [("store", "memory:"), ("request", "api.z.ai", "opening", "opening"),
                    ("responseheaders", True), ("request", "example.com", "opening", "out-of-scope")]


async def test_a_participants_refusal_is_answered_in_the_agents_format_and_nothing_is_sent(cfg_path):
    class Refusing(Participant):   # as the OpenCode id pool does when its store failed twice
        name = "refusing"

        async def request(self, flow, facts, decision):
            return route.Refuse(503, "pool-store", "sessionpin cannot reach its pool store", 1)

    p = start(cfg_path, participants=[Refusing()])
    try:
        f = flow()
        await p.send(f)
    finally:
        p.close()
    assert f.response is not None and f.response.status_code == 503
    assert f.response.headers["x-sessionpin-refused"] == "pool-store" and f.response.headers["retry-after"] == "1"
    assert json.loads(f.response.content)["error"]["message"] == "sessionpin cannot reach its pool store"
    assert f.metadata["sessionpin"]["refused"] == 503


@pytest.mark.parametrize("ctype, length, in_scope, streamed", [
    ("text/event-stream; charset=utf-8", True, False, True),
    ("application/x-ndjson", True, False, True),
    ("application/json", True, True, False),
    ("application/json", False, True, True),     # an in-scope response of unknown length
    ("application/json", False, False, False),   # not ours: mitmproxy's default
])
def test_responseheaders_streams(tmp_path, ctype, length, in_scope, streamed):
    p = start(tmp_path / "none.toml")
    f = tflow.tflow(resp=True)
    f.response.headers["content-type"] = ctype
    if not length:
        del f.response.headers["content-length"]
    if in_scope:
        f.metadata["sessionpin"] = {"target": "glm"}
    p.router.responseheaders(f)
    assert bool(f.response.stream) is streamed
    p.close()


CODEX_META = ('{"session_id":"01a22bef-e03d-7c53-8141-6c5fbf6ba8c0","thread_id":"01a22bef-e03d-7c53-8141-6c5fbf6ba8c0",'
              '"request_kind":"prewarm","history_initialization":"%s","thread_source":"user","model":"gpt-6.2-sol"%s}')


def upgrade(init="new", extra="", session="01a22bef-e03d-7c53-8141-6c5fbf6ba8c0"):
    return flow(path="/v1/responses", method=b"GET", content=b"", agent=b"codex_exec/0.171.0", host="api.openai.com",
                session=None,
                headers=[(b"upgrade", b"websocket"), (b"connection", b"Upgrade"), (b"sec-websocket-version", b"13"),
                         (b"sec-websocket-key", b"uwPXXqdS7ICAVOyaCf6oAQ=="), (b"session-id", session.encode()),
                         (b"authorization", b"Bearer sk-agent"),
                         (b"x-codex-turn-metadata", (CODEX_META % (init, extra)).encode())])


CODEX_CONFIG = CONFIG + '''
[servers.openai]
url = "https://api.openai.com"
[servers.alt]
url = "https://alt.example"
key_env = "ALT_KEY"
models = { "gpt-6.2-*" = "alt-codex-1" }
[agents.codex]
server = "alt"
'''


async def test_a_codex_websocket_is_routed_at_its_upgrade(proxy, cfg_path):
    cfg_path.write_text(CODEX_CONFIG)
    proxy.reload()
    proxy.router.env["ALT_KEY"] = "alt-sentinel"
    f = upgrade()
    await proxy.send(f)
    assert f.response is None and f.request.host == "alt.example"
    assert "alt-sentinel" in (f.request.headers.get("authorization", "") + f.request.headers.get("x-api-key", ""))
    assert "sk-agent" not in str(f.request.headers) and "agent-sentinel" not in str(f.request.headers)
    assert f.request.headers["upgrade"] == "websocket" and f.request.headers["sec-websocket-key"]
    assert f.metadata["sessionpin"]["rule"] == "opening"
    assert (await pin_of(proxy, "01a22bef-e03d-7c53-8141-6c5fbf6ba8c0")).server == "alt"
    # a fork's socket names its parent thread: it follows the parent, whatever the current server
    cfg_path.write_text(CODEX_CONFIG.replace('[agents.codex]\nserver = "alt"', '[agents.codex]\nserver = "openai"'))
    proxy.reload()
    fork = upgrade("cold_fork", ',"forked_from_thread_id":"01a22bef-e03d-7c53-8141-6c5fbf6ba8c0"',
                   session="01a22bef-e37e-7e43-b818-a21bc8c78d79")
    await proxy.send(fork)
    assert fork.request.host == "alt.example" and fork.metadata["sessionpin"]["rule"] == "fork"
    assert fork.metadata["sessionpin"]["parent"] == "01a22bef-e03d-7c53-8141-6c5fbf6ba8c0"


async def upgrade_at(proxy, cfg_path, path: str):
    """Codex's upgrade at ``path`` of api.openai.com, sent through the router (codex → alt)."""
    cfg_path.write_text(CODEX_CONFIG)
    proxy.reload()
    f = upgrade()
    f.request.path = path
    await proxy.send(f)
    return f


@pytest.mark.parametrize("path", ["/v1//responses", "/v1/respons%65s", "/v1/responses/", "/x/../v1/responses"])
async def test_a_codex_upgrade_at_an_ambiguous_path_is_refused_as_its_post_would_be(proxy, cfg_path, path):
    f = await upgrade_at(proxy, cfg_path, path)
    assert f.response is not None and f.response.status_code == 400
    assert f.response.headers["x-sessionpin-refused"] == "ambiguous-path" and f.request.host == "api.openai.com"


@pytest.mark.parametrize("path", ["/socket//x", "/ws/./feed", "/v1/Realtime"])
async def test_another_socket_of_a_configured_origin_passes_whatever_its_path(proxy, cfg_path, path):
    f = await upgrade_at(proxy, cfg_path, path)
    assert f.response is None and f.request.host == "api.openai.com" and f.request.path == path


async def test_a_codex_upgrade_at_a_base_it_does_not_route_is_refused_when_the_thread_is_pinned_elsewhere(
        proxy, cfg_path):
    cfg_path.write_text(CODEX_CONFIG)
    proxy.reload()
    proxy.router.env["ALT_KEY"] = "alt-sentinel"
    await proxy.send(upgrade())                        # the thread opens, pinned to alt
    f = upgrade("resumed")
    f.request.path = "/backend-api/codex/responses"    # ChatGPT's base, which sessionpin does not route
    await proxy.send(f)
    assert f.response is not None and f.response.status_code in (424, 426)
    assert f.response.headers["x-sessionpin-refused"] == "unnamed-path" and f.request.host == "api.openai.com"
    never = upgrade(session="01a22bef-0000-7000-8000-000000000000")
    never.request.path = "/backend-api/codex/responses"
    await proxy.send(never)                            # a thread never pinned: passes, pins nothing
    assert never.response is None and never.request.host == "api.openai.com"
    assert await pin_of(proxy, "01a22bef-0000-7000-8000-000000000000") is None


async def test_codex_zstd_body_keeps_its_encoding_and_only_the_model_changes(tmp_path):
    from mitmproxy.net import encoding

    from shellkit import Proxy  # noqa: F401  (documentation: start() builds one)
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
                      (b"authorization", b"Bearer sk-agent")])
    proxy = start(p)
    proxy.router.env["OR_KEY"] = "or-sentinel"
    try:
        req = tutils.treq(method=b"POST", scheme=b"https", host="api.openai.com", port=443, path=b"/v1/responses",
                          headers=h, content=b"")
        req.raw_content = encoding.encode(plain, "zstd")
        f = tflow.tflow(req=req)
        await proxy.send(f)
        assert f.response is None
        assert f.request.url == "https://openrouter.example/api/v1/responses"
        assert f.request.headers["content-encoding"] == "zstd"
        assert encoding.decode(f.request.raw_content, "zstd") == plain.replace(b'"gpt-5-codex"', b'"openai/gpt-5"')
        assert f.request.headers["authorization"] == "Bearer or-sentinel"
    finally:
        proxy.close()


@pytest.mark.parametrize("status, location, named", [
    (307, "https://evil.example/v1/messages", "evil.example"),
    (302, "/api/anthropic/v1/messages", "api.z.ai (same origin)"),
    (308, "https://api.z.ai:8443/x", "api.z.ai"),
])
async def test_a_redirect_from_a_server_the_request_was_moved_to_is_not_passed_on(proxy, status, location, named):
    f = flow()
    await proxy.send(f)
    assert f.request.host == "api.z.ai" and f.metadata["sessionpin"]["moved"]
    f.response = tutils.tresp(status_code=status, headers=http.Headers(location=location, content_length="0"),
                              content=b"")
    proxy.router.responseheaders(f)
    # refused before anything of it can leave: the 502's status and headers are in place
    assert f.response.status_code == 502 and "location" not in f.response.headers
    proxy.router.response(f)
    assert f.response.status_code == 502 and "location" not in f.response.headers
    assert not f.response.stream and f.response.headers["content-length"] == str(len(f.response.raw_content))
    msg = json.loads(f.response.content)["error"]["message"]
    assert "server glm" in msg and named in msg and SESSION in msg
    assert proxy.router.metrics.refusals["redirect"] == 1


@pytest.mark.parametrize("streamed_before", [True, False])
async def test_a_refused_redirect_with_a_large_body_is_refused_before_its_headers_leave(proxy, streamed_before):
    """mitmproxy marks a response streamed before ``responseheaders`` when its length passes
    ``stream_large_bodies`` (and switches a chunked one to streaming once its buffer does):
    the headers sent are those left by the hook, and the body goes through the stream
    callable. The redirect's must never be among them."""
    f = flow()
    await proxy.send(f)
    f.response = tutils.tresp(status_code=307, headers=http.Headers(
        location="https://evil.example/v1/messages", content_type="text/plain", content_length="70000000"),
        content=b"")
    f.response.stream = streamed_before
    proxy.router.responseheaders(f)
    resp = f.response
    assert resp.status_code == 502 and "location" not in resp.headers
    assert resp.headers["x-sessionpin-refused"] == "redirect" and callable(resp.stream)
    # the upstream's chunks are dropped, the refusal's body comes at the end (mitmproxy's b"")
    assert resp.stream(b"x" * 65536) == b"" and resp.stream(b"y") == b""
    body = resp.stream(b"")
    assert int(resp.headers["content-length"]) == len(body)
    assert "evil.example" in json.loads(body)["error"]["message"]
    proxy.router.response(f)                           # what was streamed stays the one refusal
    assert f.response is resp and f.response.status_code == 502 and not f.response.raw_content
    assert proxy.router.metrics.refusals["redirect"] == 1
    assert f.metadata["sessionpin"]["refused"] == 502


async def test_a_redirect_to_a_request_left_where_it_was_sent_passes(proxy):
    f = flow("continuation")         # never seen begin: left alone
    await proxy.send(f)
    f.response = tutils.tresp(status_code=307, headers=http.Headers(location="https://x.example/"), content=b"")
    proxy.router.responseheaders(f)
    proxy.router.response(f)
    assert f.response.status_code == 307


@pytest.mark.parametrize("path,shape", [("/../../v1/messages", "anthropic"), ("/v1%2fmessages", "anthropic"),
                                        ("/v1/./chat/completions", "openai"), ("/x/../v1/responses", "openai")])
async def test_an_ambiguous_path_is_refused_400_in_the_format_of_the_api_it_names(proxy, path, shape):
    f = flow(path=path)
    await proxy.send(f)
    assert f.response.status_code == 400 and f.response.headers["x-sessionpin-refused"] == "ambiguous-path"
    err = json.loads(f.response.content)
    assert ("type" in err) == (shape == "anthropic") and "ambiguous" in err["error"]["message"]
    assert await pin_of(proxy) is None


async def test_a_large_bodys_lineage_is_read_off_the_event_loop(proxy, monkeypatch):
    """Issue 20: a pin-less continuation's lineage (links and root) is read on a thread of the
    router's own when the body is large, so the event loop serves every other client meanwhile;
    the request itself waits for it and is decided as before."""
    import threading

    from sessionpin.lineage import lineage
    threads = []
    real = lineage.chain
    monkeypatch.setattr(lineage, "chain",
                        lambda *a, **k: threads.append(threading.current_thread().name) or real(*a, **k))
    big = json.loads(body("continuation"))
    big["messages"][0]["content"] = "x" * (300 * 1024)
    f = flow("continuation", session="abcd1234-0000-4000-8000-00000000b16b", content=json.dumps(big).encode())
    await proxy.send(f)
    assert f.metadata["sessionpin"]["rule"] == "continuation-unseen"
    assert threads and all(t.startswith("sessionpin-lineage-request") for t in threads), threads
    small = flow("continuation", session="abcd1234-0000-4000-8000-00000000511a")
    threads.clear()
    await proxy.send(small)
    assert threads == [threading.current_thread().name]       # a small body: no hop


async def test_a_codex_websocket_to_a_dead_server_is_refused_so_codex_falls_back_at_once(cfg_path):
    """Codex reconnects a refused upgrade five times before its HTTPS fallback, unless the answer
    is 426 (measured with Codex 0.171: docs/traffic.md); its POST then gets the 400 Codex does not retry."""
    import ports
    dead = ports.free_port()        # nobody listens there (below the ephemeral range: nobody will)
    cfg_path.write_text(CODEX_CONFIG.replace("https://alt.example", f"https://127.0.0.1:{dead}"))
    proxy = start(cfg_path, sessionpin_connect_check=True, sessionpin_connect_retry_ms=0)
    try:
        proxy.router.env["ALT_KEY"] = "alt-sentinel"
        f = upgrade()
        await proxy.send(f)
        assert f.response.status_code == 426 and f.response.headers["x-should-retry"] == "false"
        assert "retry-after" not in f.response.headers and "cannot be reached" in f.response.text
        assert f.request.host == "api.openai.com"                 # sent nowhere
    finally:
        proxy.close()


async def test_codex_s_https_refusal_is_the_400_it_shows_at_once(cfg_path):
    """Codex's turn loop retries a 424 five times (~7 s more before the error shows: measured
    with Codex 0.171, docs/traffic.md) and stops at a 400, showing its body as it came: its
    no-retry answer is a 400 whose body is the message in plain text."""
    import ports
    dead = ports.free_port()        # nobody listens there (below the ephemeral range: nobody will)
    cfg_path.write_text(CODEX_CONFIG.replace("https://alt.example", f"https://127.0.0.1:{dead}"))
    proxy = start(cfg_path, sessionpin_connect_check=True, sessionpin_connect_retry_ms=0)
    try:
        proxy.router.env["ALT_KEY"] = "alt-sentinel"
        opening = {"model": "gpt-6.2-sol", "stream": True, "tools": [{"type": "function", "name": "shell"}],
                   "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
        f = flow(path="/v1/responses", agent=b"codex_exec/0.171.0", host="api.openai.com", session=None,
                 content=json.dumps(opening).encode(),
                 headers=[(b"session-id", b"01a22bef-e03d-7c53-8141-6c5fbf6ba8c0"), (b"authorization", b"Bearer sk-agent"),
                          (b"x-codex-turn-metadata", (CODEX_META % ("new", "")).encode())])
        await proxy.send(f)
        r = f.response
        assert r.status_code == 400, (r.status_code, r.text)
        assert r.headers["content-type"].startswith("text/plain") and r.headers["x-should-retry"] == "false"
        assert "retry-after" not in r.headers and r.headers["x-sessionpin-refused"] == "unreachable"
        assert r.text.startswith("sessionpin: server alt") and f"127.0.0.1:{dead}" in r.text, r.text
        assert f.request.host == "api.openai.com"                 # sent nowhere
        assert f.metadata["sessionpin"]["refused"] == 424         # the refusal it is (424 to every other agent)
    finally:
        proxy.close()


@pytest.mark.parametrize("fields", [
    [(b"Host", b"a.example"), (b"Content-Type", b"application/json"), (b"Content-Length", b"17"),
     (b"x-api-key", b"sk-ant-client"), (b"User-Agent", b"claude-cli/2")],
    [(b"Host", b"a.example"), (b"User-Agent", b"claude-cli/2")],                       # no length
    [(b"content-length", b"17"), (b"Host", b"a.example"), (b"Content-Length", b"17")],   # twice
    [(b"Host", b"a.example"), (b"Content-Encoding", b"gzip"), (b"Content-Length", b"40")],
    [(b"Host", b"a.example"), (b"Transfer-Encoding", b"chunked")],
    [(b"Host", b"a.example"), (b"Content-Encoding", b"identity"), (b"Content-Length", b"17")],
])
@pytest.mark.parametrize("moved", [True, False])
def test_apply_stores_a_new_body_as_req_content_does(fields, moved):
    """_apply sets a renamed body's Content-Length in its one pass over the headers: the same
    headers, in the same order, and the same bytes as ``req.content = body`` gives."""
    from sessionpin.proxy.router import _apply
    from sessionpin.decision.rewrite import Changes

    def request() -> http.Request:
        r = http.Request.make("POST", "https://a.example/v1/messages", b"", {})
        r.headers.fields = tuple(fields)
        r.raw_content = b'{"model":"a"}'
        return r
    body = b'{"model":"glm-4.6","x":1}'
    where = ("https", "b.example", 8443, "/p/v1/messages") if moved else ("https", "a.example", 443, "/v1/messages")
    drop = ("x-api-key",) if moved else ()
    add = (("x-api-key", "sk-target"),) if moved else ()
    ours, theirs = request(), request()
    _apply(ours, Changes(*where, drop, add, body, ("a", "glm-4.6")))
    _apply(theirs, Changes(*where, drop, add, None, None))
    theirs.content = body
    assert ours.headers.fields == theirs.headers.fields
    assert ours.raw_content == theirs.raw_content and ours.content == body


async def test_a_large_bodys_facts_are_read_in_the_body_readers_process(proxy, monkeypatch):
    """Issue 20: a continuation of a million-odd tiny messages before its first answer is read
    whole (no bound finds its first answer sooner), in long C calls that hold the GIL: on the
    event loop or a thread they held every other client ~1 s. From 256 KiB its facts are read in
    the body reader's process; the request is decided as before. A small body is read here."""
    from sessionpin.proxy import router as router_module
    calls = []
    real = router_module.F.read
    monkeypatch.setattr(router_module.F, "read", lambda *a, **k: calls.append(len(a[3] or b"")) or real(*a, **k))
    one = b'{"role":"user","content":"x"},'
    big = body("continuation").replace(b'"messages": [', b'"messages": [' + one * 40_000, 1)
    assert len(big) >= 1024 * 1024
    f = flow("continuation", content=big)
    await put(proxy, "glm")
    await proxy.send(f)
    assert f.metadata["sessionpin"]["rule"] == "pinned" and f.request.host == "api.z.ai"
    assert f.request.content == big.replace(b'"claude-opus-4-1"', b'"glm-4.6"')   # renamed by the span found there
    assert calls == []
    small = flow("continuation")
    size = len(small.request.raw_content)
    await proxy.send(small)
    assert calls == [size]


async def test_a_large_body_of_few_objects_is_read_here_and_one_of_many_apart(proxy, monkeypatch):
    """Issue 22 beside issue 20: what holds the loop is the objects a decode builds, not the
    bytes. A 1 MB history of long messages (a few thousand objects) is read inline — the trip
    to the body reader costs more than the read — while a compressed body, one of more than
    20,000 objects, and any from 8 MiB go to the process."""
    from sessionpin.proxy import router as router_module
    from sessionpin.proxy.router import read_apart
    long = b'{"role":"user","content":"' + b"x" * 4000 + b'"},'
    few = body("continuation").replace(b'"messages": [', b'"messages": [' + long * 270, 1)
    assert len(few) >= 1024 * 1024 and not read_apart(few, None) and not read_apart(few, "identity")
    assert read_apart(few, "gzip")
    assert read_apart(b'{"a":' + b" " * (8 * 1024 * 1024) + b"1}", None)
    many = body("continuation").replace(b'"messages": [', b'"messages": [' + b'{"role":"user","content":"x"},' * 20_001, 1)
    assert read_apart(many, None) and not read_apart(many[:200_000], None)
    calls = []
    real = router_module.F.read
    monkeypatch.setattr(router_module.F, "read", lambda *a, **k: calls.append(len(a[3] or b"")) or real(*a, **k))
    f = flow("continuation", content=few)
    await put(proxy, "glm")
    await proxy.send(f)
    assert f.metadata["sessionpin"]["rule"] == "pinned" and f.request.host == "api.z.ai"
    assert f.request.content == few.replace(b'"claude-opus-4-1"', b'"glm-4.6"')
    assert calls == [len(few)]


def _history_of(item: bytes, n: int) -> bytes:
    """A continuation whose history, after its first answer, holds ``n`` copies of ``item``."""
    return body("continuation").replace(b'"content": "more"\n  }', b'"content": "more"\n  },' + (item + b",") * (n - 1)
                                        + item, 1)


async def test_a_long_history_of_many_objects_is_read_by_its_parts_here(proxy, monkeypatch):
    """Issue 22: a real long session is thousands of small tool calls and results (more than
    20,000 JSON objects in a few MB): its head, first messages and tail tell its facts, read
    here in bounded work — no count of every byte, no trip to the body reader — and it is
    decided and renamed as before."""
    from sessionpin.proxy import router as router_module
    item = b'{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"ok"}]}]}'
    big = _history_of(item, 12_000)
    assert len(big) >= 1024 * 1024 and big.count(b"{") > router_module.FACTS_INLINE_ITEMS
    assert router_module.read_apart(big, None), "the whole read would go to the process"
    trips, whole = [], []
    monkeypatch.setattr(proxy.router.bodies, "facts", lambda *a, **k: trips.append(1))
    real = router_module.F.read
    monkeypatch.setattr(router_module.F, "read", lambda *a, **k: whole.append(1) or real(*a, **k))
    f = flow("continuation", content=big)
    await put(proxy, "glm")
    await proxy.send(f)
    assert trips == [] and whole == []
    meta = f.metadata["sessionpin"]
    assert meta["rule"] == "pinned" and meta["turn"] == "continuation" and f.request.host == "api.z.ai"
    assert f.request.content == big.replace(b'"claude-opus-4-1"', b'"glm-4.6"')


def test_what_is_read_by_its_parts_first():
    """From 256 KiB up to 8 MiB, not compressed (a compressed body's parts are not its bytes,
    and from 8 MiB even the parts' scans go to the body reader)."""
    from sessionpin.proxy.router import read_in_parts
    assert read_in_parts(b"x" * (256 * 1024), None) and read_in_parts(b"x" * (256 * 1024), " Identity ")
    assert not read_in_parts(b"x" * (256 * 1024 - 1), None) and not read_in_parts(b"x" * (8 * 1024 * 1024), None)
    assert not read_in_parts(b"x" * (256 * 1024), "gzip") and not read_in_parts(b"x" * (256 * 1024), "br")


@pytest.mark.parametrize("where", ["system", "first message"])
async def test_parts_holding_too_many_objects_still_go_to_the_body_reader(proxy, monkeypatch, where):
    """What the parts' read decodes (the system prompt, the first messages' contents) is held
    to the same bound as a whole read on the loop: more than 20,000 objects there, and the
    body goes where a whole read of it would (the body reader's process)."""
    from sessionpin.proxy import router as router_module
    blocks = b"[" + b",".join([b'{"type":"text","text":"s"}'] * 21_000) + b"]"
    base = _history_of(b'{"role":"user","content":"' + b"y" * 1000 + b'"}', 400)
    if where == "system":
        big = base.replace(b'"max_tokens": 5', b'"system": ' + blocks + b', "max_tokens": 5', 1)
    else:
        big = base.replace(b'"content": "hi"', b'"content": ' + blocks, 1)
    assert len(big) >= 256 * 1024 and router_module.read_in_parts(big, None) and router_module.read_apart(big, None)
    assert router_module.F.read_parts("POST", "https://api.anthropic.com/v1/messages", [], big, objects=10**6) \
        is not None, "the parts tell its facts: only the bound sends it on"
    trips = []

    async def facts(*a, **k):
        trips.append(1)
        return router_module.F.read(*a[:5], api=a[5])
    monkeypatch.setattr(proxy.router.bodies, "facts", facts)
    f = flow("continuation", content=big)
    await put(proxy, "glm")
    await proxy.send(f)
    assert trips == [1]
    assert f.metadata["sessionpin"]["rule"] == "pinned" and f.request.host == "api.z.ai"


@pytest.mark.parametrize("fields", [
    [], [(b"Content-Encoding", b"gzip")], [(b"content-encoding", b"gzip"), (b"x", b"y"), (b"CONTENT-ENCODING", b"br")],
    [(b"content-encoding", b"")], [(b"content-encoding", b"\xff")], [(b"content-encodings", b"gzip")],
])
def test_the_content_encoding_read_off_the_fields_is_what_the_header_api_says(fields):
    """Issue 22: the router reads a request's content-encoding in one pass over its fields;
    it is ``headers.get`` (every value joined by ", ", None when absent), and the body the plan
    renames is ``get_content(strict=False)``."""
    from sessionpin.proxy.router import _content_encoding
    req = tutils.treq(headers=http.Headers(fields), content=b'{"model":"m"}')
    assert _content_encoding(req) == req.headers.get("content-encoding")
    body = req.get_content(strict=False) if _content_encoding(req) else req.raw_content
    assert body == req.get_content(strict=False)


@pytest.mark.parametrize("raw, limit", [
    (b"", 0), (b"{", 0), (b"{", 1), (b"{{", 1), (b"x{y{z{", 3), (b"x{y{z{", 2), (b'{"a":{}}' * 5000, 10_000),
    (b'{"a":{}}' * 5000, 9_999), (b"{}" * 30_000, 20_000), (b"no braces at all" * 1000, 0), (b"{" * 20_001, 20_000),
    (b"{" * 20_000, 20_000),
    # across the 64 KiB slices it counts in
    (b"x" * (64 * 1024 - 1) + b"{{" + b"y" * 70_000 + b"{", 2), (b"x" * (64 * 1024 - 1) + b"{{" + b"y" * 70_000 + b"{", 3),
    (b"{}" * 100_000, 99_999), (b"{}" * 100_000, 100_000), (b"x" * 300_000 + b"{", 0),
])
def test_more_than_counts_as_bytes_count_does(raw, limit):
    """Issue 22: the large-body test ``read_apart`` counts objects with ``replace`` (memchr,
    stopping after ``limit + 1``) instead of ``bytes.count``: the same answer at every boundary."""
    from sessionpin.proxy.router import _more_than
    assert _more_than(raw, b"{", limit) is (raw.count(b"{") > limit)


def test_an_exception_said_in_a_refusal_quotes_nothing_it_read():
    from sessionpin.proxy.router import _said
    e = KeyError("PROMPT-SENTINEL x-api-key sk-ant-api03-Q8zv2Lr7XwKp4TnB9sYd6HcJ1mFgA5eRuV0iO3lZ")
    said = _said(e)
    assert "PROMPT-SENTINEL" not in said and "Q8zv2Lr7" not in said and "not shown" in said
    assert _said(RuntimeError("store closed")) == "store closed"
    assert len(_said(RuntimeError("x" * 5000))) == 300
