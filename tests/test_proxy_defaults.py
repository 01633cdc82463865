"""Defaults: lazy connections, no request streaming, one line per decision."""

from __future__ import annotations

import logging
import re
from typing import Optional

import pytest
from mitmproxy import exceptions

from sessionpin.proxy.defaults import Defaults
from shellkit import flow, start


@pytest.fixture
def proxy(tmp_path):
    p = start(tmp_path / "none.toml")
    yield p
    p.close()


def test_connection_chatter_is_off_unless_asked(proxy, caplog):
    server_log = logging.getLogger("mitmproxy.proxy.server")
    with caplog.at_level(logging.INFO, logger="mitmproxy.proxy.server"):
        server_log.info("client connect")
        server_log.info("server disconnect api.z.ai:443")
        server_log.info("error establishing server connection: refused")
        server_log.info("Streaming response from api.z.ai.")          # one per streamed answer
        server_log.info("Received WebSocket ping from server (payload: b'')")     # one per ping relayed
        server_log.info("Received WebSocket pong from client (payload: b'')")
    assert "client connect" not in caplog.text and "server disconnect" not in caplog.text
    assert "Streaming response" not in caplog.text and "Received WebSocket" not in caplog.text
    assert "error establishing" in caplog.text
    d = next(a for a in proxy.addons if isinstance(a, Defaults))
    proxy.tctx.configure(d, sessionpin_connection_log=True)
    with caplog.at_level(logging.INFO, logger="mitmproxy.proxy.server"):
        server_log.info("client connect")
    assert "client connect" in caplog.text


async def test_one_line_per_decision_on_the_terminal(proxy, capsys, caplog):
    import asyncio
    await proxy.send(flow())
    await proxy.send(flow("continuation"))
    await asyncio.sleep(0)           # lines are written once per turn of the event loop
    out = capsys.readouterr().out
    assert out.count("\n") == 2 and "claude-code opening abcd1234" in out and "continuation abcd1234" in out
    # timestamped like mitmproxy's own lines: [HH:MM:SS.mmm]
    assert all(re.match(r"^\[\d\d:\d\d:\d\d\.\d{3}\] sessionpin: claude-code ", line) for line in out.splitlines()), out
    d = next(a for a in proxy.addons if isinstance(a, Defaults))
    proxy.tctx.configure(d, sessionpin_decision_log="off")
    await proxy.send(flow())
    await asyncio.sleep(0)
    assert capsys.readouterr().out == ""
    proxy.tctx.configure(d, sessionpin_decision_log="eventlog")
    with caplog.at_level(logging.INFO, logger="sessionpin.decisions"):
        await proxy.send(flow())
    assert "claude-code opening abcd1234" in caplog.text and capsys.readouterr().out == ""


async def test_a_refusal_is_one_line_its_warning(tmp_path, capsys, caplog):
    import asyncio

    from shellkit import CONFIG
    cfg = tmp_path / "config.toml"
    cfg.write_text(CONFIG)
    p = start(cfg, sessionpin_store_retry_ms=0)
    try:
        from sessionpin.store import StoreUnavailable

        class Down:
            """The real store, whose reads fail."""
            def __init__(self, store):
                self._s, self.url = store, store.url

            def __getattr__(self, name):
                if name != "get":
                    return getattr(self._s, name)

                async def fails(*a, **k):
                    raise StoreUnavailable("file:x: disk I/O error")
                return fails
        p.runtime.store = Down(p.store)
        with caplog.at_level(logging.WARNING, logger="sessionpin"):
            f = flow("continuation")
            await p.send(f)
            await asyncio.sleep(0)
        assert f.response.status_code == 424
        assert capsys.readouterr().out == ""                          # no decision line besides it
        said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(said) == 1 and said[0].startswith("sessionpin: refused 424 (store) claude-code continuation abcd1234 "
                                                      "[store-unreadable]: "), said
    finally:
        p.close()


def test_each_proxy_has_its_own_decision_lines_shared_by_its_defaults_and_router():
    """Issue 21: no process global. The decision log is the addon's: Defaults points it
    (``sessionpin_decision_log``), the Router writes to it, another tree has its own."""
    from sessionpin.proxy import Router, make_addons

    trees = [make_addons([])[0].parts, make_addons([])[0].parts]
    logs = []
    for tree in trees:
        defaults = next(a for a in tree if isinstance(a, Defaults))
        router = next(a for a in tree if isinstance(a, Router))
        assert defaults.decisions is router.decisions
        logs.append(router.decisions)
    assert logs[0] is not logs[1]
    logs[0].mode = "off"
    assert not logs[0].on and logs[1].on

def test_a_hand_started_mitmdump_makes_its_confdir_private_whatever_the_umask(tmp_path):
    """Issue 20: ``sessionpin run`` sets a private umask before it execs mitmdump, but a
    mitmdump started by hand with the addon made its confdir 0777 and the CA's certificates
    0666 under umask 000 (mitmproxy makes them before any script loads): anyone could put
    another CA in place. The addon takes the bits away when it loads."""
    import os
    import stat
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    confdir = tmp_path / "confdir"
    cmd = [str(Path(sys.executable).parent / "mitmdump"), "--listen-host", "127.0.0.1", "-p", "0",
           "-s", str(root / "sessionpin" / "mitmscript" / "route.py"), "--set", f"confdir={confdir}",
           "--set", "sessionpin_store=memory:", "--set", f"sessionpin_config={tmp_path / 'config.toml'}"]
    env = dict(os.environ, PYTHONPATH=str(root), HOME=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: os.umask(0))
    try:
        deadline = time.monotonic() + 60
        for line in proc.stdout:        # until it listens: the addon has loaded by then
            if "listening at" in line or time.monotonic() > deadline:
                break
    finally:
        proc.terminate()
        proc.wait(30)
    modes = {p.name: oct(stat.S_IMODE(p.lstat().st_mode)) for p in confdir.iterdir()}
    assert oct(stat.S_IMODE(confdir.stat().st_mode)) == "0o700"
    assert "mitmproxy-ca.pem" in modes and "mitmproxy-ca-cert.pem" in modes
    assert set(modes.values()) == {"0o600"}, modes


def test_the_confdir_fix_up_follows_no_symlink_and_leaves_another_users_files(tmp_path, caplog):
    import os
    import stat

    from sessionpin.proxy.defaults import private_confdir
    conf = tmp_path / "conf"
    conf.mkdir(mode=0o777)
    os.chmod(conf, 0o777)
    target = tmp_path / "elsewhere.pem"
    target.write_text("x")
    os.chmod(target, 0o666)
    (conf / "mitmproxy-ca-cert.pem").symlink_to(target)
    (conf / "other.txt").write_text("y")
    os.chmod(conf / "other.txt", 0o666)
    assert private_confdir(str(conf)) == ["."]
    assert stat.S_IMODE(conf.stat().st_mode) == 0o700
    assert stat.S_IMODE(target.stat().st_mode) == 0o666          # not followed
    assert stat.S_IMODE((conf / "other.txt").stat().st_mode) == 0o666   # not mitmproxy's
    link = tmp_path / "link"
    link.symlink_to(conf)
    os.chmod(conf, 0o755)
    assert private_confdir(str(link)) == [] and stat.S_IMODE(conf.stat().st_mode) == 0o755
    assert private_confdir(str(tmp_path / "absent")) == []


def test_the_stamp_formats_its_clock_once_a_second_and_reads_as_before():
    """Issue 22: the ``[HH:MM:SS.`` part is kept per second; every stamp reads as formatting
    it afresh would, across seconds, back and forth."""
    import time

    from sessionpin.proxy import defaults

    def fresh(t):
        return f"[{time.strftime('%H:%M:%S', time.localtime(t))}.{int(t * 1000) % 1000:03d}] "
    for t in (1_800_000_000.0, 1_800_000_000.999, 1_800_000_001.0005, 1_800_000_000.5, 1_800_003_600.25, 0.5):
        assert defaults.stamp(t) == fresh(t)
    assert defaults._second[0] == 0.0           # the second last formatted


def test_what_is_alive_when_the_proxy_runs_is_frozen_out_of_the_collector_until_done(proxy):
    """Issue 22: every full collection walked mitmproxy's and sessionpin's modules again (59 ms
    each under load). Once the proxy runs they are frozen (``gc.freeze``), garbage collected
    first; ``done`` gives them back (a script reload's old parts); the option turns it off."""
    import gc
    d = next(a for a in proxy.addons if isinstance(a, Defaults))
    before = gc.get_freeze_count()        # (Python itself starts with a few hundred)
    try:
        proxy.bundle.running()
        assert d.frozen > before + 10_000 and gc.get_freeze_count() > before + 10_000
        proxy.bundle.done()
        assert gc.get_freeze_count() == 0 and d.frozen == 0
        proxy.tctx.configure(d, sessionpin_gc_freeze=False)
        proxy.bundle.running()
        assert gc.get_freeze_count() == 0 and d.frozen == 0
    finally:
        gc.unfreeze()


def _fail_on(value: str) -> None:
    raise ValueError(f"cannot read header value {value!r} near {value.encode()!r}")


@pytest.mark.parametrize("name", ["sessionpin", "sessionpin.store.file", "sessionpin.store.redis", "sessionpin.decisions"])
def test_a_traceback_sessionpin_logs_says_where_never_what(proxy, caplog, name):
    """An exception's text can quote what it failed on (a header's value, a piece of a body):
    what sessionpin's loggers write of it is its type, its frames and its message with every
    quoted value said by its size and key-looking words hidden."""
    secret = "sk-ant-api03-Q8zv2Lr7XwKp4TnB9sYd6HcJ1mFgA5eRuV0iO3lZ"
    read = " ".join(("PROMPT-" + "SENTINEL", secret))      # (the traceback shows this file's lines)
    with caplog.at_level(logging.INFO, logger=name):
        try:
            _fail_on(read)
        except ValueError:
            logging.getLogger(name).exception("sessionpin: cannot decide %s %s", "POST", "/v1/messages")
    text = caplog.text
    assert "PROMPT-SENTINEL" not in text and "Q8zv2Lr7" not in text, text
    assert "cannot decide POST /v1/messages" in text and "ValueError: cannot read header value" in text
    assert "_fail_on" in text and "not shown" in text


def test_tracebacks_are_as_they_were_once_the_proxy_is_done(tmp_path, caplog):
    p = start(tmp_path / "none.toml")
    p.close()
    with caplog.at_level(logging.INFO, logger="sessionpin"):
        try:
            _fail_on("VISIBLE")
        except ValueError:
            logging.getLogger("sessionpin").exception("after")
    assert "VISIBLE" in caplog.text


def test_every_logger_sessionpin_writes_to_is_one_the_filter_knows():
    import pathlib
    from sessionpin.proxy import defaults
    root = pathlib.Path(defaults.__file__).resolve().parents[1]
    named = set()
    for path in root.rglob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r'getLogger\("(sessionpin[^"]*)"\)', text))
        if "getLogger(__name__)" in text:
            named.add(".".join(path.relative_to(root.parent).with_suffix("").parts))
    assert named <= set(defaults.LOGGERS), named - set(defaults.LOGGERS)
