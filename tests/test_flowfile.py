"""The pure flow-file reader, against files written by the real mitmdump and by hand."""

from __future__ import annotations

import gzip
import http.client
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sessionpin.reader import facts
from sessionpin.offline import flowfile

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


AGENT_OF = {"cc": facts.CLAUDE_CODE, "cx": facts.CODEX, "oc": facts.OPENCODE, "pi": facts.PI}


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.name)
def test_every_recorded_agent_flow_file_reads_to_the_end(path):
    """The flow files recorded from the real agents: all of each, raw bodies the reader decodes."""
    reqs = list(flowfile.read_requests(path.read_bytes()))
    assert reqs and [r.index for r in reqs] == sorted({r.index for r in reqs})
    assert all(isinstance(n, bytes) and isinstance(v, bytes) for r in reqs for n, v in r.headers)
    agents = {facts.read(r.method, r.url, r.headers, r.body).agent for r in reqs}
    assert AGENT_OF[path.name.split("-")[0]] in agents


# ---------------------------------------------------------------- written here


def written(*flows) -> bytes:
    """Flows as mitmdump -w writes them (mitmproxy's own writer)."""
    from mitmproxy import io as mio

    buf = io.BytesIO()
    w = mio.FlowWriter(buf)
    for f in flows:
        w.add(f)
    return buf.getvalue()


def hflow(**request):
    from mitmproxy.test import tflow

    f = tflow.tflow()
    for k, v in request.items():
        setattr(f.request, k, v)
    return f


def test_urls_and_ports():
    reqs = list(flowfile.read_requests(written(
        hflow(scheme="https", host="api.anthropic.com", port=443, path="/v1/messages"),
        hflow(scheme="http", host="h", port=8080, path="/x?y=1"),
        hflow(scheme="http", host="::1", port=80, path="/v1/messages"))))
    # Request.url, as the addon hands it to the reader (mitmproxy does not bracket an IPv6 host)
    assert [r.url for r in reqs] == ["https://api.anthropic.com/v1/messages", "http://h:8080/x?y=1",
                                     "http://::1/v1/messages"]


def test_other_flow_types_are_skipped_and_indexes_kept():
    from mitmproxy.test import tflow

    data = written(tflow.ttcpflow(), hflow(content=b"{}"), tflow.tdnsflow(), hflow(content=None))
    reqs = list(flowfile.read_requests(data))
    assert [(r.index, r.body) for r in reqs] == [(1, b"{}"), (3, None)]


def test_raw_headers_and_encoded_body_are_as_sent():
    f = hflow(content=b"")
    f.request.headers.fields = ((b"Content-Encoding", b"gzip"), (b"x-odd", b"\xff\xfe"))
    f.request.raw_content = b"\x1f\x8b not decoded here"
    (req,) = flowfile.read_requests(written(f))
    assert req.headers == [(b"Content-Encoding", b"gzip"), (b"x-odd", b"\xff\xfe")]
    assert req.body == b"\x1f\x8b not decoded here"


def nested(depth: int) -> bytes:
    deep = b"0:]"
    for _ in range(depth):
        deep = str(len(deep)).encode() + b":" + deep + b"]"
    return deep


@pytest.mark.parametrize(
    "data,message",
    [
        (b"", "not a mitmproxy flow file"),
        (b'{"method": "POST"}', "not a mitmproxy flow file"),
        (b"12345678901234567890:x", "not a mitmproxy flow file"),
        (b"3:abcX", "flow 0 at byte 0: unknown type tag"),
        (b"2:xx#", "flow 0 at byte 0: not a tnetstring: invalid integer"),
        (b"5:1:a,x]", "flow 0 at byte 0: not a tnetstring"),
        (b"4:1:a,]", "flow 0 at byte 0: Invalid flow"),
        (b"0:}", "flow 0 at byte 0: "),                             # a dict, but no flow
        (nested(5000), "flow 0 at byte 0: nested too deeply"),      # would exhaust the stack
        (b"99999999:x", r"truncated: the file ends inside flow 0 \(which starts at byte 0\)"),
    ],
)
def test_bad_files_raise_flowfileerror(data, message):
    with pytest.raises(flowfile.FlowFileError, match=message):
        list(flowfile.read_requests(data))


def test_truncated_file_yields_the_complete_flows_then_raises():
    data = written(hflow(method="POST"), hflow(method="PUT"))
    for cut in (1, 40, 400):
        it = flowfile.read_requests(data[:-cut])
        assert next(it).method == "POST"
        with pytest.raises(flowfile.FlowFileError, match="truncated: the file ends inside flow 1 "):
            list(it)


def test_a_newer_flow_format_is_named():
    from mitmproxy.io import tnetstring

    state = hflow().get_state()
    state["version"] = 999
    with pytest.raises(flowfile.FlowFileError, match="flow 0 at byte 0: .*flow format version 999"):
        list(flowfile.read_requests(tnetstring.dumps(state)))


def test_looks_like_flowfile():
    assert flowfile.looks_like_flowfile(written(hflow()))
    assert not flowfile.looks_like_flowfile(b'{"a": 1}')
    assert not flowfile.looks_like_flowfile(b":1")


def test_json_requests_do_not_load_mitmproxy():
    code = ("import sys; from sessionpin.offline import classify; "
            "lines = list(classify.classify_file(sys.argv[1])); "
            "assert 'mitmproxy' not in sys.modules, 'loaded'; print(len(lines))")
    sample = next((Path(__file__).parent / "fixtures" / "traffic").rglob("*.json"))
    out = subprocess.run([sys.executable, "-c", code, str(sample)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr


if __name__ == "__main__":  # regenerate the committed sample: python tests/test_flowfile.py
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        SAMPLE.parent.mkdir(parents=True, exist_ok=True)
        record(SAMPLE.resolve(), Path(d))
    print(SAMPLE, os.path.getsize(SAMPLE))
