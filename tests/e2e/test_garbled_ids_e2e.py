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
