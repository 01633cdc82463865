"""The end-to-end harness itself (tests/e2e/harness.py): fake servers over real TLS, a plain mitmdump."""

from __future__ import annotations

import http.client
import json
import signal
import ssl
import textwrap
import tomllib

import pytest

from e2e.harness import Client, FakeServer, Mitmdump, MitmdumpError, TestCA, free_port, running_rig, toml_config


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def fake(ca: TestCA):
    with FakeServer("alpha", ca, prefix="/api/anthropic") as f:
        yield f


@pytest.fixture(autouse=True)
def _clean(fake: FakeServer):
    fake.clear()
    yield


MESSAGE = {"model": "claude-opus-4-5", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


def test_fake_streams_anthropic_sse_with_real_event_names(ca, fake):
    body = json.dumps({**MESSAGE, "stream": True}).encode()
    r = Client.direct(ca).request("POST", fake.url + "/v1/messages?beta=true",
                                  [("x-api-key", "k1"), ("content-type", "application/json")], body)
    assert r.status == 200
    assert r.header("content-type").startswith("text/event-stream")
    assert r.event_names == ["message_start", "content_block_start", "ping", "content_block_delta",
                             "content_block_delta", "content_block_delta", "content_block_stop",
                             "message_delta", "message_stop"]
    assert r.events[0].json()["message"]["model"] == "claude-opus-4-5"
    assert "from alpha" in r.events[3].json()["delta"]["text"]
    [got] = fake.requests
    assert (got.method, got.path, got.body) == ("POST", "/api/anthropic/v1/messages?beta=true", body)
    assert got.header("X-API-KEY") == "k1"


def test_fake_answers_json_count_tokens_openai_and_other_paths(ca, fake):
    c = Client.direct(ca)
    r = c.request("POST", fake.url + "/v1/messages", body=json.dumps(MESSAGE).encode())
    assert r.status == 200 and r.json()["content"][0]["text"] == "reply from alpha."
    r = c.request("POST", fake.url + "/v1/messages/count_tokens?beta=true", body=json.dumps(MESSAGE).encode())
    assert r.json() == {"input_tokens": 42}
    r = c.request("POST", fake.url + "/v1/chat/completions", body=json.dumps({**MESSAGE, "stream": True}).encode())
    assert r.events[-1].data == "[DONE]" and len(r.events) == 6
    r = c.request("POST", fake.url + "/v1/responses", body=json.dumps({**MESSAGE, "stream": True}).encode())
    assert r.event_names[0] == "response.created" and r.event_names[-1] == "response.completed"
    r = c.request("GET", fake.url + "/api/claude_code/settings")
    assert r.status == 200 and r.json()["path"] == "/api/claude_code/settings"
    r = c.request("GET", fake.origin + "/v1/messages")  # outside the prefix
    assert r.status == 404
    r = c.request("POST", fake.url + "/v1/messages", body=b"\xff garbage")
    assert r.status == 400 and r.json()["type"] == "error"
    assert [g.path for g in fake.requests] == [
        "/api/anthropic/v1/messages", "/api/anthropic/v1/messages/count_tokens?beta=true",
        "/api/anthropic/v1/chat/completions", "/api/anthropic/v1/responses",
        "/api/anthropic/api/claude_code/settings", "/v1/messages", "/api/anthropic/v1/messages",
    ]


def test_fake_keeps_duplicate_headers_in_order(ca, fake):
    Client.direct(ca).request("GET", fake.url + "/x", [("x-a", "1"), ("x-b", "2"), ("x-a", "3")])
    got = fake.requests[0]
    assert got.header_all("x-a") == ["1", "3"]
    assert [k.lower() for k, _ in got.headers if k.lower().startswith("x-")] == ["x-a", "x-b", "x-a"]


def test_fake_pauses_between_events_and_returns_a_given_status(ca, fake):
    c = Client.direct(ca)
    with fake.behave(pause_ms=150, deltas=1):
        r = c.request("POST", fake.url + "/v1/messages", body=json.dumps({**MESSAGE, "stream": True}).encode())
    gaps = [b.at - a.at for a, b in zip(r.events, r.events[1:])]
    # an event read late shortens the next gap as seen here (on a loaded machine, by tens of
    # ms); the span from the first event to the last is shortened only by the first's delay
    assert len(gaps) == 6 and min(gaps) > 0.05 and r.events[-1].at - r.events[0].at > 0.8
    with fake.behave(pause_after_first_ms=300):
        r = c.request("POST", fake.url + "/v1/messages", body=json.dumps({**MESSAGE, "stream": True}).encode())
    assert r.events[1].at - r.events[0].at > 0.25
    assert r.t_first_byte - r.t_sent < 0.25
    with fake.behave(status=429):
        r = c.request("POST", fake.url + "/v1/messages", body=json.dumps(MESSAGE).encode())
    assert r.status == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert fake.status is None and fake.pause_ms == 0


def test_fake_stopped_is_unreachable_then_restarts_on_the_same_port(ca):
    f = FakeServer("beta", ca).start()
    port = f.port
    c = Client.direct(ca, timeout=5)
    with c.connect(f.url) as conn:
        assert conn.request("GET", "/a").status == 200
        f.stop()
        # open connections are dropped too (how http.client reports it varies by version)
        with pytest.raises((OSError, http.client.HTTPException)):
            conn.request("GET", "/b")
    with pytest.raises(OSError):
        c.request("GET", f.url + "/c")
    f.start()
    try:
        assert f.port == port
        assert c.request("GET", f.url + "/d").status == 200
        assert [r.path for r in f.requests] == ["/a", "/d"]
    finally:
        f.stop()


def test_fake_certificate_is_refused_without_the_test_ca(fake):
    with pytest.raises(ssl.SSLCertVerificationError):
        Client().request("GET", fake.url + "/x")


def test_toml_config_is_the_issue_format():
    text = toml_config(
        {"anthropic": {"url": "https://127.0.0.1:1"},
         "glm": {"url": "https://127.0.0.1:2/api/anthropic", "key_env": "K",
                 "models": {"claude-opus-*": "glm-4.6"}}},
        {"claude-code": "glm", "opencode": None},
    )
    assert tomllib.loads(text) == {
        "servers": {"anthropic": {"url": "https://127.0.0.1:1"},
                    "glm": {"url": "https://127.0.0.1:2/api/anthropic", "key_env": "K",
                            "models": {"claude-opus-*": "glm-4.6"}}},
        "agents": {"claude-code": {"server": "glm"}, "opencode": {}},
    }


@pytest.fixture(scope="module")
def plain(tmp_path_factory, ca):
    m = Mitmdump(tmp_path_factory.mktemp("plain"), script=None,
                 options={"ssl_verify_upstream_trusted_ca": str(ca.pem)})
    m.start()
    yield m
    m.stop()


def test_plain_mitmdump_carries_requests_and_streams_with_a_streaming_addon(tmp_path, ca, fake, plain):
    assert plain.port > 0 and plain.mitm_ca.exists()
    c = Client.via_proxy(plain.port, plain.mitm_ca)
    body = json.dumps(MESSAGE).encode()
    r = c.request("POST", fake.url + "/v1/messages?beta=true", [("x-api-key", "k2")], body)
    assert r.status == 200 and r.json()["content"][0]["text"] == "reply from alpha."
    [got] = fake.requests
    assert got.path == "/api/anthropic/v1/messages?beta=true" and got.body == body
    assert got.header("x-api-key") == "k2"
    assert got.header("host") == f"127.0.0.1:{fake.port}"

    # plain mitmdump buffers a stream; a one-line streaming addon does not
    stream = json.dumps({**MESSAGE, "stream": True}).encode()
    with fake.behave(pause_after_first_ms=600, deltas=1):
        buffered = c.request("POST", fake.url + "/v1/messages", body=stream)
        script = tmp_path / "stream.py"
        script.write_text("def responseheaders(flow):\n    flow.response.stream = True\n")
        with Mitmdump(tmp_path / "s", script=script,
                      options={"ssl_verify_upstream_trusted_ca": str(ca.pem)}) as streaming:
            streamed = Client.via_proxy(streaming.port, streaming.mitm_ca).request(
                "POST", fake.url + "/v1/messages", body=stream)
    assert buffered.t_first_byte - buffered.t_sent > 0.5
    assert streamed.t_first_byte - streamed.t_sent < 0.5
    assert streamed.events[1].at - streamed.events[0].at > 0.5
    assert streamed.event_names == buffered.event_names


def test_plain_mitmdump_http_absolute_form_and_reverse_mode(tmp_path, ca, fake):
    m = Mitmdump(tmp_path, script=None, options={"ssl_verify_upstream_trusted_ca": str(ca.pem)},
                 modes=["regular", f"reverse:{fake.origin}@{free_port()}"])
    with m:
        assert len(m.ports) == 2
        r = Client.reverse(m.ports[1]).request("GET", "http://ignored/api/anthropic/api/claude_code/settings")
        assert r.status == 200 and r.header("x-fake-server") == "alpha"
        assert fake.requests[-1].path == "/api/anthropic/api/claude_code/settings"
        # an http:// url through the regular-mode port uses absolute-form; nothing listens there
        r = Client.via_proxy(m.ports[0], m.mitm_ca).request("GET", "http://127.0.0.1:9/x")
        assert r.status == 502


def test_mitmdump_restart_keeps_confdir_and_reports_signals(tmp_path):
    m = Mitmdump(tmp_path, script=None)
    m.start()
    ca_before = m.mitm_ca.read_bytes()
    assert m.stop(signal.SIGKILL) == -signal.SIGKILL
    assert not m.alive
    m.start()
    assert m.mitm_ca.read_bytes() == ca_before
    code = m.stop(signal.SIGTERM)
    assert code is not None and not m.alive
    assert m.output.count("listening at") == 2


def test_mitmdump_failed_start_surfaces_its_output(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit('no such addon: sentinel-xyz')\n")
    m = Mitmdump(tmp_path, script=bad, args=["--set", "no_such_option_really=1"])
    with pytest.raises(MitmdumpError) as e:
        m.start(timeout=20)
    assert "exited" in str(e.value) or "did not listen" in str(e.value)
    assert "sentinel-xyz" in m.output or "no_such_option_really" in m.output, textwrap.shorten(m.output, 500)


def test_running_rig_stops_the_mitmdump_then_the_fakes_and_the_fakes_when_mitmdump_cannot_start(tmp_path):
    made: dict[str, FakeServer] = {}

    def fakes(ca: TestCA) -> dict[str, FakeServer]:
        made.update(a=FakeServer("a", ca), b=FakeServer("b", ca))
        return made

    class Rig:
        def __init__(self, tmp, ca, fakes, script=None, args=()) -> None:
            self.mitm = Mitmdump(tmp / "mitm", script=script, args=args)

    with running_rig(tmp_path / "ok", fakes, Rig) as r:
        assert r.mitm.alive and all(f.running for f in made.values())
        mitm = r.mitm
    assert not mitm.alive and not any(f.running for f in made.values())

    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit('no such addon')\n")

    class Broken(Rig):
        def __init__(self, tmp, ca, fakes) -> None:
            super().__init__(tmp, ca, fakes, script=bad)

    with pytest.raises(MitmdumpError):
        with running_rig(tmp_path / "broken", fakes, Broken):
            pass
    assert not any(f.running for f in made.values())


def test_every_mitmdump_of_the_process_starts_with_one_mitmproxy_ca(tmp_path):
    a, b = Mitmdump(tmp_path / "a", script=None), Mitmdump(tmp_path / "b", script=None)
    assert a.mitm_ca.read_bytes() == b.mitm_ca.read_bytes()
    assert (a.confdir / "mitmproxy-ca.pem").stat().st_mode & 0o777 == 0o600     # the key: ours alone
