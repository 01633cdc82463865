"""Identification headers that contradict themselves, end to end.

The rig of ``test_unnamed_paths_e2e`` (a real ``mitmdump``, real TLS, fakes ``a`` — the origin
the agents address — and ``b``). Claude Code names its conversation in ``X-Claude-Code-Session-Id``;
a request that sends that header twice with different values names two conversations, and
sessionpin cannot tell which one it is. It took the first value and followed that session's pin:
a turn of a conversation pinned to ``b`` (its history, its key) went to ``a`` because another
session, pinned there, was named first. It is refused (400, naming the header), sent nowhere,
and no pin is written or moved; the same value twice is one session, as before.
"""

from __future__ import annotations

import uuid

import pytest

from .test_router_e2e import SESSION_HEADER, cc
from .test_unnamed_paths_e2e import _default_config, claude_code_pinned_to_b, rig  # noqa: F401 (its rig, reset)


def claude_code_pinned_to_a(rig) -> str:  # noqa: F811
    rig.use(current="a")
    session = str(uuid.uuid4())
    op = cc("opening", session, stream=False)
    reply, got = rig.send(op.method, rig.a.origin + op.path, op.headers, op.body)
    assert reply.status == 200 and got == {"a": ["/v1/messages?beta=true"]}, (reply.status, got)
    rig.use()
    return session


def with_sessions(headers, *sessions: str) -> list[tuple[str, str]]:
    out = [(k, v) for k, v in headers if k.lower() != SESSION_HEADER.lower()]
    return out + [(SESSION_HEADER, s) for s in sessions]



@pytest.mark.parametrize("order", ["other-first", "own-first"])
def test_a_session_header_sent_twice_with_different_values_is_refused_and_sent_nowhere(rig, order):  # noqa: F811
    on_b, on_a = claude_code_pinned_to_b(rig), claude_code_pinned_to_a(rig)
    own, other = (on_b, on_a)
    cont = cc("continuation", own, stream=False)
    names = (other, own) if order == "other-first" else (own, other)
    reply, got = rig.send("POST", rig.a.origin + "/v1/messages?beta=true", with_sessions(cont.headers, *names),
                          cont.body)
    assert (reply.status, got) == (400, {}), (order, reply.status, got, reply.text[:300])
    assert reply.json()["type"] == "error" and "x-claude-code-session-id" in reply.text.lower()
    # the conversation itself goes on where it is pinned
    reply, got = rig.send("POST", rig.a.origin + "/v1/messages?beta=true", cont.headers, cont.body)
    assert reply.status == 200 and got == {"b": ["/v1/messages?beta=true"]}, (reply.status, got)


def test_the_same_session_twice_is_one_session(rig):  # noqa: F811
    session = claude_code_pinned_to_b(rig)
    cont = cc("continuation", session, stream=False)
    reply, got = rig.send("POST", rig.a.origin + "/v1/messages?beta=true",
                          with_sessions(cont.headers, session, " " + session), cont.body)
    assert reply.status == 200 and got == {"b": ["/v1/messages?beta=true"]}, (reply.status, got, reply.text[:300])


def test_a_codex_upgrade_naming_two_threads_sessions_is_refused_and_sent_nowhere(rig):  # noqa: F811
    from .test_unnamed_paths_e2e import UPGRADE, codex_headers, codex_pinned_to_b
    session, other = codex_pinned_to_b(rig), str(uuid.uuid4())
    headers = codex_headers(other) + [("session-id", session)] + UPGRADE
    reply, got = rig.send("GET", rig.a.origin + "/v1/responses", headers, b"")
    assert got == {} and reply.status in (400, 426), (reply.status, got, reply.text[:300])
    assert "session-id" in reply.text


def test_a_conversation_pinned_by_one_agent_named_by_a_request_read_as_another_is_refused(rig):  # noqa: F811
    """opencode's and pi's Claude Pro/Max providers send Claude Code's User-Agent (``claude-cli/…``)
    to api.anthropic.com: opencode's conversation, pinned to b from the gateway, switched to
    such a model, names its session (``x-session-id: ses_…``) in a request read as Claude Code's.
    The pin was another agent's, so the request was left alone and went to a, with the
    conversation's history. Now it is refused (424 naming the session, both agents and the
    server), sent nowhere; the pin is unchanged and opencode's own next turn still goes to b."""
    from .test_unnamed_paths_e2e import opencode_chat
    import json
    s = "ses_" + uuid.uuid4().hex[:26]
    h, body = opencode_chat(s, history=False)
    h = [(k, v) for k, v in h if k != "x-opencode-session"] + [("x-session-id", s), ("x-session-affinity", s)]
    reply, got = rig.send("POST", rig.a.origin + "/v1/chat/completions", h, body)
    assert reply.status == 200 and got == {"b": ["/v1/chat/completions"]}, (reply.status, got)
    spoofed = [("content-type", "application/json"), ("user-agent", "claude-cli/2.1.2 (external, cli)"),
               ("x-app", "cli"), ("authorization", "Bearer sk-ant-oat01-CLIENT"), ("x-session-id", s),
               ("x-session-affinity", s)]
    msgs = {"model": "claude-sonnet-4-5", "max_tokens": 100, "stream": False,
            "system": "You are Claude Code, Anthropic's official CLI for Claude.",
            "messages": [{"role": "user", "content": f"fix the test {s}"}, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "more"}]}
    reply, got = rig.send("POST", rig.a.origin + "/v1/messages", spoofed, json.dumps(msgs).encode())
    assert (reply.status, got) == (424, {}), (reply.status, got, reply.text[:300])
    assert "opencode" in reply.text and "'b'" in reply.text and s[-8:] in reply.text, reply.text[:400]
    h, body = opencode_chat(s, history=True)
    h = [(k, v) for k, v in h if k != "x-opencode-session"] + [("x-session-id", s)]
    reply, got = rig.send("POST", rig.a.origin + "/v1/chat/completions", h, body)
    assert reply.status == 200 and got == {"b": ["/v1/chat/completions"]}, (reply.status, got)


@pytest.mark.parametrize("bad", ["x" * 10240, "fp:" + "0" * 32], ids=["10KB", "fingerprint-like"])
def test_a_session_header_that_holds_no_usable_id_is_refused_not_read_as_another_conversation(rig, bad):  # noqa: F811
    """Claude Code's conversation pinned to b, its agent's current server now a. Its count_tokens
    (the whole history, no metadata) with the session header garbled — 10 KB, or an id shaped
    like sessionpin's fingerprint — was read as a conversation keyed by the fingerprint: a side
    request with no pin, sent to the current server a. It is refused (400 naming the header)."""
    import json
    session = claude_code_pinned_to_b(rig)
    rig.use(current="a")
    body = json.loads(cc("continuation", session, stream=False).body)
    count = json.dumps({"model": body["model"], "messages": body["messages"], "tools": body["tools"]}).encode()
    headers = with_sessions(cc("count_tokens", session, stream=False).headers, bad)
    reply, got = rig.send("POST", rig.a.origin + "/v1/messages/count_tokens?beta=true", headers, count)
    assert (reply.status, got) == (400, {}), (reply.status, got, reply.text[:300])
    assert "x-claude-code-session-id header is not a usable session id" in reply.text
    # with its header as the agent sends it, it follows its pin
    reply, got = rig.send("POST", rig.a.origin + "/v1/messages/count_tokens?beta=true",
                          with_sessions(headers, session), count)
    assert reply.status == 200 and got == {"b": ["/v1/messages/count_tokens?beta=true"]}, (reply.status, got)
