"""A server is the base URL of an API (issue 19), end to end: every client's paths are routed
and arrive at the target's own path for the same endpoint, however the servers are written.

A real ``mitmdump -s addons/route.py`` (regular mode, real TLS), fake servers on loopback. The
requests are recorded openings (tests/fixtures/traffic, prepared by ``replay.Replay``): Claude
Code's ``/v1/messages?beta=true``, opencode's and pi's ``/zen/v1/chat/completions`` (OpenCode's
gateway), Codex's ``/v1/responses`` over HTTP/2. Each is sent to one of four source servers, one
per way a server's URL is written — a bare origin, ``…/v1``, ``…/zen/v1``, ``…/api/anthropic`` —
with the agent's current server one of four targets written the same four ways. Every opening
must be routed (before issue 19, opencode's and pi's were left alone at a server written as a
bare origin, and Claude Code's at one written ``…/zen/v1``) and arrive at the target's base +
the endpoint (before: Claude Code's reached a ``…/zen/v1`` target as ``/zen/v1/v1/messages``,
pi's a bare-origin target as ``/chat/completions``).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Iterator

import pytest

from .harness import Client, FakeServer, Mitmdump, Received, TestCA, toml_config
from .replay import Replay, h2_request, load

RUN = uuid.uuid4().hex[:8]
KEY_ENV = "SESSIONPIN_APIPATHS_KEY"
KEY = f"APIPATHS-TARGET-KEY-SENTINEL-{RUN}"
AGENTS = ("claude-code", "opencode", "pi", "codex")

# How a server's URL is written (after its origin) -> (the fake's own prefix, where its API's endpoints are)
CONVENTIONS = {
    "bare": ("", "", "/v1"),
    "v1": ("/v1", "", "/v1"),
    "zen": ("/zen/v1", "/zen", "/zen/v1"),
    "glm": ("/api/anthropic", "/api/anthropic", "/api/anthropic/v1"),
}
# client -> (agent, scenario, the recording's file number, the endpoint and query it names)
OPENINGS = {
    "claude-code": ("claude-code", "print", 4, "/messages?beta=true"),
    "opencode": ("opencode", "zen-chat", 2, "/chat/completions"),
    "pi": ("pi", "zen-chat", 1, "/chat/completions"),
    "codex": ("codex", "exec-tool", 2, "/responses"),
}


class Rig:
    def __init__(self, tmp, ca: TestCA) -> None:
        self.sources = {c: FakeServer(f"a-{c}", ca).start() for c in CONVENTIONS}
        self.targets = {c: FakeServer(f"b-{c}", ca, prefix=CONVENTIONS[c][1]).start() for c in CONVENTIONS}
        self.current: str | None = None
        self.mitm = Mitmdump.router(tmp / "router", ca, self.config("bare"), env={KEY_ENV: KEY})

    def config(self, target: str) -> str:
        servers: dict[str, dict[str, Any]] = {}
        for c, fake in self.sources.items():
            servers[f"a-{c}"] = {"url": fake.origin + CONVENTIONS[c][0]}
        for c, fake in self.targets.items():
            servers[f"b-{c}"] = {"url": fake.origin + CONVENTIONS[c][0], "key_env": KEY_ENV}
        return toml_config(servers, {a: f"b-{target}" for a in AGENTS})

    def use(self, target: str) -> None:
        """Every agent's new conversations go to ``b-<target>``; wait until the proxy shows it."""
        if self.current == target:
            return
        self.mitm.write_config(self.config(target))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                r = Client.via_proxy(self.mitm.port, self.mitm.mitm_ca, 10).request(
                    "GET", self.sources["bare"].origin + "/__sessionpin/status")
                if r.status == 200 and all(r.json()["agents"].get(a) == f"b-{target}" for a in AGENTS):
                    self.current = target
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"the proxy did not take the config for b-{target} within 10 s")

    def fakes(self) -> dict[str, FakeServer]:
        return {**{f"a-{c}": f for c, f in self.sources.items()}, **{f"b-{c}": f for c, f in self.targets.items()}}

    def stop(self) -> None:
        self.mitm.stop()
        for f in self.fakes().values():
            f.stop()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("e2e-apipaths")
    r = Rig(tmp, TestCA(tmp / "ca"))
    try:
        r.mitm.start()
        yield r
    finally:
        r.stop()


def send_opening(rig: Rig, client: str, source: str) -> tuple[int, str, dict[str, list[Received]]]:
    """The client's recorded opening (fresh ids), sent to the source server written as
    ``source`` at the path the client uses; (status, reply text, what each fake received)."""
    agent, scenario, nn, _ = OPENINGS[client]
    [rec] = [r for r in load(agent, scenario) if r.nn == nn]
    p = Replay(RUN).prepare(rec)
    fake = rig.sources[source]
    before = {n: len(f.received()) for n, f in rig.fakes().items()}
    if p.http2:
        reply: Any = h2_request(rig.mitm.port, rig.mitm.mitm_ca, "127.0.0.1", fake.port, p.method, p.path,
                                p.headers, p.body)
    else:
        reply = Client.via_proxy(rig.mitm.port, rig.mitm.mitm_ca).request(p.method, fake.origin + p.path,
                                                                           p.headers, p.body)
    got = {n: f.received()[before[n]:] for n, f in rig.fakes().items()}
    return reply.status, reply.text, {n: r for n, r in got.items() if r}


@pytest.mark.parametrize("target", list(CONVENTIONS))
@pytest.mark.parametrize("client", list(OPENINGS))
def test_each_clients_opening_is_routed_to_the_targets_own_path(rig, client, target):
    rig.use(target)
    endpoint = OPENINGS[client][3]
    want = CONVENTIONS[target][2] + endpoint
    problems = []
    for source in CONVENTIONS:
        status, text, got = send_opening(rig, client, source)
        arrived = {n: [r.path for r in rs] for n, rs in got.items()}
        if arrived != {f"b-{target}": [want]} or status != 200:
            problems.append(f"{client} to a server written {source!r} -> {status}, arrived {arrived} "
                            f"(want {want} at b-{target}) {text[:160] if status != 200 else ''}")
            continue
        [r] = got[f"b-{target}"]
        creds = [v for k, v in r.headers if k.lower() in ("x-api-key", "authorization")]
        if not creds or not all(KEY in v for v in creds):
            problems.append(f"{client} from {source!r}: b-{target} did not get its own key")
    assert not problems, "\n".join(problems)


def test_a_request_that_looks_like_inference_and_is_not_routed_is_said_once_and_listed(rig):
    """Nothing in scope is left alone silently: a chat completion under an API version other
    than /v1 at a configured origin passes untouched, and the log says so once per origin and
    path prefix with the server URL that would route it; the status lists it with its count."""
    rig.use("zen")
    fake = rig.sources["bare"]
    prefix = f"/api/paas{uuid.uuid4().hex[:6]}/v4"
    since = rig.mitm.line_count
    body = b'{"model":"glm-4.6","messages":[{"role":"user","content":"hi"}],"stream":false}'
    headers = [("content-type", "application/json"), ("user-agent", "opencode/1.18.33"),
               ("x-opencode-session", "ses_" + uuid.uuid4().hex[:26])]
    client = Client.via_proxy(rig.mitm.port, rig.mitm.mitm_ca)
    for _ in range(2):
        before = len(fake.received())
        assert client.request("POST", fake.origin + prefix + "/chat/completions", headers, body).status == 200
        assert [r.path for r in fake.received()[before:]] == [prefix + "/chat/completions"]   # untouched
    url = fake.origin + prefix
    line = rig.mitm.wait_output(re.escape(f"left alone: POST {url}/chat/completions looks like inference"), 10, since)
    assert line is not None, rig.mitm.tail(20)
    assert f'a server with url = "{url}" would route it' in line.string
    status = Client.via_proxy(rig.mitm.port, rig.mitm.mitm_ca).request("GET", fake.origin + "/__sessionpin/status").json()
    [entry] = [u for u in status["unrouted"] if u["prefix"] == prefix]
    assert (entry["origin"], entry["endpoint"], entry["count"], entry["server"], entry["url"]) == (
        fake.origin, "/chat/completions", 2, "a-bare", url)
    assert rig.mitm.output.count(f"left alone: POST {url}/chat/completions") == 1
