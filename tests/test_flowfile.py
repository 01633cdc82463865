"""The pure flow-file reader, against files written by the real mitmdump and by hand."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sessionpin import facts, flowfile

try:
    from compression import zstd
except ImportError:
    from backports import zstd

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = Path(__file__).parent / "fixtures" / "flows" / "sample.flow"
MITMDUMP = Path(sys.executable).parent / "mitmdump"

# An addon that answers every request itself, so nothing leaves the machine.
ANSWER = """
from mitmproxy import http
def request(flow):
    flow.response = http.Response.make(200, b"{}", {"content-type": "application/json"})
"""

CC_BODY = json.dumps({
    "model": "claude-sonnet-4-5", "stream": True,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cc_entrypoint=cli;"},
               {"type": "text", "text": "You are Claude Code."}],
    "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "Bash"}],
}).encode()
CODEX_BODY = json.dumps({
    "model": "gpt-5-codex", "stream": True, "instructions": "x",
    "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
              {"type": "function_call", "name": "shell", "arguments": "{}", "call_id": "c"}],
}).encode()

# (method, path, headers, body) sent through the proxy, in order.


def gzip_as_recorded(data: bytes) -> bytes:
    """gzip bytes as the committed sample holds them (written with Python 3.13): the header's
    OS byte is 255 from Python 3.13 on and 3 before, the rest is the same."""
    out = bytearray(gzip.compress(data, mtime=0))
    out[9] = 0xFF
    return bytes(out)

REQUESTS = [
    ("POST", "/v1/messages?beta=true", [(b"User-Agent", b"claude-cli/2.1.332 (external, cli)"),
                                        (b"X-Claude-Code-Session-Id", b"sess-1"),
                                        (b"x-claude-code-request-class", b"main"),
                                        (b"content-type", b"application/json")], CC_BODY),
    ("POST", "/v1/responses", [(b"user-agent", b"codex_cli_rs/0.171.0"), (b"session-id", b"codex-1"),
                               (b"content-encoding", b"zstd")], zstd.compress(CODEX_BODY)),
    ("POST", "/v1/chat/completions", [(b"user-agent", b"opencode/1.18.33"), (b"x-opencode-session", b"ses_1"),
                                      (b"content-encoding", b"gzip"), (b"x-odd", b"\xff\xfe\x80")],
     gzip_as_recorded(b'{"model":"glm","messages":[{"role":"user","content":"x"}],"tools":[{}]}')),
    ("GET", "/api/claude_code/settings", [(b"User-Agent", b"claude-cli/2.1.332 (external, cli)")], None),
]
EXPECT = [  # (api, agent, session, turn) of each request above
    (facts.ANTHROPIC_MESSAGES, facts.CLAUDE_CODE, "sess-1", facts.OPENING),
    (facts.OPENAI_RESPONSES, facts.CODEX, "codex-1", facts.CONTINUATION),
    (facts.OPENAI_CHAT, facts.OPENCODE, "ses_1", facts.OPENING),
    (facts.OTHER, facts.CLAUDE_CODE, None, None),
]


def record(out: Path, workdir: Path, host: str = "inference.test") -> None:
    """Send REQUESTS through a real mitmdump (plain HTTP proxy requests) writing ``out``."""
    addon = workdir / "answer.py"
    addon.write_text(ANSWER)
    proc = subprocess.Popen(
        [str(MITMDUMP), "--listen-host", "127.0.0.1", "-p", "0", "--set", f"confdir={workdir / 'conf'}",
         "--set", "connection_strategy=lazy", "-s", str(addon), "-w", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=workdir,
    )
    try:
        port = None
        deadline = time.monotonic() + 30
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline().decode(errors="replace")
            if not line:
                break
            m = re.search(r"listening at .*:(\d+)", line)
            if m:
                port = int(m.group(1))
        assert port, "mitmdump did not start"
        for method, path, headers, body in REQUESTS:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.putrequest(method, f"http://{host}{path}", skip_host=True, skip_accept_encoding=True)
            conn.putheader("Host", host)
            for name, value in headers:
                conn.putheader(name, value)
            if body is not None:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
            assert resp.status == 200
            resp.read()
            conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def check(requests: list[flowfile.FlowRequest], host: str) -> None:
    assert [r.index for r in requests] == list(range(len(REQUESTS)))
    for req, (method, path, headers, body), exp in zip(requests, REQUESTS, EXPECT):
        assert (req.method, req.url) == (method, f"http://{host}{path}")
        for pair in headers:
            assert pair in req.headers
        assert req.body == (body if body is not None else b"")
        f = facts.read(req.method, req.url, req.headers, req.body)
        assert (f.api, f.agent, f.session, f.turn) == exp, f.reason


@pytest.mark.skipif(not MITMDUMP.exists(), reason="mitmdump is not installed next to this python")
def test_a_file_written_by_mitmdump_now(tmp_path):
    out = tmp_path / "live.flow"
    record(out, tmp_path)
    check(list(flowfile.read_requests(out.read_bytes())), "inference.test")


def test_the_committed_mitmdump_file():
    check(list(flowfile.read_requests(SAMPLE.read_bytes())), "inference.test")


RECORDED = sorted((Path(__file__).parent / "fixtures" / "traffic" / "flows").glob("*.flow"))


@pytest.mark.parametrize("path", [SAMPLE, *RECORDED], ids=lambda p: p.name)
def test_agrees_with_mitmproxys_own_reader(path):
    """The committed sample and every flow file recorded from the real agents."""
    from mitmproxy import io as mio  # tests may use mitmproxy; sessionpin/ may not

    with path.open("rb") as fh:
        theirs = [f.request for f in mio.FlowReader(fh).stream() if hasattr(f, "request")]
    ours = list(flowfile.read_requests(path.read_bytes()))
    assert len(ours) == len(theirs) > 0
    for o, t in zip(ours, theirs):
        assert (o.method, o.url, o.headers, o.body) == (t.method, t.url, list(t.headers.fields), t.raw_content)


# ---------------------------------------------------------------- by hand


def tn(value) -> bytes:
    """A tnetstring (for tests; mitmproxy's writer is what real files come from)."""
    if value is None:
        return b"0:~"
    if isinstance(value, bool):
        p, t = (b"true" if value else b"false"), b"!"
    elif isinstance(value, int):
        p, t = str(value).encode(), b"#"
    elif isinstance(value, float):
        p, t = repr(value).encode(), b"^"
    elif isinstance(value, bytes):
        p, t = value, b","
    elif isinstance(value, str):
        p, t = value.encode(), b";"
    elif isinstance(value, list):
        p, t = b"".join(tn(v) for v in value), b"]"
    elif isinstance(value, dict):
        p, t = b"".join(tn(k) + tn(v) for k, v in value.items()), b"}"
    else:
        raise TypeError(value)
    return str(len(p)).encode() + b":" + p + t


def flow(**request) -> dict:
    base = {"method": b"POST", "scheme": "https", "host": "api.anthropic.com", "port": 443,
            "path": b"/v1/messages", "headers": [[b"user-agent", b"claude-cli/2"]], "content": b"{}"}
    return {"type": "http", "version": 21, "request": base | request, "response": None}


def test_every_value_type():
    data = tn({"a": [1, -2, 1.5, True, False, None, b"\x00\xff", "é"], b"b": {}})
    assert list(flowfile.loads_all(data)) == [{"a": [1, -2, 1.5, True, False, None, b"\x00\xff", "é"], "b": {}}]


def test_urls_and_ports():
    reqs = list(flowfile.read_requests(
        tn(flow()) + tn(flow(scheme=b"http", host="h", port=8080, path=b"/x?y=1")) + tn(flow(host="::1", port=80, scheme="http"))
    ))
    assert [r.url for r in reqs] == ["https://api.anthropic.com/v1/messages", "http://h:8080/x?y=1", "http://[::1]/v1/messages"]


def test_other_flow_types_are_skipped_and_indexes_kept():
    data = tn({"type": "tcp", "messages": []}) + tn(flow()) + tn({"type": "http", "request": None}) + tn(flow(content=None))
    reqs = list(flowfile.read_requests(data))
    assert [(r.index, r.body) for r in reqs] == [(1, b"{}"), (3, None)]


def test_odd_request_fields_do_not_raise():
    reqs = list(flowfile.read_requests(tn(flow(method=None, headers=[[b"a"], 5, [b"k", "v"]], port="x", path=None))))
    assert reqs[0].method == "GET" and reqs[0].headers == [(b"k", b"v")]


@pytest.mark.parametrize(
    "data,message",
    [
        (b"", "not a mitmproxy flow file"),
        (b'{"method": "POST"}', "not a mitmproxy flow file"),
        (b"12345678901234567890:x", "not a mitmproxy flow file"),
        (tn(flow())[:-1], "truncated"),
        (tn(flow())[:40], "truncated"),
        (b"3:abcX", "unknown tnetstring type"),
        (b"2:xx#", "bad integer"),
        (b"1:x!", "bad boolean"),
        (b"1:x~", "bad null"),
        (b"4:1:a,}", "dict key without value"),
        (b"3:1:a]", "bad length"),
        (b"5:1:a,x]", "not a tnetstring"),
        (b"11:4:1:1#]1:1#}", "bad dict key"),
        (tn([1]), "is not a dict"),
    ],
)
def test_bad_files_raise_flowfileerror(data, message):
    with pytest.raises(flowfile.FlowFileError, match=message):
        list(flowfile.read_requests(data))


def test_good_flows_before_a_bad_one_are_yielded():
    it = flowfile.read_requests(tn(flow()) + b"99:short")
    assert next(it).method == "POST"
    with pytest.raises(flowfile.FlowFileError):
        next(it)


def test_nesting_is_bounded():
    deep = b"0:]"
    for _ in range(flowfile.MAX_DEPTH + 5):
        deep = str(len(deep)).encode() + b":" + deep + b"]"
    with pytest.raises(flowfile.FlowFileError, match="nested too deeply"):
        list(flowfile.loads_all(deep))


def test_looks_like_flowfile():
    assert flowfile.looks_like_flowfile(tn(flow()))
    assert not flowfile.looks_like_flowfile(b'{"a": 1}')
    assert not flowfile.looks_like_flowfile(b":1")


if __name__ == "__main__":  # regenerate the committed sample: python tests/test_flowfile.py
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        SAMPLE.parent.mkdir(parents=True, exist_ok=True)
        record(SAMPLE.resolve(), Path(d))
    print(SAMPLE, os.path.getsize(SAMPLE))
