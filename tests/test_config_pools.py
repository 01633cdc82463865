"""[pools.NAME] in the config: what is accepted, and each error with its file:line:key."""

from __future__ import annotations

import pytest

from sessionpin.serverpools import allocate
from sessionpin.config.config import ConfigError, parse

BASE = '''[servers.a]
url = "https://a.example"
key_env = "A_KEY"
[servers.b]
url = "https://b.example"
key_env = "B_KEY"
'''


def test_a_pool_with_every_setting():
    cfg = parse(BASE + '''[pools.glm]
members = ["a", "b"]
policy = "weighted"
weights = { a = 3 }
affinity = "soft"
[agents.claude-code]
server = "glm"
''', "config.toml")
    p = cfg.pools["glm"]
    assert (p.members, p.policy, p.weight("a"), p.weight("b"), p.affinity) == (("a", "b"), "weighted", 3, 1, "soft")
    assert cfg.current("claude-code") == "glm" and [x.name for x in cfg.pools_of("b")] == ["glm"]


def test_defaults_and_revision():
    one = parse(BASE + '[pools.glm]\nmembers = ["a", "b"]\n').pools["glm"]
    assert (one.policy, one.affinity) == ("round-robin", "hard")
    assert one.revision == parse(BASE + '[pools.glm]\nmembers = ["a", "b"]\npolicy = "round-robin"\n').pools["glm"].revision
    assert one.revision != parse(BASE + '[pools.glm]\nmembers = ["b", "a"]\n').pools["glm"].revision


ERRORS = [
    ('[pools.glm]\npolicy = "quota"\n', "config.toml:7: pools.glm: missing members"),
    ('[pools.glm]\nmembers = []\n', "config.toml:8: pools.glm.members: must name at least one server"),
    ('[pools.glm]\nmembers = "a"\n', "config.toml:8: pools.glm.members: must be an array of server names, not a string"),
    ('[pools.glm]\nmembers = ["a", "c"]\n', "config.toml:8: pools.glm.members: no server named 'c' (servers: a, b)"),
    ('[pools.glm]\nmembers = ["a", "a"]\n', "config.toml:8: pools.glm.members: 'a' is listed twice"),
    ('[pools.a]\nmembers = ["b"]\n', "config.toml:7: pools.a: a pool and a server may not share a name: server 'a' exists"),
    ('[pools.glm]\nmembers = ["a"]\npolicy = "random"\n', "config.toml:9: pools.glm.policy: must be one of "
                                                           "round-robin, weighted, least-active, quota, got 'random'"),
    ('[pools.glm]\nmembers = ["a"]\naffinity = "sticky"\n', "config.toml:9: pools.glm.affinity: must be one of hard, soft, got 'sticky'"),
    ('[pools.glm]\nmembers = ["a"]\nweights = { a = 2 }\n',
     'config.toml:9: pools.glm.weights: weights are for policy = "weighted" (this pool is round-robin)'),
    ('[pools.glm]\nmembers = ["a"]\npolicy = "weighted"\nweights = { b = 2 }\n',
     "config.toml:10: pools.glm.weights.b: not a member of pool glm (members: a)"),
    ('[pools.glm]\nmembers = ["a"]\npolicy = "weighted"\nweights = { a = 0 }\n',
     "config.toml:10: pools.glm.weights.a: must be a whole number >= 1, not 0"),
    ('[pools.glm]\nmembers = ["a"]\nsize = 2\n', "config.toml:9: pools.glm.size: unknown key (known: members, policy, weights, affinity)"),
    ('[pools.glm]\nmembers = ["a"]\n[agents.pi]\nserver = "glmm"\n',
     "config.toml:10: agents.pi.server: no server named 'glmm' (servers: a, b; pools: glm)"),
]


@pytest.mark.parametrize("extra, message", ERRORS, ids=[e[1].split(": ", 2)[-1][:40] for e in ERRORS])
def test_errors_name_file_line_and_key(extra, message):
    with pytest.raises(ConfigError) as e:
        parse(BASE + extra, "/somewhere/config.toml")
    assert str(e.value).startswith(message), str(e.value)


SHARED = '''[servers.acct-1]
url = "https://api.z.ai/api/anthropic"
key_env = "Z1"
[servers.acct-2]
url = "https://api.z.ai/api/anthropic"
key_env = "Z2"
'''


def test_accounts_of_one_provider_share_its_url_only_as_keyed_members_of_one_pool():
    cfg = parse(SHARED + '[pools.zai]\nmembers = ["acct-1", "acct-2"]\n')
    source = cfg.server_for("https", "api.z.ai", 443, "/api/anthropic/v1/messages")
    assert source.name == "acct-1"
    # the agent's key is never taken for a member's: the target is not "the addressed server"
    assert allocate.addressed_as(cfg, source, "acct-1").name != "acct-1"
    assert allocate.addressed_as(cfg, source, "acct-2") is source
    with pytest.raises(ConfigError, match="same origin and prefix as server 'acct-1' .only members of one pool"):
        parse(SHARED + '[pools.zai]\nmembers = ["acct-1"]\n')
    with pytest.raises(ConfigError, match="same origin and prefix"):
        parse(SHARED.replace('key_env = "Z2"\n', "") + '[pools.zai]\nmembers = ["acct-1", "acct-2"]\n')
    lone = parse(BASE)
    assert allocate.addressed_as(lone, lone.servers["a"], "a") is lone.servers["a"]


def test_a_member_sharing_its_url_gets_its_own_key_even_when_the_url_resolves_to_it():
    from sessionpin.reader import facts as F
    from sessionpin.decision import rewrite
    from sessionpin.decision.ladder import Decision

    cfg = parse(SHARED + '[pools.zai]\nmembers = ["acct-1", "acct-2"]\n')
    source = cfg.server_for("https", "api.z.ai", 443, "/api/anthropic/v1/messages")
    view = rewrite.RequestView("https", "api.z.ai", 443, "/api/anthropic/v1/messages",
                               (("x-api-key", "the-agents-own"),), api=F.ANTHROPIC_MESSAGES)
    for target, key in (("acct-1", "k1"), ("acct-2", "k2")):
        c = rewrite.plan(Decision(target, "create", "opening", "x"), view,
                         allocate.addressed_as(cfg, source, target), cfg, {"Z1": "k1", "Z2": "k2"})
        assert c.refuse is None and c.path == "/api/anthropic/v1/messages"
        assert "x-api-key" in c.drop_headers and c.set_headers == (("x-api-key", key),)
