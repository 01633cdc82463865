"""Browsers cannot drive the proxy (issue 20), end to end: a real mitmdump in regular mode and
in reverse mode to (a fake standing in for) opencode.ai, pi's new conversations routed to glm
with glm's key.

- A web page's no-cors ``text/plain`` POST to the reverse-mode listener (``Sec-Fetch-Site:
  cross-site``, with or without ``Origin``), shaped as pi's opening, reaches no server — never
  with glm's key. The same through the regular listener to a configured server.
- pi's own recorded request (``sec-fetch-mode: cors``, ``anthropic-dangerous-direct-browser-access``,
  no ``Origin``, no ``Sec-Fetch-Site``) is routed to glm as ever, on both listeners.
- An origin the operator allowed (``sessionpin_allow_origins``) is routed; a page browsing a
  host no server names passes untouched.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import pytest

from .harness import LOOPBACK, Client, FakeServer, Mitmdump, TestCA, free_port, toml_config
from .replay import Replay, load

RUN = uuid.uuid4().hex[:8]
GLM_ENV = "SESSIONPIN_E2E_GLM_KEY"
GLM_KEY = f"GLM-KEY-SENTINEL-{RUN}"
ALLOWED = "https://app.example"
# what a page's fetch(url, {method: "POST", mode: "no-cors", body: "..."}) sends
PAGE = [("Content-Type", "text/plain;charset=UTF-8"), ("Sec-Fetch-Site", "cross-site"),
        ("Sec-Fetch-Mode", "no-cors"), ("Sec-Fetch-Dest", "empty"), ("Accept", "*/*"),
        ("User-Agent", "Mozilla/5.0 (X11; Linux x86_64) Chrome/140.0 Safari/537.36")]


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.ca = TestCA(tmp / "ca")
        self.opencode = FakeServer("opencode", self.ca).start()
        self.glm = FakeServer("glm", self.ca, prefix="/api/anthropic").start()
        self.other = FakeServer("other", self.ca).start()
        config = toml_config({"zen": {"url": self.opencode.origin + "/zen"},
                              "glm": {"url": self.glm.url, "key_env": GLM_ENV}}, {"pi": "glm"})
        self.reverse_port = free_port()
        self.mitm = Mitmdump.router(tmp / "router", self.ca, config, env={GLM_ENV: GLM_KEY},
                                    options={"sessionpin_allow_origins": [ALLOWED]},
                                    modes=["regular", f"reverse:{self.opencode.origin}@{self.reverse_port}"])
        self.mitm.start()
        [self.regular_port] = set(self.mitm.ports) - {self.reverse_port}

    def pi_opening(self) -> tuple[str, list[tuple[str, str]], bytes]:
        """pi's recorded opening to OpenCode's gateway (fresh ids, its own sentinel key)."""
        p = Replay(RUN).prepare(load("pi", "zen-messages")[0])
        return p.path, [(k, v) for k, v in p.headers if k.lower() != "host"], p.body

    def send(self, path: str, headers: list[tuple[str, str]], body: bytes, reverse: bool):
        if reverse:
            return Client.reverse(self.reverse_port).request("POST", f"http://{LOOPBACK}{path}", headers, body)
        return Client.via_proxy(self.regular_port, self.mitm.mitm_ca).request(
            "POST", self.opencode.origin + path, headers, body)

    def counts(self) -> tuple[int, int, int]:
        return len(self.opencode.received()), len(self.glm.received()), len(self.other.received())

    def close(self) -> None:
        self.mitm.stop()
        for f in (self.opencode, self.glm, self.other):
            f.stop()


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("e2e-browsers"))
    try:
        yield r
    finally:
        r.close()


@pytest.mark.parametrize("reverse", [True, False], ids=["reverse", "regular"])
@pytest.mark.parametrize("origin", [None, "https://evil.example", "null"])
def test_a_page_s_no_cors_post_reaches_no_server(rig: Rig, reverse: bool, origin: str | None) -> None:
    path, _, body = rig.pi_opening()
    headers = PAGE + ([("Origin", origin)] if origin else [])
    before, lines = rig.counts(), rig.mitm.line_count
    r = rig.send(path, headers, body, reverse)
    assert r.status == 403, r.text[:300]
    assert r.header("x-sessionpin-refused") == "web-page"
    assert "sessionpin_allow_origins" in r.json()["error"]["message"]
    assert rig.counts() == before
    assert all(GLM_KEY not in str(x.headers) for x in rig.glm.received() + rig.opencode.received())
    assert rig.mitm.wait_output(r"refused 403 \(web-page\)", timeout=5, since=lines)


@pytest.mark.parametrize("reverse", [True, False], ids=["reverse", "regular"])
def test_pi_s_own_request_is_routed_as_ever(rig: Rig, reverse: bool) -> None:
    path, headers, body = rig.pi_opening()
    names = {k.lower() for k, _ in headers}
    assert {"sec-fetch-mode", "anthropic-dangerous-direct-browser-access"} <= names
    assert not names & {"origin", "sec-fetch-site"}
    before = rig.counts()
    r = rig.send(path, headers, body, reverse)
    assert r.status == 200, r.text[:300]
    assert rig.counts() == (before[0], before[1] + 1, before[2])
    assert rig.glm.received()[-1].header("x-api-key") == GLM_KEY


def test_an_allowed_origin_is_routed(rig: Rig) -> None:
    path, headers, body = rig.pi_opening()
    before = rig.counts()
    r = rig.send(path, headers + [("Origin", ALLOWED), ("Sec-Fetch-Site", "cross-site")], body, reverse=True)
    assert r.status == 200, r.text[:300]
    assert rig.counts() == (before[0], before[1] + 1, before[2])


def test_a_page_browsing_another_host_passes_untouched(rig: Rig) -> None:
    before = rig.counts()
    r = Client.via_proxy(rig.regular_port, rig.mitm.mitm_ca).request(
        "POST", rig.other.origin + "/v1/messages", PAGE + [("Origin", rig.other.origin)], b"{}")
    assert r.status == 200, r.text[:300]
    assert rig.counts() == (before[0], before[1], before[2] + 1)
    assert rig.other.received()[-1].header("origin") == rig.other.origin


@pytest.mark.parametrize("page", [[("Origin", "https://evil.example"), ("Sec-Fetch-Site", "same-origin")],
                                  [("Sec-Fetch-Site", "cross-site")]], ids=["origin", "sec-fetch-site"])
def test_a_page_s_request_to_a_host_no_server_names_is_never_routed_even_naming_a_pinned_conversation(
        rig: Rig, page: list[tuple[str, str]]) -> None:
    """Pins are followed whatever origin a request addressed, but the page guard only guards the
    configured servers' origins (a page browsing other hosts must keep working): a page's request
    to its own host, shaped as a turn of a pinned conversation (pi's are keyed by what they say),
    was routed to glm with glm's key — and, same-origin, its answer was the page's to read. Now a
    request with browser fetch metadata that the guard lets by passes untouched to the host it
    addressed, never routed."""
    r = Replay(RUN)
    first, turn = (r.prepare(x) for x in load("pi", "zen-messages")[:2])
    for p in (first, turn):             # pi's conversation, pinned to glm
        got = rig.send(p.path, [(k, v) for k, v in p.headers if k.lower() != "host"], p.body, reverse=False)
        assert got.status == 200 and rig.glm.received()[-1].header("x-api-key") == GLM_KEY
    before = rig.counts()
    headers = [(k, v) for k, v in turn.headers if k.lower() != "host"] + page
    got = Client.via_proxy(rig.regular_port, rig.mitm.mitm_ca).request("POST", rig.other.origin + turn.path,
                                                                         headers, turn.body)
    assert got.status == 200 and rig.counts() == (before[0], before[1], before[2] + 1), \
        f"the page's request reached {rig.counts()} (opencode, glm, other) from {before}"
    received = rig.other.received()[-1]
    assert received.path == turn.path and GLM_KEY not in str(received.headers)
    assert received.header("x-api-key") == dict((k.lower(), v) for k, v in turn.headers).get("x-api-key")
