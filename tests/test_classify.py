"""``sessionpin classify``, run as a subprocess on JSON requests and mitmdump flow files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sessionpin.reader import facts

HERE = Path(__file__).parent
SAMPLE = HERE / "fixtures" / "flows" / "sample.flow"
TRAFFIC = HERE / "fixtures" / "traffic"
KEYS = {"file", "index", "method", "url", "api", "agent", "session", "session_source", "turn", "model", "stream",
        "has_history", "has_tools", "parsed", "reason", "conflict"}


def run(*args: str | Path) -> tuple[int, list[dict], list[str]]:
    proc = subprocess.run([sys.executable, "-m", "sessionpin.offline.classify", *map(str, args)],
                          capture_output=True, text=True, timeout=60)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    return proc.returncode, lines, proc.stderr.splitlines()


def write(tmp_path: Path, name: str, obj) -> Path:
    p = tmp_path / name
    p.write_bytes(obj if isinstance(obj, bytes) else json.dumps(obj).encode())
    return p


SECRET = "the-secret-prompt-words"
CHAT = {
    "method": "POST",
    "url": "https://opencode.ai/zen/v1/chat/completions",
    "headers": [["User-Agent", "opencode/1.18.33"], ["x-opencode-session", "ses_abc"], ["content-encoding", "zstd"]],
    "body": {"model": "glm-4.6", "stream": True, "messages": [{"role": "user", "content": SECRET}], "tools": [{}]},
}


def test_a_json_request(tmp_path):
    code, lines, err = run(write(tmp_path, "chat.json", CHAT))
    assert (code, err) == (0, [])
    (line,) = lines
    assert set(line) == KEYS
    assert line["file"].endswith("chat.json")
    assert (line["api"], line["agent"], line["session"], line["turn"], line["model"], line["stream"], line["parsed"]) == (
        facts.OPENAI_CHAT, facts.OPENCODE, "ses_abc", facts.OPENING, "glm-4.6", True, True)


def test_headers_as_an_object_body_as_a_string_or_null(tmp_path):
    text = dict(CHAT, headers={"user-agent": "opencode/1", "x-session-id": "ses_x"}, body="not json " + SECRET)
    null = dict(CHAT, method="GET", url="https://api.anthropic.com/api/claude_code/settings", body=None,
                headers={"user-agent": "claude-cli/2.1.332 (external, cli)"})
    code, lines, err = run(write(tmp_path, "text.json", text), write(tmp_path, "null.json", null))
    assert code == 0
    assert (lines[0]["parsed"], lines[0]["reason"], lines[0]["session"], lines[0]["turn"]) == (
        False, "not JSON", "ses_x", facts.UNKNOWN_TURN)
    assert (lines[1]["api"], lines[1]["agent"], lines[1]["session"], lines[1]["turn"], lines[1]["model"],
            lines[1]["stream"]) == (facts.OTHER, facts.CLAUDE_CODE, None, None, None, None)


def test_nothing_from_the_prompt_is_printed(tmp_path):
    no_id = dict(CHAT, headers=[["user-agent", "x"]])
    _, lines, _ = run(write(tmp_path, "a.json", CHAT), write(tmp_path, "b.json", no_id))
    assert SECRET not in json.dumps(lines)
    assert lines[1]["session"].startswith("fp:")


def test_a_mitmdump_flow_file():
    code, lines, err = run(SAMPLE)
    assert (code, err) == (0, [])
    assert [(d["index"], d["api"], d["agent"], d["session"], d["turn"]) for d in lines] == [
        (0, facts.ANTHROPIC_MESSAGES, facts.CLAUDE_CODE, "sess-1", facts.OPENING),
        (1, facts.OPENAI_RESPONSES, facts.CODEX, "codex-1", facts.CONTINUATION),
        (2, facts.OPENAI_CHAT, facts.OPENCODE, "ses_1", facts.OPENING),
        (3, facts.OTHER, facts.CLAUDE_CODE, None, None),
    ]
    assert all(set(d) == KEYS for d in lines)


def test_the_kind_of_file_is_told_by_content_not_name(tmp_path):
    flow_named_json = write(tmp_path, "flow.json", SAMPLE.read_bytes())
    request_named_flow = write(tmp_path, "req.flow", CHAT)
    code, lines, _ = run(flow_named_json, request_named_flow)
    assert code == 0 and len(lines) == 5


@pytest.mark.parametrize(
    "content,message",
    [
        (b"garbage", "neither a JSON request nor a mitmproxy flow file"),
        (b"\x00\xff\xfe", "neither a JSON request nor a mitmproxy flow file"),
        (b"", "neither a JSON request nor a mitmproxy flow file"),
        (b"{not json", "not JSON"),
        (b"[1, 2]", "neither a JSON request nor a mitmproxy flow file"),
        (json.dumps({"method": "POST"}).encode(), 'needs string "method" and "url"'),
        (json.dumps(dict(CHAT, headers=[["a"]])).encode(), '"headers" must be'),
        (json.dumps(dict(CHAT, headers="x")).encode(), '"headers" must be'),
        (json.dumps(dict(CHAT, headers={"a": 1})).encode(), '"headers" must be'),
        (b"1234:abc", "bad flow file: truncated"),
    ],
)
def test_a_bad_file_is_named_on_stderr_and_the_others_still_classified(tmp_path, content, message):
    bad = write(tmp_path, "bad.bin", content)
    good = write(tmp_path, "good.json", CHAT)
    code, lines, err = run(bad, good)
    assert code == 1
    assert [d["file"] for d in lines] == [str(good)]
    assert len(err) == 1 and err[0].startswith(f"sessionpin classify: {bad}: ") and message in err[0], err


def test_a_missing_file_and_a_truncated_flow_file(tmp_path):
    data = SAMPLE.read_bytes()
    cut = write(tmp_path, "cut.flow", data[: len(data) - 100])
    code, lines, err = run(tmp_path / "missing.json", cut)
    assert code == 1
    assert "missing.json: No such file or directory" in err[0]
    assert "cut.flow: bad flow file: truncated" in err[1]
    assert [d["index"] for d in lines] == [0, 1, 2]  # the complete flows before the cut


def test_usage():
    code, lines, err = run()
    assert (code, lines) == (2, []) and "usage" in err[0]
    proc = subprocess.run([sys.executable, "-m", "sessionpin.offline.classify", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: sessionpin classify")


def test_every_recording_from_outside():
    files = sorted(TRAFFIC.glob("*/*.json"))
    if not files:
        pytest.skip("no recordings yet")
    code, lines, err = run(*files)
    assert (code, err) == (0, [])
    assert len(lines) == len(files)
    for path, line in zip(files, lines):
        exp = json.loads(path.read_text())["expect"]
        assert line["file"] == str(path)
        assert (line["api"], line["turn"], line["model"], line["stream"]) == (
            exp["api"], exp["turn"], exp["model"], exp["stream"]), path.name


def test_every_recorded_flow_file():
    flows = sorted((TRAFFIC / "flows").glob("*.flow"))
    if not flows:
        pytest.skip("no recorded flow files")
    code, lines, err = run(*flows)
    assert (code, err) == (0, [])
    inference = [d for d in lines if d["api"] != facts.OTHER]
    assert {d["file"] for d in inference} == {str(p) for p in flows}
    for d in inference:
        assert d["parsed"] and d["session"] and d["turn"] != facts.UNKNOWN_TURN and d["agent"] != "unknown", d
    for d in lines:
        if d["api"] == facts.OTHER:
            assert d["session"] is None and d["turn"] is None


def test_no_credential_a_url_carries_is_printed(tmp_path):
    """A URL carrying a key (Gemini's ``?key=AIza…``, a user and password) printed whole: the
    key on the operator's terminal, and in the bug report the line was pasted into. Now the
    query's values are ``…`` but ``beta``'s, and the user and password are left out."""
    key, password = "AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStUv", "hunter2-password"
    req = dict(CHAT, url=f"https://me:{password}@generativelanguage.googleapis.com/v1beta/openai/chat/completions"
                         f"?key={key}&beta=true&alt=sse")
    code, lines, err = run(write(tmp_path, "gemini.json", req))
    assert (code, err) == (0, [])
    assert lines[0]["url"] == ("https://…@generativelanguage.googleapis.com/v1beta/openai/chat/completions"
                               "?key=…&beta=true&alt=…")
    assert key not in json.dumps(lines) and password not in json.dumps(lines)
