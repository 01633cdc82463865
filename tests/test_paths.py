"""Which requests are inference (sessionpin/reader/paths.py): every recorded path, and the attack paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessionpin.reader import facts as F
from sessionpin.offline import flowfile
from sessionpin.reader import paths
from sessionpin.config.config import parse

FIXTURES = Path(__file__).parent / "fixtures" / "traffic"

# The servers the recordings addressed, as an operator would configure them.
CONFIG = parse('''
[servers.anthropic]
url = "https://api.anthropic.com"
[servers.openai]
url = "https://api.openai.com"
[servers.zen]
url = "https://opencode.ai/zen"
[servers.zen-go]
url = "https://opencode.ai/zen/go"
[servers.downloads]
url = "https://downloads.claude.ai"
[servers.chatgpt]
url = "https://chatgpt.com"
[servers.ab]
url = "https://ab.chatgpt.com"
[servers.npm]
url = "https://registry.npmjs.org"
[servers.github]
url = "https://api.github.com"
''')


def recorded():
    """(where, method, url, the api the recording says) of every recorded request."""
    out = []
    for path in sorted(FIXTURES.glob("*/*.json")):
        fx = json.loads(path.read_text())
        out.append((f"{path.parent.name}/{path.stem}", fx["method"], fx["url"], fx["expect"]["api"]))
    for path in sorted((FIXTURES / "flows").glob("*.flow")):
        for r in flowfile.read_requests(path.read_bytes()):
            out.append((f"{path.name}#{r.index}", r.method, r.url, None))
    return out


RECORDED = recorded()


def _split(url: str):
    scheme, rest = url.split("://", 1)
    host, _, path = rest.partition("/")
    return scheme, host, "/" + path


@pytest.mark.parametrize("where, method, url, expected", RECORDED, ids=[r[0] for r in RECORDED])
def test_every_recorded_request_reads_the_same_with_its_servers_prefix(where, method, url, expected):
    scheme, host, path = _split(url)
    server = CONFIG.server_for(scheme, host, 443, path)
    assert server is not None, url
    s = paths.scope(method, path, server.prefix)
    assert s.refuse is None
    assert s.api == F.api_of(method, url)
    if expected is not None:
        assert s.api == expected


def test_the_recordings_cover_every_api_and_both_prefixes():
    seen = {(paths.scope(m, _split(u)[2], CONFIG.server_for(*_split(u)[:2], 443, _split(u)[2]).prefix).api,
             CONFIG.server_for(*_split(u)[:2], 443, _split(u)[2]).name) for _, m, u, _ in RECORDED}
    assert {a for a, _ in seen} >= {paths.ANTHROPIC_MESSAGES, paths.ANTHROPIC_COUNT_TOKENS, paths.OPENAI_CHAT,
                                     paths.OPENAI_RESPONSES, paths.OTHER}
    assert {"zen", "zen-go", "anthropic", "openai"} <= {s for a, s in seen if a != paths.OTHER}


@pytest.mark.parametrize("method, path, prefix, api", [
    ("POST", "/v1/messages", "", paths.ANTHROPIC_MESSAGES),
    ("POST", "/v1/messages?beta=true", "", paths.ANTHROPIC_MESSAGES),
    ("POST", "/v1/messages/count_tokens?beta=true", "", paths.ANTHROPIC_COUNT_TOKENS),
    ("POST", "/v1/chat/completions", "", paths.OPENAI_CHAT),
    ("POST", "/v1/responses", "", paths.OPENAI_RESPONSES),
    ("post", "/v1/responses", "", paths.OPENAI_RESPONSES),
    ("POST", "/v1/responses/compact", "", paths.OPENAI_RESPONSES),         # Codex's remote compaction
    ("POST", "/zen/v1/responses/compact", "/zen/v1", paths.OPENAI_RESPONSES),
    ("POST", "/zen/v1/messages", "/zen", paths.ANTHROPIC_MESSAGES),
    ("POST", "/zen/go/v1/chat/completions", "/zen/go", paths.OPENAI_CHAT),
    ("POST", "/api/anthropic/v1/messages", "/api/anthropic", paths.ANTHROPIC_MESSAGES),
    ("POST", "/zen/v1/responses", "/zen/v1", paths.OPENAI_RESPONSES),     # a prefix with the version in it
    ("POST", "/v1/messages", "/v1", paths.ANTHROPIC_MESSAGES),
    # not inference: left where it was addressed
    ("GET", "/v1/responses", "", paths.OTHER),                             # Codex's WebSocket upgrade
    ("POST", "/v1/threads/x/messages", "", paths.OTHER),
    ("POST", "/v1/organizations/x/messages", "", paths.OTHER),
    ("POST", "/v1/messages/batches", "", paths.OTHER),
    ("POST", "/v1/models", "", paths.OTHER),
    ("POST", "/messages", "", paths.OTHER),
    ("POST", "/v2/messages", "", paths.OTHER),
    ("POST", "/api/claude_code/settings", "", paths.OTHER),
    # a server is an API at its origin: whatever plain prefix the client puts before /v1
    ("POST", "/zen/v1/messages", "/zen/go", paths.ANTHROPIC_MESSAGES),
    ("POST", "/zenx/v1/messages", "/zen", paths.ANTHROPIC_MESSAGES),
    ("POST", "/v1/messages", "/api/anthropic", paths.ANTHROPIC_MESSAGES),
    ("POST", "/api/anthropic/x/v1/messages", "/api/anthropic", paths.ANTHROPIC_MESSAGES),
    ("POST", "/zen/v1/chat/completions", "", paths.OPENAI_CHAT),           # opencode/pi at a bare origin
    ("POST", "/zen/go/v1/responses", "", paths.OPENAI_RESPONSES),
    ("POST", "/zen/v1/messages/count_tokens", "/v1", paths.ANTHROPIC_COUNT_TOKENS),
    ("POST", "/v1/messages", "/zen/v1", paths.ANTHROPIC_MESSAGES),         # Claude Code at a …/zen/v1 server
    ("POST", "/zen/v1/v1/messages", "/zen/v1", paths.ANTHROPIC_MESSAGES),  # the server's own prefix + /v1
    ("POST", "/api/paas/v4/chat/completions", "/api/paas/v4", paths.OPENAI_CHAT),  # a base with another version
    ("POST", "/v2/x/v1/messages", "/v2/x", paths.ANTHROPIC_MESSAGES),      # the server's own prefix, as written
    # look-alikes: a version segment in the client's prefix, or not a plain name
    ("POST", "/v1/threads/x/v1/messages", "", paths.OTHER),
    ("POST", "/v1/organizations/x/v1/chat/completions", "/zen", paths.OTHER),
    ("POST", "/v1beta/openai/v1/chat/completions", "", paths.OTHER),
    ("POST", "/V1/threads/v1/messages", "", paths.OTHER),
    ("POST", "/v1;x/v1/messages", "", paths.OTHER),
    ("POST", "/a:b/v1/messages", "", paths.OTHER),
    ("POST", "/api/paas/v4/chat/completions", "", paths.OTHER),            # no /v1, not this server's base
    ("POST", "/zen/v2/messages", "/zen/v1", paths.OTHER),
    ("POST", "/api/anthropic/messages", "/api/anthropic", paths.OTHER),    # its base is /api/anthropic/v1
])
def test_scope(method, path, prefix, api):
    s = paths.scope(method, path, prefix)
    assert (s.api, s.refuse) == (api, None)


@pytest.mark.parametrize("path, prefix", [
    # what a lenient server reads as an endpoint sessionpin routes, spelled otherwise: uvicorn and
    # Go decode an escaped letter, Express matches case-blind and ignores a trailing slash, Java
    # servers drop ;parameters — so it may be served as inference, and is never left alone
    ("/v1/messages/", ""),
    ("/V1/Messages", ""),
    ("/V1/MESSAGES?beta=true", ""),
    ("/v1/messages;x=1", ""),
    ("/v1;x=1/messages", ""),
    ("/v1/mess%61ges", ""),
    ("/v1/mess%61ges?beta=true", ""),
    ("/%761/messages", ""),
    ("/v1/%6Dessages/count_tokens", ""),
    ("/v1/Chat/Completions", ""),
    ("/v1/responses/", ""),
    ("/v1/respons%65s", ""),
    ("/api/anthropic/V1/messages", "/api/anthropic"),   # its base, /api/anthropic/v1, in another case
    ("/API/PAAS/V4/chat/completions", "/api/paas/v4"),
    ("/zen/v1/Messages", None),                          # no server at the origin: the /v1 form alone
])
def test_a_path_spelled_unlike_an_endpoint_it_names_is_refused(path, prefix):
    s = paths.scope("POST", path, prefix)
    assert s.api == paths.OTHER and s.refuse and "spelled unlike" in s.refuse
    assert paths.named("POST", path) is not None


@pytest.mark.parametrize("path", ["/v1/threads/x/Messages", "/V1/threads/v1/messages", "/v1;x/v1/messages",
                                  "/v1/models/", "/v1/Messages/batches", "/api/claude_code/settings/"])
def test_a_look_alike_spelled_otherwise_is_not_refused(path):
    assert paths.scope("POST", path, "").refuse is None


@pytest.mark.parametrize("path, named", [
    ("/chat/completions", ("/chat/completions", paths.OPENAI_CHAT)),              # a base without /v1
    ("/api/paas/v4/chat/completions", ("/chat/completions", paths.OPENAI_CHAT)),
    ("/x/Messages/", ("/messages", paths.ANTHROPIC_MESSAGES)),                    # any plain prefix: the pin decides
    ("/x/messages/count_tokens?beta=true", ("/messages/count_tokens", paths.ANTHROPIC_COUNT_TOKENS)),
    ("/backend-api/codex/responses", ("/responses", paths.OPENAI_RESPONSES)),
    ("/v1/responses/compact", ("/responses/compact", paths.OPENAI_RESPONSES)),
    ("/v1/models", None),
    ("/v1/messages/batches", None),
    ("/api/event_logging/batch", None),
    # look-alikes: another API's resource (a version segment before the last segment)
    ("/v1/threads/x/messages", None),
    ("/v1/organizations/x/messages", None),
    ("/V1/Threads/x/Messages/", None),
    ("/v1beta/openai/chat/completions", None),       # unless it is the server's own URL (below)
])
def test_named_reads_the_endpoint_a_path_ends_with_under_a_plain_prefix(path, named):
    assert paths.named("POST", path) == named
    assert paths.named("GET", path) is None


@pytest.mark.parametrize("path, named", [
    # Bedrock (Claude Code on Bedrock, or a gateway's prefix before it): the model in the path
    ("/model/anthropic.claude-sonnet-4-5-20250929-v1:0/invoke", ("/invoke", paths.ANTHROPIC_MESSAGES)),
    ("/model/us.anthropic.claude-x-v1:0/invoke-with-response-stream",
     ("/invoke-with-response-stream", paths.ANTHROPIC_MESSAGES)),
    ("/bedrock/model/x/converse", ("/converse", paths.ANTHROPIC_MESSAGES)),
    ("/model/x/Converse-Stream", ("/converse-stream", paths.ANTHROPIC_MESSAGES)),
    ("/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A1%3Aapplication-inference-profile%2Fabc/invoke",
     ("/invoke", paths.ANTHROPIC_MESSAGES)),                       # an ARN's escaped slash, decoded
    ("/model//invoke", None), ("/model/invoke", None), ("/model/x/invoke/more", None), ("/x/invoke", None),
    # Vertex (Claude Code on Vertex) and Gemini's native API (Gemini CLI): a model method
    ("/v1/projects/p/locations/us-east5/publishers/anthropic/models/claude-sonnet-4-5@20250929:streamRawPredict",
     (":streamrawpredict", paths.ANTHROPIC_MESSAGES)),
    ("/v1/projects/p/locations/l/publishers/anthropic/models/m:rawPredict", (":rawpredict", paths.ANTHROPIC_MESSAGES)),
    ("/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", (":streamgeneratecontent", paths.OPENAI_CHAT)),
    ("/v1beta/models/gemini-2.5-pro:generateContent", (":generatecontent", paths.OPENAI_CHAT)),
    ("/v1beta/models/gemini-2.5-pro:countTokens", (":counttokens", paths.OPENAI_CHAT)),
    ("/v1beta/models/:generateContent", None), ("/v1beta/models/x:listThings", None), ("/v1/x:generateContent", None),
    ("/v1beta/models/a/b:generateContent", None),
    # the legacy completions, under a plain prefix as the endpoints above
    ("/v1/complete", ("/complete", paths.ANTHROPIC_MESSAGES)),
    ("/v1/completions", ("/completions", paths.OPENAI_CHAT)),
    ("/zen/v1/completions", ("/completions", paths.OPENAI_CHAT)),
    ("/v1/responses/input_tokens", ("/responses/input_tokens", paths.OPENAI_RESPONSES)),
    ("/model/x/count-tokens", ("/count-tokens", paths.ANTHROPIC_MESSAGES)),
    ("/v1/threads/x/completions", None),                           # a look-alike, as for the endpoints
    ("/v1/messages/batches", None),                                # many requests, no one conversation's turn
])
def test_named_reads_other_apis_inference_endpoints(path, named):
    """Endpoints sessionpin never routes but a server may serve as inference: named, so a
    conversation pinned elsewhere is refused there (``route._guard``), never scoped as routed."""
    assert paths.named("POST", path) == named
    assert paths.named("GET", path) is None
    assert not paths.scope("POST", path, "").inference


def test_a_path_of_many_model_segments_is_read_to_its_end():
    path = "/model/" * 200_000 + "x"
    assert paths.named("POST", path) is None
    assert paths.named("POST", path + "/invoke") == ("/invoke", paths.ANTHROPIC_MESSAGES)


@pytest.mark.parametrize("path, alike", [
    ("/v1/threads/x/messages", ("/messages", paths.ANTHROPIC_MESSAGES)),            # the Assistants API's
    ("/v1/acct/gw/anthropic/v1/messages?beta=true", ("/messages", paths.ANTHROPIC_MESSAGES)),   # Cloudflare
    ("/v1/acct/gw/anthropic/v1/messages/count_tokens", ("/messages/count_tokens", paths.ANTHROPIC_COUNT_TOKENS)),
    ("/v1/projects/p/locations/l/endpoints/openapi/chat/completions", ("/chat/completions", paths.OPENAI_CHAT)),
    ("/V1/Acct/GW/OpenAI/Responses/", ("/responses", paths.OPENAI_RESPONSES)),       # read as a lenient server does
    ("/models/claude@2025/messages", ("/messages", paths.ANTHROPIC_MESSAGES)),       # a segment not a plain name
    ("/v1/messages", None), ("/chat/completions", None), ("/zen/v1/responses", None),  # named, or routed
    ("/v1/messages/batches", None), ("/v1/models", None),
])
def test_lookalike_is_an_endpoint_after_a_version_segment_that_named_leaves_out(path, alike):
    assert paths.lookalike("POST", path) == alike
    assert paths.lookalike("GET", path) is None
    assert alike is None or paths.named("POST", path) is None


def test_lookalike_leaves_the_servers_own_prefix_to_named():
    assert paths.lookalike("POST", "/v1beta/openai/chat/completions") == ("/chat/completions", paths.OPENAI_CHAT)
    assert paths.lookalike("POST", "/v1beta/openai/chat/completions", "/v1beta/openai") is None


def test_named_takes_the_servers_own_prefix_whatever_it_holds():
    assert paths.named("POST", "/v1beta/openai/messages", "/v1beta/openai") == ("/messages", paths.ANTHROPIC_MESSAGES)
    assert paths.named("POST", "/v1beta/openai/messages", None) is None
    assert paths.named("POST", "/V1beta/OpenAI/chat/completions", "/v1beta/openai") == ("/chat/completions",
                                                                                     paths.OPENAI_CHAT)


@pytest.mark.parametrize("path", [
    "/../../v1/messages", "/api/anthropic/../../v1/messages", "/v1/./messages", "/v1/messages/..",
    "/v1/threads/x/../../messages", "/v1/%2e%2e/v1/messages", "/v1/%2E%2E/messages", "/v1%2fmessages",
    "/v1%2Fmessages", "/v1%5cmessages", "/v1\\messages", "/..\\v1\\messages", "//v1/messages",
    "/v1//messages", "/api/anthropic//v1/messages", "/v1/messages%00", "/v1/messages\x00", "/v1/mess\nages",
    "/v1/messages?beta=true\r\nx: y", "/v1/messages#x", "/v1/%252e%252e/messages", "/v1/messages%",
    "/v1/messages%zz", "/v1/%7f", "v1/messages", "", "*", "https://api.anthropic.com/v1/messages",
])
@pytest.mark.parametrize("prefix", ["", "/api/anthropic"])
def test_ambiguous_paths_are_refused(path, prefix):
    s = paths.scope("POST", path, prefix)
    assert s.refuse and s.api == paths.OTHER and not s.inference
    assert paths.api_of_path("POST", path) == paths.OTHER


def test_other_methods_are_never_refused_only_left_alone():
    assert paths.scope("GET", "/../x", "") == paths.Scope(paths.OTHER)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="/.%2eEfF5cC\\v1messagzoun_tpr?#x\x00", max_size=30), st.sampled_from(["", "/zen", "/zen/v1"]))
def test_inference_is_always_an_exact_endpoint_after_the_base_or_a_plain_prefix_and_v1(path, prefix):
    s = paths.scope("POST", path, prefix)
    if s.inference:
        p = path.partition("?")[0]
        endpoint = s.endpoint.partition("?")[0]
        assert paths.ENDPOINTS[endpoint] == s.api and p.endswith(endpoint)
        before = p[: -len(endpoint)]
        if before != paths.api_base(prefix, endpoint) and before != prefix + "/v1":
            assert before.endswith("/v1")
            assert not any(paths.is_version(seg) for seg in before[:-3].split("/")), path
        assert ".." not in p and "%" not in p and "//" not in p and "\\" not in p


@pytest.mark.parametrize("path, prefix, endpoint", [
    ("/v1/messages?beta=true", "", "/messages?beta=true"),
    ("/zen/go/v1/chat/completions", "/zen/go", "/chat/completions"),
    ("/zen/v1/responses?x=1", "/zen/v1", "/responses?x=1"),
    ("/api/anthropic/v1/messages/count_tokens", None, "/messages/count_tokens"),
    ("/a/b/v1/responses?q", None, "/responses?q"),
])
def test_endpoint_is_what_follows_the_base(path, prefix, endpoint):
    assert paths.scope("POST", path, prefix).endpoint == endpoint


@pytest.mark.parametrize("prefix, base", [
    ("", "/v1"), ("/v1", "/v1"), ("/zen", "/zen/v1"), ("/zen/v1", "/zen/v1"), ("/zen/go/v1", "/zen/go/v1"),
    ("/api/anthropic", "/api/anthropic/v1"), ("/api/paas/v4", "/api/paas/v4"), ("/v1beta", "/v1beta"),
])
def test_a_servers_api_base(prefix, base):
    assert paths.api_base(prefix) == base
    assert paths.api_base(prefix, "/messages?beta=true") == base


@pytest.mark.parametrize("prefix, endpoint, base", [
    # an OpenAI client appends its endpoint to a base that holds the version, wherever it is
    ("/v1beta/openai", "/chat/completions", "/v1beta/openai"),             # Gemini's OpenAI-compatible API
    ("/v1/acct/gw/openai", "/chat/completions?x=1", "/v1/acct/gw/openai"),  # Cloudflare's AI Gateway
    ("/v1/acct/gw/openai", "/responses", "/v1/acct/gw/openai"),
    ("/v1/acct/gw/openai", "/responses/compact", "/v1/acct/gw/openai"),
    # an Anthropic client appends /v1/messages to a base without a version of its own
    ("/v1/acct/gw/anthropic", "/messages", "/v1/acct/gw/anthropic/v1"),
    ("/v1/acct/gw/anthropic", "/messages/count_tokens", "/v1/acct/gw/anthropic/v1"),
    # no version anywhere: /v1 for every client
    ("/zen", "/chat/completions", "/zen/v1"), ("", "/responses", "/v1"),
])
def test_an_openai_endpoint_is_at_a_base_that_holds_a_version_wherever_it_is(prefix, endpoint, base):
    assert paths.api_base(prefix, endpoint) == base
    path = base + endpoint
    assert paths.scope("POST", path, prefix).inference


@pytest.mark.parametrize("path, prefix, before", [
    ("/api/paas/v4/chat/completions", "", "/api/paas/v4"),      # would be routed by a server at that base
    ("/v2/messages", None, "/v2"),
    ("/openai/chat/completions", "/zen", "/openai"),
    ("/messages", "", ""),
    ("/api/anthropic/messages", "/api/anthropic", "/api/anthropic"),
    ("/v1beta/openai/messages", "/v1beta/openai", "/v1beta/openai"),   # the server's own URL: no look-alike
    # routed, look-alikes, not POST, ambiguous, not an endpoint: None
    ("/v1/messages", "", None), ("/zen/v1/chat/completions", "", None),
    ("/v1/threads/x/messages", "", None), ("/v1/organizations/x/messages", "", None),
    ("/v1beta/openai/chat/completions", "", None), ("/v1/messages/batches", "", None),
    ("/x/../messages", "", None), ("/v1/models", "", None),
])
def test_unrouted_names_the_part_before_an_endpoint_scope_does_not_take(path, prefix, before):
    assert paths.unrouted("POST", path, prefix) == before
    assert paths.unrouted("GET", path, prefix) is None


@pytest.mark.parametrize("path", ["/v1/threads/x/messages", "/v1/messages/", "/x/v1/models", "/v1/../v1/messages"])
def test_an_unknown_prefix_still_wants_an_exact_endpoint(path):
    assert not paths.scope("POST", path, None).inference


def test_a_short_target_is_remembered_and_a_long_one_is_not():
    """Issue 22: a request is scoped four times (connect check, body limit, router, rewrite
    plan); an agent's few targets are worked out once. A hostile client's long targets are
    not kept (memory)."""
    paths._memo.cache_clear()
    a = paths.scope("POST", "/v1/messages?beta=true", "")
    assert paths.scope("POST", "/v1/messages?beta=true", "") is a and a.api == "anthropic-messages"
    assert paths._memo.cache_info().hits == 1
    long = "/v1/messages?" + "x" * paths.MEMO_PATH
    assert paths.scope("POST", long, "").api == "anthropic-messages"
    assert paths._memo.cache_info().currsize == 1                  # the long one not kept
    assert paths.scope("post", "/v1/messages", "").inference      # the method as sent: its own entry
    assert paths.scope("GET", "/v1/messages", "").api == "other"


@pytest.mark.parametrize("path, api", [
    ("/chat/completions", paths.OPENAI_CHAT), ("/v1/threads/x/messages", paths.ANTHROPIC_MESSAGES),
    ("/model/x/invoke", paths.ANTHROPIC_MESSAGES), ("/v1/messages", paths.ANTHROPIC_MESSAGES),
    ("/v1/files", None), ("/v1/messages/batches", None),
])
def test_guarded_is_named_or_a_lookalike(path, api):
    assert paths.guarded("POST", path) == api
    assert paths.guarded("GET", path) is None
