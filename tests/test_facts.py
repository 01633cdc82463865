"""The request reader: every fact, from recordings (tests/fixtures/traffic) and by hand."""

from __future__ import annotations

import gzip
import json
import zlib
from collections import defaultdict
from pathlib import Path

import brotli
import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sessionpin.reader import facts
from sessionpin.decision import rewrite
from sessionpin.reader.facts import read

try:
    from compression import zstd
except ImportError:  # Python < 3.14: what mitmproxy installs
    from backports import zstd

FIXTURES = Path(__file__).parent / "fixtures" / "traffic"
FACT_FIELDS = set(facts.Facts.__struct_fields__)

CC_UA = "claude-cli/2.1.332 (external, cli)"
CC_SID = "5d1f3c2e-0000-4000-8000-00000000c0de"
MESSAGES = "https://api.anthropic.com/v1/messages?beta=true"


def enc(body) -> bytes:
    return json.dumps(body).encode()


def billing(extra: str = "") -> dict:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332.abc; cc_entrypoint=cli;{extra}"}


def cc_body(*, line=True, subagent=False, tools=True, history=False, user_id=None, system=None) -> dict:
    sys_blocks = [billing(" cc_is_subagent=true;" if subagent else "")] if line else []
    sys_blocks.append({"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}})
    messages = [{"role": "user", "content": [{"type": "text", "text": "fix the bug"}]}]
    if history:
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
        ]
    body = {
        "model": "claude-sonnet-4-5",
        "stream": True,
        "system": sys_blocks if system is None else system,
        "messages": messages,
        "max_tokens": 32000,
    }
    if tools:
        body["tools"] = [{"name": "Bash", "input_schema": {}}, {"name": "Read", "input_schema": {}}]
    if user_id is not None:
        body["metadata"] = {"user_id": user_id}
    return body


def cc(body, request_class=None, extra=(), session=CC_SID, url=MESSAGES):
    headers = [("User-Agent", CC_UA)]
    if session:
        headers.append(("X-Claude-Code-Session-Id", session))
    if request_class:
        headers.append(("x-claude-code-request-class", request_class))
    headers += list(extra)
    return read("POST", url, headers, enc(body) if not isinstance(body, bytes) else body)


# ---------------------------------------------------------------- recordings


def _fixtures() -> list[Path]:
    return sorted(FIXTURES.glob("*/*.json")) if FIXTURES.is_dir() else []


def _read_fixture(path: Path) -> tuple[dict, facts.Facts]:
    fx = json.loads(path.read_text())
    body = fx.get("body")
    raw = None if body is None else body.encode() if isinstance(body, str) else msgspec.json.encode(body)
    # The body is stored decoded; its content-encoding header is kept for the record.
    return fx, read(fx["method"], fx["url"], fx["headers"], raw, "identity")


# Expectations the reader does not meet on purpose (reported to the lead, not edited in the
# recordings): {fixture: {fact: why}}.
DISAGREE = {
    # GET downloads.claude.ai/... with User-Agent axios/…: nothing in the request names Claude
    # Code (no UA, no header of its own); the recording labels it by the process that made it.
    "claude-code/interactive-02-model-catalog": {"agent": "no agent signal in the request"},
    # GET registry.npmjs.org/@opencode-ai/plugin with User-Agent npm/…: the same.
    "opencode/anthropic-task-01-plugin-check": {"agent": "no agent signal in the request"},
    # POST ab.chatgpt.com/otlp/v1/metrics, User-Agent OTel-OTLP-Exporter-Rust: the same.
    "codex/exec-metrics-01-telemetry": {"agent": "no agent signal in the request"},
}


@pytest.mark.parametrize("path", _fixtures(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recorded_request(path):
    fx, f = _read_fixture(path)
    exp = fx["expect"]
    skip = DISAGREE.get(f"{path.parent.name}/{path.stem}", {})
    checked = 0
    for key, want in exp.items():
        if key not in FACT_FIELDS or key in skip:
            continue
        got = getattr(f, key)
        if key == "session" and want == "fingerprint":
            assert f.session and f.session.startswith(facts.FINGERPRINT_PREFIX), f
            assert f.session_source == "fingerprint"
        else:
            assert got == want, f"{key}: {got!r} != {want!r} ({f.reason}; {fx.get('note', '')})"
        checked += 1
    assert checked >= 3 and f.parsed, f


def _claude_recordings():
    for path in _fixtures():
        if path.parent.name == "claude-code":
            fx = json.loads(path.read_text())
            if fx["expect"]["api"] != facts.OTHER:
                yield path, fx


# Kinds an older client (no request-class header) cannot tell apart: a prompt suggestion has the
# main conversation's system, tools and history.
BILLING_LINE_BLIND = {"prompt-suggestion"}


def test_recorded_claude_code_turns_without_the_request_class_header():
    seen = 0
    for path, fx in _claude_recordings():
        if fx["expect"]["kind"] in BILLING_LINE_BLIND:
            continue
        headers = [h for h in fx["headers"]
                   if h[0].lower() not in ("x-claude-code-request-class", "x-claude-1p-request-class")]
        data = msgspec.json.encode(fx["body"])
        f = read(fx["method"], fx["url"], headers, data, "identity")
        line = facts.billing_line(facts.wire.body_decoder.decode(data))
        # Without the line (switched off, CLAUDE_CODE_ATTRIBUTION_HEADER=0) the role is not stated.
        want = fx["expect"]["turn"] if line or f.api == facts.ANTHROPIC_COUNT_TOKENS else facts.UNKNOWN_TURN
        assert f.turn == want, f"{path.stem}: {f.reason}"
        seen += 1
    if not seen:
        pytest.skip("no Claude Code recordings yet")


def test_recorded_claude_code_turns_with_only_the_1p_request_class_header():
    # A client sending x-claude-1p-request-class but not x-claude-code-request-class: its
    # specific values (title, prompt suggestion, subagent) decide; "main" falls to the
    # billing line, since the auto-mode classifier also says "main".
    seen = 0
    for path, fx in _claude_recordings():
        headers = [h for h in fx["headers"] if h[0].lower() != "x-claude-code-request-class"]
        p1 = next((v for k, v in headers if k.lower() == "x-claude-1p-request-class"), "")
        if p1 not in ("summary-extraction", "followup-generation", "blocking-subagent"):
            continue
        data = msgspec.json.encode(fx["body"])
        f = read(fx["method"], fx["url"], headers, data, "identity")
        assert f.turn == fx["expect"]["turn"] and "1p" in f.reason, f"{path.stem}: {f.reason}"
        seen += 1
    assert seen >= 5 or not list(_claude_recordings())


def test_recorded_claude_code_sessions_without_the_session_header_come_from_metadata():
    seen = 0
    for path, fx in _claude_recordings():
        body = fx["body"]
        if not isinstance(body, dict) or "metadata" not in body:
            continue  # count_tokens bodies have no metadata
        headers = [h for h in fx["headers"] if h[0].lower() != "x-claude-code-session-id"]
        f = read(fx["method"], fx["url"], headers, msgspec.json.encode(body), "identity")
        assert (f.session, f.session_source) == (fx["expect"]["session"], "metadata.user_id"), path.stem
        seen += 1
    if not seen:
        pytest.skip("no Claude Code recordings yet")


def test_recorded_fingerprints_group_by_conversation():
    by_conversation: dict[str, set[str]] = defaultdict(set)
    for path in _fixtures():
        fx, f = _read_fixture(path)
        if fx["expect"].get("session") == "fingerprint":
            by_conversation[f"{path.parent.name}/{fx['expect']['conversation']}"].add(f.session)
    if not by_conversation:
        pytest.skip("no fingerprint recordings yet")
    for conversation, fps in by_conversation.items():
        assert len(fps) == 1, f"{conversation}: turns of one conversation got {len(fps)} fingerprints"
    # Different conversations of one recording differ. Across recordings the same prompt was
    # typed into the same pi with the same system prompt: identical openings, which no
    # fingerprint of content can tell apart (docs/facts.md, "Fingerprint").
    # The lineage recordings open two conversations alike on purpose (and fork one): there the
    # fingerprint cannot tell them apart, which is what tests/test_lineage.py's chains do.
    by_recording: dict[str, dict[str, str]] = defaultdict(dict)
    alike: dict[str, set[str]] = defaultdict(set)
    for path in _fixtures():
        fx, f = _read_fixture(path)
        if fx["expect"].get("session") == "fingerprint":
            recording = f"{path.parent.name}/{path.stem.rsplit('-', 2)[0]}"
            if "lineage" in fx["expect"]:
                alike[recording].add(f.session)
            else:
                by_recording[recording][fx["expect"]["conversation"]] = f.session
    for recording, fps in by_recording.items():
        assert len(set(fps.values())) == len(fps), f"{recording}: two conversations share a fingerprint"
    for recording, fps in alike.items():
        assert len(fps) == 1, f"{recording}: conversations that open alike got different fingerprints"


# ---------------------------------------------------------------- api and agent


@pytest.mark.parametrize(
    "method,url,api",
    [
        ("POST", MESSAGES, facts.ANTHROPIC_MESSAGES),
        ("POST", "https://api.anthropic.com/v1/messages/count_tokens?beta=true", facts.ANTHROPIC_COUNT_TOKENS),
        ("POST", "/zen/v1/messages", facts.ANTHROPIC_MESSAGES),
        ("POST", "https://opencode.ai/zen/go/v1/chat/completions", facts.OPENAI_CHAT),
        ("POST", "https://api.openai.com/v1/responses", facts.OPENAI_RESPONSES),
        (b"POST", b"/zen/v1/messages", facts.ANTHROPIC_MESSAGES),
        # exact endpoints after /v1 only (sessionpin/reader/paths.py): no trailing slash, no other
        # case, no Codex remote-compaction endpoint (the recorded Codex compacts via /responses)
        ("POST", "https://api.openai.com/v1/responses/", facts.OTHER),
        ("POST", "https://chatgpt.com/backend-api/codex/responses/compact", facts.OTHER),
        (b"POST", b"/V1/Messages", facts.OTHER),
        ("POST", "https://api.anthropic.com/v1/threads/x/messages", facts.OTHER),
        ("POST", "https://api.anthropic.com/api/anthropic/../../v1/messages", facts.OTHER),
        ("GET", "https://api.openai.com/v1/responses", facts.OTHER),  # Codex's WebSocket upgrade
        ("POST", "https://api.anthropic.com/api/event_logging/batch", facts.OTHER),
        ("GET", "https://api.anthropic.com/api/claude_code/settings", facts.OTHER),
        ("POST", "https://api.anthropic.com/v1/messages/batches", facts.OTHER),
        ("POST", "https://x/v1/models", facts.OTHER),
        ("POST", "", facts.OTHER),
        (None, None, facts.OTHER),
    ],
)
def test_api(method, url, api):
    assert read(method, url, [], b"{}").api == api


@pytest.mark.parametrize(
    "headers,agent",
    [
        ([("User-Agent", CC_UA)], facts.CLAUDE_CODE),
        ([("user-agent", "claude-cli/1.0.0 (external, sdk-cli)")], facts.CLAUDE_CODE),
        ([("x-claude-code-session-id", CC_SID)], facts.CLAUDE_CODE),
        ([("user-agent", "Bun/1.4.6"), ("x-service-name", "claude-code")], facts.CLAUDE_CODE),
        ([("user-agent", "opencode/1.18.33")], facts.OPENCODE),
        ([("x-opencode-session", "ses_1")], facts.OPENCODE),
        ([("user-agent", "codex_cli_rs/0.171.0 (Debian 12; x86_64) xterm")], facts.CODEX),
        ([("originator", "codex_cli_rs")], facts.CODEX),
        ([("user-agent", "GeminiCLI/0.9.0 (linux; x64)")], facts.GEMINI_CLI),
        ([("user-agent", "curl/8.0")], facts.UNKNOWN_AGENT),
        ([], facts.UNKNOWN_AGENT),
    ],
)
def test_agent(headers, agent):
    assert read("POST", MESSAGES, headers, enc(cc_body())).agent == agent


def test_header_names_are_case_insensitive_and_bytes_work():
    f = read(b"POST", MESSAGES.encode(), [(b"USER-AGENT", CC_UA.encode()), (b"X-Claude-Code-Session-ID", b"abc")],
             enc(cc_body()))
    assert (f.agent, f.session, f.session_source) == (facts.CLAUDE_CODE, "abc", "header:x-claude-code-session-id")


def test_headers_as_a_mapping():
    f = read("POST", MESSAGES, {"User-Agent": CC_UA, "X-Claude-Code-Session-Id": "abc"}, enc(cc_body()))
    assert (f.agent, f.session) == (facts.CLAUDE_CODE, "abc")


def test_the_first_of_duplicate_headers_wins():
    f = cc(cc_body(), session=None, extra=[("x-claude-code-session-id", "one"), ("x-claude-code-session-id", "two")])
    assert f.session == "one"


# ---------------------------------------------------------------- Claude Code


@pytest.mark.parametrize(
    "request_class,kwargs,turn",
    [
        ("main", {}, facts.OPENING),
        ("main", {"history": True}, facts.CONTINUATION),
        ("MAIN", {"history": True}, facts.CONTINUATION),
        ("subagent", {"line": True, "subagent": True}, facts.SUBAGENT),
        ("auxiliary", {"tools": False}, facts.SIDE),
        # a prompt suggestion looks like a continuation but for its class
        ("auxiliary", {"history": True}, facts.SIDE),
        ("compaction", {"history": True}, facts.CONTINUATION),
        # no class: the billing line of system[0] (seeds/000)
        (None, {}, facts.OPENING),
        (None, {"history": True}, facts.CONTINUATION),
        (None, {"tools": False}, facts.SIDE),
        (None, {"tools": False, "history": True}, facts.SIDE),
        (None, {"subagent": True}, facts.SUBAGENT),
        (None, {"line": False}, facts.UNKNOWN_TURN),
        (None, {"line": False, "history": True}, facts.UNKNOWN_TURN),
        # an unknown class falls back to the billing line
        ("speculative", {"history": True}, facts.CONTINUATION),
        ("speculative", {"line": False}, facts.UNKNOWN_TURN),
    ],
)
def test_claude_code_turn(request_class, kwargs, turn):
    f = cc(cc_body(**kwargs), request_class)
    assert f.turn == turn, f.reason
    assert f.parsed and f.reason
    assert f.session == CC_SID and f.has_history == kwargs.get("history", False)


def test_claude_code_request_class_outranks_the_billing_line():
    # The auto-mode classifier: class auxiliary, though the billing line says main with tools.
    assert cc(cc_body(history=True), "auxiliary").turn == facts.SIDE
    assert cc(cc_body(subagent=True), "main").turn == facts.OPENING


def test_claude_code_system_as_a_string_with_the_billing_line():
    body = cc_body(system="x-anthropic-billing-header: cc_version=1.0.80; cc_entrypoint=cli\nYou are Claude Code.")
    assert cc(body).turn == facts.OPENING
    assert cc(cc_body(system="You are Claude Code.")).turn == facts.UNKNOWN_TURN


def test_count_tokens_is_side_with_the_header_session():
    body = {"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "Bash"}]}
    f = cc(body, "auxiliary", url="https://api.anthropic.com/v1/messages/count_tokens?beta=true")
    assert (f.api, f.turn, f.session, f.stream, f.reason) == (
        facts.ANTHROPIC_COUNT_TOKENS, facts.SIDE, CC_SID, False, "count_tokens")
    # even with no class header and a main-looking body
    f = cc(cc_body(), url="https://api.anthropic.com/v1/messages/count_tokens")
    assert f.turn == facts.SIDE


def test_claude_code_session_from_metadata_user_id_json():
    uid = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "sess-json-1"})
    f = cc(cc_body(user_id=uid), "main", session=None)
    assert (f.session, f.session_source) == ("sess-json-1", "metadata.user_id")


def test_claude_code_session_from_legacy_metadata_user_id():
    uid = "user_" + "ab" * 32 + "_account_1b2c3d4e-0000-4000-8000-000000000001_session_9f8e7d6c-0000-4000-8000-000000000002"
    f = cc(cc_body(user_id=uid), session=None)
    assert (f.session, f.session_source) == ("9f8e7d6c-0000-4000-8000-000000000002", "metadata.user_id:legacy")
    uid = "user_" + "ab" * 32 + "_account__session_9f8e7d6c-0000-4000-8000-000000000003"
    assert cc(cc_body(user_id=uid), session=None).session == "9f8e7d6c-0000-4000-8000-000000000003"


def test_the_session_header_outranks_metadata():
    uid = json.dumps({"session_id": "from-body"})
    assert cc(cc_body(user_id=uid)).session == CC_SID


@pytest.mark.parametrize("uid", ["", "{not json", '{"session_id": 5}', "[1]", "user_abc_account_x", "fp:abc"])
def test_claude_code_unusable_user_id_falls_through_to_the_fingerprint(uid):
    f = cc(cc_body(user_id=uid), session=None)
    assert f.session_source == "fingerprint" and f.parsed


def test_role_system_messages_mid_conversation_are_not_history():
    body = cc_body()
    body["messages"].append({"role": "system", "content": "<system-reminder>todo list changed</system-reminder>"})
    f = cc(body, "main")
    assert (f.turn, f.has_history) == (facts.OPENING, False)


# ---------------------------------------------------------------- opencode


OC_UA = [("User-Agent", "opencode/1.18.33")]


def chat(messages, tools=True, system="You are opencode.", model="glm-4.6", stream=True):
    body = {"model": model, "stream": stream, "messages": [{"role": "system", "content": system}] + messages}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "bash"}}]
    return body


U1 = {"role": "user", "content": "add a test"}
A1 = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}
T1 = {"role": "tool", "tool_call_id": "c1", "content": "done"}


def test_opencode_gateway_session_and_turns():
    h = OC_UA + [("x-opencode-session", "ses_parent"), ("x-opencode-request", "msg_1")]
    url = "https://opencode.ai/zen/v1/chat/completions"
    f = read("POST", url, h, enc(chat([U1])))
    assert (f.api, f.agent, f.session, f.session_source, f.turn) == (
        facts.OPENAI_CHAT, facts.OPENCODE, "ses_parent", "header:x-opencode-session", facts.OPENING)
    assert read("POST", url, h, enc(chat([U1, A1, T1]))).turn == facts.CONTINUATION


def test_opencode_other_provider_session_headers():
    h = OC_UA + [("x-session-affinity", "ses_aff"), ("x-session-id", "ses_id")]
    f = read("POST", MESSAGES, h, enc(cc_body(line=False)))
    assert (f.session, f.session_source, f.turn) == ("ses_id", "header:x-session-id", facts.OPENING)
    f = read("POST", MESSAGES, OC_UA + [("x-session-affinity", "ses_aff")], enc(cc_body(line=False)))
    assert (f.session, f.session_source) == ("ses_aff", "header:x-session-affinity")


def test_opencode_subagent_follows_its_parent():
    h = OC_UA + [("x-opencode-session", "ses_child"), ("x-parent-session-id", "ses_parent")]
    f = read("POST", "https://opencode.ai/zen/v1/chat/completions", h, enc(chat([U1])))
    assert (f.session, f.session_source, f.turn) == ("ses_parent", "header:x-parent-session-id", facts.SUBAGENT)
    # known from the header even when the body is unreadable
    f = read("POST", "https://opencode.ai/zen/v1/chat/completions", h, b"{oops")
    assert (f.session, f.turn, f.parsed) == ("ses_parent", facts.SUBAGENT, False)


def test_opencode_title_request_is_side():
    body = {"model": "gpt-5-nano", "input": [{"role": "user", "content": "add a test"}],
            "instructions": "You are a title generator."}
    f = read("POST", "https://opencode.ai/zen/v1/responses", OC_UA + [("x-opencode-session", "ses_1")], enc(body))
    assert (f.api, f.turn, f.session) == (facts.OPENAI_RESPONSES, facts.SIDE, "ses_1")


# ---------------------------------------------------------------- Codex


CODEX_H = [("user-agent", "codex_cli_rs/0.171.0 (Debian 12; x86_64)"), ("originator", "codex_cli_rs"),
           ("session-id", "0199aaaa-0000-7000-8000-000000000001"), ("content-encoding", "zstd")]


def codex_body(history=False):
    items = [
        {"type": "additional_tools", "role": "developer", "tools": [{"type": "namespace", "name": "functions"}]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "perms"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]},
    ]
    if history:
        items += [
            {"type": "reasoning", "summary": []},
            {"type": "function_call", "name": "shell", "arguments": "{}", "call_id": "c"},
            {"type": "function_call_output", "call_id": "c", "output": "hi"},
        ]
    return {"model": "gpt-5-codex", "instructions": "You are Codex.", "input": items, "tools": [{"type": "function"}],
            "stream": True, "prompt_cache_key": "0199aaaa-0000-7000-8000-000000000001"}


def meta(**kw) -> tuple[str, str]:
    base = {"session_id": "0199aaaa-0000-7000-8000-000000000001", "request_kind": "turn",
            "history_initialization": "new", "thread_source": "user"}
    return ("x-codex-turn-metadata", json.dumps(base | kw))


def test_codex_zstd_body_session_and_history():
    url = "https://api.openai.com/v1/responses"
    f = read("POST", url, CODEX_H, zstd.compress(enc(codex_body())))
    assert (f.api, f.agent, f.session, f.turn, f.model, f.stream, f.parsed) == (
        facts.OPENAI_RESPONSES, facts.CODEX, "0199aaaa-0000-7000-8000-000000000001", facts.OPENING,
        "gpt-5-codex", True, True)
    f = read("POST", url, CODEX_H, zstd.compress(enc(codex_body(history=True))))
    assert (f.turn, f.has_history) == (facts.CONTINUATION, True)


@pytest.mark.parametrize(
    "extra,turn",
    [
        ([("x-openai-subagent", "collab_spawn")], facts.SUBAGENT),
        ([meta(thread_source="subagent", parent_thread_id="t0")], facts.SUBAGENT),
        ([meta(request_kind="prewarm")], facts.SIDE),
        ([meta(history_initialization="cold_fork", forked_from_thread_id="t0")], facts.CONTINUATION),
        ([meta(history_initialization="cold_resume")], facts.CONTINUATION),
        ([meta()], facts.OPENING),
        ([("x-codex-turn-metadata", "{garbage")], facts.OPENING),
        ([("x-openai-subagent", "compact")], facts.CONTINUATION),
    ],
)
def test_codex_turn_from_headers(extra, turn):
    f = read("POST", "https://api.openai.com/v1/responses", CODEX_H + extra, zstd.compress(enc(codex_body())))
    assert f.turn == turn, f.reason


def test_codex_session_from_turn_metadata_then_prompt_cache_key():
    h = [CODEX_H[0], meta(session_id="from-meta")]
    assert read("POST", "/v1/responses", h, enc(codex_body())).session_source == "header:x-codex-turn-metadata"
    f = read("POST", "/v1/responses", [CODEX_H[0]], enc(codex_body()))
    assert (f.session, f.session_source) == ("0199aaaa-0000-7000-8000-000000000001", "body:prompt_cache_key")


def test_codex_websocket_upgrade_is_other():
    f = read("GET", "https://api.openai.com/v1/responses", CODEX_H + [("upgrade", "websocket")], None)
    assert (f.api, f.agent, f.session, f.turn, f.model, f.stream) == (facts.OTHER, facts.CODEX, None, None, None, None)


# ---------------------------------------------------------------- pi and fingerprints


def pi_chat(*turns, system="You are pi, a coding agent."):
    return enc(chat(list(turns), system=system))


def test_pi_chat_has_no_id_so_a_fingerprint_stays_with_the_conversation():
    url = "https://opencode.ai/zen/go/v1/chat/completions"
    first = read("POST", url, [], pi_chat(U1))
    later = read("POST", url, [], pi_chat(U1, A1, T1, {"role": "user", "content": "and another"}))
    assert first.session.startswith("fp:") and first.session_source == "fingerprint"
    assert first.session == later.session
    assert (first.turn, later.turn) == (facts.OPENING, facts.CONTINUATION)
    other = read("POST", url, [], pi_chat({"role": "user", "content": "something else"}))
    assert other.session != first.session
    other_system = read("POST", url, [], pi_chat(U1, system="You are another agent."))
    assert other_system.session != first.session


def test_fingerprint_is_only_a_hash():
    f = read("POST", "/v1/chat/completions", [], pi_chat({"role": "user", "content": "secret words"}))
    assert len(f.session) == len("fp:") + 32 and "secret" not in f.session
    int(f.session[3:], 16)


def test_a_remembered_system_prompt_gives_the_fingerprint_worked_out_afresh():
    """Issue 22: pi's system prompt has its dates taken out once per text (the regex cost
    ~0.4 ms a request), not once per request — the fingerprint is the same either way (pins
    are kept by it), and a prompt over the bound is worked out each time, not remembered."""
    from sessionpin.reader import sessions
    system = "You are pi. Current date: 2026-12-03. Today is Thursday, Dec 3rd 2026, 14:05 UTC."
    body = pi_chat({"role": "user", "content": "fix it"}, system=system)
    sessions._undated.cache_clear()
    first = read("POST", "/v1/chat/completions", [], body).session
    again = read("POST", "/v1/chat/completions", [], body).session
    assert first == again and sessions._undated.cache_info().hits >= 1
    other_day = pi_chat({"role": "user", "content": "fix it"}, system=system.replace("12-03", "12-04"))
    assert read("POST", "/v1/chat/completions", [], other_day).session == first
    sessions._undated.cache_clear()
    assert read("POST", "/v1/chat/completions", [], body).session == first      # afresh: the same
    big = system + " pad" * (sessions.UNDATED_MEMO_CHARS // 4)
    sessions._undated.cache_clear()
    read("POST", "/v1/chat/completions", [], pi_chat({"role": "user", "content": "fix it"}, system=big))
    assert sessions._undated.cache_info().currsize == 0


def test_fingerprint_ignores_cache_control_moves_block_vs_string_and_billing_line():
    one = cc_body(line=True, tools=True)
    one["system"][0] = billing(" cc_prev_req=req_1;")
    two = cc_body(line=True, tools=True, history=True)
    two["system"][0] = billing(" cc_prev_req=req_2;")
    two["system"][1].pop("cache_control")
    two["messages"][0]["content"][0]["cache_control"] = {"type": "ephemeral"}
    two["messages"].append({"role": "system", "content": "mid-conversation note"})
    three = cc_body(line=False, history=True, system="You are Claude Code.")
    three["messages"][0]["content"] = "fix the bug"
    fps = {cc(b, session=None).session for b in (one, two, three)}
    assert len(fps) == 1 and next(iter(fps)).startswith("fp:")


def test_fingerprint_of_responses_input():
    url = "https://opencode.ai/zen/v1/responses"
    b1 = {"model": "gpt-5", "instructions": "be pi", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
    b2 = {"model": "gpt-5", "instructions": "be pi", "input": [{"role": "user", "content": "hi"},
          {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
          {"role": "user", "content": "more"}]}
    f1, f2 = read("POST", url, [], enc(b1)), read("POST", url, [], enc(b2))
    assert f1.session == f2.session and (f1.turn, f2.turn) == (facts.OPENING, facts.CONTINUATION)
    assert read("POST", url, [], enc({"model": "m", "input": "hi", "instructions": "be pi"})).session == f1.session


def test_no_system_and_no_user_message_means_no_session():
    f = read("POST", "/v1/chat/completions", [], enc({"model": "m", "messages": [{"role": "assistant", "content": "x"}]}))
    assert (f.session, f.session_source, f.parsed) == (None, None, True)
    f = read("POST", "/v1/messages", [], enc({"model": "m", "messages": []}))
    assert f.session is None


def test_pi_responses_session_header_and_prompt_cache_key():
    h = [("session_id", "pi-sess-1"), ("x-client-request-id", "pi-sess-1")]
    body = {"model": "gpt-5", "input": [{"role": "user", "content": "hi"}], "prompt_cache_key": "pi-sess-1"}
    f = read("POST", "https://opencode.ai/zen/v1/responses", h, enc(body))
    assert (f.session, f.session_source) == ("pi-sess-1", "header:session_id")


def test_generic_session_headers_for_an_unknown_agent():
    f = read("POST", "/v1/chat/completions", [("x-session-id", "abc")], pi_chat(U1, system="You are helpful."))
    assert (f.agent, f.session, f.session_source, f.turn) == (facts.UNKNOWN_AGENT, "abc", "header:x-session-id", facts.OPENING)


@pytest.mark.parametrize("system, agent", [
    ("You are an expert coding assistant operating inside pi, a coding agent harness.", facts.PI),  # pi 0.73.1
    ("You are a coding assistant running inside Pi.", facts.PI),                 # reworded
    ("Built on the pi-coding-agent SDK.", facts.PI),
    ("You are helpful. Think about api design.", facts.UNKNOWN_AGENT),
    ("Pipelines inside pipes.", facts.UNKNOWN_AGENT),
])
def test_pi_is_named_by_its_system_prompt_loosely(system, agent):
    f = read("POST", "/v1/chat/completions", [("user-agent", "OpenAI/JS 6.26.0")], pi_chat(U1, system=system))
    assert f.agent == agent


@pytest.mark.parametrize("bad", ["", "   ", "fp:0123", "x" * 300, "a\tb", "a\x00b"])
def test_a_client_id_that_could_pass_for_a_fingerprint_or_is_odd_is_not_taken(bad):
    f = read("POST", "/v1/chat/completions", [("x-session-id", bad)], pi_chat(U1))
    assert f.session_source == "fingerprint"


# ---------------------------------------------------------------- encodings


@pytest.mark.parametrize(
    "encoding,compress",
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("br", brotli.compress),
        ("zstd", zstd.compress),
        ("identity", lambda d: d),
        ("gzip, zstd", lambda d: zstd.compress(gzip.compress(d))),
        ("ZSTD", zstd.compress),
    ],
)
def test_decoded_encodings(encoding, compress):
    f = read("POST", MESSAGES, [("User-Agent", CC_UA), ("content-encoding", encoding)], compress(enc(cc_body(history=True))))
    assert (f.parsed, f.turn, f.model) == (True, facts.CONTINUATION, "claude-sonnet-4-5"), f.reason


def test_raw_deflate():
    c = zlib.compressobj(wbits=-15)
    data = c.compress(enc(cc_body())) + c.flush()
    assert read("POST", MESSAGES, [("User-Agent", CC_UA)], data, "deflate").turn == facts.OPENING


def test_explicit_content_encoding_outranks_the_header():
    data = enc(cc_body())
    assert read("POST", MESSAGES, [("content-encoding", "zstd")], data, "identity").parsed
    assert read("POST", MESSAGES, [], zstd.compress(data), b"zstd").parsed


# ---------------------------------------------------------------- bad input


def _bad(body, encoding=None, headers=(), locate_model=False):
    return read("POST", MESSAGES, [("User-Agent", CC_UA), ("X-Claude-Code-Session-Id", CC_SID),
                                  ("x-claude-code-request-class", "main"), *headers], body, encoding,
                locate_model=locate_model)


@pytest.mark.parametrize(
    "body,encoding,reason",
    [
        (b"not json at all", None, "not JSON"),
        (enc(cc_body())[:-40], None, "not JSON: truncated"),
        (b"", None, "empty body"),
        (None, None, "no body"),
        (b"[1, 2]", None, "body is not a JSON object"),
        (b'"a string"', None, "body is not a JSON object"),
        (b'{"model": "m", "messages": "hello"}', None, "wrong shape: messages"),
        (b'{"model": 5, "stream": "yes", "messages": [{"role": 1}]}', None, "wrong shape: model, stream, messages"),
        (b'{"system": {"a": 1}, "messages": []}', None, "wrong shape: system"),
        (b"{}", "compress", "unknown content-encoding 'compress'"),
        (b"\x00garbage", "gzip", "bad gzip body"),
        (gzip.compress(enc(cc_body()))[:-30], "gzip", "bad gzip body"),
        (zstd.compress(enc(cc_body()))[:-10], "zstd", "bad zstd body"),
        (b"garbage", "br", "bad br body"),
        (b"\xff\xfe{}", None, "not JSON"),
        (b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "not JSON: nested too deeply"),
        (b'{"messages":[{"role":"user","content":' + b"[" * 100_000 + b"]" * 100_000 + b"}]}", None,
         "not JSON: nested too deeply"),
        (b"{\"model\": \"\xff\"}", None, "not JSON"),
    ],
)
@pytest.mark.parametrize("locate_model", [False, True], ids=["typed", "members"])
def test_bad_body_gives_unparsed_facts_with_the_header_facts(body, encoding, reason, locate_model):
    f = _bad(body, encoding, locate_model=locate_model)
    assert (f.parsed, f.reason, f.turn) == (False, reason, facts.UNKNOWN_TURN)
    assert (f.api, f.agent, f.session) == (facts.ANTHROPIC_MESSAGES, facts.CLAUDE_CODE, CC_SID)


def test_a_wrong_field_does_not_hide_the_others():
    body = cc_body()
    body["stream"] = "yes"
    f = _bad(enc(body))
    assert (f.parsed, f.reason, f.model, f.turn) == (False, "wrong shape: stream", "claude-sonnet-4-5", facts.UNKNOWN_TURN)
    f = read("POST", "/v1/chat/completions", [], enc(chat([U1], model=7)))
    assert not f.parsed and f.session_source == "fingerprint"  # the fingerprint's parts were readable


def test_header_decided_turns_survive_an_unreadable_body():
    f = read("POST", MESSAGES, [("User-Agent", CC_UA), ("x-claude-code-request-class", "subagent")], b"{nope")
    assert (f.turn, f.parsed, f.reason) == (facts.SUBAGENT, False, "not JSON; request-class subagent")


def test_too_large(monkeypatch):
    monkeypatch.setattr(facts.encodings, "MAX_BODY", 1000)
    big = enc(cc_body()) + b" " * 2000
    assert _bad(big).reason == "too large"
    for encoding, compress in (("gzip", gzip.compress), ("zstd", zstd.compress), ("br", brotli.compress),
                               ("deflate", zlib.compress)):
        f = _bad(compress(big), encoding)
        assert (f.parsed, f.reason, f.session) == (False, "too large", CC_SID), encoding


def test_a_real_decompression_bomb_is_capped():
    bomb = zstd.compress(b"{" + b" " * (facts.MAX_BODY + 10))
    assert len(bomb) < 100_000
    assert _bad(bomb, "zstd").reason == "too large"


@pytest.mark.parametrize(
    "headers",
    [
        [(b"\xff\xfe", b"\xc3\x28"), (b"User-Agent", b"claude-cli/2 \xff")],
        [("user-agent", "claude-cli/2\udcff"), ("x-claude-code-session-id", "id\udcfe")],
        [(1, 2), ("a",), None, ("b", "c", "d")],
        "not headers",
        12,
        None,
        iter([("user-agent", CC_UA), 5]),
    ],
)
def test_garbled_headers_never_raise(headers):
    f = read("POST", MESSAGES, headers, enc(cc_body()))
    assert f.parsed and f.api == facts.ANTHROPIC_MESSAGES
    assert f.session is None or f.session.encode("utf-8")


def test_deeply_nested_headers_and_fields_do_not_raise():
    deep = "[" * 100_000
    f = read("POST", "/v1/responses", [("user-agent", "codex_cli_rs/1"), ("x-codex-turn-metadata", deep)],
             enc(codex_body()))
    assert (f.agent, f.parsed, f.turn) == (facts.CODEX, True, facts.OPENING)
    body = cc_body(user_id="{" + '"a":' * 50_000)
    assert cc(body, session=None).session_source == "fingerprint"
    big = b'{"model":"m","stream":' + b"[" * 100_000 + b"]" * 100_000 + b',"messages":[]}'
    f = read("POST", MESSAGES, [], big)
    assert (f.parsed, f.reason) == (False, "not JSON: nested too deeply")
    large = _LARGE[:-1] + b',"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    f = cc(large, "main")
    assert f.reason in ("not JSON: nested too deeply", "request-class main: assistant message in history")


def test_a_header_iterable_that_breaks_keeps_what_it_read():
    def gen():
        yield ("user-agent", CC_UA)
        raise RuntimeError("boom")

    assert read("POST", MESSAGES, gen(), enc(cc_body())).agent == facts.CLAUDE_CODE


def test_non_inference_has_no_session_or_turn():
    f = read("GET", "https://api.anthropic.com/api/claude_code/settings",
             [("User-Agent", CC_UA), ("x-claude-code-session-id", CC_SID)], None)
    assert (f.api, f.agent, f.session, f.turn, f.model, f.stream, f.parsed) == (
        facts.OTHER, facts.CLAUDE_CODE, None, None, None, None, True)


# ---------------------------------------------------------------- never raises


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.sampled_from(["model", "stream", "system", "messages", "input", "tools", "metadata", "role",
                         "content", "type", "text", "user_id", "instructions", "prompt_cache_key",
                         "previous_response_id", "x"]) | st.text(max_size=5), kids, max_size=5),
    max_leaves=25,
)
_SEEDS = [enc(cc_body(history=True, user_id="user_ab_account__session_x")), enc(codex_body(history=True)),
          pi_chat(U1, A1, T1)]
_header_part = st.binary(max_size=12) | st.text(max_size=12) | st.sampled_from(
    ["user-agent", "x-claude-code-session-id", "x-claude-code-request-class", "x-parent-session-id",
     "x-codex-turn-metadata", "x-openai-subagent", "content-encoding", "session_id", CC_UA, "main", "gzip", "zstd"])


@st.composite
def _mutated(draw):
    data = bytearray(draw(st.sampled_from(_SEEDS)))
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[i:]
        else:
            data[i:i] = draw(st.sampled_from([b"[", b"{", b'"', b",", b"null", b"\xff", b'{"role":"assistant"}']))
    return bytes(data)


def _check(f):
    assert isinstance(f, facts.Facts)
    assert not f.reason.startswith("internal error"), f.reason
    if f.api == facts.OTHER:
        assert f.turn is None and f.session is None
    else:
        assert f.turn in (facts.OPENING, facts.CONTINUATION, facts.SIDE, facts.SUBAGENT, facts.UNKNOWN_TURN)
    if f.session is not None:
        assert f.session.startswith("fp:") == (f.session_source == "fingerprint")
        f.session.encode("utf-8")
    msgspec.json.encode(f)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=st.sampled_from(["POST", "GET", b"POST", "post"]) | st.text(max_size=5),
    url=st.sampled_from([MESSAGES, "/v1/chat/completions", "/v1/responses", "/v1/messages/count_tokens"]) | st.text(max_size=20),
    headers=st.lists(st.tuples(_header_part, _header_part), max_size=6),
    body=st.none() | st.binary(max_size=64) | _json.map(lambda v: json.dumps(v).encode()) | _mutated()
    | st.tuples(st.sampled_from([b'{"x":', b'{"messages":[{"role":"user","content":', b"{\"stream\":", b""]),
                st.integers(1, 50_000), st.sampled_from([b"[", b'{"a":'])).map(lambda t: t[0] + t[2] * t[1]),
    encoding=st.none() | st.sampled_from(["gzip", "zstd", "br", "deflate", "identity", "x", "gzip,br", ""]),
)
def test_random_requests_never_raise(method, url, headers, body, encoding):
    _check(read(method, url, headers, body, encoding))


@settings(max_examples=200, deadline=None)
@given(body=_mutated(), request_class=st.sampled_from([None, "main", "subagent", "auxiliary", "compaction", "??"]),
       encoding=st.sampled_from(["gzip", "zstd", "br", "deflate"]))
def test_mutated_compressed_bodies_never_raise(body, request_class, encoding):
    compress = {"gzip": gzip.compress, "zstd": zstd.compress, "br": brotli.compress, "deflate": zlib.compress}[encoding]
    data = bytearray(compress(body))
    data[len(data) // 2] ^= 0x5A
    for candidate in (compress(body), bytes(data)):
        f = cc(candidate, request_class, extra=[("content-encoding", encoding)])
        _check(f)
        assert f.session == CC_SID


# ---------------------------------------------------------------- large bodies read in parts


def _pad_history(body: dict, key: str, n_bytes: int, item) -> dict:
    """The body with tool rounds appended until its array holds ~n_bytes."""
    body = json.loads(json.dumps(body))
    i = 0
    while len(json.dumps(body[key])) < n_bytes:
        body[key].extend(item(i))
        i += 1
    return body


def _anthropic_round(i):
    code = 'x = {"role": "assistant"}\n},{"role":"user"}]\\ "quoted" },{ é → ' * 40
    return [
        {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "Bash",
                                           "input": {"messages": [{"role": "user"}], "stream": True, "system": "s"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                      "content": [{"type": "text", "text": code}]}]},
    ]


def _chat_round(i):
    return [{"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function",
             "function": {"name": "bash", "arguments": '{"tools": [], "stream": false}'}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": "line },{ \"x\"\n" * 200}]


def _responses_round(i):
    return [{"type": "function_call", "name": "shell", "arguments": "{}", "call_id": f"c{i}"},
            {"type": "function_call_output", "call_id": f"c{i}", "output": "out },{\"role\":\"user\"} " * 150}]


def _variants():
    size = 300_000
    cc = cc_body(history=True, user_id=json.dumps({"session_id": "s1"}))
    cc["tools"][0]["input_schema"] = {"properties": {"stream": {"type": "boolean"}, "system": {}}}
    big_cc = _pad_history(cc, "messages", size, _anthropic_round)
    yield "claude-code", MESSAGES, [("User-Agent", CC_UA)], big_cc
    no_stream = dict(big_cc)
    no_stream.pop("stream")
    yield "claude-code no stream", MESSAGES, [("User-Agent", CC_UA)], no_stream
    reordered = {"messages": big_cc["messages"], "stream": True, "tools": big_cc["tools"],
                 "model": big_cc["model"], "system": big_cc["system"], "metadata": big_cc["metadata"]}
    yield "messages first", MESSAGES, [("User-Agent", CC_UA)], reordered
    opening = cc_body()
    opening["messages"][0]["content"].append({"type": "text", "text": "pasted },{ file " * 30_000})
    yield "large opening", MESSAGES, [("User-Agent", CC_UA), ("x-claude-code-request-class", "main")], opening
    chat_body = _pad_history(chat([U1]), "messages", size, _chat_round)
    yield "chat", "/v1/chat/completions", [], chat_body
    yield "chat no tools", "/v1/chat/completions", [], {k: v for k, v in chat_body.items() if k != "tools"}
    resp = _pad_history(codex_body(), "input", size, _responses_round)
    yield "responses", "/v1/responses", CODEX_H[:1], resp
    yield "responses prompt_cache_key", "/v1/responses", [], resp
    first_assistant = _pad_history(chat([A1, U1]), "messages", size, _chat_round)
    yield "assistant first", "/v1/chat/completions", [], first_assistant
    count = {"model": "m", "messages": big_cc["messages"], "tools": big_cc["tools"]}
    yield "count_tokens", "https://api.anthropic.com/v1/messages/count_tokens", [("User-Agent", CC_UA)], count


@pytest.mark.parametrize("indent", [None, 1])
@pytest.mark.parametrize("name,url,headers,body", list(_variants()), ids=lambda v: v if isinstance(v, str) and " " in v or v in ("claude-code", "chat", "responses", "count_tokens") else None)
def test_large_bodies_read_in_parts_agree_with_the_whole_body(monkeypatch, name, url, headers, body, indent):
    data = json.dumps(body, indent=indent, ensure_ascii=False).encode()
    assert len(data) >= facts.largebody.FAST_MIN
    fast_decoded = facts.largebody.fast_decode(data, facts._FLAVOUR[facts.api_of("POST", url)])
    assert fast_decoded is not None, "the large-body path fell back"
    fast = read("POST", url, headers, data)
    # the router's read of the parts alone (``read_parts``) says the same, span included
    assert facts.read_parts("POST", url, headers, data, objects=10**9) == fast
    monkeypatch.setattr(facts.largebody, "FAST_MIN", 1 << 62)
    whole = read("POST", url, headers, data)
    # the parts read also says where the model is, so a rename needs no second read
    if fast.model_span is not None:
        start, end = fast.model_span
        assert json.loads(data[start:end]) == fast.model
        assert rewrite.model_span(data) == fast.model_span
    assert msgspec.structs.replace(fast, model_span=None) == msgspec.structs.replace(whole, model_span=None)
    if whole.model_span is not None:      # the whole read finds it too, from its one decode
        assert rewrite.model_span(data) == whole.model_span
    assert whole.parsed


def test_large_body_with_a_bad_field_says_which():
    body = _pad_history(cc_body(history=True), "messages", 300_000, _anthropic_round)
    body["stream"] = "yes"
    f = cc(body)
    assert (f.parsed, f.reason, f.model, f.session) == (False, "wrong shape: stream", "claude-sonnet-4-5", CC_SID)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_large_mutated_bodies_never_raise(data):
    body = bytearray(_LARGE)
    for _ in range(data.draw(st.integers(1, 3))):
        if not body:
            break
        i = data.draw(st.integers(0, len(body) - 1))
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip":
            body[i] = data.draw(st.sampled_from(b'{}[],:"\\ax\xff'))
        elif op == "cut":
            del body[i:]
        else:
            body[i:i] = data.draw(st.sampled_from([b'"messages":[', b',"stream":true', b"}]", b'{"role":"assistant"}']))
    f = cc(bytes(body), "main")
    _check(f)
    assert f.session == CC_SID


_LARGE = json.dumps(_pad_history(cc_body(history=True), "messages", 300_000, _anthropic_round)).encode()


_ROUNDS = {"anthropic": _anthropic_round, "chat": _chat_round, "responses": _responses_round}


def _inference_recordings():
    for path in _fixtures():
        fx = json.loads(path.read_text())
        if fx["expect"]["api"] != facts.OTHER and isinstance(fx["body"], dict):
            yield path


@pytest.mark.parametrize("path", list(_inference_recordings()), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recordings_made_large_read_the_same_in_parts(monkeypatch, path):
    """Each recorded body, grown past FAST_MIN (more tool rounds; or, for an opening, a large
    first prompt), reads the same in parts as whole - on real key orders and item shapes."""
    fx = json.loads(path.read_text())
    api = facts.api_of(fx["method"], fx["url"])
    flavour = facts._FLAVOUR[api]
    key = "input" if flavour == "responses" else "messages"
    body = fx["body"]
    if not isinstance(body.get(key), list):
        pytest.skip(f"no {key} array")
    grown = _pad_history(body, key, facts.largebody.FAST_MIN, _ROUNDS[flavour])
    opening = json.loads(json.dumps(body))
    for item in opening[key]:
        if item.get("role") == "user":
            item["content"] = [{"type": "text", "text": "big },{ prompt " * 20_000}]
            break
    for variant in (grown, opening):
        data = msgspec.json.encode(variant)
        assert facts.largebody.fast_decode(data, flavour) is not None, "fell back"
        with monkeypatch.context() as m:
            fast = read(fx["method"], fx["url"], fx["headers"], data, "identity")
            parts = facts.read_parts(fx["method"], fx["url"], fx["headers"], data, objects=10**9)
            assert parts == (fast if len(data) >= facts.largebody.FAST_MIN else None)
            m.setattr(facts.largebody, "FAST_MIN", 1 << 62)
            whole = read(fx["method"], fx["url"], fx["headers"], data, "identity")
        assert msgspec.structs.replace(fast, model_span=None) == msgspec.structs.replace(whole, model_span=None)
    if whole.model_span is not None:      # the whole read finds it too, from its one decode
        assert rewrite.model_span(data) == whole.model_span
        if fast.model_span is not None:
            assert rewrite.model_span(data) == fast.model_span


@pytest.mark.parametrize("today, tomorrow", [
    ("Current date: 2026-11-30", "Current date: 2026-12-01"),                  # pi's last line
    ("Now: 2026-11-30T23:59:58Z.", "Now: 2026-12-01T00:00:03Z."),
    ("It is 11:59 PM on 11/30/2026.", "It is 9:02 AM on 12/01/2026."),
    ("Current date and time: Monday, November 30, 2026, 11:10:48 PM UTC",            # older pi
     "Current date and time: Tuesday, December 1, 2026, 02:10:48 AM UTC"),
    ("Today is 30 Nov 2026.", "Today is 1st Dec 2026."),
])
def test_a_conversation_continued_another_day_keeps_its_fingerprint(today, tomorrow):
    url = "https://opencode.ai/zen/go/v1/chat/completions"
    first = read("POST", url, [], pi_chat(U1, system=f"You are a coding assistant.\n{today}"))
    later = read("POST", url, [], pi_chat(U1, A1, T1, system=f"You are a coding assistant.\n{tomorrow}"))
    assert first.session == later.session and first.session.startswith("fp:")
    other = read("POST", url, [], pi_chat({"role": "user", "content": "another task"},
                                          system=f"You are a coding assistant.\n{today}"))
    assert other.session != first.session


def test_header_session_reads_a_non_inference_requests_session_from_headers_only():
    h = [("user-agent", "codex_exec/0.171.0"), ("session-id", "019a-sess"), ("upgrade", "websocket")]
    f = read("GET", "https://api.openai.com/v1/responses", h, None)
    assert (f.api, f.session) == (facts.OTHER, None)
    assert facts.header_session(f.agent, h) == "019a-sess"
    assert facts.header_session(facts.CODEX, [("upgrade", "websocket")]) is None
    assert facts.header_session(facts.CODEX, object()) is None   # garbage never raises


@pytest.mark.parametrize("header, too_large", [
    (None, False), ("0", False), ("113161", False), (str(facts.MAX_REQUEST_BODY), False),
    (str(facts.MAX_REQUEST_BODY + 1), True), (b"1048576", False), ("10, 10", False), (" 10 ", False),
    ("10, 11", True), ("", True), ("-1", True), ("1e9", True), ("0x10", True), ("١٠", True),
    ("9" * 40, True), ("12abc", True),
])
def test_body_too_large_from_the_content_length_alone(header, too_large):
    assert facts.body_too_large(header) is too_large


def test_the_request_limit_is_what_the_reader_reads():
    assert facts.MAX_REQUEST_BODY == facts.MAX_BODY == 64 * 1024 * 1024
    assert facts.body_too_large("2048", limit=1024) and not facts.body_too_large("1024", limit=1024)


def test_header_map_of_bytes_fields_reads_as_the_text_path():
    """Issue 22: mitmproxy's fields (bytes pairs) take a shorter path in ``header_map``; it
    gives what ``kinds.text`` gives: UTF-8, stripped, lower-case names, the first value of a
    name; bytes that are not UTF-8 (in a name or a value) as ``text`` shows them."""
    from sessionpin.reader.kinds import text
    fields = ((b"Host", b"api.example"), (b" User-Agent ", b" claude-cli/2.1 "), (b"X-A", b"1"), (b"x-a", b"2"),
              (b"x-bad-value", b"caf\xe9"), (b"x-bad-\xff", b"v"), (b"x-utf8", "é".encode()), (b"", b"empty"),
              ("x-str", "s"), (b"x-mixed", "m"))
    slow = {}
    for name, value in fields:
        key = text(name).strip().lower()
        if key and key not in slow:
            slow[key] = text(value).strip()
    assert facts.header_map(fields) == slow
    assert slow["x-bad-value"] == "caf\\xe9" and slow["user-agent"] == "claude-cli/2.1" and slow["x-a"] == "1"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.binary(max_size=6), st.sampled_from([b"X-A", b"x-a", b" x-a ", b"", b" "]),
                                    st.text(max_size=4)),
                          st.one_of(st.binary(max_size=6), st.text(max_size=4))), max_size=8))
@example([(b"X-A", b"1"), (b"x-a", b"2"), (b" x-a ", b" 3 ")])        # UTF-8 throughout: the first value kept
@example([(b"", b"v"), (b"x-a", b"1")])                               # an empty name dropped
@example([(b"x-a", b"caf\xe9"), (b"x-a", b"2")])                      # not UTF-8: shown as ``text`` shows it
def test_header_map_of_any_fields_is_the_text_paths(pairs):
    """Issue 22, fifteenth round: a tuple of fields is read in one comprehension when it can be
    (UTF-8 bytes pairs); whatever the fields hold, the map is the one ``kinds.text`` gives
    pair by pair: the first value of a name kept, an empty name dropped."""
    from sessionpin.reader.kinds import text
    slow: dict = {}
    for name, value in pairs:
        key = text(name).strip().lower()
        if key and key not in slow:
            slow[key] = text(value).strip()
    assert facts.header_map(tuple(pairs)) == slow


def test_a_model_span_the_parts_read_found_before_it_gave_up_is_not_kept(monkeypatch):
    """A second top-level model after the messages (same value) sends a large body to the
    whole read; the span the parts' read had found for the first must not survive it — a
    rename there would leave the last model, the one a server reads, unmapped."""
    monkeypatch.setattr(facts.largebody, "FAST_MIN", 0)
    data = (b'{"model":"claude-opus-4-5","messages":[{"role":"user","content":"' + b"x" * 2000
            + b'"}],"model":"claude-opus-4-5"}')
    f = read("POST", "https://api.anthropic.com/v1/messages", [("user-agent", "claude-cli/2")], data)
    assert f.model == "claude-opus-4-5" and f.model_span is None
    with pytest.raises(rewrite.ModelNotFound):
        rewrite.replace_model(data, f.model, "glm-4.6", f.model_span)


def test_a_body_read_field_by_field_says_where_the_model_is_from_that_decode():
    # metadata of the wrong type: the typed read fails, the raw members are decoded one by one
    data = b'{"model": "claude-opus-4-5", "messages": [{"role": "user", "content": "hi"}], "metadata": 7}'
    f = read("POST", "https://api.anthropic.com/v1/messages", [("user-agent", "claude-cli/2")], data)
    assert data[slice(*f.model_span)] == b'"claude-opus-4-5"'


@pytest.mark.parametrize("path", list(_inference_recordings()), ids=lambda p: f"{p.parent.name}/{p.stem}")
@pytest.mark.parametrize("layout", [(",", ":"), (", ", ": "), None], ids=["compact", "python", "indented"])
def test_recordings_read_as_members_say_the_same_and_where_the_model_is(path, layout):
    """``locate_model`` (a config with a model map): a Claude Code or OpenCode body read as raw
    members then each field gives the same facts as the typed read, and the span the rename
    would find; the others are read typed, as without a model map."""
    fx = json.loads(path.read_text())
    data = (json.dumps(fx["body"], indent=1) if layout is None
            else json.dumps(fx["body"], separators=layout, ensure_ascii=False)).encode()
    typed = read(fx["method"], fx["url"], fx["headers"], data, "identity")
    members = read(fx["method"], fx["url"], fx["headers"], data, "identity", locate_model=True)
    assert msgspec.structs.replace(members, model_span=None) == msgspec.structs.replace(typed, model_span=None)
    if members.agent in (facts.CLAUDE_CODE, facts.OPENCODE) and members.model is not None and typed.model_span is None:
        assert members.model_span == rewrite.model_span(data)     # their bodies are mostly tools: found here
    elif typed.model_span is None:
        assert members.model_span is None                          # Codex's, pi's: by the rename, if one comes


def test_read_parts_tells_only_what_its_parts_tell_within_its_bound():
    """``read_parts`` (the router's read of a large body on its event loop): None for a body
    below the parts' threshold, one whose parts do not tell its facts (no answer among its
    first messages), or one whose parts would build more objects than its bound; else the
    facts ``read`` gives."""
    item = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}
    answer = {"role": "assistant", "content": "a"}
    url, h = "https://api.anthropic.com/v1/messages", [("User-Agent", CC_UA)]

    def data(messages, **more):
        return json.dumps({"model": "claude-opus-4-1", "messages": messages, **more}).encode()
    small = data([{"role": "user", "content": "hi"}, answer])
    assert facts.read_parts("POST", url, h, small, objects=10**9) is None
    told = data([{"role": "user", "content": "hi"}, answer] + [item] * 5_000)
    assert len(told) >= facts.largebody.FAST_MIN and told.count(b"{") > 10_000
    assert facts.read_parts("POST", url, h, told, objects=10) == read("POST", url, h, told)
    untold = data([item] * 5_000 + [answer])          # its first answer past the first items
    assert facts.read_parts("POST", url, h, untold, objects=10**9) is None
    system = [{"type": "text", "text": "s"}] * 30
    held = data([{"role": "user", "content": "hi"}, answer] + [item] * 5_000, system=system)
    assert facts.read_parts("POST", url, h, held, objects=30) == read("POST", url, h, held)
    assert facts.read_parts("POST", url, h, held, objects=29) is None
    assert facts.read_parts("POST", url, h, b"{" + told[1:-1], objects=10**9) is None     # not JSON


def test_read_parts_counts_no_objects_in_a_string_whatever_braces_it_holds():
    """A string decodes to one ``str``: an opening of one long text full of braces (pasted
    code, JSON) is read by its parts within the bound, and its braces are not counted byte by
    byte; the same braces as objects (blocks) still count."""
    url, h = "https://api.anthropic.com/v1/messages", [("User-Agent", CC_UA)]
    text = "function f() { return {a: 1}; }\n" * 12_000            # 24,000 braces in one string
    opening = json.dumps({"model": "claude-opus-4-1", "messages": [{"role": "user", "content": text}],
                          "system": text}).encode()
    assert len(opening) >= facts.largebody.FAST_MIN and opening.count(b"{") > 40_000
    assert facts.read_parts("POST", url, h, opening, objects=20_000) == read("POST", url, h, opening)
    blocks = [{"type": "text", "text": "x"}] * 21_000
    as_objects = json.dumps({"model": "claude-opus-4-1", "messages": [{"role": "user", "content": blocks}],
                             "system": "s" * 300_000}).encode()
    assert len(as_objects) >= facts.largebody.FAST_MIN
    assert facts.read_parts("POST", url, h, as_objects, objects=20_000) is None
    assert facts.read_parts("POST", url, h, as_objects, objects=21_000) == read("POST", url, h, as_objects)


def test_read_parts_of_a_mangled_large_body_is_none_or_what_read_says():
    """Large bodies mangled at random (brackets, quotes, commas, a second model or system, bytes
    cut or swapped): the parts' read either declines or says what ``read`` says. Seeded."""
    import random
    rnd = random.Random(7)
    one = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok " * 20}]}
    base = json.dumps({"model": "claude-opus-4-1", "messages": [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "a"}] + [one] * 3_000, "system": "s",
                       "metadata": {"user_id": "u"}, "stream": True}, separators=(",", ":")).encode()
    assert len(base) >= facts.largebody.FAST_MIN
    url, h = "https://api.anthropic.com/v1/messages", [("User-Agent", CC_UA), ("x-claude-code-session-id", "s-1")]
    told = 0
    for _ in range(150):
        b = bytearray(base)
        for _ in range(rnd.randint(1, 4)):
            op, at = rnd.random(), rnd.randrange(len(b))
            if op < 0.3:
                b[at:at + 1] = rnd.choice([b"{", b"}", b"[", b"]", b",", b'"', b":", b" ", b"\\", b'"model":"x",'])
            elif op < 0.5:
                del b[at:at + rnd.randint(1, 50)]
            elif op < 0.7:
                b[at:at] = rnd.choice([b',"model":"y"', b',"system":"s"', b'{"a":1}', b"  ", b',"messages":[]'])
            else:
                j = rnd.randrange(len(b))
                b[at:at + 10], b[j:j + 10] = b[j:j + 10], b[at:at + 10]
        data = bytes(b)
        got = facts.read_parts("POST", url, h, data, api=facts.ANTHROPIC_MESSAGES, objects=20_000)
        if got is not None:
            told += 1
            assert got == read("POST", url, h, data, None, api=facts.ANTHROPIC_MESSAGES, locate_model=True)
    assert told > 50, "most mangled bodies keep their head, first messages and tail readable"


def _cc_headers(*sessions):
    return tuple([(b"user-agent", b"claude-cli/2.1.332 (external, cli)"), (b"content-type", b"application/json")]
                 + [(b"x-claude-code-session-id", v) for v in sessions])


_CC_BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "metadata": {"user_id": json.dumps({"session_id": "s-body"})}}).encode()


@pytest.mark.parametrize("sessions, conflict", [
    ((b"s-1",), ""),
    ((b"s-1", b"s-1"), ""),                      # the same value twice: one session
    ((b"s-1", b" s-1 "), ""),
    ((b"s-1", b"s-2"), "the x-claude-code-session-id header is sent 2 times with different values"),
    ((b"s-2", b"s-1", b"s-3"), "the x-claude-code-session-id header is sent 3 times with different values"),
    ((b"", b"s-2"), ""),                         # the first is empty: the session is the body's, not a header's
    ((b"s-1", b""), ""),                         # an empty value names nothing
])
def test_a_session_header_sent_twice_apart_is_a_conflict(sessions, conflict):
    f = facts.read("POST", "/v1/messages", _cc_headers(*sessions), _CC_BODY, api=facts.ANTHROPIC_MESSAGES)
    assert f.conflict == conflict
    as_lists = [list(p) for p in _cc_headers(*sessions)]      # as the body reader's process gets them
    assert facts.read("POST", "/v1/messages", as_lists, _CC_BODY, api=facts.ANTHROPIC_MESSAGES).conflict == conflict


def test_a_codex_upgrade_naming_two_sessions_is_a_conflict():
    h = ((b"user-agent", b"codex_cli_rs/0.171.0"), (b"session-id", b"a"), (b"session-id", b"b"))
    assert facts.read_upgrade("/v1/responses", h).conflict.startswith("the session-id header is sent 2 times")


@pytest.mark.parametrize("agent, name, value, why", [
    (b"claude-cli/2.1.332 (external, cli)", b"x-claude-code-session-id", b"x" * 300, "longer than 256 characters"),
    (b"claude-cli/2.1.332 (external, cli)", b"x-claude-code-session-id", b"fp:" + b"0" * 32, "fingerprint"),
    (b"opencode/1.18.33", b"x-opencode-session", b"y" * 300, "longer than 256 characters"),
    (b"opencode/1.18.33", b"x-parent-session-id", b"fp:1", "fingerprint"),
    (b"codex_cli_rs/0.171.0", b"session-id", b"z" * 300, "longer than 256 characters"),
])
def test_an_agents_own_session_header_that_holds_no_usable_id_is_a_conflict(agent, name, value, why):
    """The session is then read elsewhere (the body, the fingerprint): a pinned conversation's
    turn would be read as another conversation's."""
    h = ((b"user-agent", agent), (name, value))
    f = facts.read("POST", "/v1/messages", h, _CC_BODY, api=facts.ANTHROPIC_MESSAGES)
    assert f.conflict.startswith(f"the {name.decode()} header is not a usable session id") and why in f.conflict


def test_a_generic_header_that_holds_no_usable_id_is_not_the_agents_own():
    h = ((b"user-agent", b"claude-cli/2.1.332 (external, cli)"), (b"x-session-id", b"x" * 300))
    assert facts.read("POST", "/v1/messages", h, _CC_BODY, api=facts.ANTHROPIC_MESSAGES).conflict == ""
