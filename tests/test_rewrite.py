import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessionpin.reader import facts as F
from sessionpin.reader import paths
from sessionpin.decision import rewrite
from sessionpin.config.config import parse
from sessionpin.decision.ladder import Decision
from sessionpin.decision.rewrite import ModelNotFound, RequestView

CONFIG = parse('''
[servers.anthropic]
url = "https://api.anthropic.com"
[servers.glm]
url = "https://api.z.ai/api/anthropic"
key_env = "ZAI_API_KEY"
models = { "claude-opus-*" = "glm-4.6", "claude-haiku-*" = "glm-4.5-air" }
[servers.bearer]
url = "http://127.0.0.1:9000/v1/"
key_env = "LOCAL_KEY"
auth = "bearer"
[servers.zai-other]
url = "https://api.z.ai/api/paas"
[servers.nokey]
url = "https://nokey.example"
''')
ENV = {"ZAI_API_KEY": "zai-sentinel", "LOCAL_KEY": "local-sentinel"}
ANTHROPIC = CONFIG.servers["anthropic"]
GLM = CONFIG.servers["glm"]

BODY = b'{"model":"claude-opus-4-1","max_tokens":10,"messages":[{"role":"user","content":"hi \\"model\\":\\"x\\""}]}'
AGENT_HEADERS = (
    ("Host", "api.anthropic.com"),
    ("X-Api-Key", "agent-sentinel"),
    ("Authorization", "Bearer agent-oauth"),
    ("Cookie", "sid=1"),
    ("anthropic-version", "2023-06-01"),
    ("x-claude-code-session-id", "s-1"),
    ("X-Refresh-Token", "t"),
    ("x-my-secret", "s"),
    ("x-goog-api-key", "g"),
    ("Proxy-Authorization", "Basic x"),
    ("content-type", "application/json"),
)


def view(path="/v1/messages?beta=true", headers=AGENT_HEADERS, body=BODY, model="claude-opus-4-1", unreadable=None, **kw):
    return RequestView(scheme=kw.pop("scheme", "https"), host=kw.pop("host", "api.anthropic.com"),
                       port=kw.pop("port", 443), path=path, headers=headers, body=body,
                       api=kw.pop("api", F.ANTHROPIC_MESSAGES), model=model, unreadable=unreadable)


def go(target):
    return Decision(target, "create", "opening", "pinned")


def test_route_to_another_server_moves_origin_prefix_and_key():
    c = rewrite.plan(go("glm"), view(), ANTHROPIC, CONFIG, ENV)
    assert c.refuse is None
    assert (c.scheme, c.host, c.port, c.path) == ("https", "api.z.ai", 443, "/api/anthropic/v1/messages?beta=true")
    assert set(c.drop_headers) == {"x-api-key", "authorization", "cookie", "x-refresh-token", "x-my-secret",
                                   "x-goog-api-key", "proxy-authorization"}
    assert c.set_headers == (("x-api-key", "zai-sentinel"),)
    assert c.model == ("claude-opus-4-1", "glm-4.6")
    assert c.body == BODY.replace(b'"claude-opus-4-1"', b'"glm-4.6"')


def test_keeps_the_path_after_the_source_prefix():
    c = rewrite.plan(go("anthropic"), view(path="/api/anthropic/v1/messages/count_tokens", host="api.z.ai",
                                           model=None), GLM, CONFIG, ENV)
    # anthropic has no key_env and the request was addressed to api.z.ai: refused
    assert c.refuse and "anthropic has no key_env" in c.refuse and "https://api.z.ai" in c.refuse
    c = rewrite.plan(go("bearer"), view(path="/api/anthropic/v1/messages/count_tokens", host="api.z.ai",
                                        model=None), GLM, CONFIG, ENV)
    # the endpoint at bearer's own base (written …/v1/), not the string after glm's prefix
    assert (c.scheme, c.host, c.port, c.path) == ("http", "127.0.0.1", 9000, "/v1/messages/count_tokens")


# Every client convention of the recordings, and every way a server's URL is written.
CLIENT_PATHS = [
    ("claude-code", "/v1/messages?beta=true", "/messages?beta=true", F.ANTHROPIC_MESSAGES),
    ("claude-code", "/v1/messages/count_tokens?beta=true", "/messages/count_tokens?beta=true", F.ANTHROPIC_COUNT_TOKENS),
    ("opencode zen", "/zen/v1/messages", "/messages", F.ANTHROPIC_MESSAGES),
    ("opencode zen", "/zen/v1/responses", "/responses", F.OPENAI_RESPONSES),
    ("opencode/pi zen", "/zen/v1/chat/completions", "/chat/completions", F.OPENAI_CHAT),
    ("opencode/pi go", "/zen/go/v1/chat/completions", "/chat/completions", F.OPENAI_CHAT),
    ("codex", "/v1/responses", "/responses", F.OPENAI_RESPONSES),
    ("glm-style client", "/api/anthropic/v1/messages", "/messages", F.ANTHROPIC_MESSAGES),
]
# how a server's URL is written -> where its API's endpoints are
CONVENTIONS = {"": "/v1", "/v1": "/v1", "/zen/v1": "/zen/v1", "/zen": "/zen/v1", "/api/anthropic": "/api/anthropic/v1"}


@pytest.mark.parametrize("src", list(CONVENTIONS))
@pytest.mark.parametrize("dst", list(CONVENTIONS))
@pytest.mark.parametrize("client, path, endpoint, api", CLIENT_PATHS, ids=[c[1] for c in CLIENT_PATHS])
def test_a_move_maps_the_endpoint_for_every_pair_of_conventions(src, dst, client, path, endpoint, api):
    """A request addressed under a configured server's origin, in any client's convention, is
    in scope whatever the server's URL says after the origin, and arrives at the target's own
    path for the same endpoint, whatever the target's URL says after its origin."""
    cfg = parse(f'''
[servers.a]
url = "https://a.example:8443{src}"
[servers.b]
url = "https://b.example{dst}"
key_env = "B_KEY"
''')
    source = cfg.server_for("https", "a.example", 8443, path)
    assert source is not None and source.name == "a", (src, path)
    where = paths.scope("POST", path, source.prefix)
    assert (where.api, where.refuse) == (api, None)
    c = rewrite.plan(go("b"), view(path=path, host="a.example", port=8443, model=None, api=api), source, cfg,
                     {"B_KEY": "b-key"})
    assert c.refuse is None
    assert (c.host, c.port, c.path) == ("b.example", 443, CONVENTIONS[dst] + endpoint)


@pytest.mark.parametrize("dst, path, api, moved_to", [
    ("/v1beta/openai", "/v1/chat/completions", F.OPENAI_CHAT, "/v1beta/openai/chat/completions"),
    ("/v1/acct/gw/openai", "/v1/responses", F.OPENAI_RESPONSES, "/v1/acct/gw/openai/responses"),
    ("/v1/acct/gw/anthropic", "/v1/messages?beta=true", F.ANTHROPIC_MESSAGES, "/v1/acct/gw/anthropic/v1/messages?beta=true"),
])
def test_a_move_to_a_base_that_holds_its_version_before_its_last_segment(dst, path, api, moved_to):
    """Gemini's OpenAI-compatible API (…/v1beta/openai) and Cloudflare's AI Gateway
    (…/v1/ACCT/GW/openai) are written as the base their OpenAI clients take: an OpenAI
    endpoint is moved to that base itself, an Anthropic one to its /v1."""
    cfg = parse(f'''
[servers.a]
url = "https://a.example"
[servers.b]
url = "https://b.example{dst}"
key_env = "B_KEY"
''')
    c = rewrite.plan(go("b"), view(path=path, host="a.example", model=None, api=api), cfg.servers["a"], cfg,
                     {"B_KEY": "b-key"})
    assert c.refuse is None and (c.host, c.path) == ("b.example", moved_to)


@pytest.mark.parametrize("path", ["/v1/threads/x/v1/messages", "/v1/threads/x/messages", "/zen/v1/x/../messages",
                                  "/v1%2fmessages", "/v1/organizations/o/v1/chat/completions"])
@pytest.mark.parametrize("src", list(CONVENTIONS))
def test_look_alikes_never_move_whatever_the_convention(src, path):
    cfg = parse(f'''
[servers.a]
url = "https://a.example{src}"
[servers.b]
url = "https://b.example/zen/v1"
key_env = "B_KEY"
''')
    source = cfg.server_for("https", "a.example", 443, path)
    assert not paths.scope("POST", path, source.prefix).inference
    c = rewrite.plan(go("b"), view(path=path, host="a.example", model=None), source, cfg, {"B_KEY": "k"})
    assert c.refuse and (c.host, c.path) == ("a.example", path)


def test_pool_members_sharing_one_url_keep_the_clients_path():
    cfg = parse('''
[servers.a]
url = "https://gw.example"
key_env = "A_KEY"
[servers.b]
url = "https://gw.example"
key_env = "B_KEY"
[pools.p]
members = ["a", "b"]
''')
    c = rewrite.plan(go("b"), view(path="/zen/v1/messages", host="gw.example", model=None), cfg.servers["a"], cfg,
                     {"A_KEY": "a", "B_KEY": "b"})
    assert c.refuse is None and c.path == "/zen/v1/messages" and c.set_headers == (("x-api-key", "b"),)


@pytest.mark.parametrize("path, why", [
    ("/api/anthropic", "not an inference endpoint"),
    ("/api/anthropic/", "not an inference endpoint"),
    ("/api/anthropic/v1/threads/x/messages", "not an inference endpoint"),
    ("/api/anthropic/v1/organizations/x/messages", "not an inference endpoint"),
    ("/api/anthropic/v1/messages/batches", "not an inference endpoint"),
    ("/api/anthropic/v1/models", "not an inference endpoint"),
    ("/api/anthropic/../../v1/messages", "dot segment"),
    ("/api/anthropic/v1/%2e%2e/messages", "encoded separator"),
    ("/api/anthropic//v1/messages", "empty segment"),
])
def test_only_an_exact_inference_path_moves(path, why):
    c = rewrite.plan(go("bearer"), view(path=path, host="api.z.ai", model=None), GLM, CONFIG, ENV)
    assert c.refuse and why in c.refuse and "not sent to server bearer" in c.refuse
    assert (c.host, c.path, c.set_headers) == ("api.z.ai", path, ())


def test_a_dot_segment_path_on_a_prefixless_server_does_not_move():
    c = rewrite.plan(go("glm"), view(path="/../../v1/messages", model=None), ANTHROPIC, CONFIG, ENV)
    assert c.refuse and "dot segment" in c.refuse


def test_no_credentials_sent_when_the_agent_sent_none():
    c = rewrite.plan(go("glm"), view(headers=(("content-type", "application/json"),)), ANTHROPIC, CONFIG, ENV)
    assert c.drop_headers == () and c.set_headers == (("x-api-key", "zai-sentinel"),)


@pytest.mark.parametrize("headers, api, style", [
    ((("x-api-key", "a"),), F.ANTHROPIC_MESSAGES, "x-api-key"),
    ((("authorization", "Bearer a"),), F.ANTHROPIC_MESSAGES, "bearer"),
    ((), F.ANTHROPIC_MESSAGES, "x-api-key"),
    ((), F.OPENAI_CHAT, "bearer"),
    ((("authorization", "Basic a"),), F.OPENAI_RESPONSES, "bearer"),
])
def test_auth_style_follows_the_agent(headers, api, style):
    assert rewrite.auth_style(GLM, view(headers=headers, api=api)) == style


def test_bearer_style_when_the_server_says_so():
    c = rewrite.plan(go("bearer"), view(headers=(("x-api-key", "agent"),), model=None), ANTHROPIC, CONFIG, ENV)
    assert c.drop_headers == ("x-api-key",) and c.set_headers == (("authorization", "Bearer local-sentinel"),)


def test_bearer_agent_gets_bearer_key():
    c = rewrite.plan(go("glm"), view(headers=(("Authorization", "Bearer oauth"),)), ANTHROPIC, CONFIG, ENV)
    assert c.set_headers == (("authorization", "Bearer zai-sentinel"),) and c.drop_headers == ("authorization",)


@pytest.mark.parametrize("env", [{}, {"ZAI_API_KEY": ""}, {"ZAI_API_KEY": "  "}])
def test_missing_key_is_refused(env):
    c = rewrite.plan(go("glm"), view(), ANTHROPIC, CONFIG, env)
    assert c.refuse.startswith("server glm: ZAI_API_KEY is not set in the proxy's environment (set it where the "
                                "proxy runs and restart the proxy") and c.operator


def test_server_without_key_env_only_takes_its_own_origin():
    c = rewrite.plan(go("nokey"), view(), ANTHROPIC, CONFIG, ENV)
    assert c.refuse and "nokey has no key_env" in c.refuse and "servers.nokey.key_env" in c.refuse and c.operator
    # same origin, other prefix: the agent's key was for this origin, it stays
    c = rewrite.plan(go("zai-other"), view(host="api.z.ai", path="/api/anthropic/v1/messages"), GLM, CONFIG, ENV)
    assert c.refuse is None and c.path == "/api/paas/v1/messages"
    # the agent's key stays; the rest is held to the allowlist like any move
    assert set(c.drop_headers) == {"cookie", "x-refresh-token", "x-my-secret", "x-goog-api-key",
                                   "proxy-authorization"} and c.set_headers == ()


def test_staying_on_the_addressed_server_keeps_headers_and_maps_the_model():
    c = rewrite.plan(go("glm"), view(host="api.z.ai", path="/api/anthropic/v1/messages"), GLM, CONFIG, {})
    assert c.refuse is None
    assert (c.host, c.path, c.drop_headers, c.set_headers) == ("api.z.ai", "/api/anthropic/v1/messages", (), ())
    assert c.model == ("claude-opus-4-1", "glm-4.6")


def test_unmapped_model_leaves_the_body_alone():
    c = rewrite.plan(go("glm"), view(model="claude-sonnet-4-5"), ANTHROPIC, CONFIG, ENV)
    assert c.body is None and c.model is None
    c = rewrite.plan(go("glm"), view(model=None), ANTHROPIC, CONFIG, ENV)
    assert c.body is None


def test_model_that_cannot_be_located_is_refused():
    body = b'{"model":"claude-opus-4-1","model":"claude-opus-4-1"}'
    c = rewrite.plan(go("glm"), view(body=body), ANTHROPIC, CONFIG, ENV)
    assert c.refuse and "cannot rename model" in c.refuse


def test_refuses_a_target_that_is_not_configured():
    assert "not configured" in rewrite.plan(go("gone"), view(), ANTHROPIC, CONFIG, ENV).refuse
    with pytest.raises(ValueError):
        rewrite.plan(Decision(None, "none", "x", "y"), view(), ANTHROPIC, CONFIG, ENV)


@pytest.mark.parametrize("body, expected", [
    (b'{"model":"a"}', b'{"model":"b-1"}'),
    (b' {\n  "stream" : true ,\n  "model"\t:\t"a" , "x": {"model": "a"}\n}\n', b' {\n  "stream" : true ,\n  "model"\t:\t"b-1" , "x": {"model": "a"}\n}\n'),
    (b'{"x": {"model": "a"}, "messages": ["\\"model\\": \\"a\\""], "model": "a"}',
     b'{"x": {"model": "a"}, "messages": ["\\"model\\": \\"a\\""], "model": "b-1"}'),
    (b'{"m\\u006fdel":"a","y":[1,{"a":"}"}]}', b'{"m\\u006fdel":"b-1","y":[1,{"a":"}"}]}'),
    (b'{"k\\\\":"\\\\","model":"a"}', b'{"k\\\\":"\\\\","model":"b-1"}'),
    ('{"é":"ü","model":"a"}'.encode(), '{"é":"ü","model":"b-1"}'.encode()),
])
def test_replace_model_changes_only_the_model_bytes(body, expected):
    assert rewrite.replace_model(body, "a", "b-1") == expected


@pytest.mark.parametrize("body", [
    b"", b"not json", b"[]", b'{"model": 3}', b'{"x": 1}', b'{"model":"a","model":"a"}', b'{"model":"a"',
    b'{"model":"other"}',
])
def test_replace_model_refuses_what_it_cannot_locate(body):
    with pytest.raises(ModelNotFound):
        rewrite.replace_model(body, "a", "b")


def test_replace_model_in_a_large_body_is_byte_exact():
    messages = [{"role": "user", "content": "x" * 1000 + '"model":"claude-opus-4-1"'} for _ in range(2000)]
    body = json.dumps({"messages": messages, "model": "claude-opus-4-1", "thinking": {"signature": "abc=="}},
                      separators=(", ", ": ")).encode()
    out = rewrite.replace_model(body, "claude-opus-4-1", "glm-4.6")
    i = body.rindex(b'"claude-opus-4-1"')
    assert out == body[:i] + b'"glm-4.6"' + body[i + len(b'"claude-opus-4-1"'):]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=6).filter(lambda k: k != "model"), json_values, max_size=5),
       st.integers(min_value=0, max_value=5), st.sampled_from([(",", ":"), (", ", ": "), (" ,\n ", " :\t")]),
       st.text(min_size=1, max_size=10))
def test_replace_model_property(other, at, seps, new):
    items = list(other.items())
    items.insert(min(at, len(items)), ("model", "claude-opus-4-1"))
    body = json.dumps(dict(items), separators=seps, ensure_ascii=False).encode()
    out = rewrite.replace_model(body, "claude-opus-4-1", new)
    decoded = msgspec.json.decode(out)
    assert decoded == {**dict(items), "model": new}
    start, end = rewrite.model_span(body)
    assert out[:start] == body[:start] and out[start + len(msgspec.json.encode(new)):] == body[end:]


@pytest.mark.parametrize("body", [
    b'{"model":"a","x":1,"model":"a"}',
    b'{"model":"a","x":"longer value","x":"s"}',
    b'{"x":"long long long","model":"a","x":"s"}',
])
def test_duplicate_keys_anywhere_are_refused(body):
    with pytest.raises(ModelNotFound):
        rewrite.model_span(body)


KEY = "sk-ant-api03-Ab3dE6gH9jK2mN5pQ8sT1vW4yZ7bC0eF3hJ6kM9nP2rS5uV8xA1cD4fG7iL0oR3tU6w"


def test_a_refusal_never_carries_a_key_even_from_a_config_built_by_hand():
    # parse() refuses a key as key_env (test_config); a Config built in code is not parsed.
    from dataclasses import replace
    bad = replace(GLM, key_env=KEY)
    cfg = replace(CONFIG, servers={**CONFIG.servers, "glm": bad})
    c = rewrite.plan(go("glm"), view(), ANTHROPIC, cfg, {})
    assert c.refuse.startswith("server glm: [redacted] is not set in the proxy's environment")
    c = rewrite.plan(go("glm"), view(headers=(("x-api-key", KEY),), body=b'{"model":"claude-opus-4-1"',
                                       model="claude-opus-4-1"), ANTHROPIC, cfg, {bad.key_env: "k"})
    assert c.refuse and KEY not in c.refuse and KEY[10:30] not in c.refuse


@pytest.mark.parametrize("why", ["unknown content-encoding 'x-custom'", "too large", "not JSON: nested too deeply",
                                 "bad zstd body; request-class main", "too many content-encodings"])
@pytest.mark.parametrize("target, source, host, path", [
    ("glm", ANTHROPIC, "api.anthropic.com", "/v1/messages?beta=true"),      # moved
    ("glm", GLM, "api.z.ai", "/api/anthropic/v1/messages"),                  # stays: glm still renames
])
def test_an_unreadable_body_is_refused_when_the_target_renames_models(why, target, source, host, path):
    c = rewrite.plan(go(target), view(host=host, path=path, model=None, unreadable=why, body=b"\x28\xb5garbage"),
                     source, CONFIG, ENV)
    assert c.refuse == f"cannot rename the model for server glm: the request body could not be read ({why})"
    assert c.body is None and c.set_headers == ()


def test_an_unreadable_body_goes_where_no_model_is_renamed():
    c = rewrite.plan(go("bearer"), view(model=None, unreadable="too large"), ANTHROPIC, CONFIG, ENV)
    assert c.refuse is None and c.host == "127.0.0.1"


def test_a_body_read_but_without_a_model_is_not_refused():
    c = rewrite.plan(go("glm"), view(model=None, unreadable=None), ANTHROPIC, CONFIG, ENV)
    assert c.refuse is None and c.body is None


def test_a_body_too_deep_for_the_model_search_is_refused_not_raised():
    body = b'{"model":"claude-opus-4-1","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    c = rewrite.plan(go("glm"), view(body=body), ANTHROPIC, CONFIG, ENV)
    assert c.refuse and "nested too deeply" in c.refuse


@pytest.mark.parametrize("path, moved_to", [
    ("/api/anthropic/v1/messages?beta=true&key=x", "/api/anthropic/v1/messages?beta=true"),
    ("/somewhere/v1/messages/count_tokens", "/api/anthropic/v1/messages/count_tokens"),
    ("/v1/chat/completions", "/api/anthropic/v1/chat/completions"),
])
def test_a_request_to_an_origin_no_longer_configured_keeps_its_api_path(path, moved_to):
    c = rewrite.plan(go("glm"), view(host="gone.example", path=path, model=None), None, CONFIG, ENV)
    assert c.refuse is None and (c.host, c.path) == ("api.z.ai", moved_to)
    assert c.set_headers == (("x-api-key", "zai-sentinel"),) and "x-api-key" in c.drop_headers


@pytest.mark.parametrize("path, why", [
    ("/v1/threads/x/messages", "not an inference endpoint"),
    ("/x/../v1/messages", "dot segment"),
    ("/v1/%2e%2e/v1/messages", "encoded"),
])
def test_a_request_to_an_origin_no_longer_configured_moves_only_an_exact_endpoint(path, why):
    c = rewrite.plan(go("glm"), view(host="gone.example", path=path, model=None), None, CONFIG, ENV)
    assert c.refuse and why in c.refuse and c.set_headers == ()
