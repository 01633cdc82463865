"""The request stepper: every transition a table row, and the side-memory property."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessionpin.reader import facts as F
from sessionpin.records import pins
from sessionpin.decision import route
from sessionpin.config.config import parse
from sessionpin.lineage.lineage import Signals
from sessionpin.records.pins import Loaded, Pin
from sessionpin.decision.rewrite import Changes

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
[agents.codex]
server = "glm"
[agents.pi]
server = "glm"
''')
ANTHROPIC = CONFIG.servers["anthropic"]
NOW = 1_800_000_000.0
OK = Changes("https", "api.z.ai", 443, "/api/anthropic/v1/messages")


def facts(turn=F.OPENING, agent=F.CLAUDE_CODE, session="s-1", api=F.ANTHROPIC_MESSAGES, **kw):
    return F.Facts(api=api, agent=agent, session=session, turn=turn, **kw)


def request(f=None, source=ANTHROPIC, config=CONFIG, host="", port=0):
    return route.Request(facts=f or facts(), source=source, config=config, now=NOW, host=host, port=port)


def loaded(server, agent=F.CLAUDE_CODE, renewed=NOW - 60):
    p = Pin(agent=agent, server=server, since=renewed, renewed=renewed)
    return Loaded(p, pins.encode(p))


NONE = Loaded(None, None)


def answerer(*, pin=NONE, title=None, plan=OK, create=None, read_fails=False, signals=None, root=None,
             parent=None, conversation=None, apart=(), pins_by_session=None, unreachable=None, instead=None):
    """How the shell answers each effect, as told (``instead``: an effect's name -> the event
    its first performance gets in place of the usual answer)."""
    instead = dict(instead or {})

    def answer(e):
        if type(e).__name__ in instead:
            return instead.pop(type(e).__name__)
        if isinstance(e, route.ReadPin):
            got = (pins_by_session or {}).get(e.session, pin)
            return route.StoreFailed("file:x: disk I/O error") if read_fails else route.PinRead(got)
        if isinstance(e, route.ReadLineage):
            return route.LineageRead(signals or Signals(), root)
        if isinstance(e, route.FindConversation):
            return route.ConversationFound(conversation, apart)
        if isinstance(e, route.FindParent):
            assert e.session != (parent or (None,))[0]
            return route.ParentFound(*parent) if parent else route.ParentFound(None)
        if isinstance(e, route.ReadTitle):
            return route.TitleRead(title)
        if isinstance(e, route.Plan):
            return route.Planned(plan)
        if isinstance(e, route.CreatePin):
            return create if create is not None else route.PinCreated()
        if isinstance(e, route.CheckReachable):
            return route.Reachable(unreachable)
        raise AssertionError(e)  # pragma: no cover
    return answer


def run(req, answer):
    """Run the stepper to its end; return (effects performed, moves made, last step)."""
    s = route.begin(req)
    seen, moves = [], [(route.START, "Request", s.state.phase)]
    while not s.done:
        seen.append(type(s.effect).__name__)
        ev = answer(s.effect)
        before = s.state.phase
        s = route.step(s.state, ev)
        moves.append((before, type(ev).__name__, s.state.phase))
    return seen, moves, s


def drive(req, **answers):
    """Run the stepper to its end, answering each effect as told; return (effects, last step)."""
    seen, _, s = run(req, answerer(**answers))
    return seen, s


def outcome(s):
    e = s.effect
    name = type(e).__name__
    return (name, getattr(e, "status", None), s.state.decision.rule if s.state.decision else None,
            tuple(type(a).__name__ for a in s.after))


CASES = [
    # (name, request, answers, effects performed, outcome)
    ("not inference", request(facts(None, api=F.OTHER)), {}, [], ("Leave", None, "out-of-scope", ())),
    ("no session", request(facts(session=None)), {}, [], ("Leave", None, "no-session", ())),
    ("opening: plan, pin durably, forward", request(), {},
     ["ReadPin", "Plan", "CreatePin", "CheckReachable"], ("Forward", None, "opening", ())),
    ("opening: pin not saved -> 503, never forwarded", request(), {"create": route.NotSaved("locked")},
     ["ReadPin", "Plan", "CreatePin"], ("Refuse", 503, "opening", ())),
    ("opening to the server it addresses: pin not saved, still sent (it stays put)",
     request(config=parse(CONFIG_TEXT := '''
[servers.anthropic]
url = "https://api.anthropic.com"
[agents.claude-code]
server = "anthropic"
''')), {"create": route.NotSaved("locked")}, ["ReadPin", "Plan", "CreatePin", "CheckReachable"], ("Forward", None, "opening", ())),
    ("opening: another proxy pinned it first -> its pin decides", request(),
     {"create": route.PinLost(loaded("anthropic"))},
     ["ReadPin", "Plan", "CreatePin", "Plan", "CheckReachable"], ("Forward", None, "pinned", ())),
    ("opening: another proxy pinned it 'not routed' -> left alone", request(),
     {"create": route.PinLost(loaded(None))}, ["ReadPin", "Plan", "CreatePin"], ("Leave", None, "pinned-not-routed", ())),
    ("opening: rewrite refused -> 502, no pin", request(), {"plan": Changes("https", "h", 443, "/", refuse="no key")},
     ["ReadPin", "Plan"], ("Refuse", 502, "opening", ())),
    ("pin read fails -> 424 (no client retries it), never 'no pin'", request(facts(F.CONTINUATION, has_history=True)),
     {"read_fails": True}, ["ReadPin"], ("Refuse", 424, None, ())),
    ("pinned: forward, no renewal due", request(facts(F.CONTINUATION, has_history=True)), {"pin": loaded("glm")},
     ["ReadPin", "Plan", "CheckReachable"], ("Forward", None, "pinned", ())),
    ("pinned: renewal due runs after", request(facts(F.CONTINUATION, has_history=True)),
     {"pin": loaded("glm", renewed=NOW - 2 * pins.DAY)}, ["ReadPin", "Plan", "CheckReachable"], ("Forward", None, "pinned", ("RenewPin",))),
    ("pinned, origin not configured: still follows its pin", request(facts(F.CONTINUATION), source=None),
     {"pin": loaded("glm")}, ["ReadPin", "Plan", "CheckReachable"], ("Forward", None, "pinned", ())),
    ("no pin, origin not configured: out of scope", request(source=None), {}, ["ReadPin"], ("Leave", None, "out-of-scope", ())),
    ("pinned server gone -> 424 (no client retries it)", request(facts(F.CONTINUATION)), {"pin": loaded("ete")},
     ["ReadPin"], ("Refuse", 424, "pinned-server-gone", ())),
    ("not routed pin renewed after", request(facts(F.CONTINUATION)), {"pin": loaded(None, renewed=NOW - 3 * pins.DAY)},
     ["ReadPin"], ("Leave", None, "pinned-not-routed", ("RenewPin",))),
    ("continuation unseen: left alone, 'not routed' written after", request(facts(F.CONTINUATION, has_history=True)), {},
     ["ReadPin", "ReadLineage", "FindParent"], ("Leave", None, "continuation-unseen", ("WritePin",))),
    # rule 7: a fork (a new id carrying its parent's history) follows its parent
    ("fork of a pinned conversation: parent's server, pinned durably",
     request(facts(F.CONTINUATION, session="fork-1", has_history=True)), {"parent": ("s-1", loaded("anthropic"))},
     ["ReadPin", "ReadLineage", "FindParent", "Plan", "CreatePin", "CheckReachable"], ("Forward", None, "fork", ())),
    ("fork of a 'not routed' conversation: not routed",
     request(facts(F.CONTINUATION, session="fork-1", has_history=True)), {"parent": ("s-1", loaded(None))},
     ["ReadPin", "ReadLineage", "FindParent"], ("Leave", None, "fork-not-routed", ("WritePin",))),
    ("fork of a conversation pinned to a removed server: its 424",
     request(facts(F.CONTINUATION, session="fork-1", has_history=True)), {"parent": ("s-1", loaded("ete"))},
     ["ReadPin", "ReadLineage", "FindParent"], ("Refuse", 424, "fork-of-gone", ())),
    ("a parent of another agent is not followed",
     request(facts(F.CONTINUATION, session="fork-1", has_history=True)),
     {"parent": ("s-1", loaded("anthropic", agent=F.OPENCODE))},
     ["ReadPin", "ReadLineage", "FindParent"], ("Leave", None, "continuation-unseen", ("WritePin",))),
    ("an opening never looks for a parent", request(facts(session="fork-1")), {"parent": ("s-1", loaded("anthropic"))},
     ["ReadPin", "Plan", "CreatePin", "CheckReachable"], ("Forward", None, "opening", ())),
    # pi, named by a fingerprint of its opening: an opening is a new conversation; a later
    # turn is the conversation whose root its history extends
    ("pi opening: a new conversation (fingerprint + nonce), never the fingerprint's pin",
     route.Request(facts=facts(agent=F.PI, session="fp:abc", session_source="fingerprint"), source=ANTHROPIC,
                   config=CONFIG, now=NOW, nonce="n2"), {"pins_by_session": {"fp:abc": loaded("anthropic", agent=F.PI)}},
     ["ReadPin", "Plan", "CreatePin", "CheckReachable"], ("Forward", None, "opening", ("RememberOpening",))),
    ("pi turn: its conversation found by the root, pinned there",
     request(facts(F.CONTINUATION, agent=F.PI, session="fp:abc", session_source="fingerprint", has_history=True)),
     {"root": "r1", "conversation": "fp:abc.n1", "pins_by_session": {"fp:abc.n1": loaded("anthropic", agent=F.PI)}},
     ["ReadLineage", "FindConversation", "ReadPin", "Plan", "CheckReachable"], ("Forward", None, "pinned", ())),
    ("pi turn, root unknown: an older pin of the fingerprint alone",
     request(facts(F.CONTINUATION, agent=F.PI, session="fp:abc", session_source="fingerprint", has_history=True)),
     {"root": "r1", "pins_by_session": {"fp:abc": loaded("glm", agent=F.PI)}},
     ["ReadLineage", "FindConversation", "ReadPin", "Plan", "CheckReachable"], ("Forward", None, "pinned", ())),
    ("pi turn, nothing known: left alone, no pin written for a fingerprint",
     request(facts(F.CONTINUATION, agent=F.PI, session="fp:abc", session_source="fingerprint", has_history=True)),
     {"root": "r1"}, ["ReadLineage", "FindConversation", "ReadPin"], ("Leave", None, "continuation-unseen", ())),
    ("pi turn with no first answer in its history: found by its opening",
     request(facts(F.CONTINUATION, agent=F.PI, session="fp:abc", session_source="fingerprint", has_history=True)),
     {"conversation": "fp:abc.n1", "pins_by_session": {"fp:abc.n1": loaded("glm", agent=F.PI)}},
     ["ReadLineage", "FindConversation", "ReadPin", "Plan", "CheckReachable"], ("Forward", None, "pinned", ())),
    ("claude count_tokens, no pin: current server, not remembered",
     request(facts(F.SIDE, api=F.ANTHROPIC_COUNT_TOKENS)), {}, ["ReadPin", "Plan", "CheckReachable"], ("Forward", None, "side-current", ())),
    ("claude continuation: no title memory read", request(facts(F.CONTINUATION, has_history=True)), {"title": "glm"},
     ["ReadPin", "ReadLineage", "FindParent"], ("Leave", None, "continuation-unseen", ("WritePin",))),
    ("opencode title: current server, remembered", request(facts(F.SIDE, agent=F.OPENCODE, api=F.OPENAI_CHAT)), {},
     ["ReadPin", "Plan", "CheckReachable"], ("Forward", None, "side-current", ("RememberTitle",))),
    ("opencode side with tools: not remembered",
     request(facts(F.SIDE, agent=F.OPENCODE, api=F.OPENAI_CHAT, has_tools=True)), {},
     ["ReadPin", "Plan", "CheckReachable"], ("Forward", None, "side-current", ())),
    ("opencode continuation after its title: follows and pins",
     request(facts(F.CONTINUATION, agent=F.OPENCODE, api=F.OPENAI_CHAT, has_history=True)), {"title": "zen"},
     ["ReadPin", "ReadLineage", "FindParent", "ReadTitle", "Plan", "CreatePin", "CheckReachable"],
     ("Forward", None, "continuation-after-title", ())),
    ("opencode continuation, no title remembered: left alone",
     request(facts(F.CONTINUATION, agent=F.OPENCODE, api=F.OPENAI_CHAT, has_history=True)), {},
     ["ReadPin", "ReadLineage", "FindParent", "ReadTitle"], ("Leave", None, "continuation-unseen", ("WritePin",))),
    ("opencode fork: follows its parent, the title memory not read",
     request(facts(F.CONTINUATION, agent=F.OPENCODE, api=F.OPENAI_CHAT, has_history=True)),
     {"title": "glm", "parent": ("ses_p", loaded("zen", agent=F.OPENCODE))},
     ["ReadPin", "ReadLineage", "FindParent", "Plan", "CreatePin", "CheckReachable"], ("Forward", None, "fork", ())),
]


@pytest.mark.parametrize("req, answers, effects, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_transitions(req, answers, effects, expected):
    seen, last = drive(req, **answers)
    assert seen == effects
    assert outcome(last) == expected


def test_a_pi_opening_gets_its_own_id_and_a_fork_names_its_parent():
    req = route.Request(facts=facts(agent=F.PI, session="fp:abc", session_source="fingerprint"), source=ANTHROPIC,
                        config=CONFIG, now=NOW, nonce="n2")
    s = route.begin(req)
    assert s.effect == route.ReadPin("fp:abc.n2")
    s = route.step(s.state, route.PinRead(NONE))
    s = route.step(s.state, route.Planned(OK))
    assert isinstance(s.effect, route.CreatePin) and s.effect.session == "fp:abc.n2"
    _, s = drive(request(facts(F.CONTINUATION, session="fork-1", has_history=True)), parent=("s-1", loaded("anthropic")))
    assert s.state.session == "fork-1" and s.state.parent == "s-1"
    s2 = route.begin(request(facts(F.CONTINUATION, session="fork-1", has_history=True)))
    s2 = route.step(s2.state, route.PinRead(NONE))
    s2 = route.step(s2.state, route.LineageRead(Signals(sessions=("p",), anchors=("req:r",)), "root1"))
    assert s2.effect == route.FindParent("claude-code", "fork-1", ("p",), ("req:r",), "root1")
    s2 = route.step(s2.state, route.ParentFound("p", loaded("anthropic")))
    s2 = route.step(s2.state, route.Planned(Changes("https", "api.anthropic.com", 443, "/v1/messages")))
    assert isinstance(s2.effect, route.CreatePin) and s2.effect.pin.parent == "p" and s2.effect.pin.rule == "fork"


def test_a_pi_turn_of_conversations_begun_alike_and_pinned_apart_is_refused_naming_them():
    """Its root not known, the opening names two conversations pinned to different servers: it
    could continue either. Before, it went to the latest one's pin (moving the other); now it
    is refused, nothing pinned, nothing after it."""
    pi = facts(F.CONTINUATION, agent=F.PI, session="fp:0123abcd", session_source="fingerprint", has_history=True)
    seen, s = drive(request(pi), root="r1", apart=(("fp:0123abcd.bbbbbbbb", "alt"), ("fp:0123abcd.aaaaaaaa", "glm")))
    assert seen == ["ReadLineage", "FindConversation"]
    assert isinstance(s.effect, route.Refuse) and s.effect.status == 424 and s.effect.kind == "lineage-apart"
    assert s.effect.retry_after is None and s.after == ()
    msg = s.effect.message
    assert "cannot tell" in msg and "alt" in msg and "glm" in msg and "sessionpin move" in msg
    _, s = drive(request(pi), root="r1", conversation="fp:0123abcd.aaaaaaaa", pins_by_session={
        "fp:0123abcd.aaaaaaaa": loaded("glm", agent=F.PI)})                     # told: its pin decides
    assert s.state.session == "fp:0123abcd.aaaaaaaa" and s.state.decision.rule == "pinned"


def unnamed(f=None, source=ANTHROPIC, endpoint="/chat/completions", path="/chat/completions"):
    """A request at a path sessionpin does not route that ends with ``endpoint``."""
    return route.Request(facts=f or facts(F.CONTINUATION, has_history=True), source=source, config=CONFIG,
                         now=NOW, scheme="https", host="api.anthropic.com", port=443, path=path, unnamed=endpoint)


@pytest.mark.parametrize("name, req, answers, effects, expected", [
    ("pinned to another server: refused, never sent where it was addressed",
     unnamed(), {"pin": loaded("glm")}, ["ReadPin"], ("Refuse", 424, "unnamed-path", ())),
    ("pinned to the server it addresses: left alone, nothing renewed",
     unnamed(), {"pin": loaded("anthropic")}, ["ReadPin"], ("Leave", None, "unnamed-path", ())),
    ("pinned not routed: left alone", unnamed(), {"pin": loaded(None)}, ["ReadPin"],
     ("Leave", None, "unnamed-path", ())),
    ("no pin, no parent: left alone, nothing pinned", unnamed(), {}, ["ReadPin", "ReadLineage", "FindParent"],
     ("Leave", None, "unnamed-path", ())),
    ("an opening: left alone, nothing pinned (it is never moved from here)", unnamed(facts()), {}, ["ReadPin"],
     ("Leave", None, "unnamed-path", ())),
    ("a side request of a conversation pinned elsewhere: refused", unnamed(facts(F.SIDE)), {"pin": loaded("glm")},
     ["ReadPin"], ("Refuse", 424, "unnamed-path", ())),
    ("a fork of a conversation pinned elsewhere: refused",
     unnamed(facts(F.CONTINUATION, session="fork-1", has_history=True)), {"parent": ("s-1", loaded("glm"))},
     ["ReadPin", "ReadLineage", "FindParent"], ("Refuse", 424, "unnamed-path", ())),
    ("at an origin no longer configured, pinned anywhere: refused", unnamed(source=None), {"pin": loaded("anthropic")},
     ["ReadPin"], ("Refuse", 424, "unnamed-path", ())),
    ("a pi opening keyed by its fingerprint: left alone, no pin read",
     unnamed(facts(agent=F.PI, session="fp:abc", session_source="fingerprint")), {}, [],
     ("Leave", None, "unnamed-path", ())),
    ("a pi turn of a conversation pinned elsewhere: refused",
     unnamed(facts(F.CONTINUATION, agent=F.PI, session="fp:abc", session_source="fingerprint", has_history=True)),
     {"conversation": "fp:abc.n1", "pin": loaded("glm", agent=F.PI)},
     ["ReadLineage", "FindConversation", "ReadPin"], ("Refuse", 424, "unnamed-path", ())),
    ("an opencode continuation: the title memory is not read", unnamed(OC := facts(
        F.CONTINUATION, agent=F.OPENCODE, api=F.OPENAI_CHAT, has_history=True)), {"title": "zen"},
     ["ReadPin", "ReadLineage", "FindParent"], ("Leave", None, "unnamed-path", ())),
    ("pinned to the server it addresses, the name re-pointed since: refused", unnamed(),
     {"pin": Loaded(p := Pin(agent=F.CLAUDE_CODE, server="anthropic", since=NOW, renewed=NOW,
                             at="https://old.example"), pins.encode(p))},
     ["ReadPin"], ("Refuse", 424, "unnamed-path", ())),
    ("pinned to the server it addresses, where it began: left alone", unnamed(),
     {"pin": Loaded(p := Pin(agent=F.CLAUDE_CODE, server="anthropic", since=NOW, renewed=NOW,
                             at="https://api.anthropic.com"), pins.encode(p))},
     ["ReadPin"], ("Leave", None, "unnamed-path", ())),
    ("a store that cannot be read: refused, never 'no pin'", unnamed(), {"read_fails": True}, ["ReadPin"],
     ("Refuse", 424, None, ())),
])
def test_a_request_at_a_path_sessionpin_does_not_route_is_only_guarded(name, req, answers, effects, expected):
    """It goes where it was addressed, as if the router were not there — unless its
    conversation is pinned to another server, which that server's path must not escape."""
    seen, last = drive(req, **answers)
    assert seen == effects
    assert outcome(last) == expected
    assert not any(isinstance(a, (route.WritePin, route.RenewPin, route.RememberTitle)) for a in last.after)


def test_the_guards_refusal_names_the_session_the_server_and_what_to_do():
    _, s = drive(unnamed(path="/chat/completions?x=1"), pin=loaded("glm"))
    m = s.effect.message
    assert "s-1" in m and "'glm'" in m and "/chat/completions" in m and "?x=1" not in m
    assert "server anthropic" in m and "base URL" in m and s.effect.retry_after is None


def test_refusals_say_what_to_do():
    _, s = drive(request(), create=route.NotSaved("database is locked"))
    assert s.effect.retry_after == route.RETRY_AFTER
    assert "s-1" in s.effect.message and "glm" in s.effect.message and "database is locked" in s.effect.message
    _, s = drive(request(facts(F.CONTINUATION)), read_fails=True)
    # a store that cannot be read: no retry signal (the shell rode out a blip first), what to do
    assert s.effect.kind == "store" and s.effect.retry_after is None and "disk I/O error" in s.effect.message
    assert s.effect.status == 424 and "once the store is back" in s.effect.message
    _, s = drive(request(facts(F.CONTINUATION)), pin=loaded("ete"))
    assert s.effect.retry_after is None and "'ete'" in s.effect.message


def test_a_new_pin_records_where_its_server_is():
    # the address ladder.moved compares a pin with: a server name re-pointed elsewhere later
    made = []
    def create(e):
        made.append(e.pin)
        return route.PinCreated()
    seen, _, s = run(request(), lambda e: create(e) if isinstance(e, route.CreatePin) else answerer()(e))
    assert made and made[0].server == "glm" and made[0].at == "https://api.z.ai"
    assert pins.decode(pins.encode(made[0])).at == "https://api.z.ai"
    old = pins.decode('{"agent":"claude-code","server":"glm","since":1,"renewed":1}')
    assert old is not None and old.at == ""          # a pin made before: read, not compared


def test_a_re_pointed_server_is_refused_naming_both_addresses_and_the_way_out():
    p = Pin(agent=F.CLAUDE_CODE, server="glm", since=NOW - 60, renewed=NOW - 60, at="https://old.example:8443")
    seen, s = drive(request(facts(F.CONTINUATION, has_history=True)), pin=Loaded(p, pins.encode(p)))
    assert seen == ["ReadPin"]
    e = s.effect
    assert (type(e).__name__, e.status, e.kind, e.retry_after) == ("Refuse", 424, "pinned-server-moved", None)
    m = e.message
    assert "s-1" in m and "'glm'" in m and "https://old.example:8443" in m and "https://api.z.ai" in m
    assert "sessionpin move s-1 glm" in m


def test_a_refusal_only_the_operator_can_lift_is_the_no_retry_answer_naming_the_session():
    no_key = Changes("https", "api.z.ai", 443, "/x", refuse="server glm: ZAI_API_KEY is not set", operator=True)
    seen, s = drive(request(facts(F.CONTINUATION, has_history=True)), pin=loaded("glm"), plan=no_key)
    e = s.effect
    assert (type(e).__name__, e.status, e.kind, e.retry_after) == ("Refuse", 424, "no-key", None)
    assert "session s-1" in e.message and "ZAI_API_KEY" in e.message and "stays pinned to glm" in e.message
    seen, s = drive(request(), plan=no_key)                 # an opening: nothing pinned
    assert s.effect.status == 424 and "CreatePin" not in seen and "stays pinned" not in s.effect.message
    other = Changes("https", "api.z.ai", 443, "/x", refuse="model not found")
    _, s = drive(request(facts(F.CONTINUATION, has_history=True)), pin=loaded("glm"), plan=other)
    assert (s.effect.status, s.effect.kind) == (502, "rewrite")  # the request's own: as before


def test_a_store_that_lost_what_it_held_is_a_refusal_never_no_pin():
    s = route.begin(request(facts(F.CONTINUATION, has_history=True)))
    s = route.step(s.state, route.StoreLost("store file:x lost what it held: run `sessionpin store accept-loss`"))
    assert s.done and isinstance(s.effect, route.Refuse) and s.effect.status == route.NO_RETRY_STATUS
    assert s.effect.retry_after is None   # no agent's retry can help: the operator decides
    assert s.effect.kind == "store-lost" and "accept-loss" in s.effect.message and "s-1" in s.effect.message
    assert s.after == ()                # no "not routed" pin written over the loss


def test_create_compares_against_what_was_read():
    garbage = Loaded(None, "{not a pin")
    s = route.begin(request())
    s = route.step(s.state, route.PinRead(garbage))
    s = route.step(s.state, route.Planned(OK))
    assert isinstance(s.effect, route.CreatePin) and s.effect.seen == garbage
    assert s.effect.pin.server == "glm" and s.effect.pin.rule == "opening" and s.effect.pin.since == NOW


def test_a_second_lost_race_refuses_instead_of_looping():
    s = route.begin(request())
    s = route.step(s.state, route.PinRead(NONE))
    s = route.step(s.state, route.Planned(OK))
    s = route.step(s.state, route.PinLost(Loaded(None, "garbage again")))
    assert isinstance(s.effect, route.Plan)
    s = route.step(s.state, route.Planned(OK))
    assert isinstance(s.effect, route.CreatePin)
    s = route.step(s.state, route.PinLost(Loaded(None, "and again")))
    assert isinstance(s.effect, route.Refuse) and s.effect.status == 503


# ---- the property: no pin and history => left alone (but for opencode's title rule) ----

AGENTS = st.sampled_from(F.AGENTS + (F.UNKNOWN_AGENT,))
TURNS = st.sampled_from([F.OPENING, F.CONTINUATION, F.SIDE, F.SUBAGENT, F.UNKNOWN_TURN])
APIS = st.sampled_from(sorted(F.INFERENCE_APIS))
MEMORY = st.sampled_from([None, "glm", "zen", "anthropic", "gone"])


@given(agent=AGENTS, turn=TURNS, api=APIS, title=MEMORY, tools=st.booleans(), parsed=st.booleans(),
       source=st.sampled_from([ANTHROPIC, CONFIG.servers["zen"], None]))
def test_no_pin_and_history_is_left_alone(agent, turn, api, title, tools, parsed, source):
    f = facts(turn, agent=agent, api=api, has_history=True, has_tools=tools, parsed=parsed)
    seen, s = drive(request(f, source=source), title=title)   # no parent known (rule 7 aside)
    if agent == F.OPENCODE and turn == F.CONTINUATION and parsed and title in CONFIG.servers and source:
        # rule 5's one exception: opencode's title-shaped opening went there moments ago
        assert s.state.decision.rule == "continuation-after-title"
        return
    assert isinstance(s.effect, route.Leave), (seen, s.state.decision)
    assert "CreatePin" not in seen


@given(agent=AGENTS, turn=TURNS, api=APIS, tools=st.booleans(), history=st.booleans())
def test_only_opencode_titles_are_remembered(agent, turn, api, tools, history):
    f = facts(turn, agent=agent, api=api, has_history=history, has_tools=tools)
    _, s = drive(request(f))
    remembered = [a for a in s.after if isinstance(a, route.RememberTitle)]
    if remembered:
        assert agent == F.OPENCODE and turn == F.SIDE and not tools and not history
        assert api != F.ANTHROPIC_COUNT_TOKENS


# ---- the table: every row of route.TRANSITIONS walked by a request that makes that move ----

import test_route_pools as pools  # noqa: E402  (server pools' config and answers)

P = route.Phase
FAILED = route.StoreFailed("file:x: disk I/O error")
LOST = route.StoreLost("store file:x lost what it held: run `sessionpin store accept-loss`")
CONT = facts(F.CONTINUATION, has_history=True)
PI_TURN = facts(F.CONTINUATION, agent=F.PI, session="fp:abc", session_source="fingerprint", has_history=True)
OC_CONT = facts(F.CONTINUATION, agent=F.OPENCODE, api=F.OPENAI_CHAT, has_history=True)
FORK = facts(F.CONTINUATION, session="fork-1", has_history=True)
SAME = {"host": "api.z.ai", "port": 443}       # addressed where OK sends it: no connect check
STAYS = parse(CONFIG_TEXT)                     # claude-code's server is the one it addresses
PLAIN = parse(pools.TEXT.replace('[agents.claude-code]\nserver = "glm"', '[agents.claude-code]\nserver = "anthropic"'))
POOL_CONT = pools.facts(F.CONTINUATION, has_history=True)
PI_POOL = pools.facts(F.CONTINUATION, agent=F.PI, has_history=True)
SOFT_GONE = pools.pool_pin("vllm-9", "local")  # a soft pool's member since removed: allocated afresh
SOFT_MOVED = pools.allocated("vllm-2", "local", rule="soft-move")
R, PR = request, pools.request
APART = (("fp:0123abcd.b", "alt"), ("fp:0123abcd.a", "glm"))   # pi conversations begun alike

WALK = [
    # (phase, event, the phase it leads to, whose answers, request, answers)
    (P.START, "Request", P.LEFT, "", R(facts(None, api=F.OTHER)), {}),
    (P.START, "Request", P.REFUSED, "", R(facts(conflict="the x-claude-code-session-id header is sent 2 times")), {}),
    (P.START, "Request", P.READING_PIN, "", R(), {}),
    (P.START, "Request", P.READING_LINEAGE, "", R(PI_TURN), {}),
    (P.READING_PIN, "PinRead", P.LEFT, "", R(facts(F.CONTINUATION)), {"pin": loaded(None)}),
    (P.READING_PIN, "PinRead", P.REFUSED, "", R(facts(F.CONTINUATION)), {"pin": loaded("ete")}),
    (P.READING_PIN, "PinRead", P.PLANNING, "", R(facts(F.CONTINUATION)), {"pin": loaded("glm")}),
    (P.READING_PIN, "PinRead", P.ALLOCATING, "pools", PR(), {"allocations": [pools.allocated("glm-b")]}),
    (P.READING_PIN, "PinRead", P.CHECKING_MEMBER, "pools", PR(POOL_CONT), {"pin": pools.pool_pin("glm-a")}),
    (P.READING_PIN, "PinRead", P.READING_LINEAGE, "", R(CONT), {}),
    (P.READING_PIN, "PinRead", P.READING_TITLE, "", R(facts(F.CONTINUATION, agent=F.OPENCODE, api=F.OPENAI_CHAT)), {}),
    (P.READING_LINEAGE, "LineageRead", P.FINDING_CONVERSATION, "", R(PI_TURN), {}),
    (P.READING_LINEAGE, "LineageRead", P.FINDING_PARENT, "", R(CONT), {}),
    (P.FINDING_CONVERSATION, "ConversationFound", P.READING_PIN, "", R(PI_TURN), {}),
    (P.FINDING_CONVERSATION, "ConversationFound", P.REFUSED, "", R(PI_TURN), {"apart": APART}),
    (P.FINDING_PARENT, "ParentFound", P.LEFT, "", R(CONT), {}),
    (P.FINDING_PARENT, "ParentFound", P.REFUSED, "", R(FORK), {"parent": ("s-1", loaded("ete"))}),
    (P.FINDING_PARENT, "ParentFound", P.PLANNING, "", R(FORK), {"parent": ("s-1", loaded("anthropic"))}),
    (P.FINDING_PARENT, "ParentFound", P.READING_TITLE, "", R(OC_CONT), {}),
    (P.READING_TITLE, "TitleRead", P.LEFT, "", R(OC_CONT), {}),
    (P.READING_TITLE, "TitleRead", P.PLANNING, "", R(OC_CONT), {"title": "zen"}),
    (P.PLANNING, "Planned", P.REFUSED, "", R(), {"plan": Changes("https", "h", 443, "/", refuse="no key")}),
    (P.PLANNING, "Planned", P.CREATING_PIN, "", R(), {}),
    (P.PLANNING, "Planned", P.CHECKING_REACHABLE, "", R(facts(F.CONTINUATION)), {"pin": loaded("glm")}),
    (P.PLANNING, "Planned", P.FORWARDED, "", R(facts(F.CONTINUATION), **SAME), {"pin": loaded("glm")}),
    (P.CREATING_PIN, "PinCreated", P.CHECKING_REACHABLE, "", R(), {}),
    (P.CREATING_PIN, "PinCreated", P.FORWARDED, "", R(**SAME), {}),
    (P.CREATING_PIN, "PinLost", P.LEFT, "", R(), {"create": route.PinLost(loaded(None))}),
    (P.CREATING_PIN, "PinLost", P.REFUSED, "", R(), {"create": route.PinLost(loaded("ete"))}),
    (P.CREATING_PIN, "PinLost", P.PLANNING, "", R(), {"create": route.PinLost(loaded("anthropic"))}),
    (P.CREATING_PIN, "PinLost", P.ALLOCATING, "pools", PR(config=PLAIN),
     {"create": route.PinLost(SOFT_GONE), "allocations": [SOFT_MOVED]}),
    (P.CREATING_PIN, "PinLost", P.CHECKING_MEMBER, "pools", PR(config=PLAIN),
     {"create": route.PinLost(pools.pool_pin("glm-a"))}),
    (P.CREATING_PIN, "NotSaved", P.REFUSED, "", R(), {"create": route.NotSaved("locked")}),
    (P.CREATING_PIN, "NotSaved", P.CHECKING_REACHABLE, "", R(config=STAYS), {"create": route.NotSaved("locked")}),
    (P.CREATING_PIN, "NotSaved", P.FORWARDED, "", R(config=STAYS, **SAME), {"create": route.NotSaved("locked")}),
    (P.ALLOCATING, "Allocated", P.PLANNING, "pools", PR(), {"allocations": [pools.allocated("glm-b")]}),
    (P.ALLOCATING, "Allocated", P.CHECKING_MEMBER, "pools", PR(pools.facts(agent=F.PI)),
     {"allocations": [pools.allocated("vllm-1", "local", F.PI)]}),
    (P.ALLOCATING, "PinLost", P.LEFT, "pools", PR(), {"allocations": [route.PinLost(loaded(None))]}),
    (P.ALLOCATING, "PinLost", P.REFUSED, "pools", PR(), {"allocations": [route.PinLost(loaded("ete"))]}),
    (P.ALLOCATING, "PinLost", P.PLANNING, "pools", PR(), {"allocations": [route.PinLost(loaded("anthropic"))]}),
    (P.ALLOCATING, "PinLost", P.ALLOCATING, "pools", PR(), {"allocations": [route.PinLost(SOFT_GONE), SOFT_MOVED]}),
    (P.ALLOCATING, "PinLost", P.CHECKING_MEMBER, "pools", PR(), {"allocations": [route.PinLost(pools.pool_pin("glm-a"))]}),
    (P.ALLOCATING, "NotAllocated", P.REFUSED, "pools", PR(), {"allocations": [route.NotAllocated(429, "pool-exhausted",
                                                                                                "…", 30)]}),
    (P.ALLOCATING, "NotSaved", P.REFUSED, "pools", PR(), {"allocations": [route.NotSaved("locked")]}),
    (P.CHECKING_MEMBER, "MemberChecked", P.PLANNING, "pools", PR(POOL_CONT), {"pin": pools.pool_pin("glm-a")}),
    (P.CHECKING_MEMBER, "MemberChecked", P.ALLOCATING, "pools", PR(PI_POOL),
     {"pin": pools.pool_pin("vllm-1", "local", F.PI), "checks": [pools.UNREACHABLE],
      "allocations": [pools.allocated("vllm-2", "local", F.PI, "soft-move")]}),
    (P.CHECKING_MEMBER, "MemberChecked", P.REFUSED, "pools", PR(POOL_CONT),
     {"pin": pools.pool_pin("glm-a"), "checks": [pools.EXHAUSTED]}),
    (P.CHECKING_REACHABLE, "Reachable", P.FORWARDED, "", R(), {}),
    (P.CHECKING_REACHABLE, "Reachable", P.REFUSED, "", R(), {"unreachable": "connection refused"}),
    (P.CHECKING_REACHABLE, "Reachable", P.ALLOCATING, "pools", PR(),
     {"allocations": [pools.allocated("glm-a"), pools.allocated("glm-b")], "reach": ["connection refused"]}),
]
# every store effect may be answered StoreFailed or StoreLost: a refusal
for _phase, _effect, _kind, _req, _answers in [
        (P.READING_PIN, "ReadPin", "", R(), {}),
        (P.FINDING_CONVERSATION, "FindConversation", "", R(PI_TURN), {}),
        (P.FINDING_PARENT, "FindParent", "", R(CONT), {}),
        (P.READING_TITLE, "ReadTitle", "", R(OC_CONT), {}),
        (P.CREATING_PIN, "CreatePin", "", R(), {}),
        (P.ALLOCATING, "Allocate", "pools", PR(), {}),
        (P.CHECKING_MEMBER, "CheckMember", "pools", PR(POOL_CONT), {"pin": pools.pool_pin("glm-a")})]:
    for _event in (FAILED, LOST):
        WALK.append((_phase, type(_event).__name__, P.REFUSED, _kind, _req, {**_answers, "instead": {_effect: _event}}))


def test_the_walk_is_the_table_row_for_row():
    rows = [w[:3] for w in WALK]
    assert len(rows) == len(set(rows))
    table = {(phase, event.__name__, to) for phase, row in route.TRANSITIONS.items()
             for event, tos in row.items() for to in tos}
    assert set(rows) == table


@pytest.mark.parametrize("phase, event, to, kind, req, answers", WALK,
                         ids=[f"{w[0].name}-{w[1]}-{w[2].name}" for w in WALK])
def test_each_row_of_the_table(phase, event, to, kind, req, answers):
    _, moves, last = run(req, (pools.answerer if kind == "pools" else answerer)(**answers))
    assert (phase, event, to) in moves
    assert last.done and last.state.phase in (P.FORWARDED, P.LEFT, P.REFUSED)


def test_each_effect_names_the_phase_that_waits_for_it():
    assert set(route.PHASE_OF) == {*route.Effect.__args__}
    assert set(route.PHASE_OF.values()) == set(P) - {P.START}


def test_a_move_the_table_does_not_hold_is_refused():
    s = route.begin(request())
    with pytest.raises(route.BadTransition, match="Planned while READING_PIN"):
        route.step(s.state, route.Planned(OK))      # a plan nobody asked for


# ---- the plan reads the request's headers only for a move (issue 22) ---------------------

HEADERS = (("host", "api.anthropic.com"), ("x-api-key", "agent-sentinel"), ("cookie", "sid=1"),
           ("anthropic-version", "2023-06-01"), ("x-claude-code-session-id", "s-1"))


def _at_plan(pinned_on):
    """A continuation pinned on ``pinned_on``, addressed to anthropic, stepped to its Plan."""
    req = route.Request(facts=facts(F.CONTINUATION, has_history=True), source=ANTHROPIC, config=CONFIG, now=NOW,
                        host="api.anthropic.com", port=443, path="/v1/messages?beta=true",
                        env={"ZAI_API_KEY": "zai-sentinel"})
    answer = answerer(pin=loaded(pinned_on))
    s = route.begin(req)
    while not isinstance(s.effect, route.Plan):
        assert not s.done, s.effect
        s = route.step(s.state, answer(s.effect))
    return s


@pytest.mark.parametrize("pinned_on, moves", [("anthropic", False), ("glm", True)])
def test_the_plan_reads_headers_only_for_a_move_and_plans_the_same(pinned_on, moves):
    s = _at_plan(pinned_on)
    asked = []

    def headers():
        asked.append(1)
        return HEADERS
    lazy = route.plan(s.state, s.effect, headers, None)
    assert lazy == route.plan(s.state, s.effect, HEADERS, None)      # the same changes as with the headers read
    assert bool(asked) is moves
    if moves:
        assert lazy.host == "api.z.ai" and "cookie" in lazy.drop_headers and ("x-api-key", "zai-sentinel") in lazy.set_headers
    else:
        assert (lazy.host, lazy.path, lazy.drop_headers, lazy.set_headers) == (
            "api.anthropic.com", "/v1/messages?beta=true", (), ())


def test_the_plain_data_of_a_step_is_frozen_and_a_request_never_shows_its_keys():
    # (frozen msgspec structs since issue 22's ninth round: a request makes a dozen of them)
    secret = "sk-test-never-shown-0123456789"
    r = route.Request(facts=facts(), source=ANTHROPIC, config=CONFIG, now=1.0, env={"GLM_KEY": secret})
    assert secret not in repr(r) and "GLM_KEY" not in repr(r) and "now=1.0" in repr(r)
    assert "env" not in dict(r.__rich_repr__())         # (msgspec's own would yield every field)
    s = route.begin(r)
    for value in (r, s, s.effect, s.state.loaded, route.PinRead(Loaded(None, None))):
        with pytest.raises(AttributeError):
            value.session = "other"         # type: ignore[misc]
    assert route.ReadPin("a") == route.ReadPin("a") != route.ReadTitle("a")


@pytest.mark.parametrize("f", [facts(F.CONTINUATION, has_history=True, conflict="x"), facts(conflict="x"),
                               facts(agent=F.PI, session="fp:1", session_source="fingerprint", conflict="x")])
def test_a_session_named_twice_apart_is_refused_400_before_any_pin_is_read(f):
    """Which conversation it is cannot be told: following the first value's pin would be a guess."""
    s = route.begin(request(f))
    assert s.done and isinstance(s.effect, route.Refuse) and (s.effect.status, s.effect.kind) == (400, "session-conflict")
    assert s.after == ()


def test_a_conflict_out_of_scope_is_left_as_any_request_out_of_scope():
    s = route.begin(request(facts(agent=F.UNKNOWN_AGENT, conflict="x")))
    assert s.done and isinstance(s.effect, route.Leave)
