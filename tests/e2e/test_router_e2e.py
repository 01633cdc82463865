"""The router end to end: a real ``mitmdump -s addons/route.py``, real TLS, fake servers on loopback.

Black-box: each test writes the config file of issue 4, sends Claude-Code-shaped requests through
the proxy in regular mode (CONNECT, trusting the mitmproxy CA) addressed to the fake "anthropic"
origin, and checks what every fake server received. One mitmdump serves the whole module (it is
restarted only where a test is about restarts); every test uses fresh session ids, so tests do
not share pins, and each starts by writing the config it needs.

Servers (all on 127.0.0.1, each with its own port and sentinel key):
- anthropic: the origin the client addresses; the client's own credentials belong here only.
- glm: under the prefix /api/anthropic; key from $SESSIONPIN_E2E_GLM_KEY; opus/haiku renamed.
- alt: key from $SESSIONPIN_E2E_ALT_KEY, auth = "bearer" (used for the removed/unreachable cases).
- nokey: configured with no key_env (may only receive requests addressed to itself).
- elsewhere: not configured at all (requests to it are out of scope).
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import pytest

from sessionpin.decision.headers import allowed as allowed_header
from sessionpin.reader.ids import short

from .harness import (Client, FakeServer, Mitmdump, MitmdumpError, Received, Reply, TestCA, free_port, running_rig,
                      toml_config)

RUN = uuid.uuid4().hex[:8]
CLIENT_KEY = f"sk-ant-api03-CLIENT-SENTINEL-{RUN}"
CLIENT_OAUTH = f"sk-ant-oat01-CLIENT-OAUTH-SENTINEL-{RUN}"
CLIENT_COOKIE = f"CLIENT-COOKIE-SENTINEL-{RUN}"
GLM_ENV = "SESSIONPIN_E2E_GLM_KEY"
GLM_KEY = f"glm-SENTINEL-{RUN}"
ALT_ENV = "SESSIONPIN_E2E_ALT_KEY"
ALT_KEY = f"alt-SENTINEL-{RUN}"
NOKEY_CLIENT_KEY = f"sk-ant-api03-NOKEY-CLIENT-SENTINEL-{RUN}"
ELSEWHERE_CLIENT_KEY = f"sk-ant-api03-ELSEWHERE-CLIENT-SENTINEL-{RUN}"
PROMPT = f"PROMPT-SENTINEL-{RUN}"  # in every prompt: it must never reach a log line or the disk

# which fake server each secret may reach: none may ever show up anywhere else
OWNER = {
    CLIENT_KEY: "anthropic", CLIENT_OAUTH: "anthropic", CLIENT_COOKIE: "anthropic",
    GLM_KEY: "glm", ALT_KEY: "alt", NOKEY_CLIENT_KEY: "nokey", ELSEWHERE_CLIENT_KEY: "elsewhere",
}

MODELS = {"claude-opus-*": "glm-4.6", "claude-haiku-*": "glm-4.5-air"}
OPUS = "claude-opus-4-5-20251101"
HAIKU = "claude-haiku-4-5-20251001"
SESSION_HEADER = "X-Claude-Code-Session-Id"
CREDENTIAL_HEADERS = {"x-api-key", "authorization", "cookie"}
# set by the HTTP layer, not by the agent: allowed to differ after routing
TRANSPORT_HEADERS = {"host", "content-length", "connection", "transfer-encoding"}
ANTHROPIC_EVENTS = ["message_start", "content_block_start", "ping", "content_block_delta",
                    "content_block_delta", "content_block_delta", "content_block_stop",
                    "message_delta", "message_stop"]


# --------------------------------------------------------------------------- Claude Code requests


TOOLS = [
    {"name": "Bash", "description": "Run a shell command.",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                      "required": ["command"], "additionalProperties": False,
                      "$schema": "http://json-schema.org/draft-07/schema#"}},
    {"name": "Read", "description": "Read a file.",
     "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}},
    {"name": "Task", "description": "Launch a subagent.",
     # a nested "model" with a model name: only the top-level model may ever change
     "input_schema": {"type": "object", "properties": {
         "prompt": {"type": "string"},
         "model": {"type": "string", "enum": [OPUS, HAIKU], "default": OPUS}}}},
]


def billing(subagent: bool = False) -> dict[str, Any]:
    extra = " cc_is_subagent=true;" if subagent else ""
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332.e4b; cc_entrypoint=cli; cch=7f3a1;{extra}"}


SYSTEM = [billing(), {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                      "cache_control": {"type": "ephemeral"}},
          {"type": "text", "text": "Working directory: /home/dev/proj. Be brief — café ✓."}]

USER_PROMPT = {"role": "user", "content": [
    {"type": "text", "text": "<system-reminder>Résumé of context ✓</system-reminder>"},
    {"type": "text", "text": f"Fix the failing test. {PROMPT}", "cache_control": {"type": "ephemeral"}}]}
def history(session: str | None) -> list[dict]:
    """A conversation under way: its first answer made by a server, with a tool-call id of its own
    (a real server's ids and signatures are unique: two conversations never share a first exchange,
    so one is never taken for a fork of another)."""
    tool_id = "toolu_01A" + (session or "none").replace("-", "")[:12]
    return [
        USER_PROMPT,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Look at the test first.",
             "signature": "EqQBCkYIBxgCKkB0c2lnbmF0dXJlLWJ5dGVzLXRoYXQtbXVzdC1zdGF5LWV4YWN0"},
            {"type": "tool_use", "id": tool_id, "name": "Bash", "input": {"command": "pytest -x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": "1 failed"}]},
    ]


@dataclass
class Req:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    model: str | None = None

    def mapped_body(self, new_model: str) -> bytes:
        """The body with only the top-level model's bytes changed (the model is its first key)."""
        old = f'"model": {json.dumps(self.model)}'.encode()
        assert self.body.count(old) >= 1
        return self.body.replace(old, f'"model": {json.dumps(new_model)}'.encode(), 1)


def encode(body: dict[str, Any]) -> bytes:
    # Indented, ASCII-escaped JSON: re-serialising it in any usual way changes its bytes,
    # so a router that rewrites more than the model name is caught.
    return json.dumps(body, indent=1, ensure_ascii=True).encode()


def cc(kind: str, session: str | None, *, model: str | None = None, stream: bool = True,
       auth: str = "x-api-key", key: str = CLIENT_KEY, cookie: bool = False) -> Req:
    """A request shaped as Claude Code 2.1.332 sends it (see shared/reference/agent-traffic.md)."""
    request_class = {"opening": "main", "continuation": "main", "title": "auxiliary", "suggestion": "auxiliary",
                     "subagent": "subagent", "count_tokens": "auxiliary"}[kind]
    headers = [
        ("Accept", "application/json"),
        ("Content-Type", "application/json"),
        ("User-Agent", "claude-cli/2.1.332 (external, cli)"),
        ("anthropic-version", "2023-06-01"),
        ("anthropic-beta", "claude-code-20250219,interleaved-thinking-2025-05-14"),
        ("x-app", "cli"),
        ("x-claude-code-request-class", request_class),
    ]
    if session is not None:
        headers.append((SESSION_HEADER, session))
    if auth == "bearer":
        headers.append(("Authorization", f"Bearer {CLIENT_OAUTH}"))
    else:
        headers.append(("x-api-key", key))
    if cookie:
        headers.append(("Cookie", f"sid={CLIENT_COOKIE}"))
    meta = {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": session or ""})}
    path = "/v1/messages?beta=true"
    if kind == "opening":
        headers.append(("x-claude-code-prompt-id", str(uuid.uuid4())))
        model = model or OPUS
        body = {"model": model, "messages": [USER_PROMPT], "system": SYSTEM, "tools": TOOLS,
                "metadata": meta, "max_tokens": 32000, "thinking": {"type": "enabled", "budget_tokens": 31999},
                "stream": stream}
    elif kind == "continuation":
        model = model or OPUS
        body = {"model": model, "messages": history(session), "system": SYSTEM, "tools": TOOLS,
                "metadata": meta, "max_tokens": 32000, "thinking": {"type": "enabled", "budget_tokens": 31999},
                "stream": stream}
    elif kind == "suggestion":
        model = model or OPUS
        body = {"model": model, "messages": history(session) + [{"role": "user", "content": "[SUGGESTION MODE: suggest]"}],
                "system": SYSTEM, "tools": TOOLS, "metadata": meta, "max_tokens": 32000, "stream": stream}
    elif kind == "title":
        model = model or HAIKU
        body = {"model": model, "messages": [{"role": "user", "content": f"Fix the failing test. {PROMPT}"}],
                "system": [billing(), {"type": "text", "text": "Generate a concise title for this conversation."}],
                "metadata": meta, "max_tokens": 512, "temperature": 0,
                "output_format": {"type": "json_schema", "schema": {"type": "object", "properties": {
                    "title": {"type": "string"}}, "required": ["title"]}},
                "stream": stream}
    elif kind == "subagent":
        headers += [("x-claude-code-agent-id", "agent_" + uuid.uuid4().hex[:8]),
                    ("x-claude-code-agent-type", "general-purpose")]
        model = model or OPUS
        body = {"model": model, "messages": [{"role": "user", "content": f"Find where the test fixture is defined. {PROMPT}"}],
                "system": [billing(subagent=True), SYSTEM[1], {"type": "text", "text": "You are a search agent."}],
                "tools": TOOLS[:2], "metadata": meta, "max_tokens": 32000, "stream": stream}
    elif kind == "count_tokens":
        model = model or OPUS
        path = "/v1/messages/count_tokens?beta=true"
        body = {"model": model, "messages": [USER_PROMPT], "tools": TOOLS}
    else:
        raise ValueError(kind)
    return Req("POST", path, headers, encode(body), model)


# --------------------------------------------------------------------------- the rig


class Rig:
    """The fakes, the mitmdump and the config file of this module."""

    def __init__(self, tmp, ca: TestCA, fakes: dict[str, FakeServer]) -> None:
        self.ca = ca
        self.fakes = fakes
        self.applied = self.config()
        # regular mode (the agents' HTTPS_PROXY) and reverse mode to the anthropic origin, at once
        self.mitm = Mitmdump.router(tmp / "router", ca, self.applied, env={GLM_ENV: GLM_KEY, ALT_ENV: ALT_KEY},
                                    modes=["regular", f"reverse:{fakes['anthropic'].origin}@{free_port()}"])

    # config
    def servers(self, *names: str) -> dict[str, dict[str, Any]]:
        f = self.fakes
        table = {
            "anthropic": {"url": f["anthropic"].url},
            "glm": {"url": f["glm"].url, "key_env": GLM_ENV, "models": MODELS},
            "alt": {"url": f["alt"].url, "key_env": ALT_ENV, "auth": "bearer"},
            "nokey": {"url": f["nokey"].url},
        }
        return {n: table[n] for n in (names or table)}

    def config(self, current: str | None = "glm", servers: tuple[str, ...] = ()) -> str:
        return toml_config(self.servers(*servers), {"claude-code": current})

    def set_config(self, current: str | None = "glm", servers: tuple[str, ...] = ()) -> None:
        """Write the config and wait until the running proxy has taken it (at most ~3 s)."""
        text = self.config(current, servers)
        if text == self.applied:
            if self.mitm.config_path.read_text() != text:
                self.mitm.write_config(text)  # a refused file left behind: same meaning, nothing to wait for
            return
        self.applied = text
        if not self.mitm.alive:
            self.mitm.write_config(text)
            return
        want = (current, set(self.servers(*servers)))
        self.mitm.write_config(text)
        # The status endpoint shows the servers and the agents' current servers (issue 4):
        # wait until it shows the new ones. Without a readable status, allow the reload 2 s.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            status = self.status()
            if status is None:
                time.sleep(2.0)
                return
            if (status["agents"].get("claude-code"), set(status["servers"])) == want:
                return
            time.sleep(0.05)

    def status(self) -> dict[str, Any] | None:
        try:
            r = self.get("/__sessionpin/status")
            status = r.json() if r.status == 200 else None
        except (OSError, ValueError):
            return None
        ok = isinstance(status, dict) and isinstance(status.get("agents"), dict) and isinstance(status.get("servers"), dict)
        return status if ok else None

    # traffic
    def client(self, timeout: float = 30.0) -> Client:
        return Client.via_proxy(self.mitm.port, self.mitm.mitm_ca, timeout=timeout)

    def send(self, req: Req, to: str = "anthropic", timeout: float = 30.0) -> Reply:
        return self.client(timeout).request(req.method, self.fakes[to].origin + req.path, req.headers, req.body)

    def get(self, path: str, to: str = "anthropic", headers: list[tuple[str, str]] | None = None) -> Reply:
        return self.client(10).request("GET", self.fakes[to].origin + path, headers or [])

    # what the fakes saw
    def of(self, session: str) -> dict[str, list[Received]]:
        out: dict[str, list[Received]] = {}
        for name, fake in self.fakes.items():
            got = [r for r in fake.received() if r.header(SESSION_HEADER) == session]
            if got:
                out[name] = got
        return out

    def where(self, session: str) -> dict[str, int]:
        """How many requests of ``session`` each fake received."""
        return {name: len(got) for name, got in self.of(session).items()}

    def total(self) -> Counter[str]:
        return Counter({name: len(f.received()) for name, f in self.fakes.items()})

    def assert_no_foreign_keys(self, since: dict[str, int] | None = None) -> None:
        """No fake received a secret that belongs to another (only requests after ``since``)."""
        for name, fake in self.fakes.items():
            for r in fake.received()[(since or {}).get(name, 0):]:
                raw = r.raw()
                for secret, owner in OWNER.items():
                    assert owner == name or secret.encode() not in raw, (
                        f"{name} received a secret meant for {owner}: {r.method} {r.path}")


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    def fakes(ca: TestCA) -> dict[str, FakeServer]:
        return {
            "anthropic": FakeServer("anthropic", ca),
            "glm": FakeServer("glm", ca, prefix="/api/anthropic"),
            "alt": FakeServer("alt", ca),
            "nokey": FakeServer("nokey", ca),
            "elsewhere": FakeServer("elsewhere", ca),
        }
    with running_rig(tmp_path_factory.mktemp("e2e-router"), fakes, Rig) as r:
        yield r


@pytest.fixture(autouse=True)
def _alive_and_clean(rig: Rig) -> Iterator[None]:
    if not rig.mitm.alive:  # a test that killed it and failed before restarting it
        rig.mitm.start()
    for f in rig.fakes.values():
        f.pause_ms = f.pause_after_first_ms = 0
        f.status = None
        f.deltas = 3
        if not f.running:
            f.start()
    since = {name: len(f.received()) for name, f in rig.fakes.items()}
    yield
    rig.assert_no_foreign_keys(since)  # this test's traffic; the last test checks everything


def new_session() -> str:
    return str(uuid.uuid4())


def headers_of(req: Req) -> list[tuple[str, str]]:
    return [(k.lower(), v) for k, v in req.headers]


def received_headers(r: Received) -> list[tuple[str, str]]:
    return [(k.lower(), v) for k, v in r.headers]


def assert_untouched(got: Received, req: Req) -> None:
    """Left alone: the same path, the same headers (bar transport ones), the same body bytes."""
    assert got.path == req.path
    assert got.body == req.body
    sent = Counter(h for h in headers_of(req) if h[0] not in TRANSPORT_HEADERS)
    seen = Counter(h for h in received_headers(got) if h[0] not in TRANSPORT_HEADERS)
    assert seen == sent


def assert_routed(got: Received, req: Req, *, key_header: str, key_value: str, prefix: str = "",
                  model: str | None = None) -> None:
    """Routed: prefix + the same path, the server's key in place of the agent's, only the model
    changed, and of the agent's headers only those the allowlist keeps (sessionpin/decision/headers.py)."""
    assert got.path == prefix + req.path
    assert got.body == (req.mapped_body(model) if model else req.body)
    assert got.header("content-length") == str(len(got.body))
    sent = Counter(h for h in headers_of(req)
                   if h[0] not in TRANSPORT_HEADERS | CREDENTIAL_HEADERS and allowed_header(h[0]))
    seen = Counter(h for h in received_headers(got) if h[0] not in TRANSPORT_HEADERS | CREDENTIAL_HEADERS)
    assert seen == sent, "only credential headers and headers the allowlist drops may change"
    creds = [h for h in received_headers(got) if h[0] in CREDENTIAL_HEADERS]
    assert creds == [(key_header, key_value)]


# --------------------------------------------------------------------------- opening turns


@pytest.mark.parametrize("auth", ["x-api-key", "bearer"])
def test_opening_turn_goes_to_the_current_server_with_its_key_and_model(rig, auth):
    rig.set_config(current="glm")
    s = new_session()
    req = cc("opening", s, auth=auth, cookie=True)
    r = rig.send(req)
    assert r.status == 200, r.text
    assert r.event_names == ANTHROPIC_EVENTS
    assert "from glm" in r.events[3].data
    assert rig.where(s) == {"glm": 1}
    [got] = rig.of(s)["glm"]
    expect = ("x-api-key", GLM_KEY) if auth == "x-api-key" else ("authorization", f"Bearer {GLM_KEY}")
    assert_routed(got, req, key_header=expect[0], key_value=expect[1], prefix="/api/anthropic", model="glm-4.6")
    # the nested model name in the tools is not the top-level model: it stays
    assert got.body.count(json.dumps(OPUS).encode()) == req.body.count(json.dumps(OPUS).encode()) - 1
    assert rig.mitm.wait_output(rf"{s[:8]}.*glm", timeout=2.0), "one log line per decision, naming session and server"


def test_reverse_mode_routes_like_regular_mode(rig):
    rig.set_config(current="glm")
    s = new_session()
    req = cc("opening", s)
    r = Client.reverse(rig.mitm.ports[1]).request(req.method, "http://127.0.0.1" + req.path, req.headers, req.body)
    assert r.status == 200 and r.event_names == ANTHROPIC_EVENTS
    assert rig.where(s) == {"glm": 1}
    got = rig.of(s)["glm"][0]
    assert got.path == "/api/anthropic" + req.path and got.body == req.mapped_body("glm-4.6")
    assert got.header("x-api-key") == GLM_KEY
    rig.set_config(current="anthropic")
    assert rig.send(cc("continuation", s)).status == 200, "the same pin, through the regular-mode port"
    assert rig.where(s) == {"glm": 2}


def test_opening_to_a_server_with_auth_bearer_gets_a_bearer_key(rig):
    rig.set_config(current="alt")
    s = new_session()
    req = cc("opening", s, stream=False)
    r = rig.send(req)
    assert r.status == 200 and r.json()["content"][0]["text"] == "reply from alt."
    assert rig.where(s) == {"alt": 1}
    assert_routed(rig.of(s)["alt"][0], req, key_header="authorization", key_value=f"Bearer {ALT_KEY}")


def test_current_server_is_the_addressed_origin_leaves_the_request_alone(rig):
    rig.set_config(current="anthropic")
    s = new_session()
    req = cc("opening", s)
    assert rig.send(req).status == 200
    assert rig.where(s) == {"anthropic": 1}
    assert_untouched(rig.of(s)["anthropic"][0], req)


def test_agent_not_routed_is_left_alone_and_stays_so(rig):
    rig.set_config(current=None)
    s = new_session()
    first = cc("opening", s)
    assert rig.send(first).status == 200
    assert_untouched(rig.of(s)["anthropic"][0], first)
    rig.set_config(current="glm")
    later = cc("continuation", s)
    assert rig.send(later).status == 200
    assert rig.where(s) == {"anthropic": 2}, "a session pinned 'not routed' stays not routed"
    assert_untouched(rig.of(s)["anthropic"][1], later)


# --------------------------------------------------------------------------- switching and pins


def test_switch_by_editing_the_config_keeps_running_conversations(rig):
    rig.set_config(current="glm")
    s1 = new_session()
    assert rig.send(cc("opening", s1)).status == 200
    assert rig.where(s1) == {"glm": 1}

    rig.set_config(current="anthropic")
    assert rig.send(cc("continuation", s1)).status == 200
    assert rig.where(s1) == {"glm": 2}, "the running conversation stays where it began"
    s2 = new_session()
    assert rig.send(cc("opening", s2)).status == 200
    assert rig.where(s2) == {"anthropic": 1}, "a new conversation goes to the new server"

    rig.set_config(current="glm")
    assert rig.send(cc("continuation", s2)).status == 200
    assert rig.send(cc("continuation", s1)).status == 200
    assert rig.where(s2) == {"anthropic": 2}
    assert rig.where(s1) == {"glm": 3}
    for got in rig.of(s1)["glm"]:
        assert got.header("x-api-key") == GLM_KEY and got.path.startswith("/api/anthropic/v1/messages")


def _reload(rig, text: str) -> None:
    """Write ``text`` as the config and wait for the proxy's line saying it took it."""
    mark = rig.mitm.line_count
    rig.mitm.write_config(text)
    rig.applied = text
    assert rig.mitm.wait_output(r"config reloaded from", timeout=5.0, since=mark), rig.mitm.tail()


def test_a_pinned_server_re_pointed_to_another_host_is_refused_not_followed(rig):
    """A pin names a server; the server's URL names where it is. Re-pointed to another host
    (the operator reused the name, or changed a provider), a running conversation pinned
    there must not be sent on, history and all, to a host it never talked to: it is refused
    (424) naming the session, the server, both addresses and the way out. New conversations
    go to the new address; pointed back, the conversation carries on where it began."""
    rig.set_config(current="glm")
    s1 = new_session()
    assert rig.send(cc("opening", s1)).status == 200
    assert rig.where(s1) == {"glm": 1}
    f = rig.fakes
    # glm now at alt's address (with alt's key: the operator's pairing), alt itself gone
    repointed = toml_config({"anthropic": {"url": f["anthropic"].url},
                             "glm": {"url": f["alt"].url, "key_env": ALT_ENV, "auth": "bearer"}},
                            {"claude-code": "glm"})
    mark = rig.mitm.line_count
    _reload(rig, repointed)
    # the reload says it: the operator learns of it before an agent does
    assert rig.mitm.wait_output(rf"server glm now at {re.escape(f['alt'].origin)}, was "
                                rf"{re.escape(f['glm'].origin)}: conversations pinned", timeout=3.0, since=mark), \
        rig.mitm.tail()
    r = rig.send(cc("continuation", s1))
    assert r.status == 424, (r.status, r.body[:300])
    msg = r.body.decode()
    assert short(s1) in msg or s1 in msg
    assert "'glm'" in msg and f["glm"].origin in msg and f["alt"].origin in msg, msg
    assert "sessionpin move" in msg, msg
    assert r.header("x-should-retry") == "false"
    assert rig.where(s1) == {"glm": 1}, "never sent to the host glm now names"
    s2 = new_session()
    assert rig.send(cc("opening", s2)).status == 200
    assert rig.where(s2) == {"alt": 1}, "a new conversation goes where glm now is"
    # at a path sessionpin does not route, addressed to the host glm now names: the guard
    # leaves alone only a conversation pinned to the server it addresses as it was pinned
    import dataclasses
    r = rig.send(dataclasses.replace(cc("continuation", s1), path="/chat/completions"), to="alt")
    assert r.status == 424 and "alt" not in rig.where(s1), (r.status, r.body[:300])
    # pointed back: the running conversation carries on where it began, nothing lost
    rig.set_config(current="glm")
    assert rig.send(cc("continuation", s1)).status == 200
    assert rig.where(s1) == {"glm": 2}


def test_a_server_whose_key_is_not_in_the_proxy_s_environment_is_a_refusal_no_agent_retries(rig):
    """glm's key_env edited to a variable the proxy's environment does not hold: its running
    conversation is not sent (no key), and the answer is one only the operator can act on — no
    client may retry it (a 502 was retried by opencode, pi and Codex by its status, for tens of
    seconds) — naming the session, the server, the variable and what to do."""
    rig.set_config(current="glm")
    s1 = new_session()
    assert rig.send(cc("opening", s1)).status == 200
    f = rig.fakes
    unset = "SESSIONPIN_E2E_UNSET_KEY"
    _reload(rig, toml_config({"anthropic": {"url": f["anthropic"].url},
                              "glm": {"url": f["glm"].url, "key_env": unset, "models": MODELS}},
                             {"claude-code": "glm"}))
    for req in (cc("continuation", s1), cc("opening", new_session())):
        r = rig.send(req)
        assert r.status == 424, (r.status, r.body[:300])
        assert r.header("x-should-retry") == "false" and r.header("retry-after") is None
        msg = r.body.decode()
        assert "glm" in msg and unset in msg and "restart" in msg, msg
    assert short(s1) in rig.send(cc("continuation", s1)).body.decode()
    assert rig.where(s1) == {"glm": 1}, "sent nowhere"
    rig.set_config(current="glm")
    assert rig.send(cc("continuation", s1)).status == 200 and rig.where(s1) == {"glm": 2}


def test_continuation_never_seen_begin_is_left_alone(rig):
    rig.set_config(current="glm")
    s = new_session()
    reqs = [cc("continuation", s), cc("continuation", s, stream=False), cc("subagent", s)]
    for req in reqs:
        assert rig.send(req).status == 200
    assert rig.where(s) == {"anthropic": 3}
    for got, req in zip(rig.of(s)["anthropic"], reqs):
        assert_untouched(got, req)


def test_title_request_just_before_the_opening_goes_where_the_opening_goes(rig):
    rig.set_config(current="glm")
    s = new_session()
    title = cc("title", s, stream=False)
    r = rig.send(title)
    assert r.status == 200 and r.json()["content"][0]["text"] == "reply from glm."
    assert rig.send(cc("opening", s)).status == 200
    assert rig.where(s) == {"glm": 2}
    got_title = rig.of(s)["glm"][0]
    assert_routed(got_title, title, key_header="x-api-key", key_value=GLM_KEY, prefix="/api/anthropic",
                  model="glm-4.5-air")


def test_title_in_parallel_with_the_opening_goes_where_the_opening_goes(rig):
    rig.set_config(current="glm")
    sessions = [new_session() for _ in range(3)]
    replies: list[Reply] = []

    def send(req: Req) -> None:
        replies.append(rig.send(req))

    threads = [threading.Thread(target=send, args=(cc(kind, s),)) for s in sessions for kind in ("title", "opening")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [r.status for r in replies] == [200] * 6
    for s in sessions:
        assert rig.where(s) == {"glm": 2}
    # and the pin they made holds once the current server changes
    rig.set_config(current="anthropic")
    for s in sessions:
        assert rig.send(cc("continuation", s)).status == 200
        assert rig.where(s) == {"glm": 3}


def test_side_request_with_history_for_an_unknown_session_is_left_alone(rig):
    rig.set_config(current="glm")
    s = new_session()
    req = cc("suggestion", s)
    assert rig.send(req).status == 200
    assert rig.where(s) == {"anthropic": 1}
    assert_untouched(rig.of(s)["anthropic"][0], req)


def test_subagent_and_count_tokens_follow_the_pin(rig):
    rig.set_config(current="glm")
    s = new_session()
    assert rig.send(cc("opening", s)).status == 200
    rig.set_config(current="anthropic")
    sub = cc("subagent", s)
    count = cc("count_tokens", s)
    assert rig.send(sub).status == 200
    r = rig.send(count)
    assert r.status == 200 and r.json() == {"input_tokens": 42}
    assert rig.where(s) == {"glm": 3}
    _, got_sub, got_count = rig.of(s)["glm"]
    assert_routed(got_sub, sub, key_header="x-api-key", key_value=GLM_KEY, prefix="/api/anthropic", model="glm-4.6")
    assert_routed(got_count, count, key_header="x-api-key", key_value=GLM_KEY, prefix="/api/anthropic",
                  model="glm-4.6")
    assert got_count.path == "/api/anthropic/v1/messages/count_tokens?beta=true"

    # a session begun on the addressed server: its subagent and count_tokens stay there
    s2 = new_session()
    assert rig.send(cc("opening", s2)).status == 200
    rig.set_config(current="glm")
    for req in (cc("subagent", s2), cc("count_tokens", s2)):
        assert rig.send(req).status == 200
    assert rig.where(s2) == {"anthropic": 3}


# --------------------------------------------------------------------------- restarts


def _restart_keeps_the_pin(rig: Rig, sig: signal.Signals) -> None:
    rig.set_config(current="glm")
    s = new_session()
    assert rig.send(cc("opening", s)).status == 200
    rig.mitm.stop(sig)
    # while it is down the operator switches new conversations to the addressed server:
    # a lost pin would now send the continuation there (left alone) instead of to glm
    rig.set_config(current="anthropic")
    rig.mitm.start()
    assert rig.send(cc("continuation", s)).status == 200
    assert rig.where(s) == {"glm": 2}
    s2 = new_session()
    assert rig.send(cc("opening", s2)).status == 200
    assert rig.where(s2) == {"anthropic": 1}, "the config edited while down is in force"


def test_sigterm_between_two_turns_keeps_the_server(rig):
    _restart_keeps_the_pin(rig, signal.SIGTERM)


def test_sigkill_between_two_turns_keeps_the_server(rig):
    _restart_keeps_the_pin(rig, signal.SIGKILL)


def test_sigkill_while_the_opening_turn_is_in_flight_keeps_the_server(rig):
    """The pin is durable before the request leaves: kill -9 as soon as glm has it, then retry."""
    rig.set_config(current="glm")
    s = new_session()
    glm = rig.fakes["glm"]
    failed: list[BaseException] = []

    def opening() -> None:
        try:
            rig.send(cc("opening", s), timeout=15)
        except BaseException as e:  # the proxy dies under it
            failed.append(e)

    with glm.behave(pause_after_first_ms=3000):
        t = threading.Thread(target=opening)
        t.start()
        deadline = time.monotonic() + 10
        while rig.where(s) != {"glm": 1} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rig.where(s) == {"glm": 1}
        rig.mitm.stop(signal.SIGKILL)
        t.join(20)
    rig.set_config(current="anthropic")
    rig.mitm.start()
    assert rig.send(cc("opening", s)).status == 200, "the agent retries the opening turn"
    assert rig.send(cc("continuation", s)).status == 200
    assert rig.where(s) == {"glm": 3}


# --------------------------------------------------------------------------- refusals and errors


def test_pinned_server_removed_gets_424_naming_session_and_server(rig):
    """424 with no retry signal: only the operator can help, so no agent retries it (a 503 was
    retried for minutes: docs/traffic.md)."""
    rig.set_config(current="alt")
    s = new_session()
    assert rig.send(cc("opening", s)).status == 200
    assert rig.where(s) == {"alt": 1}
    rig.set_config(current="glm", servers=("anthropic", "glm", "nokey"))
    before = rig.total()
    r = rig.send(cc("continuation", s))
    assert r.status == 424 and r.header("x-should-retry") == "false" and r.header("retry-after") is None, r.text
    err = r.json()
    assert err["type"] == "error" and isinstance(err["error"]["type"], str)
    message = err["error"]["message"]
    assert s[:8] in message and "alt" in message
    assert rig.total() == before, "a refused request reaches no server"
    assert rig.send(cc("subagent", s)).status == 424
    # the conversation was never moved: with the server back it continues there
    rig.set_config(current="glm")
    assert rig.send(cc("continuation", s)).status == 200
    assert rig.where(s) == {"alt": 2}


CONNECT_BUDGET = 2.0     # sessionpin_connect_retry_ms's default, in seconds


def test_pinned_server_unreachable_is_an_error_naming_it_and_the_pin_holds(rig):
    """A dead pinned server reaches the user in seconds (issue 19): the proxy rides out a
    blip for its connect budget, then answers with signals none of the four clients retries
    (424, x-should-retry: false, no retry-after; before: 502 with retry-after: 5 and
    x-should-retry: true, which kept Claude Code retrying for 196 s); the agent's own next
    try is answered at once (the address is known down), and the pin holds."""
    rig.set_config(current="alt")
    s = new_session()
    assert rig.send(cc("opening", s)).status == 200
    alt = rig.fakes["alt"]
    alt.stop()
    try:
        before = rig.total()
        t0 = time.monotonic()
        r = rig.send(cc("continuation", s))
        took = time.monotonic() - t0
        t0 = time.monotonic()
        again = rig.send(cc("continuation", s))
        took_again = time.monotonic() - t0
        assert rig.total() == before, "not moved to another server"
    finally:
        alt.start()
    for reply in (r, again):
        assert reply.status == 424, (reply.status, reply.text[:300])
        assert reply.header("x-should-retry") == "false" and reply.header("retry-after") is None
        assert reply.header("x-sessionpin-refused") == "unreachable"
        msg = reply.json()["error"]["message"]
        # the session by its short id on the agent's screen (a long hex id can read as "502" to pi)
        assert "server alt" in msg and short(s) in msg and s not in msg and "refuses connections" in msg, msg
    print(f"dead pinned server: refused after {took:.2f} s, the agent's next try after {took_again:.2f} s")
    assert CONNECT_BUDGET - 0.3 <= took < CONNECT_BUDGET + 3.0, took       # the budget, ridden out, then told
    assert took_again < 1.5, took_again                                      # known down: no second budget
    assert rig.send(cc("continuation", s)).status == 200
    assert rig.where(s) == {"alt": 2}


def test_a_pinned_server_back_within_the_connect_budget_gets_the_request(rig):
    """A blip (the server restarting) is ridden out by the proxy: the request waits and goes
    through, the agent sees no error (before issue 19: 502 at once)."""
    rig.set_config(current="alt")
    s = new_session()
    assert rig.send(cc("opening", s)).status == 200
    alt = rig.fakes["alt"]
    alt.stop()
    back = threading.Timer(0.6, alt.start)
    back.start()
    try:
        r = rig.send(cc("continuation", s))
    finally:
        back.join(5)
        if not alt.running:
            alt.start()
    assert r.status == 200, (r.status, r.text[:300])
    assert rig.where(s) == {"alt": 2}


def test_server_without_key_env_only_takes_requests_addressed_to_it(rig):
    rig.set_config(current="nokey")
    s = new_session()
    before = rig.total()
    r = rig.send(cc("opening", s))
    assert 400 <= r.status < 600 and r.status != 200
    assert r.text.strip(), "a clear error, not an empty answer"
    assert rig.total() == before, "never sent with the wrong key"
    s2 = new_session()
    req = cc("opening", s2, key=NOKEY_CLIENT_KEY)
    assert rig.send(req, to="nokey").status == 200
    assert rig.where(s2) == {"nokey": 1}
    got = rig.of(s2)["nokey"][0]
    assert got.path == req.path and got.body == req.body and got.header("x-api-key") == NOKEY_CLIENT_KEY


def test_config_error_on_reload_is_refused_and_the_previous_config_stays(rig):
    rig.set_config(current="glm")
    mark = rig.mitm.line_count
    bad = rig.config(current="anthropic").rstrip("\n").splitlines()
    bad.append("this line = is not toml")
    rig.mitm.write_config("\n".join(bad) + "\n")
    line = len(bad)
    m = rig.mitm.wait_output(r"config\.toml", timeout=3.0, since=mark)
    assert m is not None, "the refusal is logged naming the file"
    logged = [ln for ln in rig.mitm.output.splitlines()[mark:] if "config.toml" in ln]
    assert any(re.search(rf"config\.toml:{line}\b|line {line}\b", ln) for ln in logged), logged
    s = new_session()
    assert rig.send(cc("opening", s)).status == 200
    assert rig.where(s) == {"glm": 1}, "the previous config is still in force"
    rig.set_config(current="glm")


@pytest.mark.parametrize("written", ["auth", "url"])
def test_a_config_error_never_writes_a_pasted_key_to_the_log_or_the_status(rig, written):
    """The operator pastes the key where its style goes (``auth = "Bearer <key>"``) or puts it
    in a URL's query: the reload is refused, and the error the proxy logs and its status shows
    named the value it refused — the key, lower-cased (so not even the redaction saw a
    mixed-case one) or the URL whole. Now it names the place, never the key."""
    key = "Qz" + uuid.uuid4().hex[:15].upper() + uuid.uuid4().hex[:15]      # mixed case, letters and digits
    rig.set_config(current="glm")
    mark = rig.mitm.line_count
    lines = rig.config(current="glm").rstrip("\n").splitlines()
    table = lines.index("[servers.alt]")          # url, key_env, auth = "bearer" follow it
    assert lines[table + 1].startswith("url =") and lines[table + 3] == 'auth = "bearer"', lines
    if written == "auth":
        lines[table + 3] = f'auth = "Bearer {key}"'
    else:
        lines[table + 1] = f'url = "127.0.0.1:{rig.fakes["alt"].port}/v1?key={key}"'
    rig.mitm.write_config("\n".join(lines) + "\n")
    assert rig.mitm.wait_output(r"config rejected", timeout=5.0, since=mark), rig.mitm.tail(20)
    status = rig.status()
    assert status is not None and status.get("config_error"), status
    said = rig.mitm.tail(rig.mitm.line_count - mark) + json.dumps(status)
    assert f"servers.alt.{written}" in said, said
    assert key not in said and key.lower() not in said, said
    rig.set_config(current="glm")


@pytest.mark.parametrize("shape", ["huge", "fifo", "directory", "link loop"])
def test_a_config_path_that_is_no_config_file_is_refused_and_the_proxy_keeps_serving(rig, shape):
    """The config path replaced, while running, by something no config is: a file of 2 MiB (a
    log file or a dump given as the config: valid TOML, a comment), a FIFO, a directory. The
    watcher reads the path on the proxy's loop every 250 ms: a FIFO's open() waited there for a
    writer — every request stalled — a huge file was read whole four times a second, and a
    directory was skipped in silence. Each is refused with one line saying what it is; the
    previous config stays in force, and the proxy keeps serving."""
    import os
    import shutil
    rig.set_config(current="glm")
    path = rig.mitm.config_path
    good = path.read_text()
    mark = rig.mitm.line_count
    path.unlink()
    if shape == "huge":
        path.write_text(rig.config(current="anthropic") + "#" + "x" * (2 << 20) + "\n")
    elif shape == "fifo":
        os.mkfifo(path, 0o600)
    elif shape == "directory":
        path.mkdir(mode=0o700)
    else:                                           # a link to itself: unreadable, not missing
        path.symlink_to(path.name)
    try:
        said = {"huge": r"config rejected.*\d+ bytes", "fifo": r"config rejected.*not a regular file \(a FIFO\)",
                "directory": r"config rejected.*not a regular file \(a directory\)",
                "link loop": r"config rejected.*cannot read.*symbolic links"}[shape]
        assert rig.mitm.wait_output(said, timeout=5.0, since=mark), rig.mitm.tail()
        s = new_session()
        r = rig.send(cc("opening", s), timeout=10.0)
        assert r.status == 200 and rig.where(s) == {"glm": 1}, "the previous config is in force"
        assert rig.send(cc("continuation", s), timeout=10.0).status == 200 and rig.where(s) == {"glm": 2}
        assert not rig.mitm.wait_output(r"config reloaded from", timeout=0.6, since=mark), rig.mitm.tail()
    finally:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        mark = rig.mitm.line_count
        path.write_text(good)
        assert rig.mitm.wait_output(r"accepted again|config reloaded", timeout=5.0, since=mark), rig.mitm.tail()


@pytest.mark.parametrize("shape", ["huge", "fifo"])
def test_a_config_that_is_no_config_file_at_start_stops_mitmdump_with_the_message(rig, tmp_path, shape):
    import os
    m = Mitmdump.router(tmp_path, rig.ca, rig.config(current="glm"))
    m.config_path.unlink()
    if shape == "huge":
        m.config_path.write_text(rig.config(current="glm") + "#" + "x" * (2 << 20) + "\n")
    else:
        os.mkfifo(m.config_path, 0o600)
    try:
        with pytest.raises(MitmdumpError):
            m.start(timeout=20.0)
        out = m.output
        assert re.search(r"sessionpin: config\.toml: (\d+ bytes|not a regular file \(a FIFO\))", out), out[-2000:]
        assert "listening" not in out
    finally:
        m.stop(signal.SIGKILL)


def test_config_error_at_start_stops_mitmdump_with_the_message(rig, tmp_path):
    text = rig.config(current="nosuchserver")
    m = Mitmdump.router(tmp_path, rig.ca, text)
    try:
        with pytest.raises(MitmdumpError):
            m.start(timeout=20)
        assert "config.toml" in m.output and "nosuchserver" in m.output
    finally:
        m.stop(signal.SIGKILL)


# --------------------------------------------------------------------------- streaming and pass-through


def test_sse_with_pauses_arrives_event_by_event(rig):
    rig.set_config(current="glm")
    s = new_session()
    with rig.fakes["glm"].behave(pause_ms=1000, deltas=1):
        r = rig.send(cc("opening", s))
    assert r.status == 200
    assert r.event_names == ["message_start", "content_block_start", "ping", "content_block_delta",
                             "content_block_stop", "message_delta", "message_stop"]
    gaps = [b.at - a.at for a, b in zip(r.events, r.events[1:])]
    assert all(g > 0.6 for g in gaps), f"events arrived bunched: gaps {gaps}"
    assert r.events[0].at - r.t_sent < r.events[-1].at - r.t_sent - 4.0


def test_non_model_paths_pass_untouched(rig):
    rig.set_config(current="glm")
    ua = ("User-Agent", "claude-cli/2.1.332 (external, cli)")
    reqs = [
        Req("GET", "/api/claude_code/settings", [ua, ("x-api-key", CLIENT_KEY), ("Accept", "application/json")], b""),
        Req("GET", "/api/claude_code/policy_limits", [ua, ("Authorization", f"Bearer {CLIENT_OAUTH}")], b""),
        Req("POST", "/api/event_logging/batch", [ua, ("x-api-key", CLIENT_KEY), ("Content-Type", "application/json")],
            b'{"events": [{"event_name": "tengu_started", "model": "claude-opus-4-5"}]}'),
        Req("GET", "/v1/models?limit=5", [ua, ("x-api-key", CLIENT_KEY)], b""),
    ]
    a = rig.fakes["anthropic"]
    for req in reqs:
        before = len(a.received())
        before_all = rig.total()
        r = rig.client().request(req.method, a.origin + req.path, req.headers, req.body)
        assert r.status == 200
        got = a.received()[before:]
        assert len(got) == 1 and rig.total() - before_all == Counter({"anthropic": 1})
        assert_untouched(got[0], req)


def test_model_request_to_an_unconfigured_origin_passes_untouched(rig):
    rig.set_config(current="glm")
    s = new_session()
    req = cc("opening", s, key=ELSEWHERE_CLIENT_KEY)
    assert rig.send(req, to="elsewhere").status == 200
    assert rig.where(s) == {"elsewhere": 1}
    assert_untouched(rig.of(s)["elsewhere"][0], req)


GARBAGE = {
    "truncated-json": b'{"model": "claude-opus-4-5", "messages": [{"role": "us',
    "binary": bytes(range(256)) * 4,
    "json-array": b'[{"model": "claude-opus-4-5"}]',
    "model-not-a-string": b'{"model": {"$gt": 1}, "messages": 7, "tools": "x", "stream": "yes"}',
    "empty": b"",
}


@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_body_passes_untouched_or_gets_a_clear_error(rig, name):
    rig.set_config(current="glm")
    s = new_session()
    req = cc("opening", s)
    req.body = GARBAGE[name]
    before = rig.total()
    r = rig.send(req)
    arrived = rig.of(s)
    if arrived:
        assert sum(len(v) for v in arrived.values()) == 1
        [(name_, [got])] = arrived.items()
        assert got.body == req.body, "a body the router cannot read is passed on as it came"
        if name_ == "anthropic":
            assert_untouched(got, req)
    else:
        assert r.status >= 400 and r.text.strip(), "a clear error"
        assert rig.total() == before
    assert rig.mitm.alive
    s2 = new_session()
    assert rig.send(cc("opening", s2)).status == 200, "the proxy keeps serving"
    assert rig.where(s2) == {"glm": 1}


# --------------------------------------------------------------------------- visibility


def test_status_endpoint_answers_json(rig):
    rig.set_config(current="glm")
    s = new_session()
    assert rig.send(cc("opening", s)).status == 200
    before = rig.total()
    r = rig.get("/__sessionpin/status")
    assert r.status == 200, r.text
    assert "json" in (r.header("content-type") or "")
    status = r.json()
    # the issue's three parts: servers, agents' current servers, pins per server
    assert {"anthropic", "glm", "alt", "nokey"} <= set(status["servers"])
    assert status["agents"]["claude-code"] == "glm"
    pins_before = status["pins"].get("glm", {}).get("pins", 0)
    assert pins_before >= 1
    assert rig.send(cc("opening", new_session())).status == 200
    assert rig.get("/__sessionpin/status").json()["pins"]["glm"]["pins"] == pins_before + 1
    for secret in OWNER:
        assert secret not in r.text
    assert rig.total() - before == Counter({"glm": 1}), "answered by the addon itself"


def test_metrics_endpoint_answers_prometheus_text(rig):
    r = rig.get("/__sessionpin/metrics")
    assert r.status == 200, r.text
    assert (r.header("content-type") or "").startswith("text/plain")
    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*",?)*\})?'
                        r' (-?[0-9.eE+-]+|[+-]?Inf|NaN)( -?[0-9]+)?$')
    lines = [ln for ln in r.text.splitlines() if ln.strip()]
    samples = [ln for ln in lines if not ln.startswith("#")]
    assert samples and all(sample.match(ln) for ln in samples), samples
    assert any(ln.startswith("sessionpin") for ln in samples)
    # the four families: pins, decisions, refusals, store errors (by any name that says so)
    for family in ("pins", "decision", "refus", "store_error"):
        assert any(family in ln for ln in lines if ln.startswith("sessionpin") or ln.startswith("# ")), family
    assert rig.fakes["anthropic"].received("/__sessionpin") == []


# --------------------------------------------------------------------------- the credential rule, over everything


def test_nothing_from_a_prompt_or_a_key_reaches_the_logs_or_the_disk(rig):
    """Runs late: mitmdump's whole output and every file it wrote, searched for sentinels."""
    assert rig.fakes["glm"].received() and PROMPT.encode() in rig.fakes["glm"].received()[0].raw()
    out = rig.mitm.output
    assert PROMPT not in out
    for secret in OWNER:
        assert secret not in out
    files = [p for p in rig.mitm.workdir.rglob("*") if p.is_file()]
    assert any(p.name.startswith("state.db") for p in files), [p.name for p in files]
    for p in files:
        data = p.read_bytes()
        assert PROMPT.encode() not in data, p.name
        for secret in OWNER:
            assert secret.encode() not in data, p.name


def test_no_request_ever_carried_a_key_to_a_server_it_was_not_meant_for(rig):
    """Runs last: every request every fake received in this module, checked for foreign secrets."""
    rig.assert_no_foreign_keys()
    seen = {name: len(f.received()) for name, f in rig.fakes.items()}
    assert seen["anthropic"] and seen["glm"] and seen["alt"], seen  # the check covered real traffic
    for r in rig.fakes["glm"].received("/v1/messages"):
        assert GLM_KEY in (r.header("x-api-key") or r.header("authorization") or "")
