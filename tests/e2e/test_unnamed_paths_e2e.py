"""A path the config did not name is not taken for "not inference", end to end.

A real ``mitmdump -s addons/route.py`` (regular and reverse mode, real TLS), fake servers on
loopback: ``a`` (the origin the agents address, configured, no key), ``b`` (the agents' current
server, a key from the proxy's environment) and ``v4`` (a server written with a version base,
``…/api/paas/v4``). A conversation opened at ``a`` is routed to ``b`` and pinned there; its next
request, addressed to ``a`` (or to ``v4`` once that server is no longer configured) at a path
sessionpin does not route, must never reach the server it addressed: that server may well
serve it as inference, with the agent's own key, and the conversation would break there.

- A path a lenient server reads as an endpoint sessionpin routes, spelled otherwise (an escaped
  letter, another case, a trailing slash, a ``;parameter``) is refused 400 like the other
  ambiguous paths, over HTTP/1.1 and HTTP/2, and for Codex's WebSocket upgrade too.
- A path that ends with an endpoint under a base sessionpin does not route (``/chat/completions``
  without ``/v1``, another server's version base at an origin no longer configured) has its
  conversation's pin read: pinned elsewhere, it is refused (424, naming the session and the
  server); a conversation never pinned goes where it was addressed, as before.
- Codex's remote compaction (``/v1/responses/compact``) is an endpoint: it follows the thread's pin.
- A server written as the base its OpenAI clients take, with its version before its last
  segment (Gemini's ``…/v1beta/openai``), routes its own ``…/chat/completions`` and is moved to there.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator

import pytest

from .harness import Client, FakeServer, Mitmdump, TestCA, free_port, toml_config
from .replay import h2_request
from .test_router_e2e import cc

RUN = uuid.uuid4().hex[:8]
KEY_ENV = "SESSIONPIN_UNNAMED_KEY"
KEY = f"UNNAMED-B-KEY-{RUN}"
GEM_ENV = "SESSIONPIN_UNNAMED_GEM_KEY"
AGENTS = ("claude-code", "opencode", "pi", "codex")


class Rig:
    def __init__(self, tmp, ca: TestCA) -> None:
        self.a = FakeServer("a", ca).start()
        self.b = FakeServer("b", ca).start()
        self.v4 = FakeServer("v4", ca).start()
        self.reverse_port = free_port()
        self.mitm = Mitmdump.router(tmp / "router", ca, self.config(), env={KEY_ENV: KEY, GEM_ENV: f"GEM-{RUN}"},
                                    modes=["regular", f"reverse:{self.a.origin}@{self.reverse_port}"])
        self.written: tuple[str | None, str] = ("/api/paas/v4", "b")

    def config(self, v4: str | None = "/api/paas/v4", current: str = "b") -> str:
        servers: dict[str, dict[str, Any]] = {"a": {"url": self.a.origin},
                                              "b": {"url": self.b.origin, "key_env": KEY_ENV}}
        if v4 is not None:
            servers["v4"] = {"url": self.v4.origin + v4, "key_env": GEM_ENV}
        return toml_config(servers, {agent: current for agent in AGENTS})

    def use(self, v4: str | None = "/api/paas/v4", current: str = "b") -> None:
        """Write the config (v4 written with that path, or not at all; every agent's new
        conversations to ``current``) and wait until the proxy shows it."""
        if (v4, current) == self.written:
            return
        self.mitm.write_config(self.config(v4, current))
        want = {"a": "", "b": ""} | ({"v4": v4} if v4 is not None else {})
        deadline, status = time.monotonic() + 10, {}
        while time.monotonic() < deadline:
            try:
                r = self.client().request("GET", self.a.origin + "/__sessionpin/status")
                status = r.json() if r.status == 200 else {}
                if {n: s.get("prefix", "") for n, s in status.get("servers", {}).items()} == want \
                        and {status.get("agents", {}).get(agent) for agent in AGENTS} == {current}:
                    self.written = (v4, current)
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"the proxy did not take the config within 10 s: {status}")

    def client(self) -> Client:
        return Client.via_proxy(self.mitm.port, self.mitm.mitm_ca)

    def fakes(self) -> dict[str, FakeServer]:
        return {"a": self.a, "b": self.b, "v4": self.v4}

    def send(self, method: str, url: str, headers, body: bytes, reverse: bool = False):
        """(the proxy's answer, {fake: [paths it received]} for the fakes that received any)."""
        before = {n: len(f.received()) for n, f in self.fakes().items()}
        if reverse:
            reply = Client.reverse(self.reverse_port).request(method, "http://127.0.0.1" + url[len(self.a.origin):],
                                                              headers, body)
        else:
            reply = self.client().request(method, url, headers, body)
        return reply, self.reached(before)

    def reached(self, before: dict[str, int]) -> dict[str, list[str]]:
        got = {n: [r.path for r in f.received()[before[n]:]] for n, f in self.fakes().items()}
        return {n: p for n, p in got.items() if p}


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("e2e-unnamed-paths")
    r = Rig(tmp, TestCA(tmp / "ca"))
    try:
        r.mitm.start()
        yield r
    finally:
        r.mitm.stop()
        for f in r.fakes().values():
            f.stop()


@pytest.fixture(autouse=True)
def _default_config(rig: Rig) -> None:
    rig.use()


def claude_code_pinned_to_b(rig: Rig, origin: str | None = None) -> str:
    session = str(uuid.uuid4())
    op = cc("opening", session, stream=False)
    reply, got = rig.send(op.method, (origin or rig.a.origin) + op.path, op.headers, op.body)
    assert reply.status == 200 and got == {"b": ["/v1/messages?beta=true"]}, (reply.status, got, reply.text[:300])
    return session


def opencode_chat(session: str, history: bool) -> tuple[list[tuple[str, str]], bytes]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are opencode."},
                                      {"role": "user", "content": f"fix the test {session}"}]
    if history:
        call = "call_" + session[4:12]
        messages += [{"role": "assistant", "content": "ok", "tool_calls": [
            {"id": call, "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": call, "content": "done"}]
    body = {"model": "glm-4.6", "messages": messages, "stream": False,
            "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]}
    return ([("content-type", "application/json"), ("user-agent", "opencode/1.18.33"),
             ("x-opencode-session", session)], json.dumps(body).encode())


def codex_headers(session: str) -> list[tuple[str, str]]:
    return [("content-type", "application/json"), ("user-agent", "codex_cli_rs/0.171.0 (Linux; x86_64)"),
            ("originator", "codex_cli_rs"), ("session-id", session), ("authorization", f"Bearer sk-CLIENT-{RUN}")]


def codex_pinned_to_b(rig: Rig) -> str:
    session = str(uuid.uuid4())
    body = {"model": "gpt-5.1-codex", "instructions": "You are Codex, a coding agent.",
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": f"hi {session}"}]}],
            "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}],
            "stream": False, "prompt_cache_key": session}
    reply, got = rig.send("POST", rig.a.origin + "/v1/responses", codex_headers(session), json.dumps(body).encode())
    assert reply.status == 200 and got == {"b": ["/v1/responses"]}, (reply.status, got, reply.text[:300])
    return session


# Claude Code's next turn, at a path a lenient HTTP server takes as /v1/messages
SPELLED_OTHERWISE = [
    "/v1/mess%61ges?beta=true",          # %61 is 'a': the same path (RFC 3986 6.2.2.2); uvicorn, Go decode it
    "/v1/%6Dessages?beta=true",
    "/%761/messages?beta=true",
    "/v1/messages/?beta=true",           # Express (non-strict routing) ignores the slash
    "/V1/MESSAGES?beta=true",            # Express, ASP.NET match case-blind
    "/v1/messages;x=1?beta=true",        # Tomcat, Jetty, Spring drop path parameters
    "/v1;x=1/messages?beta=true",
]


@pytest.mark.parametrize("reverse", [False, True], ids=["regular", "reverse"])
@pytest.mark.parametrize("path", SPELLED_OTHERWISE)
def test_a_turn_at_a_path_spelled_unlike_its_endpoint_is_refused_and_reaches_no_server(rig, path, reverse):
    session = claude_code_pinned_to_b(rig)
    cont = cc("continuation", session, stream=False)
    reply, got = rig.send("POST", rig.a.origin + path, cont.headers, cont.body, reverse=reverse)
    assert (reply.status, got) == (400, {}), (path, reply.status, got, reply.text[:300])
    assert "spelled unlike" in reply.text and reply.json()["type"] == "error"      # Anthropic's error format


def test_over_http2_too(rig):
    session = claude_code_pinned_to_b(rig)
    cont = cc("continuation", session, stream=False)
    before = {n: len(f.received()) for n, f in rig.fakes().items()}
    reply = h2_request(rig.mitm.port, rig.mitm.mitm_ca, "127.0.0.1", rig.a.port, "POST", "/v1/mess%61ges?beta=true",
                       [(k.lower(), v) for k, v in cont.headers], cont.body)
    assert (reply.status, rig.reached(before)) == (400, {})


UPGRADE = [("upgrade", "websocket"), ("connection", "Upgrade"), ("sec-websocket-version", "13"),
           ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")]


@pytest.mark.parametrize("path", ["/v1//responses", "/v1/./responses", "/x/../v1/responses", "/v1/respons%65s",
                                  "/v1/responses/"])
def test_a_codex_threads_websocket_upgrade_at_an_ambiguous_path_is_refused_as_its_post_would_be(rig, path):
    session = codex_pinned_to_b(rig)
    reply, got = rig.send("GET", rig.a.origin + path, codex_headers(session) + UPGRADE, b"")
    assert got == {} and reply.status in (400, 426), (path, reply.status, got, reply.text[:300])


def test_codexs_remote_compaction_follows_the_threads_pin(rig):
    """Codex compacts at {base}/responses/compact on OpenAI's provider (codex-rs compact.rs)."""
    session = codex_pinned_to_b(rig)
    body = {"model": "gpt-5.1-codex", "instructions": "You are Codex, a coding agent.",
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"hi {session}"}]},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "more"}]}]}
    reply, got = rig.send("POST", rig.a.origin + "/v1/responses/compact", codex_headers(session),
                          json.dumps(body).encode())
    assert reply.status == 200 and got == {"b": ["/v1/responses/compact"]}, (reply.status, got, reply.text[:300])
    assert rig.b.received()[-1].header("authorization") == f"Bearer {KEY}"


def test_a_turn_at_a_base_sessionpin_does_not_route_is_refused_when_pinned_elsewhere(rig):
    """opencode opened at a's /v1/chat/completions, pinned to b; its next turn at a's
    /chat/completions (a base URL without /v1, as DeepSeek documents one) is refused, naming
    the session and where it is pinned; a conversation never pinned there still passes."""
    session = "ses_" + uuid.uuid4().hex[:26]
    h, body = opencode_chat(session, history=False)
    reply, got = rig.send("POST", rig.a.origin + "/v1/chat/completions", h, body)
    assert reply.status == 200 and got == {"b": ["/v1/chat/completions"]}, (reply.status, got)
    h, body = opencode_chat(session, history=True)
    reply, got = rig.send("POST", rig.a.origin + "/chat/completions", h, body)
    assert (reply.status, got) == (424, {}), (reply.status, got, reply.text[:300])
    assert session[-8:] in reply.text and "'b'" in reply.text and "base URL" in reply.text
    # never pinned: left where it was addressed, as if the router were not there
    other = "ses_" + uuid.uuid4().hex[:26]
    h, body = opencode_chat(other, history=True)
    reply, got = rig.send("POST", rig.a.origin + "/chat/completions", h, body)
    assert reply.status == 200 and got == {"a": ["/chat/completions"]}, (reply.status, got)


def test_at_an_origin_no_longer_configured_no_spelling_escapes_the_pin(rig):
    """Conversations opened at v4 (…/api/paas/v4) and at v4's origin are pinned to b; v4 is then
    removed from the config. The /v1 forms follow the pin (as before); v4's own base and an
    encoded slash, which the old server may serve as inference, are refused."""
    oc = "ses_" + uuid.uuid4().hex[:26]
    h, body = opencode_chat(oc, history=False)
    reply, got = rig.send("POST", rig.v4.origin + "/api/paas/v4/chat/completions", h, body)
    assert reply.status == 200 and got == {"b": ["/v1/chat/completions"]}, (reply.status, got)
    claude = claude_code_pinned_to_b(rig, rig.v4.origin)
    rig.use(v4=None)
    h, body = opencode_chat(oc, history=True)
    reply, got = rig.send("POST", rig.v4.origin + "/v1/chat/completions", h, body)
    assert got == {"b": ["/v1/chat/completions"]}, (reply.status, got)
    reply, got = rig.send("POST", rig.v4.origin + "/api/paas/v4/chat/completions", h, body)
    assert (reply.status, got) == (424, {}), (reply.status, got, reply.text[:300])
    cont = cc("continuation", claude, stream=False)
    reply, got = rig.send("POST", rig.v4.origin + "/v1/messages?beta=true", cont.headers, cont.body)
    assert got == {"b": ["/v1/messages?beta=true"]}, (reply.status, got)
    reply, got = rig.send("POST", rig.v4.origin + "/v1%2Fmessages?beta=true", cont.headers, cont.body)
    assert (reply.status, got) == (400, {}), (reply.status, got, reply.text[:300])


def test_a_server_written_as_its_openai_clients_base_routes_its_own_path_and_is_moved_to(rig):
    """Gemini's OpenAI-compatible API is written https://…/v1beta/openai, the base its clients
    take: their POST <url>/chat/completions is routed (it was left alone, silently), and a
    conversation moved there arrives at that same path, not at …/v1beta/openai/v1/…."""
    rig.use(v4="/v1beta/openai")
    session = "ses_" + uuid.uuid4().hex[:26]
    h, body = opencode_chat(session, history=False)
    reply, got = rig.send("POST", rig.v4.origin + "/v1beta/openai/chat/completions", h, body)
    assert reply.status == 200 and got == {"b": ["/v1/chat/completions"]}, (reply.status, got, reply.text[:300])
    rig.use(v4="/v1beta/openai", current="v4")
    session = "ses_" + uuid.uuid4().hex[:26]
    h, body = opencode_chat(session, history=False)
    reply, got = rig.send("POST", rig.a.origin + "/v1/chat/completions", h, body)
    assert reply.status == 200 and got == {"v4": ["/v1beta/openai/chat/completions"]}, (reply.status, got)
    assert rig.v4.received()[-1].header("authorization") == f"Bearer GEM-{RUN}"
