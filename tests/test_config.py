import pytest

from sessionpin.config import config
from sessionpin.config.config import ConfigError

EXAMPLE = '''\
[servers.anthropic]
url = "https://api.anthropic.com"        # a server is an origin plus an optional path prefix

[servers.glm]
url = "https://api.z.ai/api/anthropic"
key_env = "ZAI_API_KEY"                  # its key is read from this environment variable
# auth = "x-api-key" | "bearer"          # default: the style the agent used
models = { "claude-opus-*" = "glm-4.6", "claude-haiku-*" = "glm-4.5-air" }

[agents.claude-code]
server = "glm"                           # new conversations go here; absent or "" = not routed
'''


def test_the_issue_example_parses():
    c = config.parse(EXAMPLE, "/somewhere/config.toml")
    assert c.path == "/somewhere/config.toml"
    assert list(c.servers) == ["anthropic", "glm"]
    glm = c.servers["glm"]
    assert (glm.scheme, glm.host, glm.port, glm.prefix) == ("https", "api.z.ai", 443, "/api/anthropic")
    assert glm.origin == "https://api.z.ai"
    assert glm.key_env == "ZAI_API_KEY" and glm.auth is None
    assert c.servers["anthropic"].prefix == "" and c.servers["anthropic"].key_env is None
    assert c.current("claude-code") == "glm"
    assert c.current("opencode") is None
    assert c.current("unknown") is None


@pytest.mark.parametrize("model, mapped", [
    ("claude-opus-4-1-20250805", "glm-4.6"),
    ("claude-haiku-4-5", "glm-4.5-air"),
    ("claude-sonnet-4-5", "claude-sonnet-4-5"),     # no pattern: unchanged
    ("", ""),
])
def test_map_model(model, mapped):
    assert config.parse(EXAMPLE).servers["glm"].map_model(model) == mapped


@pytest.mark.parametrize("path, server", [
    ("/zen/go/v1/chat/completions", "go"),      # the longest prefix the path is under
    ("/zen/v1/messages", "zen"),
    ("/zen/gox/v1/messages", "zen"),            # a prefix is whole segments
    ("/v1/messages", "zen"),                    # under none: the first written at the origin
    ("/api/anthropic/v1/messages", "zen"),
])
def test_server_for_at_an_origin_with_several_servers(path, server):
    c = config.parse('[servers.zen]\nurl = "https://opencode.ai/zen/v1"\n[servers.go]\nurl = "https://opencode.ai/zen/go/v1"\n'
                     '[servers.x]\nurl = "https://other.example/zen/v1"\n')
    got = c.server_for("https", "opencode.ai", 443, path)
    assert got is not None and got.name == server
    assert c.server_for("https", "opencode.ai", 8443, path) is None


@pytest.mark.parametrize("url, base", [
    ("https://api.anthropic.com", "/v1"), ("https://api.openai.com/v1", "/v1"), ("https://opencode.ai/zen/v1", "/zen/v1"),
    ("https://opencode.ai/zen/v1/", "/zen/v1"), ("https://opencode.ai/zen", "/zen/v1"),
    ("https://api.z.ai/api/anthropic", "/api/anthropic/v1"), ("https://api.z.ai/api/paas/v4", "/api/paas/v4"),
])
def test_a_servers_url_is_the_base_url_of_its_api(url, base):
    assert config.parse(f'[servers.s]\nurl = "{url}"\n').servers["s"].base == base


def test_first_matching_glob_wins_in_written_order():
    c = config.parse('[servers.s]\nurl = "https://s"\nmodels = { "claude-opus-4*" = "a", "claude-*" = "b", "*" = "c" }\n')
    s = c.servers["s"]
    assert [s.map_model(m) for m in ("claude-opus-4", "claude-haiku", "gpt-5")] == ["a", "b", "c"]


@pytest.mark.parametrize("scheme, host, port, path, server", [
    ("https", "api.anthropic.com", 443, "/v1/messages", "anthropic"),
    ("https", "API.Anthropic.com", 443, "/v1/messages?beta=true", "anthropic"),
    ("https", "api.z.ai", 443, "/api/anthropic/v1/messages", "glm"),
    ("https", "api.z.ai", 443, "/api/anthropic", "glm"),
    # a server is an API at its origin: a path under no server's prefix is still its origin's
    # (paths.scope says which of them are inference)
    ("https", "api.z.ai", 443, "/api/anthropicx/v1/messages", "glm"),
    ("https", "api.z.ai", 443, "/v1/messages", "glm"),
    ("http", "api.anthropic.com", 80, "/v1/messages", None),           # scheme is part of the origin
    ("https", "api.anthropic.com", 8443, "/v1/messages", None),
    ("https", "example.com", 443, "/v1/messages", None),
])
def test_server_for(scheme, host, port, path, server):
    s = config.parse(EXAMPLE).server_for(scheme, host, port, path)
    assert (s.name if s else None) == server


def test_longest_prefix_wins_on_a_shared_origin():
    c = config.parse('[servers.root]\nurl = "https://h"\n[servers.sub]\nurl = "https://h/api/v2/"\n')
    assert c.servers["sub"].prefix == "/api/v2"
    assert c.server_for("https", "h", 443, "/api/v2/messages").name == "sub"
    assert c.server_for("https", "h", 443, "/api/v1/messages").name == "root"
    assert c.addresses_origin("https", "h", 443) and not c.addresses_origin("https", "h", 444)


def test_explicit_port_and_http():
    s = config.parse('[servers.local]\nurl = "http://127.0.0.1:8080/v1"\n').servers["local"]
    assert (s.scheme, s.host, s.port, s.prefix, s.origin) == ("http", "127.0.0.1", 8080, "/v1", "http://127.0.0.1:8080")


def test_empty_server_means_not_routed_and_agents_are_optional():
    c = config.parse('[servers.a]\nurl = "https://a"\n[agents.pi]\nserver = ""\n[agents.codex]\n')
    assert c.current("pi") is None and c.current("codex") is None and c.agents["pi"].server is None


def test_auth_styles():
    c = config.parse('[servers.a]\nurl = "https://a"\nauth = "Bearer"\n[servers.b]\nurl = "https://b"\nauth = "x-api-key"\n')
    assert c.servers["a"].auth == "bearer" and c.servers["b"].auth == "x-api-key"


def test_empty_text_is_an_empty_config():
    c = config.parse("")
    assert c.servers == {} and c.agents == {}
    assert c.server_for("https", "api.anthropic.com", 443, "/v1/messages") is None


def test_load_missing_file_is_empty(tmp_path):
    c = config.load(tmp_path / "nope.toml")
    assert c.servers == {} and c.path == str(tmp_path / "nope.toml")


def test_load_reads_the_file(tmp_path):
    p = tmp_path / "config.toml"
    p.write_text(EXAMPLE)
    assert config.load(p).current("claude-code") == "glm"
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        config.load(p)


def test_default_path_is_in_the_user_config_dir():
    p = config.default_path()
    assert p.name == "config.toml" and p.parent.name == "sessionpin"


def err(text: str) -> str:
    with pytest.raises(ConfigError) as e:
        config.parse(text, "/home/u/.config/sessionpin/config.toml")
    return str(e.value)


def test_error_names_file_line_key_and_the_servers():
    text = EXAMPLE.replace('server = "glm"', 'server = "glmm"')
    assert err(text) == "config.toml:11: agents.claude-code.server: no server named 'glmm' (servers: anthropic, glm)"


@pytest.mark.parametrize("text, expected", [
    ('[servers.a]\nurl = "https://a"\n\n[agents.claude-code]\nserver = "b"\n',
     "config.toml:5: agents.claude-code.server: no server named 'b' (servers: a)"),
    ('[agents.claude-code]\nserver = "b"\n',
     "config.toml:2: agents.claude-code.server: no server named 'b' (servers: none configured)"),
    ('[servers.a]\nurl = "https://a"\n[agents.claude]\nserver = "a"\n',
     "config.toml:3: agents.claude: unknown agent (known: claude-code, opencode, pi, codex, gemini-cli)"),
    ('[agents.unknown]\n', "config.toml:1: agents.unknown: unknown agent (known: claude-code, opencode, pi, codex, gemini-cli)"),
    ('[servers.a]\n\nurl = 3\n', "config.toml:3: servers.a.url: must be a string, not a number"),
    ('[servers.a]\nkey_env = "K"\n', 'config.toml:1: servers.a: missing url (e.g. url = "https://api.anthropic.com")'),
    ('[servers.a]\nurl = "ftp://a"\n', "config.toml:2: servers.a.url: must start with https:// or http://, got 'ftp://a'"),
    ('[servers.a]\nurl = "https://a?x=1"\n', "config.toml:2: servers.a.url: an origin and a path prefix only: no query, fragment or user"),
    ('[servers.a]\nurl = "https://"\n', "config.toml:2: servers.a.url: no host in 'https://'"),
    ('[servers.a]\nurl = "https://a:99999"\n', "config.toml:2: servers.a.url: not a URL: Port out of range 0-65535"),
    ('[servers.a]\nurl = "https://a"\nkey_env = "MY KEY"\n',
     "config.toml:3: servers.a.key_env: not an environment variable name: M…(6 chars) (letters, digits and '_', not starting with a digit)"),
    ('[servers.a]\nurl = "https://a"\nauth = "basic"\n', "config.toml:3: servers.a.auth: must be one of x-api-key, bearer (the style the key is sent in, not the key), got 'basic'"),
    ('[servers.a]\nurl = "https://a"\nmodels = { "x" = 1 }\n', "config.toml:3: servers.a.models.x: must be a string, not a number"),
    ('[servers.a]\nurl = "https://a"\nmodels = { "claude-*" = "" }\n', 'config.toml:3: servers.a.models."claude-*": maps to an empty model name'),
    ('[servers.a]\nurl = "https://a"\nmodel = {}\n', "config.toml:3: servers.a.model: unknown key (known: url, key_env, auth, models, prices)"),
    ('[server.a]\nurl = "https://a"\n', "config.toml:1: server: unknown key (known: servers, pools, agents)"),
    ('servers = 1\n', "config.toml:1: servers: must be a table, not a number"),
    ('[servers.a]\nurl = "https://a"\n[servers.b]\nurl = "https://a/"\n', "config.toml:4: servers.b.url: same origin and prefix as server 'a'"),
    ('[servers."a b"]\nurl = "https://a"\n', 'config.toml:1: servers."a b": a server name is letters, digits, \'_\', \'-\' and \'.\''),
    ('servers.a.url = "https://a"\nagents.pi.server = "x"\n', "config.toml:2: agents.pi.server: no server named 'x' (servers: a)"),
    ('[agents]\npi = { server = "x" }\n', "config.toml:2: agents.pi.server: no server named 'x' (servers: none configured)"),
])
def test_semantic_errors(text, expected):
    assert err(text) == expected


KEYS = [
    "sk-ant-api03-Ab3dE6gH9jK2mN5pQ8sT1vW4yZ7bC0eF3hJ6kM9nP2rS5uV8xA1cD4fG7iL0oR3tU6w-AbCdEfAA",
    "sk-0123456789abcdef0123456789abcdef",                           # DeepSeek-shaped
    "3f9c2a7b1e8d4f6a0b5c9e2d7f1a8b3c.Hk29sLq0ZpXw7rTu",             # z.ai-shaped
    "a3f9c2a7b1e8d4f6a0b5c9e2d7f1a8b3c",                             # hex, a valid variable name
    "xS3kd9Qm2Lp7Zr4Tw8Yv1Bn6Hc5Jf0GdK",                              # base62, a valid variable name
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.c2lnbmF0dXJlc2ln",  # a JWT
    "AIzaSyD-1234567890abcdefghijklmnopqrstu",
    "sk_live_0123456789abcdefABCDEF",
]


@pytest.mark.parametrize("key", KEYS)
def test_a_key_pasted_as_key_env_is_refused_and_never_echoed(key):
    e = err(f'[servers.a]\nurl = "https://a"\nkey_env = "{key}"\n')
    assert e == f"config.toml:3: servers.a.key_env: looks like a key, not a variable name: {key[:4]}…({len(key)} chars); " \
               "put the key in the proxy's environment and name the variable here"
    assert key[4:8] not in e


@pytest.mark.parametrize("name", ["ZAI_API_KEY", "_K", "OPENROUTER_API_KEY_2", "MY_VERY_LONG_COMPANY_PROVIDER_GLM_API_KEY",
                                  "anthropic_auth_token", "K"])
def test_variable_names_are_taken(name):
    c = config.parse(f'[servers.a]\nurl = "https://a"\nkey_env = "{name}"\n')
    assert c.servers["a"].key_env == name


@pytest.mark.parametrize("bad", ["1KEY", "MY-KEY", "MY KEY", "KEY$", "ключ"])
def test_a_bad_variable_name_is_named_without_being_shown(bad):
    e = err(f'[servers.a]\nurl = "https://a"\nkey_env = "{bad}"\n')
    assert "not an environment variable name" in e and bad not in e


@pytest.mark.parametrize("text, line", [
    ('[servers.a]\nurl = "https://a\n', 2),
    ('[servers.a]\nurl = "https://a"\nurl = "https://b"\n', 3),
    ('[servers.a\n', 1),
])
def test_syntax_errors_carry_the_line(text, line):
    e = err(text)
    assert e.startswith(f"config.toml:{line}: TOML syntax: "), e
    assert "\n" not in e


def test_error_without_a_path():
    with pytest.raises(ConfigError) as e:
        config.parse('[agents.x]\n')
    assert str(e.value).startswith("config:1: agents.x: unknown agent")
    assert e.value.line == 1 and e.value.key == "agents.x" and e.value.path is None


def test_error_line_is_the_key_not_a_lookalike_inside_a_multiline_string():
    # (a line reader of our own once took the string's lines for a table and its key)
    text = ('[servers.a]\nurl = "https://a"\nmodels = { "x" = """\n[agents.pi]\nserver = "zz"\n""" }\n\n'
            '[agents.pi]\nserver = "b"\n')
    assert err(text) == "config.toml:9: agents.pi.server: no server named 'b' (servers: a)"


def test_error_line_of_a_dotted_key_and_a_key_after_a_line_separator():
    text = '[servers.a]\nurl = "https://a"\nkey_env = "A"  # one\u2028two\n[agents]\npi.server = "b"\n'
    assert err(text) == "config.toml:5: agents.pi.server: no server named 'b' (servers: a)"


def test_a_config_others_may_write_or_another_user_owns_is_refused(tmp_path):
    """Issue 20: the config names where requests go and with which keys, and the proxy reloads
    it within a second: one that others may write, or another user owns, is refused with the
    fix in the message (never read as if it were the operator's)."""
    import os

    p = tmp_path / "config.toml"
    p.write_text('[servers.glm]\nurl = "https://glm.example"\n')
    os.chmod(p, 0o600)
    assert "glm" in config.load(p).servers
    os.chmod(p, 0o666)
    with pytest.raises(ConfigError, match=r"writable by other users \(mode 666\).*chmod go-w"):
        config.load(p)
    os.chmod(p, 0o644)
    assert "glm" in config.load(p).servers
    if os.geteuid() == 0:                       # only root can give a file away
        os.chown(p, 65534, 65534)
        with pytest.raises(ConfigError, match=r"owned by another user \(uid 65534"):
            config.load(p)


def test_repointed_names_the_servers_at_another_origin():
    old = config.parse('[servers.a]\nurl = "https://a.example/v1"\n[servers.b]\nurl = "https://b.example"\n'
                       '[servers.c]\nurl = "http://c.example:8000"\n')
    new = config.parse('[servers.a]\nurl = "https://a.example/api/v4"\n[servers.b]\nurl = "https://x.example"\n'
                       '[servers.c]\nurl = "http://c.example:8001"\n[servers.d]\nurl = "https://d.example"\n')
    assert config.repointed(old, new) == [("b", "https://b.example", "https://x.example"),
                                          ("c", "http://c.example:8000", "http://c.example:8001")]
    assert config.repointed(new, config.Config()) == []        # removed: pinned-server-gone, said as such


def test_only_a_regular_file_of_a_config_s_size_is_read(tmp_path):
    """What no config is — a FIFO (its open() waited for a writer on the proxy's loop), a
    directory, a device, a file over MAX_BYTES — is a ConfigError saying what it is, read no
    further; a file at the bound is read; a missing file and a dangling link are no config."""
    import os

    p = tmp_path / "config.toml"
    head = '[servers.glm]\nurl = "https://glm.example"\n'
    p.write_text(head + "#" * (config.MAX_BYTES - len(head) - 1) + "\n")
    assert len(p.read_bytes()) == config.MAX_BYTES and "glm" in config.load(p).servers
    with open(p, "a") as f:
        f.write("#" * 64)
    with pytest.raises(ConfigError, match=rf"config.toml: {os.path.getsize(p)} bytes, more than"):
        config.load(p)
    p.unlink()
    os.mkfifo(p, 0o600)
    with pytest.raises(ConfigError, match=r"not a regular file \(a FIFO\)"):
        config.read_trusted(p)                  # returns at once: nothing writes the FIFO
    p.unlink()
    p.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=r"not a regular file \(a directory\)"):
        config.load(p)
    p.rmdir()
    assert config.read_trusted(p) is None
    p.symlink_to(tmp_path / "nowhere.toml")
    assert config.read_trusted(p) is None


@pytest.mark.parametrize("host,path,server,api", [
    ("api.z.ai", "/api/paas/v4/chat/completions", "zai", "openai-chat"),
    ("api.z.ai", "/v1/messages", "zai", "anthropic-messages"),           # a client's /v1 at that origin
    ("api.z.ai", "/api/paas/v4/threads/x/messages", "zai", "other"),
    ("glm.example", "/api/anthropic/v1/messages", "glm", "anthropic-messages"),
    ("elsewhere.example", "/api/paas/v4/chat/completions", None, "other"),   # no server: the path alone
    ("elsewhere.example", "/zen/v1/responses", None, "openai-responses"),
])
def test_scope_is_the_server_a_request_addresses_and_its_path_under_that_base(host, path, server, api):
    """The one rule the router, the body limit and the connect check share (issue 19)."""
    cfg = config.parse('[servers.zai]\nurl = "https://api.z.ai/api/paas/v4"\n'
                '[servers.glm]\nurl = "https://glm.example/api/anthropic"\n')
    source, scope = cfg.scope("POST", "https", host, 443, path)
    assert (source.name if source else None) == server and scope.api == api
    assert cfg.scope("GET", "https", host, 443, path)[1].api == "other"


def test_a_config_renames_when_a_server_has_a_model_map_or_there_is_a_pool():
    """``renames``: the reader then says where the model lies (a pool pin keeps its member's map)."""
    assert not config.parse('[servers.a]\nurl = "https://a"\n').renames
    assert config.parse('[servers.a]\nurl = "https://a"\nmodels = {"claude-*" = "glm-4.6"}\n').renames
    assert config.parse('[servers.a]\nurl = "https://a"\n[servers.b]\nurl = "https://b"\n'
                        '[pools.p]\nmembers = ["a", "b"]\n').renames


MIXED_KEY = "Xy7kQ2mN9pL4rT8vW3zA6bC1dE5fG0hJ"     # 32 mixed-case letters and digits, as Mistral's keys


@pytest.mark.parametrize("line, secret", [
    (f'url = "https://api.mistral.ai"\nauth = "Bearer {MIXED_KEY}"', MIXED_KEY),   # the key where its style goes
    (f'url = "https://api.mistral.ai"\nauth = "{MIXED_KEY}"', MIXED_KEY),
    ('url = "api.example.com/v1?key=hunter2-secret"', "hunter2-secret"),          # no scheme: the query not echoed
    ('url = "user:hunter2-secret@api.example.com"', "hunter2-secret"),
    ('url = "ftp://user:hunter2-secret@api.example.com"', "hunter2-secret"),
    (f'url = "{MIXED_KEY}"', MIXED_KEY),                                           # the key where the URL goes
    (f'url = "https://api.example.com"\n[servers.a.prices."x"]\ninput = "{MIXED_KEY}"', MIXED_KEY),
])
def test_a_config_error_never_echoes_a_credential_it_quotes(line: str, secret: str):
    """A key pasted where a style, a URL or a price belongs: the error (logged by the proxy, in
    its status, printed by the CLI) names the place, never the key. Before, ``auth`` was echoed
    lower-cased (which hid a mixed-case key from the redaction too) and a URL whole."""
    with pytest.raises(ConfigError) as e:
        config.parse(f"[servers.a]\n{line}\n")
    assert secret not in str(e.value) and secret.lower() not in str(e.value), str(e.value)
    assert "servers.a." in str(e.value)
