"""The request stepper with server pools: every new transition a table row (tests/test_route.py style)."""

from __future__ import annotations

import pytest

from sessionpin.reader import facts as F
from sessionpin.records import pins
from sessionpin.decision import route
from sessionpin.config.config import parse
from sessionpin.records.pins import Loaded, Pin
from sessionpin.decision.rewrite import Changes

TEXT = '''
[servers.anthropic]
url = "https://api.anthropic.com"
[servers.glm-a]
url = "https://a.example"
key_env = "A_KEY"
[servers.glm-b]
url = "https://b.example"
key_env = "B_KEY"
[servers.vllm-1]
url = "http://10.0.0.1:8000"
[servers.vllm-2]
url = "http://10.0.0.2:8000"
[servers.vllm-3]
url = "http://10.0.0.3:8000"
[pools.glm]
members = ["glm-a", "glm-b"]
[pools.local]
members = ["vllm-1", "vllm-2"]
affinity = "soft"
[agents.claude-code]
server = "glm"
[agents.pi]
server = "local"
'''
CONFIG = parse(TEXT)
ANTHROPIC = CONFIG.servers["anthropic"]
NOW = 1_800_000_000.0
OK = Changes("https", "b.example", 443, "/v1/messages")


def facts(turn=F.OPENING, agent=F.CLAUDE_CODE, session="s-1", api=F.ANTHROPIC_MESSAGES, **kw):
    return F.Facts(api=api, agent=agent, session=session, turn=turn, **kw)


def request(f=None, source=ANTHROPIC, config=CONFIG):
    return route.Request(facts=f or facts(), source=source, config=config, now=NOW)


def pool_pin(member, pool="glm", agent=F.CLAUDE_CODE, rule="opening", at=""):
    p = Pin(agent=agent, server=member, since=NOW - 60, renewed=NOW - 60, rule=rule, pool=pool,
            models=(), why=f"pool {pool}: round-robin → {member}", at=at)
    return Loaded(p, pins.encode(p))


NONE = Loaded(None, None)


def allocated(member, pool="glm", agent=F.CLAUDE_CODE, rule="opening"):
    loaded = pool_pin(member, pool, agent, rule)
    return route.Allocated(member, loaded, loaded.pin.why)


def answerer(*, pin=NONE, allocations=(), checks=(), plan=OK, create=None, instead=None, reach=()):
    """How the shell answers each effect: from the given queues (``instead``: an effect's name
    -> the event its first performance gets in place of the usual answer)."""
    allocations, checks, instead, reach = list(allocations), list(checks), dict(instead or {}), list(reach)

    def answer(e):
        if type(e).__name__ in instead:
            return instead.pop(type(e).__name__)
        if isinstance(e, route.ReadPin):
            return route.PinRead(pin)
        if isinstance(e, route.Plan):
            return route.Planned(plan)
        if isinstance(e, route.Allocate):
            return allocations.pop(0)
        if isinstance(e, route.CheckMember):
            return checks.pop(0) if checks else route.MemberChecked()
        if isinstance(e, route.CreatePin):
            return create if create is not None else route.PinCreated()
        if isinstance(e, route.CheckReachable):
            return route.Reachable(reach.pop(0) if reach else None)
        raise AssertionError(e)  # pragma: no cover
    return answer


def drive(req, **answers):
    """Run the stepper, answering each effect from the given queues; return (effects, last step)."""
    answer = answerer(**answers)
    s = route.begin(req)
    seen = []
    while not s.done:
        e = s.effect
        seen.append(type(e).__name__ + (f"({e.member})" if isinstance(e, route.CheckMember) else "")
                    + (f"({','.join(sorted(e.exclude))})" if isinstance(e, route.Allocate) and e.exclude else ""))
        s = route.step(s.state, answer(e))
    return seen, s


def outcome(s):
    e = s.effect
    d = s.state.decision
    return (type(e).__name__, getattr(e, "status", None), d.rule if d else None, d.target if d else None,
            tuple(type(a).__name__ for a in s.after))


UNREACHABLE = route.MemberChecked(missing="unreachable")
EXHAUSTED = route.MemberChecked(exhausted_until=NOW + 30, exhausted_why="429, retry-after 30s")

CASES = [
    ("opening to a pool: allocate (the pin is written by it), plan, forward — no second pin",
     request(), {"allocations": [allocated("glm-b")]},
     ["ReadPin", "Allocate", "Plan", "CheckReachable"], ("Forward", None, "opening", "glm-b", ())),
    ("opening: another proxy pinned it first -> its pin decides (checked, not moved)",
     request(), {"allocations": [route.PinLost(pool_pin("glm-a"))]},
     ["ReadPin", "Allocate", "CheckMember(glm-a)", "Plan", "CheckReachable"], ("Forward", None, "pinned", "glm-a", ())),
    ("opening: pool exhausted past the wait -> 429 with retry-after, nothing sent",
     request(), {"allocations": [route.NotAllocated(429, "pool-exhausted", "every member …", 30)]},
     ["ReadPin", "Allocate"], ("Refuse", 429, "opening", "glm", ())),
    ("opening: contention past 20 tries -> 503 with retry-after",
     request(), {"allocations": [route.NotAllocated(503, "pool-contention", "…", 1)]},
     ["ReadPin", "Allocate"], ("Refuse", 503, "opening", "glm", ())),
    ("opening: the pin could not be saved -> 503 (as a single server's)",
     request(), {"allocations": [route.NotSaved("disk full")]},
     ["ReadPin", "Allocate"], ("Refuse", 503, "opening", "glm", ())),
    ("side request, no pin: where the allocator would send the opening, nothing pinned",
     request(facts(F.SIDE, api=F.ANTHROPIC_COUNT_TOKENS)), {"allocations": [route.Allocated("glm-a", NONE, "pool glm: round-robin → glm-a")]},
     ["ReadPin", "Allocate", "Plan", "CheckReachable"], ("Forward", None, "side-current", "glm-a", ())),
    ("subagent of a pinned conversation: follows the pin", request(facts(F.SUBAGENT, has_history=True)),
     {"pin": pool_pin("glm-b")}, ["ReadPin", "CheckMember(glm-b)", "Plan", "CheckReachable"], ("Forward", None, "pinned", "glm-b", ())),
    ("pinned turn (hard): member fine -> its member", request(facts(F.CONTINUATION, has_history=True)),
     {"pin": pool_pin("glm-a")}, ["ReadPin", "CheckMember(glm-a)", "Plan", "CheckReachable"], ("Forward", None, "pinned", "glm-a", ())),
    ("pinned turn on an exhausted member: 429 with the reset, never moved",
     request(facts(F.CONTINUATION, has_history=True)), {"pin": pool_pin("glm-a"), "checks": [EXHAUSTED]},
     ["ReadPin", "CheckMember(glm-a)"], ("Refuse", 429, "pinned", "glm-a", ())),
    ("pinned turn (hard) on an unreachable member: not moved (the router's connect check answers)",
     request(facts(F.CONTINUATION, has_history=True)), {"pin": pool_pin("glm-a"), "checks": [UNREACHABLE]},
     ["ReadPin", "CheckMember(glm-a)", "Plan", "CheckReachable"], ("Forward", None, "pinned", "glm-a", ())),
    ("pinned turn (hard), member removed from the config: 424, never moved",
     request(facts(F.CONTINUATION, has_history=True)), {"pin": pool_pin("glm-z")},
     ["ReadPin"], ("Refuse", 424, "pinned-server-gone", None, ())),
    ("soft: pinned member reachable -> stays", request(facts(F.CONTINUATION, agent=F.PI, has_history=True)),
     {"pin": pool_pin("vllm-1", "local", F.PI)}, ["ReadPin", "CheckMember(vllm-1)", "Plan", "CheckReachable"],
     ("Forward", None, "pinned", "vllm-1", ())),
    ("soft: pinned member unreachable -> a clean miss, allocated afresh (move), checked, sent",
     request(facts(F.CONTINUATION, agent=F.PI, has_history=True)),
     {"pin": pool_pin("vllm-1", "local", F.PI), "checks": [UNREACHABLE],
      "allocations": [allocated("vllm-2", "local", F.PI, rule="soft-move")]},
     ["ReadPin", "CheckMember(vllm-1)", "Allocate(vllm-1)", "CheckMember(vllm-2)", "Plan", "CheckReachable"],
     ("Forward", None, "soft-move", "vllm-2", ())),
    ("soft: pinned member drained -> moved too", request(facts(F.CONTINUATION, agent=F.PI, has_history=True)),
     {"pin": pool_pin("vllm-1", "local", F.PI), "checks": [route.MemberChecked(missing="drained")],
      "allocations": [allocated("vllm-2", "local", F.PI, rule="soft-move")]},
     ["ReadPin", "CheckMember(vllm-1)", "Allocate(vllm-1)", "CheckMember(vllm-2)", "Plan", "CheckReachable"],
     ("Forward", None, "soft-move", "vllm-2", ())),
    ("soft: pinned member removed from the config -> moved, not refused",
     request(facts(F.CONTINUATION, agent=F.PI, has_history=True)),
     {"pin": pool_pin("vllm-9", "local", F.PI), "allocations": [allocated("vllm-2", "local", F.PI, rule="soft-move")]},
     ["ReadPin", "Allocate(vllm-9)", "CheckMember(vllm-2)", "Plan", "CheckReachable"], ("Forward", None, "soft-move", "vllm-2", ())),
    ("pinned turn (hard), member re-pointed to another host: 424, never followed",
     request(facts(F.CONTINUATION, has_history=True)), {"pin": pool_pin("glm-a", at="https://old.example")},
     ["ReadPin"], ("Refuse", 424, "pinned-server-moved", None, ())),
    ("soft: pinned member re-pointed to another host -> moved, as one removed",
     request(facts(F.CONTINUATION, agent=F.PI, has_history=True)),
     {"pin": pool_pin("vllm-1", "local", F.PI, at="http://10.9.9.9:8000"),
      "allocations": [allocated("vllm-2", "local", F.PI, rule="soft-move")]},
     ["ReadPin", "Allocate(vllm-1)", "CheckMember(vllm-2)", "Plan", "CheckReachable"],
     ("Forward", None, "soft-move", "vllm-2", ())),
    ("soft: pinned member taken out of the pool's members (still a server) -> moved, not checked",
     request(facts(F.CONTINUATION, agent=F.PI, has_history=True)),
     {"pin": pool_pin("vllm-3", "local", F.PI), "allocations": [allocated("vllm-2", "local", F.PI, rule="soft-move")]},
     ["ReadPin", "Allocate(vllm-3)", "CheckMember(vllm-2)", "Plan", "CheckReachable"],
     ("Forward", None, "soft-move", "vllm-2", ())),
    ("hard: pinned member taken out of the pool's members (still a server) -> stays, never moved",
     request(facts(F.CONTINUATION, has_history=True)), {"pin": pool_pin("anthropic")},
     ["ReadPin", "CheckMember(anthropic)", "Plan", "CheckReachable"], ("Forward", None, "pinned", "anthropic", ())),
    ("opening asked again, its member now exhausted: nothing began there -> allocated afresh, sent",
     request(facts(F.OPENING)), {"pin": pool_pin("glm-a"), "checks": [EXHAUSTED],
                                 "allocations": [allocated("glm-b")]},
     ["ReadPin", "CheckMember(glm-a)", "Allocate(glm-a)", "Plan", "CheckReachable"],
     ("Forward", None, "pinned", "glm-b", ())),
    ("opening asked again, every other member exhausted too -> the pool's 429",
     request(facts(F.OPENING)), {"pin": pool_pin("glm-a"), "checks": [EXHAUSTED],
                                 "allocations": [route.NotAllocated(429, "pool-exhausted", "every member …", 30)]},
     ["ReadPin", "CheckMember(glm-a)", "Allocate(glm-a)"], ("Refuse", 429, "pinned", "glm-a", ())),
    ("soft: opening asked again on an exhausted member -> allocated afresh, the new member checked",
     request(facts(F.OPENING, agent=F.PI)), {"pin": pool_pin("vllm-1", "local", F.PI), "checks": [EXHAUSTED],
                                             "allocations": [allocated("vllm-2", "local", F.PI)]},
     ["ReadPin", "CheckMember(vllm-1)", "Allocate(vllm-1)", "CheckMember(vllm-2)", "Plan", "CheckReachable"],
     ("Forward", None, "pinned", "vllm-2", ())),
    ("a pin that is not the opening's allocation (moved since) -> deferred, not moved",
     request(facts(F.OPENING)), {"pin": pool_pin("glm-a", rule="soft-move"), "checks": [EXHAUSTED]},
     ["ReadPin", "CheckMember(glm-a)"], ("Refuse", 429, "pinned", "glm-a", ())),
    ("opening allocated to a member found unreachable -> allocated afresh before anything is sent",
     request(), {"allocations": [allocated("glm-a"), allocated("glm-b")], "reach": ["connection refused"]},
     ["ReadPin", "Allocate", "Plan", "CheckReachable", "Allocate(glm-a)", "Plan", "CheckReachable"],
     ("Forward", None, "opening", "glm-b", ())),
    ("opening asked again, its member unreachable -> allocated afresh",
     request(facts(F.OPENING)), {"pin": pool_pin("glm-a"), "allocations": [allocated("glm-b")],
                                 "reach": ["connection refused"]},
     ["ReadPin", "CheckMember(glm-a)", "Plan", "CheckReachable", "Allocate(glm-a)", "Plan", "CheckReachable"],
     ("Forward", None, "pinned", "glm-b", ())),
    ("opening allocated afresh, the next member unreachable too -> both left out: the pool's answer",
     request(), {"allocations": [allocated("glm-a"), allocated("glm-b"),
                                 route.NotAllocated(503, "pool-no-member", "no member …", None)],
                 "reach": ["connection refused", "connection refused"]},
     ["ReadPin", "Allocate", "Plan", "CheckReachable", "Allocate(glm-a)", "Plan", "CheckReachable",
      "Allocate(glm-a,glm-b)"],
     ("Refuse", 503, "opening", "glm-b", ())),
    ("a conversation that began on an unreachable member (hard): refused, never moved",
     request(facts(F.CONTINUATION, has_history=True)), {"pin": pool_pin("glm-a"), "reach": ["connection refused"]},
     ["ReadPin", "CheckMember(glm-a)", "Plan", "CheckReachable"], ("Refuse", 424, "pinned", "glm-a", ())),
    ("soft: exhausted is deferred, not a miss", request(facts(F.CONTINUATION, agent=F.PI, has_history=True)),
     {"pin": pool_pin("vllm-1", "local", F.PI), "checks": [EXHAUSTED]},
     ["ReadPin", "CheckMember(vllm-1)"], ("Refuse", 429, "pinned", "vllm-1", ())),
    ("soft: exhausted and drained -> the miss decides: moved, not deferred",
     request(facts(F.CONTINUATION, agent=F.PI, has_history=True)),
     {"pin": pool_pin("vllm-1", "local", F.PI),
      "checks": [route.MemberChecked(exhausted_until=NOW + 600, exhausted_why="429", missing="drained")],
      "allocations": [allocated("vllm-2", "local", F.PI, rule="soft-move")]},
     ["ReadPin", "CheckMember(vllm-1)", "Allocate(vllm-1)", "CheckMember(vllm-2)", "Plan", "CheckReachable"],
     ("Forward", None, "soft-move", "vllm-2", ())),
    ("hard: exhausted and unreachable -> deferred (a hard pin never moves)",
     request(facts(F.CONTINUATION, has_history=True)),
     {"pin": pool_pin("glm-a"), "checks": [route.MemberChecked(exhausted_until=NOW + 30, missing="unreachable")]},
     ["ReadPin", "CheckMember(glm-a)"], ("Refuse", 429, "pinned", "glm-a", ())),
    ("soft: every member missed -> the allocation's refusal",
     request(facts(F.CONTINUATION, agent=F.PI, has_history=True)),
     {"pin": pool_pin("vllm-1", "local", F.PI), "checks": [UNREACHABLE],
      "allocations": [route.NotAllocated(503, "pool-no-member", "no member …", 5)]},
     ["ReadPin", "CheckMember(vllm-1)", "Allocate(vllm-1)"], ("Refuse", 503, "pinned", "vllm-1", ())),
    ("soft: the new member is unreachable too -> missed again, both excluded",
     request(facts(F.CONTINUATION, agent=F.PI, has_history=True)),
     {"pin": pool_pin("vllm-1", "local", F.PI), "checks": [UNREACHABLE, UNREACHABLE],
      "allocations": [allocated("vllm-2", "local", F.PI, rule="soft-move"),
                      route.NotAllocated(503, "pool-no-member", "no member …", 5)]},
     ["ReadPin", "CheckMember(vllm-1)", "Allocate(vllm-1)", "CheckMember(vllm-2)", "Allocate(vllm-1,vllm-2)"],
     ("Refuse", 503, "soft-move", "vllm-2", ())),
    ("soft: opening allocated to a member found unreachable -> moved before anything is sent",
     request(facts(agent=F.PI)), {"checks": [UNREACHABLE],
                                  "allocations": [allocated("vllm-1", "local", F.PI),
                                                  allocated("vllm-2", "local", F.PI, rule="soft-move")]},
     ["ReadPin", "Allocate", "CheckMember(vllm-1)", "Allocate(vllm-1)", "CheckMember(vllm-2)", "Plan", "CheckReachable"],
     ("Forward", None, "soft-move", "vllm-2", ())),
    ("a pin of a single server is not checked (no pool)", request(facts(F.CONTINUATION, has_history=True)),
     {"pin": Loaded(p := Pin(agent=F.CLAUDE_CODE, server="anthropic", since=NOW, renewed=NOW), pins.encode(p))},
     ["ReadPin", "Plan", "CheckReachable"], ("Forward", None, "pinned", "anthropic", ())),
]


@pytest.mark.parametrize("req, answers, effects, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_transitions(req, answers, effects, expected):
    seen, last = drive(req, **answers)
    assert seen == effects
    assert outcome(last) == expected


def test_allocate_carries_the_pin_to_write_and_what_was_read():
    s = route.begin(request())
    s = route.step(s.state, route.PinRead(NONE))
    e = s.effect
    assert isinstance(e, route.Allocate) and e.pool == "glm" and e.commit and e.seen == NONE
    assert e.pin.agent == F.CLAUDE_CODE and e.pin.rule == "opening" and e.pin.since == NOW


def test_a_soft_move_compares_against_the_old_pin_and_says_why():
    old = pool_pin("vllm-1", "local", F.PI)
    s = route.begin(request(facts(F.CONTINUATION, agent=F.PI, has_history=True)))
    s = route.step(s.state, route.PinRead(old))
    s = route.step(s.state, UNREACHABLE)
    e = s.effect
    assert isinstance(e, route.Allocate) and e.seen == old and e.reason == "unreachable" and e.commit
    assert e.pin.rule == "soft-move" and e.pin.server is None
    moved = allocated("vllm-2", "local", F.PI, rule="soft-move")
    moved = route.Allocated("vllm-2", moved.loaded, "soft: vllm-1 unreachable → vllm-2")
    s = route.step(s.state, moved)
    s = route.step(s.state, route.MemberChecked())
    s = route.step(s.state, route.Planned(OK))
    assert s.effect == route.CheckReachable("vllm-2", "b.example", 443)   # another origin than addressed
    s = route.step(s.state, route.Reachable())
    assert isinstance(s.effect, route.Forward)
    assert s.state.decision.why == "soft: vllm-1 unreachable → vllm-2"
    assert s.state.loaded.pin.server == "vllm-2"


def test_a_soft_member_out_of_the_pool_is_a_miss_that_says_so():
    s = route.begin(request(facts(F.CONTINUATION, agent=F.PI, has_history=True)))
    s = route.step(s.state, route.PinRead(pool_pin("vllm-3", "local", F.PI)))
    e = s.effect
    assert isinstance(e, route.Allocate) and e.reason == "left the pool" and e.exclude == {"vllm-3"} and e.commit


def test_an_opening_asked_again_is_moved_with_its_reason_and_the_opening_s_pin():
    old = pool_pin("glm-a")
    s = route.begin(request(facts(F.OPENING)))
    s = route.step(s.state, route.PinRead(old))
    s = route.step(s.state, EXHAUSTED)
    e = s.effect
    assert isinstance(e, route.Allocate) and e.seen == old and e.commit and e.exclude == {"glm-a"}
    assert e.reason == "out of quota before the opening began" and e.pin.rule == "opening" and e.pin.server is None


def test_the_deferral_names_member_session_and_reset():
    _, s = drive(request(facts(F.CONTINUATION, has_history=True)), pin=pool_pin("glm-a"), checks=[EXHAUSTED])
    e = s.effect
    assert e.kind == "member-exhausted" and e.retry_after == 30
    assert "glm-a" in e.message and "s-1" in e.message and "not moved" in e.message and "retry-after 30s" in e.message


def test_a_not_routed_agent_never_allocates():
    cfg = parse(TEXT.replace('[agents.claude-code]\nserver = "glm"', '[agents.claude-code]\nserver = ""'))
    seen, s = drive(request(config=cfg))
    assert "Allocate" not in seen and isinstance(s.effect, route.Leave)
