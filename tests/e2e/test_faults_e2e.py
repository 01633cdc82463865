"""Issue 10's request, config and hostile faults, end to end: a real ``mitmdump -s
addons/route.py``, real TLS, a real file store, fake inference servers on loopback.

One rig serves the module: servers ``anthropic`` (the origin Claude Code addresses; the
client's own key belongs there only) and ``glm`` (prefix ``/api/anthropic``, its key from
the proxy's environment, ``claude-opus-*`` renamed ``glm-4.6``); ``claude-code`` is routed
to glm. Every test uses fresh session ids and checks what each fake received, headers
included; after each test no fake holds a key meant for another.

Each row, and what the code before issue 10 (c33fb11) did with it — seen by running this
module, one test at a time, against a copy of c33fb11 with this harness (its tree first on
``PYTHONPATH``):

1. ``test_removed_or_emptied_config_never_moves_a_pinned_conversation``: ``servers remove
   anthropic`` removed it without a word (exit 0). With the config edited instead (a copy
   of this test without the CLI steps), the pinned conversation's next turn went to
   anthropic ("reply from anthropic."). The test goes on: the file emptied while running
   (a 503 naming glm, a new conversation left alone), ``servers remove glm`` counted and
   refused without ``--force``, then the 503; glm back, the conversation is there.
2. ``test_a_redirect_from_the_routed_server_is_a_502_and_is_not_followed``: the 307, 302
   and 308 reached the agent as sent, ``Location`` and all.
3. ``test_nested_look_alike_keys_do_not_stall_the_proxy``: a 1.2 MB body of look-alike
   keys before ``"messages"`` held the proxy past the client's 30 s timeout. So did the
   code of this branch before bc78740 (the lineage reader's head search, not the facts
   reader's); the steps-per-byte unit tests are in tests/test_reader_work.py.
4. ``test_a_200_mb_body_is_refused_413_without_being_buffered``: no limit: the body was
   buffered whole and sent to glm (the fake answered 400, not JSON). The test bounds the
   proxy's peak RSS growth (generously, < 300 MB) and checks that the 413 is counted in
   ``sessionpin_refusals_total{reason="too-large"}`` (not counted before e52a1d6).
   ``test_a_200_mb_body_without_a_length_is_refused_413_without_being_buffered``: the same
   body chunked: buffered whole (peak RSS +400 MB) and answered 502 by the reader as
   "too large" before the sink took bodies of unknown length; now 413, +~50 MB.
5. ``test_an_unreadable_body_of_a_moved_session_is_refused_never_sent_unmapped``: the 70 MB
   body, the 10k-deep one and the mislabelled gzip reached glm with glm's key and the
   model unmapped.
6. ``test_unknown_headers_and_query_parameters_never_reach_the_other_server``: ``sig=`` and
   ``code=`` reached glm, and so did ``anthropic-organization-id`` and
   ``chatgpt-account-id`` (seen with the path check left out).
7. ``test_look_alike_paths_of_a_pinned_session_are_not_routed``: ``/v1/threads/x/messages``
   of a pinned session went to glm. (test_bounds_e2e.py's look-alike test covers fresh
   sessions; it cannot run on c33fb11 at all, whose mitmdump lacks its options.) Since review
   (2026-12-05) a turn there (an inference body) of a session pinned elsewhere is refused 424,
   sent nowhere; another API's resource (no model) still passes untouched.
8. ``test_ambiguous_paths_of_a_pinned_session_are_refused``: ``/../../v1/messages`` of a
   pinned session reached glm as ``/api/anthropic/../../v1/messages`` with glm's key;
   ``/v1%2fmessages`` passed to anthropic. (test_bounds_e2e.py covers fresh sessions.)
9. ``test_a_key_pasted_as_key_env_is_never_echoed``: the config was accepted (no
   ``config_error``); the issue saw the key in status, the log and a 502 body.
10. ``test_status_and_metrics_refuse_a_foreign_host``: ``Host: evil`` got 200 with the
   config path, the store path and every server's URL.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from .harness import Client, FakeServer, Mitmdump, Received, Reply, TestCA, toml_config

RUN = uuid.uuid4().hex[:8]
GLM_ENV = "SESSIONPIN_E2E_FAULTS_GLM_KEY"
GLM_KEY = f"glm-FAULTS-SENTINEL-{RUN}"
CLIENT_KEY = f"sk-ant-api03-FAULTS-CLIENT-SENTINEL-{RUN}"
OWNER = {GLM_KEY: "glm", CLIENT_KEY: "anthropic"}
SESSION_HEADER = "X-Claude-Code-Session-Id"
OPUS = "claude-opus-4-5-20251101"
MODELS = {"claude-opus-*": "glm-4.6"}
LIMIT_MB = 128   # raised, so a 70 MB body is under the proxy's limit and over the reader's
TOOLS = [{"name": "Bash", "description": "Run a shell command.",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]


def sessionpin_argv() -> list[str]:
    exe = Path(sys.executable).parent / "sessionpin"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "sessionpin.cli"]


def body_of(kind: str, session: str, head: bytes = b"", model: str = OPUS) -> bytes:
    """An opening or a continuation as Claude Code sends it; ``head`` is raw JSON members
    placed before ``"model"`` (the body's first members)."""
    messages: list[Any] = [{"role": "user", "content": "Fix the failing test."}]
    if kind == "continuation":
        # each conversation's first answer is its own (as a server's is): two conversations
        # never share a first exchange, so one is never taken for a fork of another
        messages += [{"role": "assistant", "content": [{"type": "text", "text": f"Looking ({session})."}]},
                     {"role": "user", "content": "Go on."}]
    meta = {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": session})}
    rest = json.dumps({"model": model, "messages": messages, "tools": TOOLS, "metadata": meta,
                       "max_tokens": 1024, "stream": False}).encode()
    return (b"{" + head + b"," + rest[1:]) if head else rest


def headers_of(session: str, extra: list[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    return [("Content-Type", "application/json"), ("User-Agent", "claude-cli/2.1.332 (external, cli)"),
            ("anthropic-version", "2023-06-01"), ("x-claude-code-request-class", "main"),
            (SESSION_HEADER, session), ("x-api-key", CLIENT_KEY), *extra]


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ca = TestCA(tmp / "ca")
        self.fakes = {"anthropic": FakeServer("anthropic", self.ca).start(),
                      "glm": FakeServer("glm", self.ca, prefix="/api/anthropic").start()}
        self.base = self.config()
        self.mitm = Mitmdump.router(tmp / "router", self.ca, self.base, env={GLM_ENV: GLM_KEY},
                                    options={"sessionpin_max_body_mb": LIMIT_MB})
        self.store = self.mitm.options["sessionpin_store"]
        self.cli_env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONPIN_") or k == "SESSIONPIN_STORE_MEMORY"}

    def config(self, *names: str) -> str:
        table = {"anthropic": {"url": self.fakes["anthropic"].url},
                 "glm": {"url": self.fakes["glm"].url, "key_env": GLM_ENV, "models": MODELS}}
        names = names or tuple(table)
        return toml_config({n: table[n] for n in names}, {"claude-code": "glm"} if "glm" in names else {})

    # traffic
    def client(self, timeout: float = 30.0) -> Client:
        return Client.via_proxy(self.mitm.port, self.mitm.mitm_ca, timeout=timeout)

    def send(self, kind: str, session: str, *, path: str = "/v1/messages?beta=true", head: bytes = b"",
             body: bytes | None = None, extra: list[tuple[str, str]] = (), timeout: float = 30.0) -> Reply:
        data = body if body is not None else body_of(kind, session, head)
        return self.client(timeout).request("POST", self.fakes["anthropic"].origin + path,
                                            headers_of(session, extra), data)

    def get(self, path: str, headers: list[tuple[str, str]] = ()) -> Reply:
        return self.client(10).request("GET", self.fakes["anthropic"].origin + path, headers)

    def status(self) -> dict[str, Any]:
        r = self.get("/__sessionpin/status")
        assert r.status == 200, r.text
        return r.json()

    def metrics(self) -> str:
        r = self.get("/__sessionpin/metrics")
        assert r.status == 200, r.text
        return r.text

    def wait_servers(self, names: set[str], timeout: float = 10.0) -> dict[str, Any]:
        """Wait until the running proxy's config has exactly these servers."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if set(status["servers"]) == names:
                return status
            assert time.monotonic() < deadline, f"the proxy still has {sorted(status['servers'])}"
            time.sleep(0.05)

    def restore(self) -> None:
        if self.mitm.config_path.read_text() != self.base:
            self.mitm.write_config(self.base)
        self.wait_servers({"anthropic", "glm"})

    def cli(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*sessionpin_argv(), "--config", str(self.mitm.config_path), "--store", self.store,
                               *argv], capture_output=True, text=True, env=self.cli_env, stdin=subprocess.DEVNULL,
                              timeout=60)

    # what the fakes saw
    def of(self, session: str) -> dict[str, list[Received]]:
        return {name: got for name, f in self.fakes.items()
                if (got := [r for r in f.received() if r.header(SESSION_HEADER) == session])}

    def pinned(self) -> str:
        """A fresh conversation, opened and pinned to glm."""
        s = str(uuid.uuid4())
        r = self.send("opening", s)
        assert r.status == 200 and r.json()["content"][0]["text"] == "reply from glm.", r.text[:300]
        return s

    def assert_no_foreign_keys(self, since: dict[str, int]) -> None:
        for name, fake in self.fakes.items():
            for r in fake.received()[since.get(name, 0):]:
                raw = r.raw()
                for secret, owner in OWNER.items():
                    assert owner == name or secret.encode() not in raw, (
                        f"{name} received a secret meant for {owner}: {r.method} {r.path}")

    def close(self) -> None:
        self.mitm.stop()
        for f in self.fakes.values():
            f.stop()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("e2e-faults"))
    try:
        r.mitm.start()
        yield r
    finally:
        r.close()


@pytest.fixture(autouse=True)
def _clean(rig: Rig) -> Iterator[None]:
    if not rig.mitm.alive:
        rig.mitm.start()
    for f in rig.fakes.values():
        f.canned = None
    since = {name: len(f.received()) for name, f in rig.fakes.items()}
    yield
    rig.assert_no_foreign_keys(since)


def refusal_message(r: Reply) -> str:
    err = r.json()
    assert err["type"] == "error", err
    return err["error"]["message"]


# --------------------------------------------------------------------------- row 4 (first: it measures RSS)


def _rss_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def test_a_200_mb_body_is_refused_413_without_being_buffered(rig: Rig) -> None:
    pid = rig.mitm.proc.pid
    try:   # reset the peak (Linux >= 4.0); without it this test, run first, measures from start
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass
    rss_before = _rss_kb(pid, "VmRSS")
    s = rig.pinned()
    size = 200 * 1024 * 1024
    chunk = (b'{"model":"' + OPUS.encode() + b'","messages":[{"role":"user","content":"'
             + b"x" * (1024 * 1024))[:1024 * 1024]
    conn = rig.client(120).connect(rig.fakes["anthropic"].origin)
    c = conn._conn
    c.putrequest("POST", "/v1/messages?beta=true", skip_accept_encoding=True)
    for k, v in headers_of(s):
        c.putheader(k, v)
    c.putheader("Content-Length", str(size))
    c.endheaders()
    sent = 0
    try:
        while sent < size:
            c.send(chunk)
            sent += len(chunk)
    except OSError:
        pass   # the proxy may answer and close before the whole body is sent
    resp = c.getresponse()
    status, text = resp.status, resp.read().decode("utf-8", "replace")
    conn.close()
    peak = _rss_kb(pid, "VmHWM")
    assert status == 413, text[:300]
    err = json.loads(text)
    assert err["error"]["type"] == "request_too_large" and "sessionpin_max_body_mb" in err["error"]["message"]
    assert [len(x) for x in rig.of(s).values()] == [1], "only the opening reached a server"
    # generous (the machine is shared): buffering it whole took ~600 MB more
    assert peak - rss_before < 300 * 1024, f"the proxy's peak RSS grew by {(peak - rss_before) // 1024} MB"
    assert 'sessionpin_refusals_total{reason="too-large"}' in rig.metrics()
    # the conversation goes on
    assert rig.send("continuation", s).status == 200 and len(rig.of(s)["glm"]) == 2


def _send_chunked(client: Client, origin: str, session: str, body_chunks) -> tuple[int, str]:
    """POST with ``Transfer-Encoding: chunked`` (no length): the proxy cannot judge it at its headers."""
    conn = client.connect(origin)
    c = conn._conn
    c.putrequest("POST", "/v1/messages?beta=true", skip_accept_encoding=True)
    for k, v in headers_of(session):
        c.putheader(k, v)
    c.putheader("Transfer-Encoding", "chunked")
    c.endheaders()
    try:
        for chunk in body_chunks:
            c.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        c.send(b"0\r\n\r\n")
    except OSError:
        pass   # the proxy may answer and close before the whole body is sent
    resp = c.getresponse()
    status, text = resp.status, resp.read().decode("utf-8", "replace")
    conn.close()
    return status, text


SMALL_LIMIT_MB = 16


def test_a_200_mb_body_without_a_length_is_refused_413_without_being_buffered(rig: Rig, tmp_path: Path) -> None:
    """The same body sent chunked: no Content-Length to judge at the headers. The proxy
    buffers such a body up to its limit only (mitmproxy's stream_large_bodies, set to the
    limit), then streams it to its sink for the 413 (before: buffered whole). A router of
    its own with a 16 MiB limit, so that "up to the limit" and "whole" are far apart."""
    mitm = Mitmdump.router(tmp_path / "small", rig.ca, rig.base, env={GLM_ENV: GLM_KEY},
                           options={"sessionpin_max_body_mb": SMALL_LIMIT_MB})
    mitm.start()
    try:
        client = Client.via_proxy(mitm.port, mitm.mitm_ca, timeout=120)
        origin = rig.fakes["anthropic"].origin
        s = str(uuid.uuid4())
        r = client.request("POST", origin + "/v1/messages?beta=true", headers_of(s), body_of("opening", s))
        assert r.status == 200 and r.json()["content"][0]["text"] == "reply from glm.", r.text[:300]
        pid = mitm.proc.pid
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        except OSError:
            pass
        rss_before = _rss_kb(pid, "VmRSS")
        chunk = (b'{"model":"' + OPUS.encode() + b'","messages":[{"role":"user","content":"'
                 + b"x" * (1024 * 1024))[:1024 * 1024]
        status, text = _send_chunked(client, origin, s, (chunk for _ in range(200)))
        peak = _rss_kb(pid, "VmHWM")
        assert status == 413, text[:300]
        err = json.loads(text)
        assert err["error"]["type"] == "request_too_large" and "sent without a length" in err["error"]["message"]
        assert [len(x) for x in rig.of(s).values()] == [1], "only the opening reached a server"
        # mitmproxy holds up to the limit (and copies of it while it switches to streaming):
        # a few times 16 MiB, never the 200 MB (buffering it whole took ~600 MB more)
        assert peak - rss_before < 120 * 1024, f"the proxy's peak RSS grew by {(peak - rss_before) // 1024} MB"
        # a chunked body within the limit is routed as any other: to its pin, renamed, glm's key
        small = body_of("continuation", s)
        status, text = _send_chunked(client, origin, s, [small[:100], small[100:]])
        assert status == 200 and json.loads(text)["content"][0]["text"] == "reply from glm.", text[:300]
        got = rig.of(s)
        assert list(got) == ["glm"] and len(got["glm"]) == 2
        last = got["glm"][-1]
        assert last.header("x-api-key") == GLM_KEY and last.json()["model"] == "glm-4.6"
        assert last.header("x-sessionpin-sink") is None
        r = client.request("GET", origin + "/__sessionpin/metrics", [])
        assert 'sessionpin_refusals_total{reason="too-large"} 1' in r.text, r.text[:2000]
    finally:
        mitm.stop()


# --------------------------------------------------------------------------- row 1


def test_removed_or_emptied_config_never_moves_a_pinned_conversation(rig: Rig) -> None:
    s1 = rig.pinned()
    try:
        # `servers remove` of the server the conversation began addressed to: counted, and --force
        r = rig.cli("servers", "remove", "anthropic")
        assert r.returncode != 0, r.stdout + r.stderr
        said = r.stdout + r.stderr
        assert re.search(r"\d+ running conversations? began addressed to anthropic", said), said
        assert "--force" in said, said
        assert "[servers.anthropic]" in rig.mitm.config_path.read_text()
        r = rig.cli("servers", "remove", "anthropic", "--force")
        assert r.returncode == 0, r.stdout + r.stderr
        rig.wait_servers({"glm"})
        # the pin is consulted though its origin is no longer configured
        r = rig.send("continuation", s1)
        assert r.status == 200 and r.json()["content"][0]["text"] == "reply from glm.", r.text[:300]
        got = rig.of(s1)
        assert list(got) == ["glm"] and len(got["glm"]) == 2
        assert got["glm"][-1].header("x-api-key") == GLM_KEY and got["glm"][-1].json()["model"] == "glm-4.6"
        # … only on an exact inference path: at a look-alike its turn is refused (a gateway's
        # versioned path looks the same: docs/router.md), another API's resource passes where
        # it was sent, untouched, and an ambiguous path is refused
        r = rig.send("continuation", s1, path="/v1/threads/x/messages")
        assert r.status == 424 and "anthropic" not in rig.of(s1) and len(rig.of(s1)["glm"]) == 2, r.text[:300]
        r = rig.send("continuation", s1, path="/v1/threads/x/messages", body=ASSISTANTS_MESSAGE)
        assert r.status == 200 and rig.of(s1)["anthropic"][0].header("x-api-key") == CLIENT_KEY
        r = rig.send("continuation", s1, path="/../../v1/messages")
        assert r.status == 400 and len(rig.of(s1)["anthropic"]) == 1 and len(rig.of(s1)["glm"]) == 2
        # a new conversation addressed to it is no longer routed: it goes where it was addressed
        s2 = str(uuid.uuid4())
        assert rig.send("opening", s2).status == 200
        assert list(rig.of(s2)) == ["anthropic"] and rig.of(s2)["anthropic"][0].header("x-api-key") == CLIENT_KEY

        # the config emptied while running: valid, routes nothing new, moves nothing pinned
        rig.mitm.write_config("")
        status = rig.wait_servers(set())
        assert not status.get("config_error"), status.get("config_error")
        r = rig.send("continuation", s1)
        assert r.status == 424 and r.header("retry-after") is None, r.text[:300]   # no agent retries it
        message = refusal_message(r)
        assert "glm" in message and s1[:8] in message, message
        assert len(rig.of(s1)["glm"]) == 2 and len(rig.of(s1)["anthropic"]) == 1, "sent nowhere"
        s3 = str(uuid.uuid4())
        assert rig.send("opening", s3).status == 200 and list(rig.of(s3)) == ["anthropic"]
        # the pinned server itself removed with the CLI: counted, --force, then 424
        rig.mitm.write_config(rig.config("anthropic", "glm"))
        rig.wait_servers({"anthropic", "glm"})
        assert rig.cli("use", "claude-code", "--not-routed").returncode == 0
        r = rig.cli("servers", "remove", "glm")
        said = r.stdout + r.stderr
        assert r.returncode != 0 and re.search(r"\d+ running conversations? (is|are) pinned to glm", said), said
        assert "424" in said and "--force" in said, said
        assert rig.cli("servers", "remove", "glm", "--force").returncode == 0
        rig.wait_servers({"anthropic"})
        r = rig.send("continuation", s1)
        assert r.status == 424 and "glm" in refusal_message(r), r.text[:300]
        assert len(rig.of(s1)["anthropic"]) == 1
    finally:
        rig.restore()
    # glm back: the conversation is where it was
    r = rig.send("continuation", s1)
    assert r.status == 200 and len(rig.of(s1)["glm"]) == 3 and len(rig.of(s1)["anthropic"]) == 1


# --------------------------------------------------------------------------- row 2


@pytest.mark.parametrize("code,where", [(307, "other"), (302, "own"), (308, "relative")])
def test_a_redirect_from_the_routed_server_is_a_502_and_is_not_followed(rig: Rig, code: int, where: str) -> None:
    glm = rig.fakes["glm"]
    location = {"other": "https://evil.example/v1/messages",
                "own": glm.origin + "/api/anthropic/v1/messages?moved=1",
                "relative": "/api/anthropic/v1/messages"}[where]
    host = {"other": "evil.example", "own": "127.0.0.1", "relative": "127.0.0.1"}[where]
    glm.canned = lambda rec: (code, [("Location", location), ("Content-Type", "text/plain")], b"moved")
    s = str(uuid.uuid4())
    r = rig.send("opening", s)
    glm.canned = None
    assert r.status == 502, (r.status, r.text[:300])
    assert r.header("location") is None
    message = refusal_message(r)
    assert "glm" in message and host in message and str(code) in message, message
    assert r.header("x-sessionpin-refused") == "redirect"
    got = rig.of(s)
    assert list(got) == ["glm"] and len(got["glm"]) == 1, "nothing followed"


# --------------------------------------------------------------------------- row 3


def look_alikes(n_bytes: int) -> bytes:
    """A head member holding thousands of ``{"messages":0}``, nested in an array."""
    one = b'{"messages":0}'
    n = n_bytes // (len(one) + 1)
    return b'"h":[' + b",".join([one] * n) + b"]"


def test_nested_look_alike_keys_do_not_stall_the_proxy(rig: Rig) -> None:
    head = look_alikes(1_200_000)
    # an opening (routed, its history head recorded after the answer), a continuation never
    # seen begin (its lineage looked up), and a pinned conversation's turn (renamed)
    s_open, s_unseen = str(uuid.uuid4()), str(uuid.uuid4())
    r = rig.send("opening", s_open, head=head, timeout=30)
    assert r.status == 200, r.text[:300]
    assert list(rig.of(s_open)) == ["glm"] and rig.of(s_open)["glm"][0].json()["model"] == "glm-4.6"
    r = rig.send("continuation", s_unseen, head=head, timeout=30)
    assert r.status == 200 and list(rig.of(s_unseen)) == ["anthropic"]
    r = rig.send("continuation", s_open, head=head, timeout=30)
    assert r.status == 200 and len(rig.of(s_open)["glm"]) == 2
    # and the proxy still answers at once
    assert rig.send("opening", str(uuid.uuid4()), timeout=30).status == 200


# --------------------------------------------------------------------------- row 5


def deep(n: int) -> bytes:
    return b'"deep":' + b"[" * n + b"]" * n


@pytest.mark.parametrize("case", ["70 MB", "10k-deep", "gzip that is not", "unknown coding"])
def test_an_unreadable_body_of_a_moved_session_is_refused_never_sent_unmapped(rig: Rig, case: str) -> None:
    s = rig.pinned()
    extra: list[tuple[str, str]] = []
    body = body_of("continuation", s)
    if case == "70 MB":
        body = body_of("continuation", s, head=b'"pad":"' + b"x" * (70 * 1024 * 1024) + b'"')
    elif case == "10k-deep":
        body = body_of("continuation", s, head=deep(10_000))
    elif case == "gzip that is not":
        extra = [("Content-Encoding", "gzip")]
    else:
        extra = [("Content-Encoding", "x-sessionpin-unknown")]
        body = gzip.compress(body)
    r = rig.send("continuation", s, body=body, extra=extra, timeout=120)
    del body
    got = rig.of(s)
    assert list(got) == ["glm"], "the addressed server got nothing"
    for rec in got["glm"][1:]:   # anything forwarded was renamed (bytes: it may not even parse)
        assert OPUS.encode() not in rec.body and b"glm-4.6" in rec.body
    assert r.status == 502, (r.status, r.text[:300])
    message = refusal_message(r)
    assert "cannot rename the model for server glm" in message and "could not be read" in message, message
    assert len(got["glm"]) == 1
    # the conversation's readable turns go on
    assert rig.send("continuation", s).status == 200 and len(rig.of(s)["glm"]) == 2


# --------------------------------------------------------------------------- row 6


SECRETS = [f"SECRET-{i}-{RUN}" for i in range(8)]


def test_unknown_headers_and_query_parameters_never_reach_the_other_server(rig: Rig) -> None:
    s = str(uuid.uuid4())
    extra = [("x-access", SECRETS[0]), ("openai-organization", f"org-{SECRETS[1]}"),
             ("anthropic-organization-id", SECRETS[2]), ("chatgpt-account-id", SECRETS[3]),
             ("Authorization", f"Bearer {SECRETS[4]}")]
    r = rig.send("opening", s, path=f"/v1/messages?beta=true&sig={SECRETS[5]}&code={SECRETS[6]}", extra=extra)
    assert r.status == 200, r.text[:300]
    got = rig.of(s)
    assert list(got) == ["glm"]
    rec = got["glm"][0]
    assert rec.path == "/api/anthropic/v1/messages?beta=true"
    names = {k.lower() for k, _ in rec.headers}
    assert not names & {"x-access", "openai-organization", "anthropic-organization-id", "chatgpt-account-id",
                        "authorization"}, names
    assert [v for k, v in rec.headers if k.lower() == "x-api-key"] == [GLM_KEY], "only its own credential"
    assert rec.header("anthropic-version") == "2023-06-01" and rec.header("user-agent").startswith("claude-cli/")
    raw = rec.raw()
    assert not [x for x in SECRETS if x.encode() in raw] and CLIENT_KEY.encode() not in raw
    # an obs-folded header (mitmproxy takes it, its value keeps the fold): an allowed name, dropped
    s2 = str(uuid.uuid4())
    r = rig.send("opening", s2, extra=[("x-claude-code-note", f"a\r\n {SECRETS[7]}")])
    assert r.status == 200 and list(rig.of(s2)) == ["glm"], r.text[:300]
    rec = rig.of(s2)["glm"][0]
    assert rec.header("x-claude-code-note") is None and SECRETS[7].encode() not in rec.raw()
    assert [v for k, v in rec.headers if k.lower() == "x-api-key"] == [GLM_KEY]


# --------------------------------------------------------------------------- rows 7 and 8


# the Assistants API's "add a message to a thread": another API's resource, not inference
ASSISTANTS_MESSAGE = json.dumps({"role": "user", "content": "hello"}).encode()


@pytest.mark.parametrize("path", ["/v1/threads/x/messages", "/v1/organizations/x/messages"])
def test_look_alike_paths_of_a_pinned_session_are_not_routed(rig: Rig, path: str) -> None:
    """Never routed (no server's key attached). A turn of the conversation there (an inference
    body: a model) is refused, sent nowhere — a gateway's versioned path looks the same
    (Cloudflare's /v1/ACCT/GW/anthropic/v1/messages); another API's resource passes untouched."""
    s = rig.pinned()
    r = rig.send("continuation", s, path=path)
    assert r.status == 424 and r.header("x-sessionpin-refused") == "unnamed-path", (r.status, r.text[:300])
    assert list(rig.of(s)) == ["glm"] and len(rig.of(s)["glm"]) == 1, "not routed, sent nowhere"
    r = rig.send("continuation", s, path=path, body=ASSISTANTS_MESSAGE)
    assert r.status == 200
    got = rig.of(s)
    assert len(got["glm"]) == 1, "not routed"
    rec = got["anthropic"][0]
    assert rec.path == path and rec.header("x-api-key") == CLIENT_KEY and GLM_KEY.encode() not in rec.raw()


@pytest.mark.parametrize("path", ["/../../v1/messages", "/v1%2fmessages", "/x/%2e%2e/v1/messages"])
def test_ambiguous_paths_of_a_pinned_session_are_refused(rig: Rig, path: str) -> None:
    s = rig.pinned()
    r = rig.send("continuation", s, path=path)
    assert r.status == 400, (r.status, r.text[:300])
    assert "ambiguous" in refusal_message(r)
    assert [len(x) for x in rig.of(s).values()] == [1] and "anthropic" not in rig.of(s)


# --------------------------------------------------------------------------- row 9


def test_a_key_pasted_as_key_env_is_never_echoed(rig: Rig, tmp_path: Path) -> None:
    pasted = f"sk-ant-api03-PASTED-{RUN}-" + "Q" * 40
    bad = rig.base.replace(f'key_env = "{GLM_ENV}"', f'key_env = "{pasted}"')
    assert bad != rig.base
    since = rig.mitm.line_count
    try:
        rig.mitm.write_config(bad)
        assert rig.mitm.wait_output(r"config rejected", timeout=10, since=since), rig.mitm.tail(20)
        status_text = rig.get("/__sessionpin/status").text
        assert "looks like a key" in status_text and pasted not in status_text
        assert pasted not in rig.metrics()
        # requests go on under the previous config; nothing echoes the key
        s = str(uuid.uuid4())
        r = rig.send("opening", s)
        assert r.status == 200 and list(rig.of(s)) == ["glm"]
        assert pasted.encode() not in r.body
        for f in rig.fakes.values():
            assert not [x for x in f.received() if pasted.encode() in x.raw()]
        # the CLI: its status and doctor read the bad file; servers add refuses the value
        for argv in (["status"], ["doctor"], ["servers", "list"],
                     ["servers", "add", "other", "https://127.0.0.1:9/", "--key-env", pasted]):
            out = rig.cli(*argv)
            assert pasted not in out.stdout + out.stderr, argv
        out = rig.cli("servers", "add", "other", "https://127.0.0.1:9/", "--key-env", pasted)
        assert out.returncode != 0 and "looks like a key" in out.stdout + out.stderr
        # at start: exits 1 with the line, the key not in it
        other = Mitmdump.router(tmp_path / "bad", rig.ca, bad, env={GLM_ENV: GLM_KEY})
        with pytest.raises(Exception):
            other.start()
        assert other.wait_exit(20) == 1
        assert "looks like a key" in other.output and pasted not in other.output
    finally:
        rig.restore()
    assert pasted not in rig.mitm.output


# --------------------------------------------------------------------------- row 10


@pytest.mark.parametrize("path", ["/__sessionpin/status", "/__sessionpin/metrics"])
@pytest.mark.parametrize("host", ["evil", "evil.example:443", "127.0.0.1.evil.example"])
def test_status_and_metrics_refuse_a_foreign_host(rig: Rig, path: str, host: str) -> None:
    r = rig.get(path, [("Host", host)])
    assert r.status == 403, (r.status, r.text[:200])
    for leak in (str(rig.mitm.config_path), rig.store, rig.fakes["glm"].url, "sessionpin_pins"):
        assert leak not in r.text
    assert rig.get(path).status == 200   # its own loopback Host is answered
