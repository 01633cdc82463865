"""``sessionpin doctor`` over every config the test suite and the docs use (issue 19: it crashed
with a KeyError whenever an agent's server was a pool), and what it says of a running proxy's
requests that looked like inference and were left alone."""

from __future__ import annotations

import ast
import json
import re
import time
from pathlib import Path

import pytest

from sessionpin.config import config
from sessionpin.cli import doctor
from sessionpin.records.documents import Status, Unrouted

from test_cli import env, run  # noqa: F401 (the fixture)

ROOT = Path(__file__).resolve().parent.parent

# An agent on a pool of each kind (the e2e pools rig writes its pools like this).
POOLS = '''
[servers.a]
url = "https://a.example/zen/v1"
key_env = "SP_TEST_A_KEY"
[servers.b]
url = "https://b.example"
key_env = "SP_TEST_B_KEY"
[servers.c]
url = "https://c.example/api/anthropic"
[pools.hard]
members = ["a", "b"]
policy = "weighted"
weights = { a = 2 }
[pools.soft]
members = ["b", "c"]
affinity = "soft"
policy = "least-active"
[agents.claude-code]
server = "hard"
[agents.opencode]
server = "soft"
[agents.pi]
server = "c"
[agents.codex]
server = ""
'''


def configs() -> list[tuple[str, str]]:
    """(where, text) of every config text written in the tests and the docs that the loader accepts."""
    found: dict[str, str] = {}
    for f in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "[servers." in node.value:
                found.setdefault(node.value, f"{f.relative_to(ROOT)}:{node.lineno}")
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"```toml\n(.*?)```", f.read_text(), re.S):
            found.setdefault(m.group(1), f"{f.relative_to(ROOT)}")
    found.setdefault(POOLS, "pools of each kind")
    out = []
    for text, where in found.items():
        try:
            config.parse(text)
        except config.ConfigError:
            continue        # a test's bad config: doctor's FAIL line for those is tested in test_cli
        out.append((where, text))
    return out


CONFIGS = configs()


def test_the_configs_include_pools_the_docs_and_the_suites():
    parsed = [config.parse(t) for _, t in CONFIGS]
    assert len(CONFIGS) >= 20
    assert sum(any(a.server in c.pools for a in c.agents.values()) for c in parsed) >= 3
    assert any(w.startswith("docs/") for w, _ in CONFIGS)


@pytest.mark.parametrize("where, text", CONFIGS, ids=[w for w, _ in CONFIGS])
def test_doctor_runs_over_each_config(env, capsys, where, text):  # noqa: F811
    env.cfg.write_text(text)
    code, o, e = run(capsys, "doctor")
    assert code in (0, 1) and "Traceback" not in o + e, e
    assert o.splitlines()[-1] in ("All good.",) or o.splitlines()[-1].endswith("to fix.")
    cfg = config.parse(text)
    for a in cfg.agents.values():
        members = cfg.pools[a.server].members if a.server in cfg.pools else [a.server] if a.server else []
        for m in members:
            assert f"key {m}" in o, f"{where}: no key line for {m} ({a.name} → {a.server})"


def test_doctor_lists_what_a_running_proxy_left_alone_that_looked_like_inference():
    checks = []
    status = Status(version="x", pid=1, host="h", started=0.0, unrouted=[
        Unrouted(origin="https://api.z.ai", prefix="/api/paas/v4", endpoint="/chat/completions", server="glm",
                 count=3, first=time.time() - 60, last=time.time(), url="https://api.z.ai/api/paas/v4"),
        Unrouted(origin="https://gw.example", prefix="/openai", endpoint="/chat/completions", server="gw",
                 count=1, first=time.time(), last=time.time())])
    doctor._unrouted(type("P", (), {"status": status})(), lambda *c: checks.append(c))
    assert [c[:2] for c in checks] == [("not routed", "warn")] * 2
    assert "3 requests to https://api.z.ai/api/paas/v4/chat/completions (server glm's origin" in checks[0][2]
    assert 'add a server with url = "https://api.z.ai/api/paas/v4"' in checks[0][2]
    assert "1 request to https://gw.example/openai/chat/completions" in checks[1][2]
    assert "no server URL routes" in checks[1][2]
    json.dumps(checks)
