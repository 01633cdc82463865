"""The sessionpin command, against a real config file and a real file store in a tmp dir."""

import asyncio
import io
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sessionpin import cli
from sessionpin.config import config
from sessionpin.records import pins
from sessionpin.cli import common, context, launch, look, proxies
from sessionpin.store import open_store
from sessionpin.reader.ids import short, shorts
import ports  # tests/ports.py: a port that is free again at a restart

ROOT = Path(__file__).resolve().parent.parent

CONFIG = '''\
# my servers
[servers.anthropic]
url = "https://api.anthropic.com"

[servers.glm]
url = "https://api.z.ai/api/anthropic"
key_env = "SP_TEST_GLM_KEY"   # set where the proxy runs

# glm is slow today
[agents.claude-code]
server = "anthropic"          # new conversations go here

[agents.opencode]
server = "glm"
'''


def free_port() -> int:
    return ports.free_port()      # below the ephemeral range: free again at a restart


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A config file and a store URL in tmp_path, given to the CLI through its variables."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(CONFIG)
    url = f"file:{tmp_path / 'state' / 'state.db'}"
    monkeypatch.setenv("SESSIONPIN_CONFIG", str(cfg))
    monkeypatch.setenv("SESSIONPIN_STORE", url)
    monkeypatch.delenv("SP_TEST_GLM_KEY", raising=False)
    # Nothing listens here: the "is a proxy answering" fallback must not find a teammate's proxy.
    nowhere = ("127.0.0.1", free_port())
    monkeypatch.setattr(proxies, "DEFAULT_LISTEN", nowhere)
    monkeypatch.setattr(launch, "DEFAULT_LISTEN", nowhere)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    return type("Env", (), {"cfg": cfg, "url": url, "dir": tmp_path})


def put_pins(url: str, entries: list[tuple]) -> None:
    """entries: (session, agent, server, since_ago_s, last_seen_ago_s or None, requests)."""
    async def put() -> None:
        store = open_store(url)
        now = time.time()
        try:
            for session, agent, server, since_ago, last_ago, requests in entries:
                t = now - since_ago
                await pins.create(store, session, pins.Pin(agent=agent, server=server, since=t, renewed=t,
                                                           rule="opening", turn="opening"))
                if last_ago is not None:
                    await pins.record_seen(store, [(session, agent, server, now - last_ago, requests)])
        finally:
            await store.close()
    asyncio.run(put())


def read_pin(url: str, session: str) -> pins.Pin | None:
    async def read() -> pins.Pin | None:
        store = open_store(url)
        try:
            return (await pins.load(store, session)).pin
        finally:
            await store.close()
    return asyncio.run(read())


RUNNING = [
    ("1f0c9a2b-aaaa-4000-8000-000000000001", "claude-code", "anthropic", 7200, 120, 41),
    ("1f0c9a2b-bbbb-4000-8000-000000000002", "claude-code", "anthropic", 90000, 20000, 3),
    ("77e1d3c4-cccc-4000-8000-000000000003", "claude-code", None, 600, 30, 5),
    ("ses_5a1b2c3d4e5f", "opencode", "glm", 300, 10, 12),
]


def run(capsys, *argv):
    code = cli.main(list(argv))
    o, e = capsys.readouterr()
    return code, o, e


# --- use --------------------------------------------------------------------------


def test_use_rewrites_only_that_setting_and_says_what_stays(env, capsys):
    put_pins(env.url, RUNNING)
    code, o, e = run(capsys, "use", "claude-code", "glm")
    assert code == 0, e
    assert o.splitlines()[0] == "New claude-code conversations → glm. (was: anthropic)"
    assert o.splitlines()[1] == "3 running conversations stay where they are: 2 on anthropic, 1 not routed."
    assert "1 active in the last hour" not in o          # two were active in the last hour
    assert "2 active in the last hour" in o
    # Only the one line changed, its comment kept.
    before, after = CONFIG.splitlines(), env.cfg.read_text().splitlines()
    assert [(a, b) for a, b in zip(before, after) if a != b] == [
        ('server = "anthropic"          # new conversations go here',
         'server = "glm"          # new conversations go here')]
    assert config.load(env.cfg).current("claude-code") == "glm"
    assert "No proxy is answering" in o
    assert "SP_TEST_GLM_KEY is not set" in e


def test_use_and_servers_add_on_a_config_that_is_a_link_write_the_file_it_names(env, capsys, tmp_path):
    # dotfiles kept elsewhere and linked in: the link stays, the file it names changes (a
    # replaced link let the next dotfiles sync put the old choice back in force, unasked)
    import os
    dots = tmp_path / "dots"
    dots.mkdir()
    target = dots / "sessionpin.toml"
    os.replace(env.cfg, target)
    env.cfg.symlink_to(target)
    assert run(capsys, "use", "claude-code", "glm")[0] == 0
    assert run(capsys, "servers", "add", "zen", "https://opencode.ai/zen/v1")[0] == 0
    assert env.cfg.is_symlink() and os.readlink(env.cfg) == str(target)
    cfg = config.load(target)
    assert cfg.current("claude-code") == "glm" and "zen" in cfg.servers


def test_use_choice_in_force_writes_nothing(env, capsys):
    mtime = env.cfg.stat().st_mtime_ns
    code, o, _ = run(capsys, "use", "claude-code", "anthropic")
    assert code == 0
    assert o == "New claude-code conversations already go to anthropic; nothing written.\n"
    assert env.cfg.stat().st_mtime_ns == mtime and env.cfg.read_text() == CONFIG


def test_use_not_routed_and_new_agent_table(env, capsys):
    code, o, _ = run(capsys, "use", "claude-code", "--not-routed")
    assert code == 0
    assert o.startswith("New claude-code conversations → not routed (left alone: they go where claude-code sends them).")
    assert "No running claude-code conversation is pinned." in o
    code, o, _ = run(capsys, "use", "pi", "glm")
    assert code == 0
    cfg = config.load(env.cfg)
    assert cfg.current("claude-code") is None and cfg.current("pi") == "glm" and cfg.current("opencode") == "glm"
    text = env.cfg.read_text()
    assert "# glm is slow today" in text and text.endswith('[agents.pi]\nserver = "glm"\n')


def test_use_of_a_server_without_key_env_says_what_it_takes(env, capsys):
    code, _, e = run(capsys, "use", "pi", "anthropic")
    assert code == 0
    assert e.startswith("Note: anthropic has no key_env, so only requests addressed to https://api.anthropic.com can go there")


def test_use_singular_sentence(env, capsys):
    put_pins(env.url, RUNNING[3:])
    code, o, _ = run(capsys, "use", "opencode", "anthropic")
    assert code == 0
    assert "1 running conversation stays where it is: 1 on glm." in o


@pytest.mark.parametrize("argv, message", [
    (["use", "claude", "glm"], "sessionpin: unknown agent 'claude' (known: claude-code, opencode, pi, codex, gemini-cli)"),
    (["use", "claude-code", "glmm"], "sessionpin: no server named 'glmm' in"),
    (["use", "claude-code", "glm", "--not-routed"], "sessionpin: give a SERVER or --not-routed, not both"),
    (["move", "1f0c", "nowhere", "--yes"], "sessionpin: no server named 'nowhere'"),
])
def test_bad_input_is_one_line_and_writes_nothing(env, capsys, argv, message):
    put_pins(env.url, RUNNING)
    code, o, e = run(capsys, *argv)
    assert code == 1
    assert o == ""
    assert e.startswith(message) and e.count("\n") == 1
    assert env.cfg.read_text() == CONFIG


def test_broken_config_names_file_line_and_key(env, capsys):
    env.cfg.write_text(CONFIG.replace('server = "glm"', 'server = "glmm"'))
    code, o, e = run(capsys, "use", "claude-code", "glm")
    assert code == 1 and o == ""
    assert e.startswith("sessionpin: config.toml:14: agents.opencode.server: no server named 'glmm'")
    assert e.count("\n") == 1
    code, _, e = run(capsys, "status")
    assert code == 1 and "config.toml:14" in e


def test_edit_that_would_not_say_what_was_asked_is_refused(env, capsys):
    text = '[servers.a]\nurl = "https://a.example"\n[agents]\ncodex = { server = "" }\n'
    env.cfg.write_text(text)
    code, _, e = run(capsys, "use", "codex", "a")
    assert code == 1
    assert "could not change agents.codex.server" in e and "nothing written" in e
    assert env.cfg.read_text() == text


def test_use_when_the_config_cannot_be_written(env, capsys, monkeypatch):
    # (as root a read-only directory does not stop a write, so the failure is injected)
    def refuse(path, text):
        raise PermissionError(13, "Permission denied")
    from sessionpin.config import configedit
    monkeypatch.setattr(configedit, "write_atomic", refuse)
    code, o, e = run(capsys, "use", "claude-code", "glm")
    assert code == 1 and o == ""
    assert e == f"sessionpin: cannot write {env.cfg}: Permission denied; nothing changed\n"
    assert env.cfg.read_text() == CONFIG


# --- sessions, prefixes -------------------------------------------------------------


def test_sessions_table_and_filters(env, capsys):
    put_pins(env.url, RUNNING)
    code, o, _ = run(capsys, "sessions")
    assert code == 0
    lines = o.splitlines()
    assert lines[0].split() == ["SESSION", "AGENT", "SERVER", "WHY", "PINNED", "LAST", "SEEN", "REQUESTS"]
    # Most recently seen first.
    assert lines[1].split() == ["ses_2c3d4e5f", "opencode", "glm", "began", "here", "5m", "ago", "10s", "ago", "12"]
    assert lines[2].split()[:3] == ["77e1d3c4", "claude-code", "not"]
    assert len(lines) == 5
    code, o, _ = run(capsys, "sessions", "--agent", "claude-code", "--server", "anthropic")
    # two ids that share their first eight characters read apart (issue 19): longer where needed
    assert [line.split()[0] for line in o.splitlines()[1:]] == ["1f0c9a2b…0001", "1f0c9a2b…0002"]
    code, o, _ = run(capsys, "move", "1f0c9a2b…0002", "glm", "--yes")      # as shown, it names one
    assert code == 0 and o.startswith("Moved 1f0c9a2b (claude-code) from anthropic to glm.")
    assert read_pin(env.url, RUNNING[1][0]).server == "glm" and read_pin(env.url, RUNNING[0][0]).server == "anthropic"
    code, o, _ = run(capsys, "sessions", "--not-routed", "--json")
    data = json.loads(o)
    assert [d["session"] for d in data] == ["77e1d3c4-cccc-4000-8000-000000000003"]
    assert data[0]["server"] is None and data[0]["requests"] == 5 and data[0]["agent"] == "claude-code"


def damage_pages(env, garbage: bytes) -> None:
    """The store's pins, 3,000 fillers after them, and ``garbage`` over pages in the middle of
    its file: pages the open itself does not read, found by the check that runs beside the reads."""
    from sessionpin.store.file import FileStore
    put_pins(env.url, RUNNING)
    path = env.dir / "state" / "state.db"
    s = FileStore(path)
    for i in range(3000):
        s.set(f"filler:{i:05d}", "x" * 40)
    s.close()
    data = bytearray(path.read_bytes())
    middle = len(data) // 4096 // 2 * 4096
    data[middle: middle + len(garbage)] = garbage
    path.write_bytes(bytes(data))


def test_sessions_on_pages_found_damaged_while_it_read_says_so_then_lists_the_repaired_store(env, capsys):
    # the CLI opens a file store without checking every page first (quick_check of a
    # million pins takes seconds) and asks for the background check's verdict at the end
    damage_pages(env, os.urandom(4096 * 3))
    code, o, e = run(capsys, "sessions")
    assert code == 1 and "damaged" in e, (code, o, e)
    code, o, e = run(capsys, "sessions")
    assert code == 0 and len(o.splitlines()) == 5, (o, e)       # rebuilt from its copy: every pin


def test_a_read_that_meets_the_repair_of_damaged_pages_says_the_store_was_found_damaged(env, capsys, monkeypatch):
    """The check that runs while the command reads finds damaged pages and repairs the file;
    a read that meets the repair fails ("deleted while it was open; repairing"). The damage
    is what the command says, as when its reads ended before the repair (it was a generic
    "cannot read" then: one run in ~60 of the test above)."""
    from sessionpin.store import StoreUnavailable
    damage_pages(env, b"\x5a" * (4096 * 3))

    def met_the_repair(ctx, args):
        ctx.need_store()
        raise StoreUnavailable(f"store {env.url}: cannot read: its database file was deleted while it was open; "
                               "repairing")
    real = cli.COMMANDS["sessions"]
    monkeypatch.setitem(cli.COMMANDS, "sessions", met_the_repair)
    code, o, e = run(capsys, "sessions")
    assert code == 1 and "found damaged while this command read it" in e, (code, o, e)
    cli.COMMANDS["sessions"] = real
    code, o, e = run(capsys, "sessions")
    assert code == 0 and len(o.splitlines()) == 5, (o, e)       # rebuilt from its copy: every pin


def test_sessions_name_a_forks_parent(env, capsys):
    """A fork under a new id is pinned naming its parent: WHY says so, and a PARENT column
    appears when a listed conversation is a fork (JSON: ``parent``)."""
    put_pins(env.url, RUNNING)
    parent, fork = RUNNING[0][0], "9c2e41d0-dddd-4000-8000-000000000004"

    async def put() -> None:
        store = open_store(env.url)
        try:
            now = time.time()
            await pins.create(store, fork, pins.Pin(agent="claude-code", server="anthropic", since=now, renewed=now,
                                                    rule="fork", turn="continuation", parent=parent))
        finally:
            await store.close()
    asyncio.run(put())
    code, o, _ = run(capsys, "sessions", "--agent", "claude-code")
    lines = [line.split() for line in o.splitlines()]
    assert lines[0] == ["SESSION", "AGENT", "SERVER", "WHY", "PARENT", "PINNED", "LAST", "SEEN", "REQUESTS"]
    row = next(line for line in lines if line[0] == "9c2e41d0")
    assert row[3:7] == ["fork", "of", "1f0c9a2b", "1f0c9a2b…0001"]
    assert all(line[5] == "-" for line in lines[1:] if line[0] != "9c2e41d0" and line[3] == "began")
    data = json.loads(run(capsys, "sessions", "--json")[1])
    assert {d["session"]: d["parent"] for d in data}[fork] == parent
    assert {d["session"]: d["why"] for d in data}[fork] == "fork of 1f0c9a2b"
    assert "PARENT" not in run(capsys, "sessions", "--agent", "opencode")[1]     # no fork listed: no column


def test_sessions_json_is_one_array_as_before(env, capsys):
    put_pins(env.url, RUNNING)
    code, o, _ = run(capsys, "sessions", "--json")
    assert code == 0 and o == json.dumps(json.loads(o), indent=2) + "\n"       # printed row by row, same text
    assert [d["session"] for d in json.loads(o)][:2] == ["ses_5a1b2c3d4e5f", "77e1d3c4-cccc-4000-8000-000000000003"]
    assert run(capsys, "sessions", "--json", "--agent", "pi")[1] == "[]\n"


def test_sessions_stream_rows_past_the_sorted_limit(env, capsys, monkeypatch):
    """Past SORTED_UP_TO rows (as the index counts them) ``sessions`` prints each batch as the
    store walk yields it, the first as soon as it is read, most recently renewed first (not
    sorted by last seen: that needs every row first)."""
    put_pins(env.url, RUNNING)
    monkeypatch.setattr(look, "SORTED_UP_TO", 2)
    monkeypatch.setattr(look, "LISTING_BATCH", 1)
    read, printed = [0], []
    listing = context.Ctx.listing

    def counted(self, names, batch=1000):
        for rows in listing(self, names, batch):
            read[0] += 1
            yield rows
    monkeypatch.setattr(context.Ctx, "listing", counted)
    monkeypatch.setattr(look, "out", lambda text="": printed.append((read[0], text)))
    code, _, e = run(capsys, "sessions")
    assert code == 0
    assert printed[0][1].split() == ["SESSION", "AGENT", "SERVER", "WHY", "PARENT", "PINNED", "LAST", "SEEN",
                                     "REQUESTS"]
    assert [t.split()[0] for _, t in printed[1:]] == ["ses_2c3d4e5f", "77e1d3c4", "1f0c9a2b", "1f0c9a2b"]
    assert [t.split()[-1] for _, t in printed[1:]] == ["12", "5", "41", "3"]
    assert printed[1][0] == 1 and read[0] == 4          # the first row once the first batch was read
    assert "4 conversations, more than 2: listed as the store walks its index" in e
    monkeypatch.setattr(look, "out", common.out)
    code, o, e = run(capsys, "sessions", "--json")
    assert [d["session"][:4] for d in json.loads(o)] == ["ses_", "77e1", "1f0c", "1f0c"]
    assert json.loads(o)[2]["requests"] == 41 and "4 conversations" in e


def test_sessions_unknown_filter(env, capsys):
    put_pins(env.url, RUNNING)
    code, _, e = run(capsys, "sessions", "--server", "nope")
    assert code == 1 and "no server named 'nope' and no conversation pinned to it" in e
    code, _, e = run(capsys, "sessions", "--agent", "claudecode")
    assert code == 1 and "unknown agent" in e


def test_ambiguous_prefix_lists_candidates(env, capsys):
    put_pins(env.url, RUNNING)
    code, o, e = run(capsys, "forget", "1f0c9a2b", "--yes")
    assert code == 1 and o == ""
    assert "'1f0c9a2b' matches 2 conversations: 1f0c9a2b-aaaa" in e and "1f0c9a2b-bbbb" in e
    assert "give more characters" in e
    code, _, e = run(capsys, "forget", "zzz", "--yes")
    assert code == 1 and "no pinned conversation matches 'zzz'" in e


# --- move, forget -------------------------------------------------------------------


def test_move_without_yes_and_no_terminal_is_refused(env, capsys):
    put_pins(env.url, RUNNING)
    code, o, e = run(capsys, "move", "1f0c9a2b-a", "glm")
    assert code == 1 and o == ""
    assert "Moving running conversation 1f0c9a2b (claude-code" in e and "from anthropic to glm" in e
    assert "context window (400" in e and "invalid signature" in e and "(403" in e
    assert e.splitlines()[-1] == "sessionpin: 1f0c9a2b not moved: confirm with --yes (stdin is not a terminal, so sessionpin cannot ask)"
    assert read_pin(env.url, RUNNING[0][0]).server == "anthropic"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_move_confirmed_at_a_terminal(env, capsys, monkeypatch):
    put_pins(env.url, RUNNING)
    monkeypatch.setattr(sys, "stdin", Terminal("n\n"))
    code, _, e = run(capsys, "move", "1f0c9a2b-a", "glm")
    assert code == 1 and "not confirmed" in e
    assert read_pin(env.url, RUNNING[0][0]).server == "anthropic"
    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    code, o, _ = run(capsys, "move", "1f0c9a2b-a", "glm")
    assert code == 0
    assert o.startswith("Moved 1f0c9a2b (claude-code) from anthropic to glm.")
    pin = read_pin(env.url, RUNNING[0][0])
    assert pin.server == "glm" and pin.agent == "claude-code" and pin.rule == "operator"


def test_move_yes_and_not_routed_and_already_there(env, capsys):
    put_pins(env.url, RUNNING)
    code, o, _ = run(capsys, "move", "ses_5a", "--not-routed", "--yes")
    assert code == 0 and "from glm to not routed" in o
    assert read_pin(env.url, "ses_5a1b2c3d4e5f").server is None
    code, o, _ = run(capsys, "move", "ses_5a", "--not-routed", "--yes")
    assert code == 0 and "already not routed; nothing written" in o


def test_move_to_a_re_pointed_server_is_how_the_operator_accepts_its_new_address(env, capsys):
    # The proxy refuses a conversation whose server name now points at another host
    # (ladder.moved) and says `sessionpin move SESSION SERVER`: that must write, not say
    # "already on glm; nothing written", and record the new address.
    async def put() -> None:
        store = open_store(env.url)
        try:
            await pins.create(store, "ses_re1", pins.Pin(agent="opencode", server="glm", since=time.time(),
                                                         renewed=time.time(), at="https://old.example"))
        finally:
            await store.close()
    asyncio.run(put())
    code, o, e = run(capsys, "move", "ses_re1", "glm", "--yes")
    assert code == 0 and "Moved" in o and "https://old.example" in o + e and "https://api.z.ai" in o + e, (o, e)
    assert read_pin(env.url, "ses_re1").at == "https://api.z.ai"
    code, o, _ = run(capsys, "move", "ses_re1", "glm", "--yes")
    assert code == 0 and "already on glm; nothing written" in o
    code, o, _ = run(capsys, "move", "ses_re1", "anthropic", "--yes")
    assert code == 0 and read_pin(env.url, "ses_re1").at == "https://api.anthropic.com"
    assert "Moved ses_re1 (opencode) from glm to anthropic." in o, o     # another server: no addresses said


def test_forget(env, capsys):
    put_pins(env.url, RUNNING)
    # A not-routed pin: forgetting it moves nothing, no question asked.
    code, o, _ = run(capsys, "forget", "77e1")
    assert code == 0 and o.startswith("Forgot 77e1d3c4 (claude-code, was not routed).")
    assert read_pin(env.url, RUNNING[2][0]) is None
    # A routed one: forgetting it moves it, so it is confirmed like a move.
    code, _, e = run(capsys, "forget", "ses_5a")
    assert code == 1 and "moves it" in e and "not forgotten: confirm with --yes" in e
    assert read_pin(env.url, "ses_5a1b2c3d4e5f") is not None
    code, _, _ = run(capsys, "forget", "ses_5a", "-y")
    assert code == 0 and read_pin(env.url, "ses_5a1b2c3d4e5f") is None


def lose_pins(url: str, sessions: list[str], recorded: dict[str, tuple[str, str]] | None = None) -> None:
    """The pins of ``sessions`` deleted by hand (their index entries stay); ``recorded``: a
    proxy's record of a lost pin (session -> (agent, server)) whose index entry is gone too."""
    from sessionpin.store import identity

    async def lose() -> None:
        store = open_store(url)
        try:
            for s in sessions:
                await store.delete(pins.key(s))
            for s, (agent, server) in (recorded or {}).items():
                await identity.record_partial(store, s, identity.PartialLoss(
                    server, agent, time.time() + 3600, "host:1", time.time()))
        finally:
            await store.close()
    asyncio.run(lose())


def test_a_lost_pin_is_listed_and_decided_one_by_one(env, capsys):
    """A pin the store lost (its index entry left, or only a proxy's record of it) is what the
    proxies refuse: ``sessions`` lists it as lost with its ways out, ``move`` puts it back (no
    question when it goes back where it was), ``forget`` lets it be decided afresh. Before:
    not listed, and "no pinned conversation matches" to both commands."""
    put_pins(env.url, RUNNING)
    a, b = RUNNING[0][0], RUNNING[1][0]
    lose_pins(env.url, [a, b], {"ses_77aa00bb": ("opencode", "glm")})
    code, o, e = run(capsys, "sessions")
    assert code == 0 and short(a) not in o and "77e1d3c4" in o
    lost = {ln.split()[1]: ln for ln in e.splitlines() if ln.startswith("LOST ")}
    shown = shorts([a, b, "ses_77aa00bb"])          # a and b begin alike: longer forms, unique
    assert set(lost) == set(shown.values()), e
    assert "(claude-code, pinned anthropic)" in lost[shown[a]] and "its pin index still holds it" in lost[shown[a]]
    assert f"`sessionpin move {shown[a]} anthropic` puts it back" in lost[shown[a]]
    assert "host:1 recorded it lost" in lost["ses_77aa"]
    code, o, e = run(capsys, "sessions", "--agent", "opencode")
    assert [ln.split()[1] for ln in e.splitlines() if ln.startswith("LOST ")] == ["ses_77aa"]
    # status and doctor say what the proxies recorded lost (no walk of the index): the recorded one
    code, o, e = run(capsys, "status")
    assert "LOST PINS: the proxies refuse 1 conversation whose pin the store lost: ses_77aa (opencode, glm)" in o, o
    code, o, e = run(capsys, "status", "--json")
    assert json.loads(o)["lost_pins"] == [{"session": "ses_77aa00bb", "agent": "opencode", "server": "glm"}]
    code, o, e = run(capsys, "doctor", "--json")
    checks = {c["check"]: c for c in json.loads(o)["checks"]}
    assert checks["lost pins"]["state"] == "fail" and "ses_77aa (opencode, glm)" in checks["lost pins"]["detail"]
    # back where it was (by the form shown): nothing moves, nothing asked
    code, o, e = run(capsys, "move", shown[a], "anthropic")
    assert code == 0 and "whose pin the store had lost, back on anthropic" in o, o + e
    assert read_pin(env.url, a).server == "anthropic"
    # elsewhere: a move like any other, confirmed
    code, o, e = run(capsys, "move", "ses_77aa", "anthropic")
    assert code == 1 and "not moved: confirm with --yes" in e, e
    code, o, e = run(capsys, "forget", b)
    assert code == 1 and "lost the pin" in e and "not forgotten: confirm with --yes" in e, e
    code, o, e = run(capsys, "forget", b, "--yes")
    assert code == 0 and "its pin had been lost" in o, o + e
    assert read_pin(env.url, b) is None
    code, o, e = run(capsys, "forget", "ses_77aa", "--yes")
    assert code == 0, e
    code, o, e = run(capsys, "sessions")
    assert code == 0 and "LOST" not in e and short(a) in o, o + e
    code, o, e = run(capsys, "doctor", "--json")
    assert "lost pins" not in {c["check"] for c in json.loads(o)["checks"]}
    code, o, e = run(capsys, "status")
    assert "LOST PINS" not in o
    code, o, e = run(capsys, "forget", b, "--yes")                         # forgotten: neither pinned nor lost
    assert code == 1 and "no pinned conversation matches" in e


def test_no_store_here_while_the_machine_remembers_another_names_it(env, capsys, tmp_path, monkeypatch):
    """A shell without the proxy's SESSIONPIN_STORE (or with a wrong path) looks at a store
    that does not exist: "no pinned conversations" — while this machine remembers another
    store holding live pins. The command names it (stderr), so the operator looks there."""
    monkeypatch.setenv("SESSIONPIN_STORE_MEMORY", str(tmp_path / "machine"))
    put_pins(env.url, RUNNING)
    code, _, _ = run(capsys, "sessions")                 # remembered, with its 4 pins
    assert code == 0
    elsewhere = f"file:{tmp_path / 'other' / 'state.db'}"
    code, o, e = run(capsys, "sessions", "--store", elsewhere)
    assert code == 0 and "no pinned conversations (no store file yet at" in o
    assert f"this machine last used store {env.url} (4 pins, seen " in e, e
    code, o, e = run(capsys, "status", "--store", elsewhere)
    assert f"this machine last used store {env.url} (4 pins" in e, o + e


def test_missing_store(env, capsys, tmp_path):
    missing = tmp_path / "nowhere" / "state.db"
    code, o, _ = run(capsys, "--store", f"file:{missing}", "sessions")
    assert code == 0 and "no pinned conversations (no store file yet at" in o
    code, _, e = run(capsys, "move", "abc", "glm", "--store", f"file:{missing}", "--yes")
    assert code == 1 and e.startswith(f"sessionpin: no store at {missing} yet") and e.count("\n") == 1
    assert not missing.parent.exists()          # reading never creates it
    code, _, e = run(capsys, "sessions", "--store", "nope://localhost")
    assert code == 1 and e.startswith("sessionpin: cannot open the store nope://localhost:") and e.count("\n") == 1


# --- servers ------------------------------------------------------------------------


def test_servers_add_and_list(env, capsys):
    code, o, _ = run(capsys, "servers", "add", "ete", "https://ete.example/anthropic", "--key-env", "ETE_KEY")
    assert code == 0 and o.startswith("Added server ete: https://ete.example/anthropic.")
    text = env.cfg.read_text()
    assert text.startswith(CONFIG.split("# glm is slow today")[0])
    assert '[servers.ete]\nurl = "https://ete.example/anthropic"\nkey_env = "ETE_KEY"\n\n# glm is slow today' in text
    code, o, _ = run(capsys, "servers", "--json")
    assert [s["name"] for s in json.loads(o)] == ["anthropic", "glm", "ete"]
    code, _, e = run(capsys, "servers", "add", "ete", "https://x.example")
    assert code == 1 and "a server named 'ete' exists" in e
    code, _, e = run(capsys, "servers", "add", "bad", "ftp://x.example")
    assert code == 1 and "servers.bad.url: must start with https://" in e and "nothing written" in e


@pytest.mark.parametrize("url, base", [("https://gw.example", "/v1"), ("https://gw.example/zen/v1", "/zen/v1"),
                                       ("https://gw.example/api/anthropic", "/api/anthropic/v1")])
def test_servers_add_says_which_endpoints_of_which_agents_it_takes(env, capsys, url, base):
    code, o, _ = run(capsys, "servers", "add", "gw", url, "--key-env", "GW_KEY")
    assert code == 0
    assert f"It takes the inference requests addressed to https://gw.example (at {base}/<endpoint>, " in o
    assert "  claude-code  messages, messages/count_tokens\n" in o
    assert "  opencode     messages, chat/completions, responses\n" in o
    assert "  pi           messages, chat/completions, responses\n" in o
    assert "  codex        responses (HTTPS and its WebSocket)\n" in o
    assert f"Requests moved here from another server arrive at https://gw.example{base}/<endpoint>" in o


def test_servers_remove_warns_and_needs_force(env, capsys):
    put_pins(env.url, RUNNING)
    code, _, e = run(capsys, "servers", "remove", "glm")
    assert code == 1 and "new opencode conversations go to glm; first send them elsewhere" in e
    run(capsys, "use", "opencode", "anthropic")
    code, o, e = run(capsys, "servers", "remove", "glm")
    assert code == 1 and o == ""
    assert "1 running conversation is pinned to glm (1 opencode; 1 active in the last hour)." in e
    assert "refuses their requests with 424" in e
    assert e.splitlines()[-1] == "sessionpin: glm not removed: run again with --force to remove it anyway"
    assert "glm" in config.load(env.cfg).servers
    code, o, _ = run(capsys, "servers", "remove", "glm", "--force")
    assert code == 0 and "1 conversation pinned to glm now get 424" in o
    cfg = config.load(env.cfg)
    assert list(cfg.servers) == ["anthropic"]
    text = env.cfg.read_text()
    assert "# my servers" in text and "# glm is slow today" in text and "SP_TEST_GLM_KEY" not in text
    # The pins stay: the operator decides (status shows them as pinned to an unconfigured server).
    code, o, _ = run(capsys, "status", "--json")
    assert json.loads(o)["unconfigured_servers_with_pins"] == [{"name": "glm", "pinned": 1, "active_last_hour": 1}]


def test_servers_remove_without_pins_needs_no_force(env, capsys):
    run(capsys, "use", "opencode", "anthropic")
    code, o, _ = run(capsys, "servers", "remove", "glm")
    assert code == 0 and o.startswith("Removed server glm")


# --- status, doctor -----------------------------------------------------------------


def test_status(env, capsys, monkeypatch):
    put_pins(env.url, RUNNING)
    code, o, _ = run(capsys, "status", "--json")
    assert code == 0
    s = json.loads(o)
    assert s["config"] == str(env.cfg) and s["store"] == env.url
    assert s["proxy"]["answering"] is False and "no live proxy heartbeat in the store" in s["proxy"]["why"]
    by = {x["name"]: x for x in s["servers"]}
    assert (by["anthropic"]["pinned"], by["anthropic"]["active_last_hour"]) == (2, 1)
    assert (by["glm"]["pinned"], by["glm"]["active_last_hour"], by["glm"]["key_set"]) == (1, 1, False)
    assert s["not_routed"] == {"pinned": 1, "active_last_hour": 1}
    assert s["agents"]["claude-code"] == "anthropic" and s["agents"]["pi"] is None
    monkeypatch.setenv("SP_TEST_GLM_KEY", "x")
    code, o, _ = run(capsys, "status")
    assert code == 0
    rows = {line.split()[0]: line.split()[1:] for line in o.splitlines() if line.strip()}
    assert rows["glm"] == ["https://api.z.ai/api/anthropic", "$SP_TEST_GLM_KEY", "set", "1", "1"]
    assert rows["anthropic"] == ["https://api.anthropic.com", "the", "agent's", "own", "2", "1"]
    assert rows["(not"] == ["routed)", "-", "-", "1", "1"]
    assert "(keys checked in this shell)" in o
    assert "proxy   not answering: no live proxy heartbeat in the store" in o


def test_doctor(env, capsys):
    put_pins(env.url, RUNNING)
    confdir = env.dir / "mitm"
    confdir.mkdir()
    code, o, _ = run(capsys, "doctor", "--confdir", str(confdir))
    assert code == 1
    lines = o.splitlines()
    assert lines[0].startswith("ok    config")
    assert lines[1].startswith("ok    store") and "mode 0600 in a 0700 directory" in lines[1]
    assert any(line.startswith("FAIL  CA") and "start the proxy once" in line for line in lines)
    assert any(line.startswith("FAIL  proxy") for line in lines)
    assert any(line.startswith("FAIL  key glm") and "$SP_TEST_GLM_KEY is not set in this shell" in line for line in lines)
    assert lines[-1] == "3 problems to fix."
    (confdir / "mitmproxy-ca-cert.pem").write_text("x")
    db = context.store_file(env.url)
    os.chmod(db, 0o644)
    os.chmod(db.parent, 0o755)
    code, o, _ = run(capsys, "doctor", "--confdir", str(confdir), "--json")
    checks = {c["check"]: c for c in json.loads(o)["checks"]}
    assert checks["CA"]["state"] == "ok"
    assert checks["store mode"]["state"] == "warn" and "was mode 0644" in checks["store mode"]["detail"]
    assert checks["store dir"]["state"] == "warn" and f"chmod 700 {db.parent}" in checks["store dir"]["detail"]
    assert checks["store"]["state"] == "ok"


def test_doctor_checks_the_key_of_a_server_conversations_are_pinned_to(env, capsys):
    # No agent sends new conversations to glm any more, but a running one is pinned there.
    put_pins(env.url, RUNNING[3:])
    run(capsys, "use", "opencode", "anthropic")
    code, o, _ = run(capsys, "doctor", "--json")
    checks = {c["check"]: c for c in json.loads(o)["checks"]}
    assert checks["key glm"]["state"] == "fail"
    assert "$SP_TEST_GLM_KEY is not set in this shell" in checks["key glm"]["detail"]


def test_doctor_broken_config(env, capsys):
    env.cfg.write_text("[servers.a]\nurl = 3\n")
    code, o, _ = run(capsys, "doctor")
    assert code == 1 and "FAIL  config  config.toml:2: servers.a.url: must be a string" in o


# --- env, exec, run -----------------------------------------------------------------


def test_env_lines_per_runtime(env, capsys):
    confdir = env.dir / "mitm"
    code, o, _ = run(capsys, "env", "claude-code", "--confdir", str(confdir))
    assert code == 0
    exports = [line for line in o.splitlines() if line.startswith("export")]
    port = launch.DEFAULT_LISTEN[1]
    assert exports == [f"export HTTPS_PROXY=http://127.0.0.1:{port}", f"export HTTP_PROXY=http://127.0.0.1:{port}",
                       f"export NODE_EXTRA_CA_CERTS={confdir / 'mitmproxy-ca-cert.pem'}"]
    assert "does not exist yet" in o and "no proxy is answering yet" in o
    code, o, _ = run(capsys, "env", "codex", "--confdir", str(confdir), "--json")
    e = json.loads(o)["env"]
    assert set(e) == {"HTTPS_PROXY", "HTTP_PROXY", "SSL_CERT_FILE", "CODEX_CA_CERTIFICATE"}
    code, o, _ = run(capsys, "env", "claude-code", "--reverse", "8081")
    assert "export ANTHROPIC_BASE_URL=http://127.0.0.1:8081" in o
    assert "sessionpin run --mode reverse:https://api.anthropic.com@8081" in o
    code, _, e = run(capsys, "env", "pi", "--reverse", "8081")
    assert code == 1 and "pi has no base-URL variable" in e
    code, o, _ = run(capsys, "env", "codex", "--reverse", "8082")
    assert code == 0 and "openai_base_url=\"http://127.0.0.1:8082/v1\"" in o and "OPENAI_BASE_URL" not in o
    # the hints suggest one reverse port per origin (the README's table), so one proxy can listen for all
    assert "`sessionpin env codex --reverse 8083`" in run(capsys, "env", "codex", "--confdir", str(confdir))[1]
    assert "`sessionpin env claude-code --reverse 8081`" in run(capsys, "env", "claude-code")[1]


def test_exec_runs_the_command_with_the_variables(env, tmp_path):
    script = "import os, json; print(json.dumps({k: os.environ.get(k) for k in ('HTTPS_PROXY', 'NODE_EXTRA_CA_CERTS', 'SSL_CERT_FILE')}))"
    p = subprocess.run([sys.executable, "-m", "sessionpin.cli", "exec", "--proxy", "127.0.0.1:9999",
                        "--confdir", str(tmp_path), "--", sys.executable, "-c", script],
                       capture_output=True, text=True, env=os.environ, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"HTTPS_PROXY": "http://127.0.0.1:9999",
                                    "NODE_EXTRA_CA_CERTS": str(tmp_path / "mitmproxy-ca-cert.pem"),
                                    "SSL_CERT_FILE": str(tmp_path / "mitmproxy-ca-cert.pem")}
    p = subprocess.run([sys.executable, "-m", "sessionpin.cli", "exec", "--agent", "claude-code", "--proxy",
                        "127.0.0.1:9999", "--confdir", str(tmp_path), "--", sys.executable, "-c", script],
                       capture_output=True, text=True, env={**os.environ, "SSL_CERT_FILE": ""}, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"HTTPS_PROXY": "http://127.0.0.1:9999",
                                    "NODE_EXTRA_CA_CERTS": str(tmp_path / "mitmproxy-ca-cert.pem"),
                                    "SSL_CERT_FILE": ""}
    p = subprocess.run([sys.executable, "-m", "sessionpin.cli", "exec", "--", "no-such-command-xyz"],
                       capture_output=True, text=True, env=os.environ, cwd=ROOT, timeout=60)
    assert p.returncode == 127 and p.stderr.splitlines()[-1] == "sessionpin: command not found: no-such-command-xyz"


def test_run_command_line(env, capsys):
    import shlex
    code, o, _ = run(capsys, "run", "--dry-run")
    assert code == 0
    cmd = shlex.split(o)
    assert Path(cmd[0]).name == "mitmdump"
    assert cmd[1:5] == ["--listen-host", "127.0.0.1", "--listen-port", str(launch.DEFAULT_LISTEN[1])]
    script = Path(cmd[cmd.index("-s") + 1])
    assert script.is_file() and "make_addons" in script.read_text()
    assert f"sessionpin_config={env.cfg}" in cmd and f"sessionpin_store={env.url}" in cmd
    assert "connection_strategy=lazy" in cmd
    assert "flow_detail=0" in cmd            # one line per decision: the router's
    code, o, _ = run(capsys, "run", "--verbose", "--dry-run")
    assert "flow_detail=0" not in shlex.split(o) and "sessionpin_connection_log=true" in shlex.split(o)
    code, o, _ = run(capsys, "run", "--web", "--dry-run", "-p", "9090", "--set", "termlog_verbosity=warn")
    cmd = shlex.split(o)
    assert Path(cmd[0]).name == "mitmweb"
    assert "--listen-port" not in cmd and cmd[-4:] == ["-p", "9090", "--set", "termlog_verbosity=warn"]
    assert any(a.startswith("web_columns=") and a.endswith(",comment") for a in cmd)


PRIVATE_UMASK = r"""
import os, stat, sys
from pathlib import Path
os.umask(0)
from sessionpin.cli import launch
launch.private_umask()                  # what `sessionpin run` does before it execs mitmdump
from mitmproxy.certs import CertStore
confdir = Path(sys.argv[1]) / ".mitmproxy"
CertStore.from_store(confdir, "mitmproxy", 2048)     # mitmproxy makes its confdir and CA, as at its first start
print(oct(stat.S_IMODE(os.umask(0))), oct(stat.S_IMODE(confdir.stat().st_mode)))
for f in sorted(confdir.iterdir()):
    print(f.name, oct(stat.S_IMODE(f.stat().st_mode)))
"""


def test_run_makes_what_mitmdump_creates_private_whatever_the_umask(tmp_path):
    """Issue 20: under umask 000 mitmproxy's confdir was 0777 and its CA files 0666."""
    out = subprocess.run([sys.executable, "-c", PRIVATE_UMASK, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0] == "0o77 0o700"
    files = dict(line.split() for line in lines[1:] if line)
    assert "mitmproxy-ca.pem" in files and set(files.values()) == {"0o600"}, files


def test_run_refuses_a_broken_config(env, capsys):
    env.cfg.write_text("[agents.nobody]\n")
    code, _, e = run(capsys, "run", "--dry-run")
    assert code == 1 and "agents.nobody: unknown agent" in e


def test_classify_joins_the_command(capsys):
    fixture = ROOT / "tests" / "fixtures" / "traffic" / "claude-code" / "interactive-04-opening.json"
    code, o, _ = run(capsys, "classify", str(fixture))
    assert code == 0
    line = json.loads(o.splitlines()[0])
    assert (line["agent"], line["turn"]) == ("claude-code", "opening")
    code, _, e = run(capsys, "classify", str(ROOT / "no-such-file.json"))
    assert code == 1 and "no-such-file.json" in e


def test_pool_report_reads_the_shared_store(env, capsys):
    from sessionpin.opencode_ids import state

    code, o, _ = run(capsys, "pool")
    assert code == 0 and o.startswith("pool: empty")
    now = int(time.time() * 1000)

    async def spare() -> None:
        store = open_store(env.url)
        try:
            await state.add_spare(store, "opencode", "big-pickle", "ses_spare1",
                                  state.Spare(upstream_ms=420, verified_at=now - 5000, created_at=now - 9000))
        finally:
            await store.close()
    asyncio.run(spare())
    code, o, _ = run(capsys, "pool", "--json")
    assert code == 0
    group = json.loads(o)["groups"][0]
    assert (group["provider"], group["model"], group["fresh_spares"]) == ("opencode", "big-pickle", 1)
    code, o, _ = run(capsys, "pool", "--ttl-ms", "1000")
    assert "0 fresh spare(s) of 1" in o and "STALE" in o


def test_reading_the_store_does_not_disturb_a_proxy_holding_it_open(env):
    # The proxy keeps its store open for hours while operators run `sessionpin` beside it.
    # Once, a CLI closing its connection deleted the WAL under the proxy's open connection
    # (the store's flush had dropped SQLite's locks), and the proxy's later pins vanished.
    held = open_store(env.url)
    try:
        asyncio.run(held.set("warm", "1"))     # an ordinary write: the store's flush thread runs
        time.sleep(1.0)
        argv = [sys.executable, "-m", "sessionpin.cli", "sessions", "--json"]
        p = subprocess.run(argv, capture_output=True, text=True, env=os.environ, cwd=ROOT, timeout=60)
        assert p.returncode == 0 and json.loads(p.stdout) == []
        now = time.time()
        asyncio.run(pins.create(held, "after-the-cli", pins.Pin(agent="claude-code", server="glm", since=now,
                                                                renewed=now)))
        p = subprocess.run(argv, capture_output=True, text=True, env=os.environ, cwd=ROOT, timeout=60)
        assert [r["session"] for r in json.loads(p.stdout)] == ["after-the-cli"]
    finally:
        held.close_now()


# --- the installed script -------------------------------------------------------------


def test_console_script_errors_without_traceback(env):
    exe = Path(sys.executable).parent / "sessionpin"
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "sessionpin.cli"]
    env.cfg.write_text("[servers.a\n")
    p = subprocess.run(argv + ["status"], capture_output=True, text=True, env=os.environ, timeout=60)
    assert p.returncode == 1
    assert p.stderr.startswith("sessionpin: config.toml:1: TOML syntax:") and p.stderr.count("\n") == 1
    p = subprocess.run(argv + ["use"], capture_output=True, text=True, env=os.environ, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1


# --- a store that lost what it held (issue 18) -----------------------------------------------


def test_a_store_emptied_after_use_fails_commands_until_accept_loss(env, capsys):
    put_pins(env.url, RUNNING)
    code, o, e = run(capsys, "sessions")                 # the CLI uses it: remembered (4 pins)
    assert code == 0, e
    import shutil
    shutil.rmtree(env.dir / "state")                      # the store's directory deleted
    code, o, e = run(capsys, "sessions")                  # not "no store yet": a loss
    assert code == 1 and f"store {env.url} lost what it held" in e, e
    put_pins(env.url, [])                                 # ... and made again, empty, by someone
    code, o, e = run(capsys, "sessions")
    assert code == 1 and f"store {env.url} lost what it held" in e and "holding 4 pins" in e
    assert "sessionpin store accept-loss" in e and "sessionpin store copy BACKUP" in e
    code, o, e = run(capsys, "status")
    assert "LOST: store" in o
    code, o, e = run(capsys, "status", "--json")
    assert "lost what it held" in json.loads(o)["store_lost"]
    code, o, e = run(capsys, "use", "claude-code", "glm")   # the config changes all the same
    assert code == 0 and "But: store" in o, (o, e)
    code, o, e = run(capsys, "store", "accept-loss", "--json")
    assert code == 0, e
    said = json.loads(o)
    assert len(said["accepted"]) == 1 and said["pins"] == 0
    code, o, e = run(capsys, "sessions")
    assert code == 0, e


def test_a_loss_a_proxy_on_another_machine_recorded_fails_commands_until_accept_loss(env, capsys):
    """This machine never saw the store whole; a proxy elsewhere found it emptied and recorded
    the loss in it (``store:losses``): the CLI judges by that record too, as the proxies do."""
    from sessionpin.store import identity
    put_pins(env.url, RUNNING)

    async def record() -> None:
        store = open_store(env.url)
        try:
            now = time.time()
            gone = identity.Remembered(env.url, "0123456789abcdef", pins=4, seen=now - 60)
            await identity.record_loss(store, gone, "a proxy on another machine", now, identity.LOST)
        finally:
            await store.close()
    asyncio.run(record())
    code, o, e = run(capsys, "sessions")
    assert code == 1 and "0123456789abcdef" in e and "sessionpin store accept-loss" in e, (code, o, e)
    code, o, e = run(capsys, "status")
    assert "LOST: store" in o, o
    assert run(capsys, "store", "accept-loss")[0] == 0
    code, o, e = run(capsys, "sessions")
    assert code == 0 and len(o.splitlines()) == 5, (o, e)


def test_a_store_rolled_back_to_an_older_copy_fails_commands_until_accept_loss(env, capsys, tmp_path):
    """A proxy remembered the count of pins made in the store; its directory is then restored
    from an older cold copy: the pins made since read as never made, so the CLI says so."""
    import shutil
    from sessionpin.store import identity
    put_pins(env.url, RUNNING[:2])
    assert run(capsys, "sessions")[0] == 0
    shutil.copytree(env.dir / "state", tmp_path / "older")
    put_pins(env.url, RUNNING[2:])

    async def remember() -> None:                # what a proxy remembers of it, seen whole now
        store = open_store(env.url)
        try:
            found, _ = await identity.read(store)
            made = await identity.made(store)
        finally:
            await store.close()
        identity.Memory(env.url).save(identity.Remembered(env.url, found.id, pins=len(RUNNING), seen=time.time(),
                                                          made=made, accepted=found.accepted))
    asyncio.run(remember())
    shutil.rmtree(env.dir / "state")
    shutil.copytree(tmp_path / "older", env.dir / "state")
    code, o, e = run(capsys, "sessions")
    assert code == 1 and "was rolled back" in e, (code, o, e)
    assert run(capsys, "store", "accept-loss")[0] == 0
    code, o, e = run(capsys, "sessions")
    assert code == 0 and len(o.splitlines()) == 3, (o, e)


def test_store_copy_is_a_restore_carrying_the_identity(env, capsys, tmp_path):
    put_pins(env.url, RUNNING)
    assert run(capsys, "sessions")[0] == 0
    backup = f"file:{tmp_path / 'backup' / 'state.db'}"
    assert run(capsys, "store", "copy", env.url, backup)[0] == 0
    import shutil
    shutil.rmtree(env.dir / "state")
    put_pins(env.url, [])
    assert run(capsys, "sessions")[0] == 1                # lost
    code, o, e = run(capsys, "store", "copy", backup, env.url)
    assert code == 0, e
    code, o, e = run(capsys, "sessions", "--json")        # the store it was: whole again
    assert code == 0, e
    assert {r["session"] for r in json.loads(o)} == {r[0] for r in RUNNING}


def _two_live_proxies(monkeypatch, cfg: Path, ports=(18081, 18082)) -> list[int]:
    """Two proxies answering on the store (their heartbeats and status, as ``check`` finds them)."""
    from sessionpin.records.documents import Heartbeat
    beats = [Heartbeat(pid=40000 + i, host=socket.gethostname(), started=time.time() - 60 * i, beat=time.time(),
                       listen=[("127.0.0.1", port)], modes=["regular"], confdir=None, config=str(cfg),
                       store=None, version="x", token="") for i, port in enumerate(ports)]
    monkeypatch.setattr(proxies, "heartbeats", lambda ctx: beats)
    monkeypatch.setattr(proxies, "check", lambda b: proxies.Proxy(True, b, proxies.addresses(b)[0]))
    return [b.pid for b in beats]


def test_use_names_every_live_proxy_on_the_store(env, capsys, monkeypatch):
    pids = _two_live_proxies(monkeypatch, env.cfg)
    code, o, _ = run(capsys, "use", "claude-code", "glm")
    assert code == 0
    assert f"The proxy at http://127.0.0.1:18081 (pid {pids[0]}) applies this within 1 s." in o
    assert f"The proxy at http://127.0.0.1:18082 (pid {pids[1]}) applies this within 1 s." in o


def test_env_lists_every_live_proxy_and_points_at_the_first(env, capsys, monkeypatch):
    pids = _two_live_proxies(monkeypatch, env.cfg)
    code, o, _ = run(capsys, "env", "claude-code")
    assert code == 0
    assert "export HTTPS_PROXY=http://127.0.0.1:18081" in o
    assert (f"# 2 proxies answer on this store: http://127.0.0.1:18081 (pid {pids[0]}), "
            f"http://127.0.0.1:18082 (pid {pids[1]}); these lines point at the first (the newest); "
            f"another: sessionpin env claude-code --proxy URL") in o
    code, o, _ = run(capsys, "env", "claude-code", "--json")
    assert [p["address"] for p in json.loads(o)["proxies"]] == ["http://127.0.0.1:18081", "http://127.0.0.1:18082"]


def test_run_never_prints_a_secret_passed_to_mitmdump(env, capsys):
    """``run`` prints the command it starts (to stderr; ``--dry-run``: to stdout), which a
    service manager keeps in its journal: the passwords an operator passes on to mitmdump after
    ``--`` were printed as written. Now each is ``***``, as the store's password already was."""
    import shlex
    secrets = ["hunter2-a", "hunter2-b", "hunter2-c", "hunter2-d", "hunter2-e"]
    code, o, _ = run(capsys, "run", "--dry-run", "--",
                     "--set", f"upstream_auth=me:{secrets[0]}", "--proxyauth", f"me:{secrets[1]}",
                     "--mode", f"upstream:http://me:{secrets[2]}@127.0.0.1:3128", "--set", f"web_password={secrets[3]}",
                     "--upstream-auth", f"me:{secrets[4]}", "--set", "termlog_verbosity=warn")
    assert code == 0
    assert not any(s in o for s in secrets), o
    cmd = shlex.split(o)
    assert cmd[-12:] == ["--set", "upstream_auth=***", "--proxyauth", "***", "--mode",
                         "upstream:http://***@127.0.0.1:3128", "--set", "web_password=***", "--upstream-auth", "***",
                         "--set", "termlog_verbosity=warn"]
