"""The body reader's process side: the same facts as ``facts.read``, over its framed pipe protocol."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import msgspec
import pytest

from sessionpin.decision import bodyreader as B
from sessionpin.reader import facts as F

URL = "https://api.anthropic.com/v1/messages?beta=true"
HEADERS = [(b"user-agent", b"claude-cli/2.1.332 (external, cli)"), (b"x-claude-code-request-class", b"main"),
           (b"x-claude-code-session-id", b"abcd1234-0000-4000-8000-000000000001")]


def tiny(n: int, answer: bool = True) -> bytes:
    """A history of ``n`` tiny user messages before its first answer (issue 20's shape)."""
    one = b'{"role":"user","content":"x"},'
    tail = b'{"role":"assistant","content":"ok"},{"role":"user","content":"more"}' if answer else b'{"role":"user","content":"y"}'
    return (b'{"model":"claude-opus-4-5","stream":true,"system":"You are Claude Code.","messages":['
            + one * n + tail + b'],"tools":[{"name":"Bash"}]}')


def ask(*requests: tuple[bytes, str]) -> list[F.Facts]:
    inp = io.BytesIO(b"".join(B.request_head("POST", URL, HEADERS, enc, None, len(body)) + body
                              for body, enc in requests))
    out = io.BytesIO()
    B.serve(inp, out)
    return answers(out.getvalue(), B.decode_answer)


def answers(data: bytes, decode) -> list:
    """The framed answers ``serve`` wrote, decoded."""
    got = []
    while data:
        n = int.from_bytes(data[:B.HEAD_LEN], "big")
        got.append(decode(data[B.HEAD_LEN:B.HEAD_LEN + n]))
        data = data[B.HEAD_LEN + n:]
    return got


@pytest.mark.parametrize("body", [
    tiny(3), tiny(40_000), tiny(40_000, answer=False), b"not json", b"",
    json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    b'{"model":"m","messages":[{"role":"user","content":' + b"[" * 5000 + b"]" * 5000 + b"}]}",
])
def test_the_facts_are_those_of_the_reader(body):
    got, = ask((body, ""))
    want = F.read("POST", URL, HEADERS, body, "", api=None)
    assert got == want or (want.model_span is None and got == msgspec.structs.replace(want, model_span=got.model_span))


def test_requests_follow_each_other_on_one_pipe_and_the_end_of_input_ends_it():
    import gzip
    big = tiny(40_000)
    got = ask((big, "gzip"), (tiny(2, answer=False), ""), (gzip.compress(big), "gzip"))
    assert [f.turn for f in got] == ["unknown", "opening", "continuation"]
    assert not got[0].parsed and got[2].parsed and got[2].has_history


def test_a_model_span_the_reader_missed_is_found_so_a_rename_reads_nothing_again(monkeypatch):
    body = tiny(300)
    monkeypatch.setattr(F, "read", lambda *a, **k: F.Facts(api=F.ANTHROPIC_MESSAGES, agent=F.CLAUDE_CODE,
                                                           model="claude-opus-4-5"))
    f = B.facts_of("POST", URL, HEADERS, body, "", None)
    assert body[slice(*f.model_span)] == b'"claude-opus-4-5"'


def test_a_broken_request_ends_the_process_without_an_answer():
    out = io.BytesIO()
    B.serve(io.BytesIO(b"\x00\x00\x00\x03abc"), out)             # cut short
    B.serve(io.BytesIO(b"\xff\xff\xff\xff" + b"x" * 10), out)     # a head over the bound
    assert out.getvalue() == b""


def test_it_runs_as_a_module():
    body = tiny(5)
    proc = subprocess.run([sys.executable, "-m", "sessionpin.decision.bodyreader"], capture_output=True, timeout=60,
                          input=B.request_head("POST", URL, HEADERS, "", None, len(body)) + body)
    assert proc.returncode == 0 and proc.stderr == b""
    assert B.decode_answer(proc.stdout[B.HEAD_LEN:]).turn == "continuation"


def test_a_shape_is_promptshapes_up_to_a_bound_of_messages():
    from sessionpin.reader import promptshape
    for body in (tiny(3), tiny(1000), b"garbage"):
        inp = io.BytesIO(B.request_head("", "", [], "", F.ANTHROPIC_MESSAGES, len(body), B.SHAPE) + body)
        out = io.BytesIO()
        B.serve(inp, out)
        assert B.decode_shape(out.getvalue()[B.HEAD_LEN:]) == promptshape.shape(body, F.ANTHROPIC_MESSAGES)
    assert B.shape_of(tiny(B.MAX_SHAPE_ITEMS), F.ANTHROPIC_MESSAGES, "") is None     # one more than the bound
    assert len(B.shape_of(tiny(B.MAX_SHAPE_ITEMS - 2), F.ANTHROPIC_MESSAGES, "").messages) == B.MAX_SHAPE_ITEMS


def test_the_shapes_of_one_conversations_turns_reuse_the_digests_of_the_messages_sent_again(monkeypatch):
    """Issue 22: each turn of a conversation sends its whole history again; the process keeps
    the digests it worked out (as the ledger does in the proxy), so a turn digests only its new
    messages — and its shape is the one worked out afresh."""
    from sessionpin.reader import promptshape
    digests = []
    real = promptshape._digest
    monkeypatch.setattr(promptshape, "_digest",
                        lambda raw, message=False, **kw: digests.append(message) or real(raw, message, **kw))
    first = tiny(300)
    second = first.replace(b'{"role":"user","content":"more"}]',
                           b'{"role":"user","content":"more"},{"role":"assistant","content":"sure"}]')
    assert second != first
    bodies = (first, second, b"garbage", first)
    inp = io.BytesIO(b"".join(B.request_head("", "", [], "", F.ANTHROPIC_MESSAGES, len(b), B.SHAPE) + b
                              for b in bodies))
    out = io.BytesIO()
    B.serve(inp, out)
    shapes = answers(out.getvalue(), B.decode_shape)
    monkeypatch.setattr(promptshape, "_digest", real)
    assert shapes == [promptshape.shape(b, F.ANTHROPIC_MESSAGES) for b in bodies]
    # the first turn's messages: 300 tiny ones alike, "ok" and "more"; the second: only "sure" is new
    assert digests.count(True) == 3 + 1


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd (Linux only)")
def test_with_a_shared_file_the_body_is_read_from_it_and_a_length_it_has_not_ends_the_process():
    """``--shared FD``: the pipe carries the heads only, each body is at the start of the
    file; a request saying more bytes than the file holds (or an absurd length) gets no answer
    and ends the process, as a body cut short on the pipe does."""
    fd = os.memfd_create("test-body")
    try:
        body = tiny(500)
        os.pwrite(fd, body, 0)
        out = io.BytesIO()
        B.serve(io.BytesIO(B.request_head("POST", URL, HEADERS, "", None, len(body)) * 2), out, shared=fd)
        got = answers(out.getvalue(), B.decode_answer)
        want = F.read("POST", URL, HEADERS, body, "")
        assert len(got) == 2 and all((a.turn, a.session, a.parsed) == (want.turn, want.session, want.parsed)
                                      for a in got)
        for n in (len(body) + 1, B.MAX_SHARED + 1, 2 ** 63):
            out = io.BytesIO()
            B.serve(io.BytesIO(B.request_head("POST", URL, HEADERS, "", None, n)), out, shared=fd)
            assert out.getvalue() == b""
    finally:
        os.close(fd)


def test_a_turns_top_level_is_read_with_the_history_it_repeats_stood_in_for():
    """Issue 22: the process's prompt shape decoded each body's whole top level (the history
    skimmed in C: 276 of 516 µs for a 1 MB Claude Code turn). A kept messages array's items the
    next turn repeats (all, or all but the one whose cache mark moved) are stood in for, so
    only the new messages and the members around them are decoded — and each turn's shape is
    the one worked out afresh, a body that is not JSON included."""
    from sessionpin.reader import knownvalues, promptshape, wire
    messages = [{"role": "user", "content": "fix the test"}]
    for i in range(300):
        messages += [{"role": "assistant", "content": [{"type": "text", "text": f"step {i} " + "y" * 400}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "x" * 400}]}]

    def body(msgs) -> bytes:
        return json.dumps({"model": "claude-opus-4-5", "messages": msgs, "system": "s", "tools": [{"name": "Bash"}],
                           "stream": True}, separators=(",", ":")).encode()

    grown = json.loads(json.dumps(messages))
    grown[-1]["content"][0]["cache_control"] = {"type": "ephemeral"}      # the mark moved
    grown += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "and now?"}]
    first, second = body(messages), body(grown)
    bad = second[:-40] + b"{{" + second[-38:]
    saved = list(knownvalues._known)
    try:
        knownvalues._known.clear()
        seen, runs = {}, promptshape.Runs()
        for b in (first, second, bad, second):
            wire.STEPS.n = 0
            got = B.shape_of(b, F.ANTHROPIC_MESSAGES, "", seen, runs)
            steps = wire.STEPS.n
            assert got == promptshape.shape(b, F.ANTHROPIC_MESSAGES), b[-60:]
            if b is second:
                assert got is not None and steps < len(second) // 4, steps
        assert B.shape_of(bad, F.ANTHROPIC_MESSAGES, "", seen, runs) is None
    finally:
        knownvalues._known[:] = saved
