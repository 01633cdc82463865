"""ConfigWatch: read at start, watched while running, bad texts refused."""

from __future__ import annotations

import pytest
from mitmproxy import exceptions

from shellkit import CONFIG, start


@pytest.fixture
def cfg_path(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text(CONFIG)
    return p


@pytest.fixture
def proxy(cfg_path):
    p = start(cfg_path)
    yield p
    p.close()


def test_bad_config_is_refused_and_the_previous_one_stays(proxy, cfg_path, caplog):
    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = "glmm"'))
    proxy.reload()
    assert proxy.config.config.current("claude-code") == "glm"
    assert proxy.config.problem.startswith("config.toml:")
    assert "agents.claude-code.server: no server named 'glmm'" in caplog.text
    assert proxy.config.rejected == 1
    cfg_path.unlink()   # a vanished file keeps the config in force
    proxy.reload()
    assert proxy.config.config.current("claude-code") == "glm"
    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = ""'))
    proxy.reload()
    assert proxy.config.config.current("claude-code") is None and proxy.config.problem is None
    assert proxy.config.reloads == 1


def test_a_text_seen_once_is_not_applied(proxy, cfg_path):
    cfg_path.write_text("")                  # an editor truncated the file, about to write
    proxy.config.check()
    assert proxy.config.config.current("claude-code") == "glm"
    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = "anthropic"'))
    proxy.config.check()
    assert proxy.config.config.current("claude-code") == "glm"
    proxy.config.check()
    assert proxy.config.config.current("claude-code") == "anthropic"


def test_an_emptied_file_is_an_empty_config(proxy, cfg_path):
    cfg_path.write_text("")
    proxy.reload()
    assert proxy.config.config.servers == {} and proxy.config.problem is None


def test_bad_config_option_raises_options_error(proxy, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[agents.claude-code]\nserver = "x"\n')
    with pytest.raises(exceptions.OptionsError, match=r"bad.toml:2: agents.claude-code.server: no server named 'x'"):
        proxy.tctx.configure(proxy.config, sessionpin_config=str(bad))
    assert proxy.config.config.current("claude-code") == "glm"


def test_missing_config_file_routes_nothing(tmp_path):
    p = start(tmp_path / "none.toml")
    try:
        assert p.config.config.servers == {} and p.config.problem is None
    finally:
        p.close()


def test_reload_interval_is_validated(proxy):
    with pytest.raises(exceptions.OptionsError, match="sessionpin_reload_ms"):
        proxy.tctx.configure(proxy.config, sessionpin_reload_ms=1)


async def test_the_watch_loop_applies_an_edit(proxy, cfg_path):
    import asyncio
    proxy.tctx.configure(proxy.config, sessionpin_reload_ms=20)
    proxy.config.running()
    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = "anthropic"'))
    for _ in range(200):
        await asyncio.sleep(0.02)
        if proxy.config.config.current("claude-code") == "anthropic":
            break
    assert proxy.config.config.current("claude-code") == "anthropic"


def test_the_reload_line_shows_pools(tmp_path):
    from sessionpin.config.config import parse
    from sessionpin.proxy.configwatch import ConfigWatch
    w = ConfigWatch()
    w.config = parse('''
[servers.a]
url = "https://a.example"
key_env = "A"
[servers.b]
url = "https://b.example"
key_env = "B"
[pools.glm]
members = ["a", "b"]
affinity = "soft"
[agents.claude-code]
server = "glm"
''')
    assert w.describe() == "servers: a, b; pool glm: a, b (round-robin, soft); claude-code → glm"


def test_a_config_others_may_write_is_kept_out_at_reload_and_said_once(proxy, cfg_path, caplog):
    """Issue 20: a config that others may write could send a server's key anywhere; the watcher
    keeps the config in force, says so once, and takes the file back once it is trusted again."""
    import os

    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = "anthropic"'))
    os.chmod(cfg_path, 0o666)
    for _ in range(3):
        proxy.config.check()
    assert proxy.config.config.current("claude-code") == "glm"
    assert "writable by other users" in proxy.config.problem and proxy.config.rejected == 1
    assert caplog.text.count("config rejected, keeping the previous one") == 1
    os.chmod(cfg_path, 0o600)
    proxy.reload()
    assert proxy.config.config.current("claude-code") == "anthropic" and proxy.config.problem is None


def test_a_config_that_cannot_be_read_is_said_once_and_kept_out(proxy, cfg_path, caplog):
    """A path that cannot be read (here a link to itself; permissions alike, which root does not
    meet) keeps the config in force and is said once, in the log and as the problem status
    shows — before, a debug line only: edits were no longer taken and nothing said so."""
    cfg_path.unlink()
    cfg_path.symlink_to(cfg_path.name)
    for _ in range(3):
        proxy.config.check()
    assert proxy.config.config.current("claude-code") == "glm"
    assert proxy.config.problem.startswith("config.toml: cannot read: ") and proxy.config.rejected == 1
    assert caplog.text.count("config rejected, keeping the previous one") == 1
    cfg_path.unlink()
    cfg_path.write_text(CONFIG.replace('server = "glm"', 'server = "anthropic"'))
    proxy.reload()
    assert proxy.config.config.current("claude-code") == "anthropic" and proxy.config.problem is None
