"""The sessionpin command against a running router: a real mitmdump, real TLS, fake servers.

The command runs as its own process (the installed console script), with the same config
file and store as the proxy, as an operator would run it. Checked: ``use`` switches where
new conversations go within 1 s and leaves running ones alone, ``move`` (after its refusal
without --yes) moves one conversation within 1 s, ``forget`` hands a conversation back to
the "did not see begin" rule, ``servers remove`` warns with the right count and what it
said happens (424), and status/doctor/env see the running proxy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from .harness import Client, FakeServer, Mitmdump, TestCA, toml_config

GLM_ENV = "SESSIONPIN_CLI_E2E_GLM_KEY"
GLM_KEY = f"glm-cli-sentinel-{uuid.uuid4().hex[:8]}"
CLIENT_KEY = f"sk-ant-api03-cli-client-{uuid.uuid4().hex[:8]}"
SESSION_HEADER = "X-Claude-Code-Session-Id"
TOOLS = [{"name": "Bash", "description": "Run a shell command.",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]


def sessionpin_argv() -> list[str]:
    exe = Path(sys.executable).parent / "sessionpin"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "sessionpin.cli"]


def claude_code(kind: str, session: str) -> tuple[list[tuple[str, str]], bytes]:
    """An opening turn or a continuation, shaped as Claude Code sends them."""
    headers = [("Content-Type", "application/json"), ("User-Agent", "claude-cli/2.1.332 (external, cli)"),
               ("anthropic-version", "2023-06-01"), ("x-claude-code-request-class", "main"),
               (SESSION_HEADER, session), ("x-api-key", CLIENT_KEY)]
    messages = [{"role": "user", "content": "Fix the failing test."}]
    if kind == "continuation":
        # each conversation's first answer is its own (as a server's is): two conversations
        # never share a first exchange, so one is never taken for a fork of another
        messages += [{"role": "assistant", "content": [{"type": "text", "text": f"Looking ({session})."}]},
                     {"role": "user", "content": "Go on."}]
    meta = {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": session})}
    body = {"model": "claude-opus-4-5-20251101", "messages": messages, "tools": TOOLS, "metadata": meta,
            "max_tokens": 1024, "stream": True}
    return headers, json.dumps(body).encode()


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.ca = TestCA(tmp / "ca")
        self.fakes = {"anthropic": FakeServer("anthropic", self.ca), "glm": FakeServer("glm", self.ca)}
        for f in self.fakes.values():
            f.start()
        servers = {"anthropic": {"url": self.fakes["anthropic"].url},
                   "glm": {"url": self.fakes["glm"].url, "key_env": GLM_ENV}}
        text = "# the operator's notes stay\n" + toml_config(servers, {"claude-code": "anthropic"})
        self.mitm = Mitmdump.router(tmp / "router", self.ca, text, env={GLM_ENV: GLM_KEY})
        self.config = self.mitm.config_path
        self.store = self.mitm.options["sessionpin_store"]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONPIN_") or k == "SESSIONPIN_STORE_MEMORY"}
        self.env.pop(GLM_ENV, None)

    def cli(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*sessionpin_argv(), "--config", str(self.config), "--store", self.store, *argv],
                              capture_output=True, text=True, env=self.env, stdin=subprocess.DEVNULL, timeout=60)

    def send(self, kind: str, session: str) -> int:
        headers, body = claude_code(kind, session)
        client = Client.via_proxy(self.mitm.port, self.mitm.mitm_ca)
        return client.request("POST", self.fakes["anthropic"].origin + "/v1/messages?beta=true", headers, body).status

    def where(self, session: str) -> list[str]:
        """Which fake received each request of ``session``, in arrival order."""
        got = [(r.at, name) for name, f in self.fakes.items() for r in f.received() if r.header(SESSION_HEADER) == session]
        return [name for _, name in sorted(got)]

    def pins(self) -> dict[str, dict]:
        p = self.cli("sessions", "--json")
        assert p.returncode == 0, p.stderr
        return {row["session"]: row for row in json.loads(p.stdout)}


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("e2e-cli"))
    try:
        r.mitm.start()
        yield r
    finally:
        r.mitm.stop()
        for f in r.fakes.values():
            f.stop()


def wait_for_proxy_in_store(rig: Rig) -> dict:
    deadline = time.monotonic() + 10
    while True:
        p = rig.cli("status", "--json")
        assert p.returncode == 0, p.stderr
        status = json.loads(p.stdout)
        if status["proxy"]["answering"] or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def claude_code_on_glm(rig: Rig) -> None:
    """New claude-code conversations go to glm, as the first test leaves them: each test that
    builds on it says so, and runs alone too."""
    p = rig.cli("use", "claude-code", "glm")
    assert p.returncode == 0, p.stderr
    if "already go to glm" not in p.stdout:
        time.sleep(1.0)                             # the proxy applies it within 1 s


def test_use_switches_new_conversations_within_a_second_and_running_ones_stay(rig):
    status = wait_for_proxy_in_store(rig)
    assert status["proxy"]["answering"], status["proxy"]
    assert status["proxy"]["address"] == f"http://127.0.0.1:{rig.mitm.port}"

    s1 = str(uuid.uuid4())
    assert rig.send("opening", s1) == 200
    assert rig.where(s1) == ["anthropic"]

    before = rig.config.read_text()
    p = rig.cli("use", "claude-code", "glm")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "New claude-code conversations → glm. (was: anthropic)"
    assert lines[1] == "1 running conversation stays where it is: 1 on anthropic."
    assert f"The proxy at http://127.0.0.1:{rig.mitm.port} (pid {rig.mitm.proc.pid}) applies this within 1 s." in p.stdout
    # Only that setting changed; the comment is kept.
    after = rig.config.read_text()
    assert after.startswith("# the operator's notes stay\n")
    assert [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b] == [
        ('server = "anthropic"', 'server = "glm"')]

    time.sleep(1.0)
    s2 = str(uuid.uuid4())
    assert rig.send("opening", s2) == 200
    assert rig.send("continuation", s1) == 200
    assert rig.where(s2) == ["glm"], "a new conversation follows the change within 1 s"
    assert rig.where(s1) == ["anthropic", "anthropic"], "the running conversation stays where it began"
    got = [r for r in rig.fakes["glm"].received() if r.header(SESSION_HEADER) == s2][0]
    assert got.header("x-api-key") == GLM_KEY

    p = rig.cli("use", "claude-code", "glm")
    assert p.returncode == 0 and p.stdout == "New claude-code conversations already go to glm; nothing written.\n"
    assert rig.config.read_text() == after


def test_move_is_refused_without_yes_then_the_next_request_follows_it(rig):
    claude_code_on_glm(rig)
    s = str(uuid.uuid4())
    assert rig.send("opening", s) == 200
    assert rig.where(s) == ["glm"]

    p = rig.cli("move", s[:13], "anthropic")
    assert p.returncode == 1 and p.stdout == ""
    assert "context window (400" in p.stderr
    assert p.stderr.splitlines()[-1].startswith(f"sessionpin: {s[:8]} not moved: confirm with --yes")
    assert rig.send("continuation", s) == 200
    assert rig.where(s) == ["glm", "glm"]

    p = rig.cli("move", s[:13], "anthropic", "--yes")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"Moved {s[:8]} (claude-code) from glm to anthropic.")
    assert rig.send("continuation", s) == 200    # the very next request: the router reads pins per request
    assert rig.where(s) == ["glm", "glm", "anthropic"]
    got = [r for r in rig.fakes["anthropic"].received() if r.header(SESSION_HEADER) == s][-1]
    assert got.header("x-api-key") == CLIENT_KEY   # back on the origin it addressed, with its own key
    assert rig.pins()[s]["server"] == "anthropic" and rig.pins()[s]["rule"] == "operator"


def test_forget_hands_the_conversation_to_the_not_seen_begin_rule(rig):
    claude_code_on_glm(rig)
    s = str(uuid.uuid4())
    assert rig.send("opening", s) == 200
    assert rig.where(s) == ["glm"]
    p = rig.cli("forget", s, "--yes")
    assert p.returncode == 0, p.stderr
    assert "the proxy leaves a conversation it did not see begin alone (not routed)" in p.stdout
    assert rig.send("continuation", s) == 200
    assert rig.where(s) == ["glm", "anthropic"]     # left alone: where the agent sent it
    assert rig.pins()[s]["server"] is None


def test_activity_reaches_sessions_and_status(rig):
    claude_code_on_glm(rig)
    s = str(uuid.uuid4())
    assert rig.send("opening", s) == 200
    assert rig.send("continuation", s) == 200
    deadline = time.monotonic() + 10            # the router flushes activity every 0.5 s
    while (row := rig.pins()[s])["requests"] < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert row["requests"] == 2 and row["last_seen"] is not None and row["server"] == "glm"
    p = rig.cli("sessions", "--server", "glm")
    assert p.returncode == 0
    header = p.stdout.splitlines()[0]
    line = next(x for x in p.stdout.splitlines() if x.startswith(s[:8]))
    # REQUESTS by its column (the ledger's columns may follow it)
    assert line.split()[1:3] == ["claude-code", "glm"] and line[header.index("REQUESTS"):].split()[0] == "2"
    status = json.loads(rig.cli("status", "--json").stdout)
    glm = next(x for x in status["servers"] if x["name"] == "glm")
    assert glm["key_set"] is True and glm["key_checked_in"] == "the running proxy's environment"
    assert glm["active_last_hour"] >= 1


def test_doctor_and_env_see_the_running_proxy(rig):
    claude_code_on_glm(rig)                         # (doctor checks the keys of the servers in use)
    p = rig.cli("doctor", "--json")
    checks = {c["check"]: c for c in json.loads(p.stdout)["checks"]}
    assert checks["proxy"]["state"] == "ok" and checks["CA"]["state"] == "ok"
    assert checks["CA"]["detail"] == str(rig.mitm.mitm_ca)
    assert checks["key glm"]["state"] == "ok"
    assert p.returncode == 0, p.stdout
    p = rig.cli("env", "claude-code")
    assert f"export HTTPS_PROXY=http://127.0.0.1:{rig.mitm.port}" in p.stdout
    assert f"export NODE_EXTRA_CA_CERTS={rig.mitm.mitm_ca}" in p.stdout


def test_a_proxy_reading_other_files_is_named(rig, tmp_path, monkeypatch):
    from sessionpin.cli import context, proxies

    # `use` on another config file than the proxy's: it says the change does not reach it.
    other = tmp_path / "other.toml"
    other.write_text(rig.config.read_text())
    p = subprocess.run([*sessionpin_argv(), "--config", str(other), "--store", rig.store, "use", "pi", "anthropic"],
                       capture_output=True, text=True, env=rig.env, stdin=subprocess.DEVNULL, timeout=60)
    assert p.returncode == 0, p.stderr
    assert (f"Warning: the proxy at http://127.0.0.1:{rig.mitm.port} (pid {rig.mitm.proc.pid}) reads {rig.config}, "
            f"not {other}: this change does not reach it") in p.stdout
    p = subprocess.run([*sessionpin_argv(), "--config", str(other), "--store", rig.store, "doctor"],
                       capture_output=True, text=True, env=rig.env, stdin=subprocess.DEVNULL, timeout=60)
    assert p.returncode == 1
    line = next(x for x in p.stdout.splitlines() if x.startswith("FAIL  proxy"))
    assert f"the proxy at http://127.0.0.1:{rig.mitm.port} (pid {rig.mitm.proc.pid}) reads {rig.config}" in line
    # A command using another store finds no heartbeat, but names the proxy answering on the default port.
    monkeypatch.setattr(proxies, "DEFAULT_LISTEN", ("127.0.0.1", rig.mitm.port))
    ctx = context.make_ctx(str(other), f"file:{tmp_path / 'elsewhere.db'}")
    try:
        proxy = proxies.find_proxy(ctx)
    finally:
        ctx.close()
    assert not proxy.answering
    assert proxy.why == (f"a sessionpin proxy answers at 127.0.0.1:{rig.mitm.port} but uses {rig.store}, "
                         f"not file:{tmp_path / 'elsewhere.db'}")


def test_servers_remove_warns_with_the_count_and_the_424_it_announces_happens(rig):
    claude_code_on_glm(rig)
    assert rig.send("opening", str(uuid.uuid4())) == 200      # a running conversation on glm
    p = rig.cli("servers", "remove", "glm")
    assert p.returncode == 1 and "new claude-code conversations go to glm" in p.stderr
    assert rig.cli("use", "claude-code", "anthropic").returncode == 0
    on_glm = [s for s, row in rig.pins().items() if row["server"] == "glm"]
    assert on_glm
    p = rig.cli("servers", "remove", "glm")
    assert p.returncode == 1
    n = len(on_glm)
    assert f"{n} running conversation{'s' if n > 1 else ''} {'are' if n > 1 else 'is'} pinned to glm" in p.stderr
    assert "refuses their requests with 424" in p.stderr
    p = rig.cli("servers", "remove", "glm", "--force")
    assert p.returncode == 0, p.stderr
    time.sleep(1.0)
    headers, body = claude_code("continuation", on_glm[0])
    client = Client.via_proxy(rig.mitm.port, rig.mitm.mitm_ca)
    reply = client.request("POST", rig.fakes["anthropic"].origin + "/v1/messages?beta=true", headers, body)
    assert reply.status == 424 and "glm" in reply.text
    assert rig.where(on_glm[0])[-1] == "glm"       # nothing new reached anyone: refused at the proxy
    # Every secret stayed with its owner.
    for name, f in rig.fakes.items():
        for r in f.received():
            assert (GLM_KEY.encode() in r.raw()) == (name == "glm" and r.header("x-api-key") == GLM_KEY)
            if name == "glm":
                assert CLIENT_KEY.encode() not in r.raw()


class SessionpinRun(Mitmdump):
    """``sessionpin run`` itself (it execs mitmdump with the script shipped in the package)."""

    def __init__(self, workdir: Path, config: Path, store: str, ca: TestCA) -> None:
        super().__init__(workdir, options={"ssl_verify_upstream_trusted_ca": str(ca.pem)}, env={GLM_ENV: GLM_KEY})
        self.config_path = config
        self.store_url = store

    def command(self) -> list[str]:
        return [*sessionpin_argv(), "--config", str(self.config_path), "--store", self.store_url, "run",
                "-p", "0", "--set", f"confdir={self.confdir}",
                "--set", f"ssl_verify_upstream_trusted_ca={self.options['ssl_verify_upstream_trusted_ca']}"]


def test_sessionpin_run_starts_the_router_from_the_installed_package(tmp_path):
    ca = TestCA(tmp_path / "ca")
    fakes = {"anthropic": FakeServer("anthropic", ca), "glm": FakeServer("glm", ca)}
    for f in fakes.values():
        f.start()
    config = tmp_path / "config.toml"
    config.write_text(toml_config({"anthropic": {"url": fakes["anthropic"].url},
                                   "glm": {"url": fakes["glm"].url, "key_env": GLM_ENV}}, {"claude-code": "glm"}))
    store = f"file:{tmp_path / 'state.db'}"
    proxy = SessionpinRun(tmp_path / "run", config, store, ca)
    try:
        port = proxy.start()
        assert "sessionpin/mitmscript/route.py" in proxy.output
        assert proxy.wait_output(r"sessionpin: config .*claude-code → glm", timeout=5)
        session = str(uuid.uuid4())
        headers, body = claude_code("opening", session)
        reply = Client.via_proxy(port, proxy.mitm_ca).request(
            "POST", fakes["anthropic"].origin + "/v1/messages?beta=true", headers, body)
        assert reply.status == 200
        got = fakes["glm"].received()
        assert len(got) == 1 and got[0].header("x-api-key") == GLM_KEY
        assert fakes["anthropic"].received() == []
        env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONPIN_") or k == "SESSIONPIN_STORE_MEMORY"}
        deadline = time.monotonic() + 10
        while True:
            p = subprocess.run([*sessionpin_argv(), "--config", str(config), "--store", store, "status", "--json"],
                               capture_output=True, text=True, env=env, timeout=60)
            answering = json.loads(p.stdout)["proxy"]
            if answering["answering"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert answering["answering"] and answering["address"] == f"http://127.0.0.1:{port}"
    finally:
        proxy.stop()
        for f in fakes.values():
            f.stop()


@pytest.fixture
def second(rig: Rig, tmp_path: Path) -> Iterator[Mitmdump]:
    """A second proxy on the rig's store and config (two proxies sharing one store)."""
    m = Mitmdump(tmp_path / "second", options={"sessionpin_config": str(rig.config), "sessionpin_store": rig.store,
                                                "ssl_verify_upstream_trusted_ca": str(rig.ca.pem)},
                 env={GLM_ENV: GLM_KEY})
    try:
        m.start()
        deadline = time.monotonic() + 15
        while True:
            status = json.loads(rig.cli("status", "--json").stdout)
            if len([p for p in status["proxies"] if p["answering"]]) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        yield m
    finally:
        m.stop(signal.SIGKILL)


def test_use_and_env_name_both_proxies_of_a_store(rig, second):
    first = f"http://127.0.0.1:{rig.mitm.port} (pid {rig.mitm.proc.pid})"
    other = f"http://127.0.0.1:{second.port} (pid {second.proc.pid})"
    p = rig.cli("use", "pi", "anthropic")
    assert p.returncode == 0, p.stderr
    assert f"The proxy at {first} applies this within 1 s." in p.stdout
    assert f"The proxy at {other} applies this within 1 s." in p.stdout
    p = rig.cli("env", "claude-code")
    assert p.returncode == 0, p.stderr
    # the newest first: the second proxy started last
    assert f"export HTTPS_PROXY=http://127.0.0.1:{second.port}" in p.stdout
    assert f"# 2 proxies answer on this store: {other}, {first};" in p.stdout


def test_request_counts_survive_a_kill_9_a_second_later(rig, second):
    s = str(uuid.uuid4())
    client = Client.via_proxy(second.port, second.mitm_ca)
    for kind in ("opening", "continuation", "continuation"):
        headers, body = claude_code(kind, s)
        assert client.request("POST", rig.fakes["anthropic"].origin + "/v1/messages?beta=true",
                              headers, body).status == 200
    time.sleep(1.0)      # the promise under test: what is a second old is in the store
    second.stop(signal.SIGKILL)
    assert rig.pins()[s]["requests"] == 3
