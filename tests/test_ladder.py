import pytest

from sessionpin.reader import facts as F
from sessionpin.decision import ladder
from sessionpin.config.config import parse
from sessionpin.records.pins import Pin

CONFIG = parse('''
[servers.anthropic]
url = "https://api.anthropic.com"
[servers.glm]
url = "https://api.z.ai/api/anthropic"
key_env = "ZAI_API_KEY"
[servers.zen]
url = "https://opencode.ai/zen"
[agents.claude-code]
server = "glm"
[agents.opencode]
server = "zen"
[agents.pi]
server = ""
''')
SRC = CONFIG.servers["anthropic"]


def facts(turn=F.OPENING, agent=F.CLAUDE_CODE, session="s-1", api=F.ANTHROPIC_MESSAGES, **kw):
    return F.Facts(api=api, agent=agent, session=session, turn=turn, **kw)


def pin(server, agent=F.CLAUDE_CODE):
    return Pin(agent=agent, server=server, since=1.0, renewed=1.0)


# (name, facts, pin, expected (target, pin_action, rule, refuse))
CASES = [
    # rule 1: a pin of the same agent decides, whatever the turn
    ("pin followed (opening)", facts(), pin("anthropic"), ("anthropic", "renew", "pinned", None)),
    ("pin followed (continuation)", facts(F.CONTINUATION, has_history=True), pin("glm"), ("glm", "renew", "pinned", None)),
    ("pin followed (side)", facts(F.SIDE), pin("anthropic"), ("anthropic", "renew", "pinned", None)),
    ("pin followed (subagent)", facts(F.SUBAGENT), pin("anthropic"), ("anthropic", "renew", "pinned", None)),
    ("pin followed (count_tokens)", facts(F.SIDE, api=F.ANTHROPIC_COUNT_TOKENS, has_history=True), pin("glm"), ("glm", "renew", "pinned", None)),
    ("pin followed (unknown turn)", facts(F.UNKNOWN_TURN), pin("glm"), ("glm", "renew", "pinned", None)),
    ("pin followed, body unreadable", facts(F.UNKNOWN_TURN, parsed=False), pin("glm"), ("glm", "renew", "pinned", None)),
    ("pin 'not routed' followed", facts(), pin(None), (None, "renew", "pinned-not-routed", None)),
    ("pinned server no longer configured", facts(F.CONTINUATION), pin("ete"), (None, "none", "pinned-server-gone", 424)),
    ("another agent's pin elsewhere: refused, not overwritten", facts(agent=F.OPENCODE), pin("glm"), (None, "none", "other-agent-pin", 424)),
    ("another agent's pin to the server it addresses: left alone", facts(agent=F.OPENCODE), pin("anthropic"), (None, "none", "other-agent-pin", None)),
    ("another agent's 'not routed' pin", facts(agent=F.OPENCODE), pin(None), (None, "none", "other-agent-pin", None)),
    # rule 2: the agent is not routed
    ("not routed: opening", facts(agent=F.PI), None, (None, "create", "not-routed", None)),
    ("not routed: continuation", facts(F.CONTINUATION, agent=F.PI), None, (None, "create", "not-routed", None)),
    ("not routed: unknown turn", facts(F.UNKNOWN_TURN, agent=F.CODEX), None, (None, "create", "not-routed", None)),
    ("not routed: side makes no pin", facts(F.SIDE, agent=F.PI), None, (None, "none", "side-not-routed", None)),
    # rule 3: opening turn
    ("opening turn", facts(), None, ("glm", "create", "opening", None)),
    ("opening turn (opencode)", facts(agent=F.OPENCODE, api=F.OPENAI_CHAT), None, ("zen", "create", "opening", None)),
    # rule 4: continuation never seen begin
    ("continuation unseen", facts(F.CONTINUATION, has_history=True), None, (None, "create", "continuation-unseen", None)),
    # rule 5: side requests and subagents never create a pin
    ("title before the opening turn", facts(F.SIDE), None, ("glm", "none", "side-current", None)),
    ("count_tokens before the opening turn", facts(F.SIDE, api=F.ANTHROPIC_COUNT_TOKENS), None, ("glm", "none", "side-current", None)),
    ("side request with history: unseen", facts(F.SIDE, has_history=True), None, (None, "none", "side-unseen", None)),
    ("subagent without a pin", facts(F.SUBAGENT), None, (None, "none", "subagent-unseen", None)),
    # rule 6: a turn that cannot be told
    ("unknown turn with a session", facts(F.UNKNOWN_TURN), None, ("glm", "create", "unknown-turn", None)),
    ("unknown turn, no session", facts(F.UNKNOWN_TURN, session=None), None, (None, "none", "no-session", None)),
    ("opening, no session", facts(session=None), None, (None, "none", "no-session", None)),
    ("empty session id", facts(session=""), None, (None, "none", "no-session", None)),
    # beyond the six rules
    ("unreadable body, no pin", facts(F.UNKNOWN_TURN, parsed=False, reason="bad json"), None, (None, "none", "unreadable", None)),
    ("unknown agent is never routed", facts(agent=F.UNKNOWN_AGENT), None, (None, "none", "unknown-agent", None)),
    ("unknown agent ignores pins", facts(agent=F.UNKNOWN_AGENT), pin("glm"), (None, "none", "unknown-agent", None)),
    ("non-inference api", facts(None, api=F.OTHER), pin("glm"), (None, "none", "out-of-scope", None)),
]


@pytest.mark.parametrize("f, p, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_ladder(f, p, expected):
    d = ladder.decide(f, p, CONFIG, SRC)
    assert (d.target, d.pin_action, d.rule, d.refuse) == expected
    assert d.why


def test_not_addressed_to_a_configured_server_without_a_pin_is_out_of_scope():
    d = ladder.decide(facts(), None, CONFIG, None)
    assert (d.target, d.pin_action, d.rule) == (None, "none", "out-of-scope")


@pytest.mark.parametrize("p, want", [
    (pin("glm"), ("glm", "renew", "pinned", None)),
    (pin(None), (None, "renew", "pinned-not-routed", None)),
    (pin("gone"), (None, "none", "pinned-server-gone", 424)),
])
def test_a_pin_decides_wherever_the_request_was_addressed(p, want):
    # the addressed server was removed from the config, or the config emptied: the pin
    # still decides (issue 10), it never falls back to the addressed origin
    d = ladder.decide(facts(F.CONTINUATION, has_history=True), p, CONFIG, None)
    assert (d.target, d.pin_action, d.rule, d.refuse) == want


@pytest.mark.parametrize("at, want", [
    ("https://api.z.ai", ("glm", "renew", "pinned", None)),            # where it began
    ("", ("glm", "renew", "pinned", None)),                            # a pin made before pins recorded it
    ("https://other.example", (None, "none", "pinned-server-moved", 424)),
    ("https://api.z.ai:8443", (None, "none", "pinned-server-moved", 424)),   # another port is another server
    ("http://api.z.ai", (None, "none", "pinned-server-moved", 424)),
])
def test_a_pinned_server_re_pointed_to_another_host_is_refused(at, want):
    # A pin names a server; the name re-pointed to another host (an edit, a name reused, another
    # proxy's config) is not the server the conversation began on: refused, never followed.
    p = Pin(agent=F.CLAUDE_CODE, server="glm", since=1.0, renewed=1.0, at=at)
    d = ladder.decide(facts(F.CONTINUATION, has_history=True), p, CONFIG, SRC)
    assert (d.target, d.pin_action, d.rule, d.refuse) == want
    assert ladder.moved(p, CONFIG) == (want[2] == "pinned-server-moved")


def test_another_agent_s_pin_to_the_addressed_server_re_pointed_since_is_refused():
    # left alone only when the pin names the server it addresses *as it was*: the name now at
    # another host, the request would take the conversation there
    p = Pin(agent=F.OPENCODE, server="anthropic", since=1.0, renewed=1.0, at="https://old.example")
    d = ladder.decide(facts(F.CONTINUATION, has_history=True), p, CONFIG, SRC)
    assert (d.target, d.pin_action, d.rule, d.refuse) == (None, "none", "other-agent-pin", 424)
    p = Pin(agent=F.OPENCODE, server="anthropic", since=1.0, renewed=1.0, at="https://api.anthropic.com")
    d = ladder.decide(facts(F.CONTINUATION, has_history=True), p, CONFIG, SRC)
    assert (d.target, d.rule, d.refuse) == (None, "other-agent-pin", None)


def test_a_prefix_changed_at_the_same_origin_is_the_same_server():
    cfg = parse('''
[servers.glm]
url = "https://api.z.ai/api/coding/paas/v4"
''')
    p = Pin(agent=F.CLAUDE_CODE, server="glm", since=1.0, renewed=1.0, at="https://api.z.ai")
    assert ladder.decide(facts(F.CONTINUATION, has_history=True), p, cfg, None).rule == "pinned"


def test_a_fork_of_a_conversation_whose_server_was_re_pointed_is_refused():
    parent = Pin(agent=F.CLAUDE_CODE, server="glm", since=1.0, renewed=1.0, at="https://old.example")
    d = ladder.decide(facts(F.CONTINUATION, has_history=True, session="s-2"), None, CONFIG, SRC, parent=parent)
    assert (d.target, d.pin_action, d.rule, d.refuse) == (None, "none", "fork-of-moved", 424)
    same = Pin(agent=F.CLAUDE_CODE, server="glm", since=1.0, renewed=1.0, at="https://api.z.ai")
    d = ladder.decide(facts(F.CONTINUATION, has_history=True, session="s-2"), None, CONFIG, SRC, parent=same)
    assert (d.target, d.rule) == ("glm", "fork")


def test_current_server_change_moves_only_new_conversations():
    moved = parse(CONFIG_TEXT_SWITCHED)
    running = ladder.decide(facts(F.CONTINUATION, has_history=True), pin("glm"), moved, SRC)
    new = ladder.decide(facts(session="s-2"), None, moved, SRC)
    assert running.target == "glm" and new.target == "anthropic"


CONFIG_TEXT_SWITCHED = '''
[servers.anthropic]
url = "https://api.anthropic.com"
[servers.glm]
url = "https://api.z.ai/api/anthropic"
[agents.claude-code]
server = "anthropic"
'''


def test_outcomes():
    assert ladder.decide(facts(), None, CONFIG, SRC).outcome == ladder.ROUTED
    assert ladder.decide(facts(F.CONTINUATION), None, CONFIG, SRC).outcome == ladder.LEFT_ALONE
    assert ladder.decide(facts(), pin("gone"), CONFIG, SRC).outcome == ladder.REFUSED


def test_the_ladder_never_targets_an_unconfigured_server():
    # every combination of turn / history / pin / routing lands on a configured server or nowhere
    for turn in (F.OPENING, F.CONTINUATION, F.SIDE, F.SUBAGENT, F.UNKNOWN_TURN, None):
        for hist in (False, True):
            for p in (None, pin("glm"), pin(None), pin("gone"), pin("glm", agent=F.PI)):
                for agent in (*F.AGENTS, F.UNKNOWN_AGENT):
                    d = ladder.decide(facts(turn, agent=agent, has_history=hist), p, CONFIG, SRC)
                    assert d.target is None or d.target in CONFIG.servers
                    if d.pin_action == "create":
                        assert p is None and turn not in (F.SIDE, F.SUBAGENT)
                    if p is not None and p.agent != agent:
                        assert d.pin_action == "none" and d.target is None


# rule 5's one exception: opencode's title-shaped opening (title_went, facts, pin) -> (target, rule)
OC = dict(agent=F.OPENCODE, api=F.OPENAI_CHAT)


@pytest.mark.parametrize("title_went, f, p, want", [
    ("zen", facts(F.CONTINUATION, has_history=True, **OC), None, ("zen", "continuation-after-title")),
    ("glm", facts(F.CONTINUATION, has_history=True, **OC), None, ("glm", "continuation-after-title")),  # config switched since
    ("gone", facts(F.CONTINUATION, has_history=True, **OC), None, (None, "continuation-unseen")),      # removed: no guess
    ("zen", facts(F.CONTINUATION, has_history=True, **OC), pin(None, agent=F.OPENCODE), (None, "pinned-not-routed")),
    (None, facts(F.CONTINUATION, has_history=True, **OC), None, (None, "continuation-unseen")),
    # no other agent's side request adopts a conversation (a resumed Claude Code session's count_tokens)
    ("glm", facts(F.CONTINUATION, has_history=True), None, (None, "continuation-unseen")),
    ("glm", facts(F.CONTINUATION, has_history=True, agent=F.CODEX, api=F.OPENAI_RESPONSES), None,
     (None, "not-routed")),
    # side requests and subagents never follow memory: with history they are left alone
    ("zen", facts(F.SIDE, has_history=True, **OC), None, (None, "side-unseen")),
    ("zen", facts(F.SUBAGENT, **OC), None, (None, "subagent-unseen")),
])
def test_only_an_opencode_title_makes_a_continuation_an_opening(title_went, f, p, want):
    d = ladder.decide(f, p, CONFIG, SRC, title_went)
    assert (d.target, d.rule) == want
    if f.turn == F.SIDE:
        assert d.pin_action != ladder.CREATE, "a side request never makes a pin"


@pytest.mark.parametrize("f, shaped", [
    (facts(F.SIDE, **OC), True),
    (facts(F.SIDE, has_tools=True, **OC), False),
    (facts(F.SIDE, has_history=True, **OC), False),
    (facts(F.SIDE, agent=F.OPENCODE, api=F.ANTHROPIC_COUNT_TOKENS), False),
    (facts(F.SIDE), False),
    (facts(F.OPENING, **OC), False),
])
def test_title_shaped(f, shaped):
    assert ladder.is_title_shaped(f) is shaped


def test_an_unknown_turn_with_history_is_a_conversation_never_seen_begin():
    # Rule 6 routes a turn it cannot tell — but history says a conversation is under way,
    # and pinning it to the current server would move it.
    d = ladder.decide(facts(F.UNKNOWN_TURN, has_history=True), None, CONFIG, SRC)
    assert (d.target, d.pin_action, d.rule) == (None, ladder.CREATE, "unknown-turn-unseen")
    d = ladder.decide(facts(F.UNKNOWN_TURN), None, CONFIG, SRC)
    assert (d.target, d.pin_action, d.rule) == ("glm", ladder.CREATE, "unknown-turn")


def test_rule_ids_are_a_named_set_of_stable_strings():
    # rule ids are stored (a pin's rule), exported (metrics labels) and shown (flow
    # metadata): a rename is a change of format, so the set is spelled out here
    from sessionpin.decision.ladder import Rule
    assert {r.value for r in Rule} == {
        "out-of-scope", "unknown-agent", "no-session", "other-agent-pin", "pinned-not-routed",
        "pinned-server-gone", "pinned", "fork-not-routed", "fork-of-gone", "fork", "unreadable",
        "pinned-server-moved", "fork-of-moved",
        "side-unseen", "side-not-routed", "side-current", "subagent-unseen", "not-routed", "opening",
        "continuation-after-title", "continuation-unseen", "unknown-turn-unseen", "unknown-turn",
        "soft-move", "store-unreadable", "unnamed-path"}
    assert Rule.OPENING == "opening" and f"{Rule.SOFT_MOVE}" == "soft-move"   # a pin written before compares equal
