"""The ledger end to end: a real mitmdump, real TLS, fake servers streaming Anthropic SSE with usage.

One Claude Code conversation goes through the proxy turn by turn; the fakes answer each turn
with the usage (and, once, the provider's cache diagnostic) the test planned. Checked:
- every answer reaches the client byte-identical and as it streams (events spaced as sent);
- the ledger in the store, read by ``sessionpin show --json``, equals the sums of the usage
  objects the fakes sent, per server and model, across a restart of the proxy;
- each crafted miss gets its reason: tools changed (assessed after the restart, from the
  store's record), the provider's own diagnostic, compaction (history rewritten at message 0),
  an operator's move to another server, a model switch; a continued history is a hit;
- ``sessionpin sessions`` and ``show`` show them, the Prometheus counters count the misses by
  reason (the flow's comment is checked in tests/test_proxy_ledgerwatch.py);
- ``sessionpin costs`` prices them with the config's prices;
- with ``sessionpin_otel=console`` the SDK prints a span per turn with the GenAI attributes.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from .harness import Client, FakeServer, Mitmdump, TestCA, sse, toml_config

GLM_ENV = "SESSIONPIN_LEDGER_E2E_GLM_KEY"
SESSION = str(uuid.uuid4())
TOOLS = [{"name": "Bash", "description": "Run a shell command.",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
PRICES = {"claude-*": "{ input = 5, output = 25, cache_read = 0.5, cache_write_5m = 6.25, cache_write_1h = 10 }"}


class UsageServer(FakeServer):
    """A fake that streams, for each /v1/messages request, the next planned usage (and diagnostics)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.plan: list[tuple[dict, dict | None]] = []
        self.sent: list[bytes] = []

    def _answer(self, h, rec, n) -> None:
        if not rec.path.split("?")[0].endswith("/v1/messages"):
            return super()._answer(h, rec, n)
        usage, diagnostics = self.plan.pop(0)
        model = json.loads(rec.body)["model"]
        message = {"id": f"msg_{self.name}_{n}", "type": "message", "role": "assistant", "model": model,
                   "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
        if diagnostics is not None:
            message["diagnostics"] = diagnostics
        events = [sse("message_start", {"type": "message_start", "message": message}),
                  sse("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {"type": "text", "text": ""}}),
                  sse("ping", {"type": "ping"})]
        events += [sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "text_delta", "text": f"part {i}. "}})
                   for i in range(3)]
        events += [sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
                   sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                         "usage": {"output_tokens": usage["output_tokens"]}}),
                   sse("message_stop", {"type": "message_stop"})]
        self.sent.append(b"".join(events))
        h.send_stream(events, self.pause_ms, 0, [("request-id", f"req_{self.name}_{n}")])


def sessionpin_argv() -> list[str]:
    exe = Path(sys.executable).parent / "sessionpin"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "sessionpin.cli"]


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.ca = TestCA(tmp / "ca")
        self.fakes = {n: UsageServer(n, self.ca).start() for n in ("anthropic", "glm")}
        servers = {"anthropic": {"url": self.fakes["anthropic"].url},
                   "glm": {"url": self.fakes["glm"].url, "key_env": GLM_ENV}}
        text = toml_config(servers, {"claude-code": "anthropic"})
        for name in servers:
            text += "".join(f'\n[servers.{name}.prices]\n"{glob}" = {table}\n' for glob, table in PRICES.items())
        self.mitm = Mitmdump.router(tmp / "router", self.ca, text, env={GLM_ENV: "glm-sentinel"},
                                    options={"sessionpin_otel": "console"})
        self.store = self.mitm.options["sessionpin_store"]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONPIN_")}
        self.messages: list[dict] = [{"role": "user", "content": "Fix the failing test."}]

    def cli(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*sessionpin_argv(), "--config", str(self.mitm.config_path), "--store", self.store,
                               *argv], capture_output=True, text=True, env=self.env, stdin=subprocess.DEVNULL,
                              timeout=60)

    def turn(self, fake: str, usage: dict, diagnostics: dict | None = None, *, model="claude-opus-5-5",
             tools=TOOLS, system="You are a coding agent.", messages: list | None = None):
        """One Claude Code turn: the history so far (or ``messages``), answered by ``fake``."""
        self.fakes[fake].plan.append((usage, diagnostics))
        if messages is not None:
            self.messages = messages
        headers = [("Content-Type", "application/json"), ("User-Agent", "claude-cli/2.1.332 (external, cli)"),
                   ("anthropic-version", "2023-06-01"), ("x-claude-code-request-class", "main"),
                   ("X-Claude-Code-Session-Id", SESSION), ("x-api-key", "sk-ant-client")]
        body = {"model": model, "system": system, "tools": tools, "messages": self.messages, "max_tokens": 1024,
                "stream": True}
        client = Client.via_proxy(self.mitm.port, self.mitm.mitm_ca)
        reply = client.request("POST", self.fakes["anthropic"].origin + "/v1/messages?beta=true", headers,
                               json.dumps(body).encode())
        assert reply.status == 200, reply.body[:500]
        assert reply.body == self.fakes[fake].sent[-1], "the answer was changed on its way"
        self.messages = copy.deepcopy(self.messages) + [
            {"role": "assistant", "content": [{"type": "text", "text": "part 0. part 1. part 2."}]},
            {"role": "user", "content": f"and now step {len(self.messages)}"}]
        return reply

    def ledger(self, turns: int) -> dict:
        deadline = time.monotonic() + 15
        while True:
            p = self.cli("show", SESSION, "--json")
            got = json.loads(p.stdout) if p.returncode == 0 else {"turns": []}
            if len(got["turns"]) >= turns or time.monotonic() > deadline:
                assert len(got["turns"]) == turns, (p.stdout, p.stderr)
                return got
            time.sleep(0.2)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("e2e-ledger"))
    try:
        r.mitm.start()
        yield r
    finally:
        r.mitm.stop()
        for f in r.fakes.values():
            f.stop()


def u(uncached: int, read: int, write: int, out: int, one_hour: int = 0) -> dict:
    usage = {"input_tokens": uncached, "cache_read_input_tokens": read, "cache_creation_input_tokens": write,
             "output_tokens": out}
    if one_hour:
        usage["cache_creation"] = {"ephemeral_5m_input_tokens": write - one_hour, "ephemeral_1h_input_tokens": one_hour}
    return usage


def test_a_conversations_ledger_reasons_and_costs(rig: Rig) -> None:
    plan = []

    def turn(fake, usage, *a, **kw):
        plan.append((fake, usage))
        return rig.turn(fake, usage, *a, **kw)

    with rig.fakes["anthropic"].behave(pause_ms=60):
        first = turn("anthropic", u(3, 0, 20_000, 400, one_hour=20_000))
    # sent 60 ms apart: had the proxy held the answer, every event would arrive at once (a loaded
    # machine may hand the client two events in one read: the spread is what is checked)
    assert len(first.events) == 9 and first.events[-1].at - first.events[0].at > 0.3, \
        "the answer was not passed on as it streamed"
    turn("anthropic", u(5, 20_000, 900, 300))                             # the history grew: a hit
    assert rig.ledger(2)["turns"][1]["reason"] is None

    rig.mitm.restart()                                                    # the next turn is compared
    turn("anthropic", u(4, 0, 21_500, 200), tools=TOOLS + [{"name": "Edit", "input_schema": {"type": "object"}}])
    turn("anthropic", u(6, 0, 22_000, 100), {"cache_miss_reason": {"type": "messages_changed",
                                                                   "cache_missed_input_tokens": 21_000}},
         tools=TOOLS + [{"name": "Edit", "input_schema": {"type": "object"}}])
    tools2 = TOOLS + [{"name": "Edit", "input_schema": {"type": "object"}}]
    turn("anthropic", u(2_000, 0, 0, 500), tools=tools2,                  # compaction: a summary replaces it all
         messages=[{"role": "user", "content": "Summary of the conversation so far."}])
    p = rig.cli("move", SESSION, "glm", "--yes")
    assert p.returncode == 0, p.stderr
    turn("glm", u(30, 0, 2_600, 50), tools=tools2)
    turn("glm", u(40, 0, 2_700, 60), tools=tools2, model="claude-sonnet-5")

    got = rig.ledger(7)
    reasons = [(t["reason"], t["detail"]) for t in got["turns"]]
    assert reasons == [
        ("first_turn", None),
        (None, None),
        ("tools_changed", None),
        ("messages_changed", "provider: messages_changed"),
        ("messages_changed", "at message 0"),
        ("server_changed", "from anthropic"),
        ("model_changed", "from claude-opus-5-5"),
    ]
    assert [t["server"] for t in got["turns"]] == ["anthropic"] * 5 + ["glm"] * 2

    # the sums of what the servers said, per server and model
    want: dict[tuple[str, str], dict[str, int]] = {}
    for i, (fake, usage) in enumerate(plan):
        model = "claude-sonnet-5" if i == 6 else "claude-opus-5-5"
        w = want.setdefault((fake, model), {"input": 0, "output": 0, "cache_read": 0, "cache_write_5m": 0,
                                            "cache_write_1h": 0})
        one_hour = usage.get("cache_creation", {}).get("ephemeral_1h_input_tokens", 0)
        w["input"] += usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
        w["output"] += usage["output_tokens"]
        w["cache_read"] += usage["cache_read_input_tokens"]
        w["cache_write_1h"] += one_hour
        w["cache_write_5m"] += usage["cache_creation_input_tokens"] - one_hour
    by = {(r["server"], r["model"]): {k: v for k, v in r["tokens"].items() if k in w}
          for r in got["by_server_model"]}
    assert by == want
    assert got["misses"] == 5 and got["turns"] and got["tokens"]["cache_read"] == 20_000

    # the cost at the config's prices
    a = want[("anthropic", "claude-opus-5-5")]
    uncached = a["input"] - a["cache_read"] - a["cache_write_5m"] - a["cache_write_1h"]
    expected = (uncached * 5 + a["output"] * 25 + a["cache_read"] * 0.5 + a["cache_write_5m"] * 6.25
                + a["cache_write_1h"] * 10) / 1e6
    p = rig.cli("costs", "--by", "server", "--json")
    costs = {r["server"]: r for r in json.loads(p.stdout)}
    assert costs["anthropic"]["cost"] == pytest.approx(expected) and costs["glm"]["cost"] > 0

    # what an operator sees: the sessions columns, the show table, Prometheus
    p = rig.cli("sessions")
    assert p.returncode == 0 and "COST" in p.stdout.splitlines()[0]
    p = rig.cli("show", SESSION[:8])
    assert "miss: server_changed (from anthropic)" in p.stdout and "first turn" in p.stdout
    client = Client.via_proxy(rig.mitm.port, rig.mitm.mitm_ca)
    text = client.request("GET", rig.fakes["anthropic"].origin + "/__sessionpin/metrics").body.decode()
    from prometheus_client.parser import text_string_to_metric_families
    families = {f.name: f for f in text_string_to_metric_families(text)}
    misses = {s.labels["reason"]: s.value for s in families["sessionpin_ledger_cache_misses"].samples
              if s.name.endswith("_total")}
    assert misses == {"tools_changed": 1, "messages_changed": 2, "server_changed": 1, "model_changed": 1}

    # OpenTelemetry: the SDK's console exporter prints a span per turn (batched: within seconds)
    deadline = time.monotonic() + 15
    while rig.mitm.output.count('"gen_ai.conversation.id": "' + SESSION) < 5 and time.monotonic() < deadline:
        time.sleep(0.2)
    out = rig.mitm.output
    assert out.count('"gen_ai.conversation.id": "' + SESSION) >= 5, rig.mitm.tail(40)
    assert '"gen_ai.usage.cache_creation.input_tokens": 2700' in out
    assert '"sessionpin.cache.reason": "model_changed"' in out
    assert "Fix the failing test" not in out            # ids and numbers, never the prompt


# --------------------------------------------------------------------------- hostile servers


class HostileRig:
    """A router whose new Claude Code conversations go to a fake ``glm`` answering a JSON
    message whose usage and model the test chooses per conversation (``answers``)."""

    def __init__(self, tmp: Path, store: str | None = None) -> None:
        self.ca = TestCA(tmp / "ca")
        self.anthropic = FakeServer("anthropic", self.ca).start()
        self.glm = FakeServer("glm", self.ca, prefix="/api/anthropic").start()
        self.answers: dict[str, tuple[dict, str]] = {}      # session -> (usage, model)
        self.glm.canned = self._canned
        config = toml_config({"anthropic": {"url": self.anthropic.url},
                              "glm": {"url": self.glm.url, "key_env": GLM_ENV}}, {"claude-code": "glm"})
        self.mitm = Mitmdump.router(tmp / "router", self.ca, config, env={GLM_ENV: "glm-sentinel"},
                                    options={"sessionpin_store": store} if store else {})
        self.mitm.start()

    def _canned(self, rec):
        if rec.method != "POST" or not rec.path.split("?")[0].endswith("/v1/messages"):
            return None
        usage, model = self.answers.get(rec.header("X-Claude-Code-Session-Id") or "",
                                        ({"input_tokens": 100, "output_tokens": 1}, "glm-4.6"))
        body = json.dumps({"id": "msg_1", "type": "message", "role": "assistant", "model": model,
                           "content": [{"type": "text", "text": "ok"}], "usage": usage}).encode()
        return 200, [("Content-Type", "application/json")], body

    def send(self, session: str) -> None:
        headers = [("Content-Type", "application/json"), ("User-Agent", "claude-cli/2.1.332 (external, cli)"),
                   ("x-api-key", "sk-ant-client"), ("X-Claude-Code-Session-Id", session),
                   ("x-claude-code-request-class", "main"), ("anthropic-version", "2023-06-01")]
        body = json.dumps({"model": "claude-opus-4-5", "max_tokens": 10, "stream": False,
                           "messages": [{"role": "user", "content": "hello"}]}).encode()
        r = Client.via_proxy(self.mitm.port, self.mitm.mitm_ca).request(
            "POST", self.anthropic.origin + "/v1/messages", headers, body)
        assert r.status == 200, r.body[:300]

    def close(self) -> None:
        self.mitm.stop()
        self.anthropic.stop()
        self.glm.stop()


def test_an_absurd_usage_number_or_a_poisoned_ledger_costs_no_other_conversation_its_turns(tmp_path) -> None:
    """Redis store: its ``HINCRBY`` takes int64 only, and the ledger writes every conversation's
    turns of 0.2 s in one script. Before: one server's ``"input_tokens": 18446744073709551615``
    failed the whole batch (every other conversation's turns lost with it), and 2**63-1 made
    every later batch of that conversation fail for 30 days. Now a figure over 10**9 is not
    stated, and a batch the store refuses (a ledger already at int64's end, from before) is
    written one conversation at a time."""
    import asyncio
    import threading

    from redis_servers import RedisServer
    from sessionpin.accounting import ledger
    from sessionpin.store import open_store
    from sessionpin.store.base import HIncr

    (tmp_path / "redis").mkdir()
    srv = RedisServer(tmp_path / "redis").start()
    url = srv.url()
    hostile, poisoned = "h-" + str(uuid.uuid4()), "p-" + str(uuid.uuid4())
    victims = ["v-" + str(uuid.uuid4()) for _ in range(3)]

    async def poison():
        await open_store(url).apply([], [HIncr(ledger.key(poisoned), "glm|glm-4.6|input", 2**63 - 1)])
    asyncio.run(poison())
    rig = HostileRig(tmp_path, url)
    try:
        rig.answers[hostile] = ({"input_tokens": 18446744073709551615, "cache_read_input_tokens": 2**63 - 1,
                                 "output_tokens": 7}, "glm-4.6")
        for _ in range(2):               # twice: the hostile conversation's later batches are written too
            sends = [threading.Thread(target=rig.send, args=(s,)) for s in (hostile, poisoned, *victims)]
            for t in sends:
                t.start()
            for t in sends:
                t.join()
            time.sleep(1.0)

        async def read(session):
            store = open_store(url)
            return (await store.hgetall(ledger.key(session)),
                    await store.zcount(ledger.turns_key(session), float("-inf"), float("inf")))
        for v in victims:
            sums, turns = asyncio.run(read(v))
            assert turns == 2 and int(sums["glm|glm-4.6|input"]) == 200, (v, sums, turns, rig.mitm.output[-2000:])
        sums, turns = asyncio.run(read(hostile))
        assert turns == 2 and int(sums["glm|glm-4.6|output"]) == 14, sums
        assert all(int(v) <= 10**12 for k, v in sums.items() if k.startswith("glm|")), sums
    finally:
        rig.close()
        srv.stop()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_a_server_naming_huge_or_ever_new_models_grows_neither_the_proxy_nor_the_store(tmp_path) -> None:
    """File store. A routed server names a new 1 MB model in each of 40 answers, then 150
    short new ones. Before: each 1 MB name became a Prometheus label kept for the process's
    life (/metrics 80 MB, +100 MB of RSS) and a field of the conversation's ledger and of its
    turn records (200 MB of store). Now a name is cut to 200 characters where it is read, and
    the first 100 models named get a label of their own, the rest ``other``."""
    rig = HostileRig(tmp_path)
    try:
        session = str(uuid.uuid4())
        rig.send(session)
        time.sleep(1.0)
        pid = rig.mitm.proc.pid
        before = _rss_mb(pid)
        for _ in range(40):
            rig.answers[session] = ({"input_tokens": 10, "output_tokens": 1},
                                    "glm-" + uuid.uuid4().hex + "x" * 1_000_000)
            rig.send(session)
        for i in range(150):
            rig.answers[session] = ({"input_tokens": 10, "output_tokens": 1}, f"m-{i}")
            rig.send(session)
        time.sleep(1.5)
        grew = _rss_mb(pid) - before
        metrics = Client.via_proxy(rig.mitm.port, rig.mitm.mitm_ca).request(
            "GET", rig.anthropic.origin + "/__sessionpin/metrics", [("Host", "127.0.0.1")])
        db = sum(p.stat().st_size for p in rig.mitm.workdir.glob("state.db*"))
        labels = {line.split('model="', 1)[1].split('"', 1)[0] for line in metrics.text.splitlines()
                  if line.startswith("sessionpin_ledger_tokens_total{")}
        print(f"\n190 answers: proxy RSS +{grew:.0f} MB, /metrics {len(metrics.body) / 1e6:.2f} MB, "
              f"{len(labels)} model labels, store files {db / 1e6:.1f} MB")
        assert metrics.status == 200
        assert len(metrics.body) < 500_000, f"/metrics is {len(metrics.body) / 1e6:.1f} MB"
        assert len(labels) <= 101 and "other" in labels and max(len(x) for x in labels) <= 200
        assert db < 20_000_000, f"the store's files are {db / 1e6:.0f} MB"
        # (40 answers of 1 MB with a short model grow it ~20-25 MB too: mitmproxy and the allocator)
        assert grew < 60, f"the proxy kept {grew:.0f} MB more after 190 answers"
    finally:
        rig.close()
