"""Other APIs' inference endpoints under a pinned conversation, end to end.

The same rig as ``test_unnamed_paths_e2e`` (a real ``mitmdump``, regular and reverse mode, real
TLS, fakes ``a`` — the origin the agents address — and ``b`` — their current server). A Claude
Code conversation opened at ``a`` is routed to ``b`` and pinned there. Claude Code also speaks
Bedrock (``/model/{id}/invoke``, ``…/invoke-with-response-stream``) and Vertex
(``…/publishers/anthropic/models/{m}:streamRawPredict``, ``:rawPredict``), whose base URLs
point at LLM gateways as easily as at AWS or Google (``ANTHROPIC_BEDROCK_BASE_URL``,
``ANTHROPIC_VERTEX_BASE_URL``); ``--resume`` there sends the same session id with the whole
history. Gemini's native API (``…/models/{m}:generateContent``), the legacy completions
(``/v1/complete``, ``/v1/completions``) and Bedrock's Converse are inference endpoints too.
sessionpin routes none of them, and it must not send a conversation pinned to ``b`` to the
server it addressed at one of them either: that server would serve it as inference, with the
agent's own key. Before, these paths were "not inference" and passed untouched whatever the pin.
"""

from __future__ import annotations

import json
import uuid

import pytest

from .test_router_e2e import cc
from sessionpin.reader.ids import short
from .test_unnamed_paths_e2e import _default_config, claude_code_pinned_to_b, rig  # noqa: F401 (its rig, reset)

OTHER_APIS = [
    "/model/anthropic.claude-sonnet-4-5-20250929-v1:0/invoke",
    "/model/us.anthropic.claude-sonnet-4-5-20250929-v1:0/invoke-with-response-stream",
    "/bedrock/model/anthropic.claude-sonnet-4-5/converse",                    # a gateway's prefix
    "/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A1%3Aapplication-inference-profile%2Fabc/invoke",
    "/v1/projects/p/locations/us-east5/publishers/anthropic/models/claude-sonnet-4-5@20250929:streamRawPredict",
    "/v1/projects/p/locations/global/publishers/anthropic/models/claude-sonnet-4-5@20250929:rawPredict",
    "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse",
    "/v1beta/models/gemini-2.5-pro:generateContent",
    "/v1/complete",
    "/v1/completions",
    "/model/anthropic.claude-sonnet-4-5/count-tokens",
    "/v1/responses/input_tokens",
]


def bedrock(body: bytes) -> bytes:
    """Claude Code's body as Bedrock and Vertex take it: no model (it is in the path)."""
    b = json.loads(body)
    b.pop("model", None)
    b["anthropic_version"] = "bedrock-2023-05-31"
    return json.dumps(b).encode()


@pytest.mark.parametrize("reverse", [False, True], ids=["regular", "reverse"])
@pytest.mark.parametrize("path", OTHER_APIS)
def test_a_pinned_conversation_at_another_apis_inference_endpoint_is_refused_not_sent(rig, path, reverse):  # noqa: F811
    session = claude_code_pinned_to_b(rig)
    cont = cc("continuation", session, stream=False)
    reply, got = rig.send("POST", rig.a.origin + path, cont.headers, bedrock(cont.body), reverse=reverse)
    if "%2F" in path:       # an encoded slash at a configured origin: ambiguous, refused before any pin
        assert (reply.status, got) == (400, {}), (path, reply.status, got, reply.text[:300])
        return
    assert (reply.status, got) == (424, {}), (path, reply.status, got, reply.text[:300])
    assert short(session) in reply.text and "'b'" in reply.text


@pytest.mark.parametrize("path", [p for p in OTHER_APIS if "%2F" in p or "Predict" in p])
def test_at_an_origin_no_longer_configured_too(rig, path):  # noqa: F811
    """A conversation opened at v4's origin, pinned to b; v4 then removed from the config: its
    Bedrock call with an inference profile's ARN (an encoded slash, refused nowhere else at an
    origin sessionpin does not know) and its Vertex call are refused, never sent to v4."""
    session = claude_code_pinned_to_b(rig, rig.v4.origin)
    rig.use(v4=None)
    cont = cc("continuation", session, stream=False)
    reply, got = rig.send("POST", rig.v4.origin + path, cont.headers, bedrock(cont.body))
    assert (reply.status, got) == (424, {}), (path, reply.status, got, reply.text[:300])


@pytest.mark.parametrize("path", OTHER_APIS[:1] + OTHER_APIS[4:5] + OTHER_APIS[6:7])
def test_a_conversation_never_pinned_there_still_goes_where_it_was_addressed(rig, path):  # noqa: F811
    session = str(uuid.uuid4())
    cont = cc("continuation", session, stream=False)
    reply, got = rig.send("POST", rig.a.origin + path, cont.headers, bedrock(cont.body))
    assert reply.status == 200 and got == {"a": [path]}, (path, reply.status, got, reply.text[:300])
    assert rig.a.received()[-1].header("x-api-key") == dict(cont.headers)["x-api-key"]   # its own key, untouched


def test_a_batch_is_not_one_conversation_and_passes(rig):  # noqa: F811
    """``/v1/messages/batches`` holds many requests, none of them this session's turn: it passes."""
    session = claude_code_pinned_to_b(rig)
    cont = cc("continuation", session, stream=False)
    body = json.dumps({"requests": [{"custom_id": "1", "params": json.loads(cont.body)}]}).encode()
    reply, got = rig.send("POST", rig.a.origin + "/v1/messages/batches", cont.headers, body)
    assert reply.status == 200 and got == {"a": ["/v1/messages/batches"]}, (reply.status, got, reply.text[:300])


# Gateways whose own path holds a version before the agent's base: Cloudflare's AI Gateway
# (``https://gateway.ai.cloudflare.com/v1/ACCT/GW/anthropic`` as ANTHROPIC_BASE_URL, ``…/openai``
# as an OpenAI base), Vertex's OpenAI-compatible endpoint. Read as look-alikes of another API's
# resource (``/v1/threads/x/messages``), they passed untouched whatever the pin.
GATEWAY_PATHS = [
    "/v1/acct0123/gw/anthropic/v1/messages?beta=true",
    "/v1/acct0123/gw/anthropic/v1/messages/count_tokens?beta=true",
    "/v1/projects/p/locations/us-central1/endpoints/openapi/chat/completions",
    "/v1/acct0123/gw/openai/responses",
]


@pytest.mark.parametrize("path", GATEWAY_PATHS)
def test_a_pinned_conversation_at_a_gateways_versioned_path_is_refused_not_sent(rig, path):  # noqa: F811
    session = claude_code_pinned_to_b(rig)
    cont = cc("continuation", session, stream=False)
    reply, got = rig.send("POST", rig.a.origin + path, cont.headers, cont.body)
    assert (reply.status, got) == (424, {}), (path, reply.status, got, reply.text[:300])
    assert short(session) in reply.text and "'b'" in reply.text


@pytest.mark.parametrize("path", ["/v1/threads/thread_abc/messages", "/v1/organizations/org_x/messages"])
def test_another_apis_resource_that_is_not_an_inference_request_still_passes(rig, path):  # noqa: F811
    """The Assistants API's "add a message to a thread" (``{"role", "content"}``, no model): not
    inference, it goes where it was addressed, also under a pinned session's headers."""
    session = claude_code_pinned_to_b(rig)
    cont = cc("continuation", session, stream=False)
    body = json.dumps({"role": "user", "content": "hello"}).encode()
    reply, got = rig.send("POST", rig.a.origin + path, cont.headers, body)
    assert reply.status == 200 and got == {"a": [path]}, (path, reply.status, got, reply.text[:300])


def test_a_codex_threads_websocket_upgrade_at_a_gateways_versioned_path_is_refused_when_pinned_elsewhere(rig):  # noqa: F811
    from .test_unnamed_paths_e2e import UPGRADE, codex_headers, codex_pinned_to_b
    session = codex_pinned_to_b(rig)
    reply, got = rig.send("GET", rig.a.origin + "/v1/acct0123/gw/openai/responses", codex_headers(session) + UPGRADE, b"")
    assert got == {} and reply.status in (424, 426), (reply.status, got, reply.text[:300])
    assert short(session) in reply.text or session in reply.text
