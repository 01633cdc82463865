import os
import re
import stat
import tomllib

import pytest

from sessionpin.config import config, configedit

ISSUE_EXAMPLE = '''\
# servers I use
[servers.anthropic]
url = "https://api.anthropic.com"        # a server is an origin plus an optional path prefix

[servers.glm]
url = "https://api.z.ai/api/anthropic"
key_env = "ZAI_API_KEY"                  # its key is read from this environment variable
# auth = "x-api-key" | "bearer"          # default: the style the agent used
# models = { "claude-opus-*" = "glm-4.6", "claude-haiku-*" = "glm-4.5-air" }

# glm is slow before 9am
[agents.claude-code]
server = "glm"                           # new conversations go here; absent or "" = not routed
'''


def changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    a, b = before.splitlines(), after.splitlines()
    assert len(a) == len(b)
    return [(x, y) for x, y in zip(a, b) if x != y]


def test_set_server_rewrites_only_the_value_and_keeps_its_comment():
    out = configedit.set_agent_server(ISSUE_EXAMPLE, "claude-code", "anthropic")
    assert changed_lines(ISSUE_EXAMPLE, out) == [(
        'server = "glm"                           # new conversations go here; absent or "" = not routed',
        'server = "anthropic"                           # new conversations go here; absent or "" = not routed',
    )]
    assert config.parse(out).current("claude-code") == "anthropic"


def test_not_routed_writes_empty_string():
    out = configedit.set_agent_server(ISSUE_EXAMPLE, "claude-code", None)
    assert config.parse(out).current("claude-code") is None
    assert 'server = ""   ' in out
    assert "# glm is slow before 9am" in out


def test_missing_agent_table_is_appended():
    out = configedit.set_agent_server(ISSUE_EXAMPLE, "opencode", "glm")
    assert out.startswith(ISSUE_EXAMPLE)
    assert out[len(ISSUE_EXAMPLE):] == '\n[agents.opencode]\nserver = "glm"\n'
    cfg = config.parse(out)
    assert cfg.current("opencode") == "glm" and cfg.current("claude-code") == "glm"


def test_table_without_server_line_gets_one_under_its_header():
    text = '[servers.a]\nurl = "https://a.example"\n\n[agents.pi]   # pi here\n# nothing yet\n'
    out = configedit.set_agent_server(text, "pi", "a")
    assert out == '[servers.a]\nurl = "https://a.example"\n\n[agents.pi]   # pi here\nserver = "a"\n# nothing yet\n'


def test_quoted_header_and_literal_value():
    text = "[servers.a]\nurl = 'https://a.example'\n[servers.b]\nurl = 'https://b.example'\n[agents.\"codex\"]\nserver='a'#c\n"
    out = configedit.set_agent_server(text, "codex", "b")
    assert out.endswith('server="b"#c\n')
    assert config.parse(out).current("codex") == "b"


def test_dotted_key_under_agents_table():
    text = '[servers.a]\nurl = "https://a.example"\n[agents]\ncodex.server = "" # later\n'
    out = configedit.set_agent_server(text, "codex", "a")
    assert out.endswith('codex.server = "a" # later\n')


@pytest.mark.parametrize("text, form", [
    ('[servers.a]\nurl = "https://a.example"\n[agents]\ncodex = { server = "" }\n', "an inline table"),
    ('agents = { codex = { server = "" } }\n', "an inline table"),
    ('[[agents.codex]]\nserver = ""\n', "an array of tables"),
    ('[agents]\ncodex = "a"\n', "a value, not a table"),
    ('[agents]\ncodex.other = 1\n', "dotted keys"),
])
def test_forms_it_does_not_edit_are_refused_and_nothing_is_half_edited(text, form):
    with pytest.raises(configedit.EditError) as e:
        configedit.set_agent_server(text, "codex", "a")
    assert str(e.value).startswith("could not change agents.codex.server safely: ")
    assert form in str(e.value) and "nothing written" in str(e.value)
    assert 'edit it by hand: [agents.codex] server = "a"' in str(e.value)


def test_root_dotted_key_and_out_of_order_tables_are_edited_in_place():
    text = 'agents.pi.server = "a"  # dotted\n[servers.a]\nurl = "https://a.example"\n'
    assert configedit.set_agent_server(text, "pi", None) == text.replace('"a"  #', '""  #')
    text = ('[servers.a]\nurl = "https://a.example"\n[agents.pi]\nserver = "a"\n'
            '[servers.b]\nurl = "https://b.example"\n[agents.codex]\nserver = "a"\n')
    out = configedit.set_agent_server(text, "codex", "b")
    assert changed_lines(text, out) == [('server = "a"', 'server = "b"')]
    assert out.splitlines()[3] == 'server = "a"'     # pi's line, the same words, untouched


def test_multiline_value_is_replaced_whole_and_its_lines_are_not_read_as_tables():
    text = '[agents.pi]\nserver = """\n[servers.x]\n# not a comment\n"""  # why\n\n[servers.a]\nurl = "https://a"\n'
    out = configedit.set_agent_server(text, "pi", "a")
    assert out == '[agents.pi]\nserver = "a"  # why\n\n[servers.a]\nurl = "https://a"\n'
    kinds = [ln.kind for ln in configedit.layout(text)]
    assert kinds == ["header", "key", "value", "value", "value", "blank", "header", "key"]


def test_array_of_tables_and_multiline_array_elsewhere_are_kept():
    text = ('x = [\n  1, # one\n\n  2,\n]\n[[extra.t]]\nk = 1\n\n[servers.a]\nurl = "https://a"\n'
            '\n# b\n[[extra.t]]\nk = 2\n')
    out = configedit.add_server(text, "b", "https://b")
    assert out == text.replace('"https://a"\n', '"https://a"\n\n[servers.b]\nurl = "https://b"\n')
    assert tomllib.loads(out)["extra"]["t"] == [{"k": 1}, {"k": 2}]
    assert configedit.remove_server(out, "b") == text
    # the array's comment and blank line are inside its value, not comment or blank lines
    assert [ln.kind for ln in configedit.layout(text)][:6] == ["key", "value", "value", "value", "value", "array"]


def test_a_line_separator_inside_a_string_is_not_a_line_break():
    text = '[servers.a]\nurl = "https://a"\nnote = "one\u2028two"\n[agents.pi]\nserver = "a"\n'
    assert [ln.path for ln in configedit.layout(text)] == [
        ("servers", "a"), ("servers", "a", "url"), ("servers", "a", "note"), ("agents", "pi"), ("agents", "pi", "server")]
    assert configedit.set_agent_server(text, "pi", None).endswith('[agents.pi]\nserver = ""\n')


def test_server_written_inline_is_refused_on_remove_and_add():
    text = '[servers]\na = { url = "https://a" }\n'
    with pytest.raises(configedit.EditError, match="could not change servers.a safely"):
        configedit.remove_server(text, "a")
    with pytest.raises(configedit.EditError, match=r"could not change servers.b safely: it is written as servers = \.\.\. \(an inline table\)"):
        configedit.add_server('servers = { a = { url = "https://a" } }\n', "b", "https://b")


def test_key_lines_name_headers_keys_dotted_and_inline_keys():
    text = ('# top\nservers.a.url = "https://a"\n[servers."b.c"]  # x\nurl = \'https://b\'\n'
            'models = { "claude-*" = "m", k.j = "n" }\n[[arr]]\n[agents]\npi.server = "a"\n')
    assert configedit.key_lines(text) == [
        (("servers", "a", "url"), 2), (("servers", "b.c"), 3), (("servers", "b.c", "url"), 4),
        (("servers", "b.c", "models"), 5), (("servers", "b.c", "models", "claude-*"), 5),
        (("servers", "b.c", "models", "k"), 5), (("servers", "b.c", "models", "k", "j"), 5),
        (("arr",), 6), (("agents",), 7), (("agents", "pi", "server"), 8)]


def test_header_lookalike_inside_multiline_string_is_ignored():
    text = 'x = """\n[agents.pi]\nserver = "no"\n"""\n'
    out = configedit.set_agent_server(text, "pi", "a")
    assert out.startswith(text)
    assert tomllib.loads(out)["x"] == '[agents.pi]\nserver = "no"\n'
    assert tomllib.loads(out)["agents"]["pi"]["server"] == "a"


def test_crlf_file_stays_crlf():
    text = ISSUE_EXAMPLE.replace("\n", "\r\n")
    out = configedit.set_agent_server(text, "pi", "anthropic")
    assert "\n" not in out.replace("\r\n", "")
    assert config.parse(out).current("pi") == "anthropic"


def test_empty_file():
    assert configedit.set_agent_server("", "pi", "a") == '[agents.pi]\nserver = "a"\n'


def test_add_server_goes_after_the_last_server_and_its_own_comments():
    out = configedit.add_server(ISSUE_EXAMPLE, "ete", "https://ete.example/v1", key_env="ETE_KEY", auth="bearer")
    # glm's commented-out lines stay with glm; the agent's comment stays with the agent.
    assert ('# models = { "claude-opus-*" = "glm-4.6", "claude-haiku-*" = "glm-4.5-air" }\n\n'
            '[servers.ete]\nurl = "https://ete.example/v1"\nkey_env = "ETE_KEY"\nauth = "bearer"\n\n'
            '# glm is slow before 9am\n[agents.claude-code]\n') in out
    cfg = config.parse(out)
    assert cfg.servers["ete"].key_env == "ETE_KEY"
    assert cfg.servers["ete"].prefix == "/v1"
    assert configedit.remove_server(out, "ete") == ISSUE_EXAMPLE


def test_add_server_to_empty_and_to_file_without_servers():
    assert configedit.add_server("", "a", "https://a.example") == '[servers.a]\nurl = "https://a.example"\n'
    out = configedit.add_server("# mine\n[agents.pi]\n", "a", "https://a.example")
    assert out == '# mine\n[agents.pi]\n\n[servers.a]\nurl = "https://a.example"\n'


def test_add_server_with_a_dot_in_its_name_is_quoted():
    out = configedit.add_server("", "glm.fast", "https://a.example")
    assert '[servers."glm.fast"]' in out
    assert "glm.fast" in config.parse(out).servers


def test_remove_server_takes_its_comments_and_sub_tables():
    text = ('[servers.a]\nurl = "https://a.example"\n\n# b is the backup\n[servers.b]\nurl = "https://b.example"\n'
            '[servers.b.models]\n"claude-*" = "m"\n\n[agents.pi]\nserver = "a"\n')
    out = configedit.remove_server(text, "b")
    assert out == '[servers.a]\nurl = "https://a.example"\n\n[agents.pi]\nserver = "a"\n'


def test_remove_last_table_and_unknown_name():
    text = '[servers.a]\nurl = "https://a.example"\n\n[servers.b]\nurl = "https://b.example"\n'
    assert configedit.remove_server(text, "b") == '[servers.a]\nurl = "https://a.example"\n'
    assert configedit.remove_server(text, "zzz") == text


def test_write_atomic_keeps_mode_and_new_file_is_private(tmp_path):
    p = tmp_path / "sub" / "config.toml"
    configedit.write_atomic(p, "a = 1\n")
    assert p.read_text() == "a = 1\n"
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    os.chmod(p, 0o640)
    configedit.write_atomic(p, "a = 2\n")
    assert p.read_text() == "a = 2\n"
    assert stat.S_IMODE(p.stat().st_mode) == 0o640
    assert [x.name for x in p.parent.iterdir()] == ["config.toml"]   # no temp file left


def test_a_config_that_is_a_link_is_written_where_it_points(tmp_path):
    """Replacing the link with a file left the file it named unchanged: the next re-link (a
    dotfiles sync) put the old config back in force, unasked."""
    dots = tmp_path / "dots"
    dots.mkdir()
    target = dots / "config.toml"
    target.write_text("a = 1\n")
    os.chmod(target, 0o640)
    link = tmp_path / "config.toml"
    link.symlink_to(target)
    configedit.write_atomic(link, "a = 2\n")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "a = 2\n" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(x.name for x in tmp_path.iterdir()) == ["config.toml", "dots"]
    assert [x.name for x in dots.iterdir()] == ["config.toml"]          # no temp file left
    chained = tmp_path / "again.toml"
    chained.symlink_to(link)                     # a link to a link: the file at the end
    configedit.write_atomic(chained, "a = 3\n")
    assert chained.is_symlink() and link.is_symlink() and target.read_text() == "a = 3\n"
    dangling = tmp_path / "new.toml"
    dangling.symlink_to(dots / "sub" / "new.toml")   # a link made before its file: the file is made
    configedit.write_atomic(dangling, "a = 4\n")
    assert dangling.is_symlink() and (dots / "sub" / "new.toml").read_text() == "a = 4\n"


def test_under_umask_000_the_config_s_directories_are_0700_and_no_one_else_may_write_it(tmp_path):
    """Issue 20: under umask 000 the config directory was 0777: anyone could replace
    config.toml and point a server's URL (with its key) elsewhere."""
    p = tmp_path / "home" / ".config" / "sessionpin" / "config.toml"
    old = os.umask(0)
    try:
        configedit.write_atomic(p, "a = 1\n")
    finally:
        os.umask(old)
    for d in (tmp_path / "home", tmp_path / "home" / ".config", p.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    os.chmod(p, 0o666)                   # a file others may write keeps no write for them
    configedit.write_atomic(p, "a = 2\n")
    assert stat.S_IMODE(p.stat().st_mode) == 0o644


# --- property: any config written in the usual forms ------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402

from sessionpin.reader.facts import AGENTS  # noqa: E402

NAMES = ["anthropic", "glm", "ete", "z.ai", "local-1"]


@st.composite
def configs(draw):
    """A config text in the forms people write, and what it means."""
    servers = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    agents = draw(st.dictionaries(st.sampled_from(AGENTS), st.sampled_from([None, *servers]), max_size=4))
    comment = st.sampled_from(["", "  # why", "\t#note", " # [agents.pi] server = \"x\""])
    string = lambda v: draw(st.sampled_from([f'"{v}"', f"'{v}'"]))  # noqa: E731
    key = lambda k: k if "." not in k and draw(st.booleans()) else f'"{k}"'  # noqa: E731
    lines: list[str] = []
    for i, name in enumerate(servers):
        if draw(st.booleans()):
            lines.append("# " + draw(st.sampled_from(["a server", "[servers.fake]", "server = 'no'"])))
        lines.append(f"[servers.{key(name)}]{draw(comment)}")
        lines.append(f"url = {string(f'https://h{i}.example/p')}{draw(comment)}")
        if draw(st.booleans()):
            lines.append(f"key_env = {string(f'KEY_{i}')}")
        if draw(st.booleans()):
            lines.append("")
    for agent, server in agents.items():
        lines.append(f"[agents.{key(agent)}]{draw(comment)}")
        if server is not None or draw(st.booleans()):
            lines.append(f"server = {string(server or '')}{draw(comment)}")
        if draw(st.booleans()):
            lines.append("")
    return "\n".join(lines) + draw(st.sampled_from(["", "\n"])), servers, agents


@settings(max_examples=150, deadline=None)
@given(configs(), st.sampled_from(AGENTS), st.data())
def test_set_agent_server_changes_exactly_that_setting(case, agent, data):
    text, servers, agents = case
    before = config.parse(text)
    target = data.draw(st.sampled_from([None, *servers]))
    out = configedit.set_agent_server(text, agent, target)
    after = config.parse(out)
    assert after.current(agent) == target
    assert after.servers == before.servers
    assert {a: x.server for a, x in after.agents.items() if a != agent} == \
        {a: x.server for a, x in before.agents.items() if a != agent}
    # Every line that was there is still there, in order, except the one server line changed.
    kept = [line for line in text.splitlines() if line not in out.splitlines()]
    assert len(kept) <= 1 and all(line.startswith("server =") for line in kept)
    # ... and that one keeps its comment: every comment of the file is still there.
    assert sorted(re.findall(r"#.*", text)) == sorted(re.findall(r"#.*", out))


@settings(max_examples=100, deadline=None)
@given(configs(), st.sampled_from(NAMES))
def test_add_then_remove_server_round_trips(case, name):
    text, servers, _ = case
    if name in servers:
        return
    out = configedit.add_server(text, name, "https://new.example", key_env="NEW_KEY")
    cfg = config.parse(out)
    assert cfg.servers[name].key_env == "NEW_KEY" and cfg.agents == config.parse(text).agents
    back = configedit.remove_server(out, name)
    assert config.parse(back) == config.parse(text)
    assert [x for x in back.splitlines() if x.strip()] == [x for x in text.splitlines() if x.strip()]
