"""The pin ladder: where one inference request goes, and what happens to its session's pin.

``decide(facts, pin, config, in_scope_server)`` is pure: no clock, no store, no I/O.
For a request in scope (an inference api, addressed to a configured server), the first
rule that applies decides (seeds/000, made stronger):

0. No session id: nothing can keep the conversation together, so leave it alone and pin
   nothing. An unknown agent is never routed and never pinned.
1. The session has a pin of the same agent: go to its pinned server ("not routed" =
   leave it alone) and renew the pin. A pinned server that is no longer configured is
   refused (503), never moved. A pin of another agent is neither followed nor
   overwritten: the request is left alone.
   - A body that could not be read (``parsed=False``) and has no pin is left alone,
     pinned nothing: its turn is unknowable, and guessing "opening" would pin a running
     conversation to the wrong server (a seed weakness).
2. Side requests and subagents never create a pin (checked before rule 3 so that even
   a "not routed" pin is only made by a conversation's own turns).
   - a side request with no pin goes to the agent's current server (the title request
     that races the opening turn must land where the opening turn will), unless it
     carries a conversation's history: that conversation began unseen, leave it alone;
   - but a side request of a session whose earlier side request (no pin) the router
     sent somewhere follows it there (``side_went``, remembered in memory only): a side
     thread that runs several rounds, like Codex's title thread calling a tool, stays
     whole instead of its later rounds being left alone;
   - a subagent with no pin is left alone: its parent was never seen begin (else it
     would have a pin), and the parent's next turn will be left alone too.
3. The agent is not routed: leave it alone, pin "not routed".
4. Opening turn: the agent's current server, and pin it.
5. Continuation the router never saw begin: leave it alone, pin "not routed" — unless
   this session's side request went somewhere moments ago (``side_went``): that request
   was the opening, so follow it and pin.
6. A turn that cannot be told (``unknown``): the agent's current server, and pin it;
   with history, it is a conversation under way never seen begin: as rule 5.

``pin_action`` is "create" (write a new pin for ``target``; ``None`` = not routed),
"renew" (a pin was followed: renew it if ``pins.renew_due``) or "none".
"""

from __future__ import annotations

from dataclasses import dataclass

from . import facts as F
from .config import Config, Server
from .pins import Pin

CREATE = "create"
RENEW = "renew"
NONE = "none"

# outcomes, for metrics and logs
ROUTED = "routed"          # sent to a configured server (maybe the one it addressed)
LEFT_ALONE = "left-alone"  # passed untouched
REFUSED = "refused"        # answered by the proxy with an error


@dataclass(frozen=True)
class Decision:
    target: str | None           # configured server name; None: leave the request alone
    pin_action: str              # create | renew | none
    rule: str                    # short rule id, stable (metrics, metadata)
    why: str                     # a few words for people (flow comment, logs)
    refuse: int | None = None    # a status to answer with instead of forwarding

    @property
    def outcome(self) -> str:
        if self.refuse:
            return REFUSED
        return ROUTED if self.target is not None else LEFT_ALONE


def _leave(rule: str, why: str, pin_action: str = NONE) -> Decision:
    return Decision(None, pin_action, rule, why)


def decide(facts: F.Facts, pin: Pin | None, config: Config, in_scope_server: Server | str | None,
           side_went: str | None = None) -> Decision:
    if in_scope_server is None or facts.api not in F.INFERENCE_APIS:
        return _leave("out-of-scope", "not an inference request to a configured server")
    if facts.agent not in F.AGENTS:
        return _leave("unknown-agent", "agent not recognised")
    if not facts.session:
        return _leave("no-session", "no session id")

    # 1. a pin decides
    if pin is not None:
        if pin.agent != facts.agent:
            return _leave("other-agent-pin", f"session pinned by {pin.agent}")
        if pin.server is None:
            return _leave("pinned-not-routed", "pinned: not routed", RENEW)
        if pin.server not in config.servers:
            return Decision(None, NONE, "pinned-server-gone", f"pinned to {pin.server}, no longer configured", refuse=503)
        return Decision(pin.server, RENEW, "pinned", "pin")

    if not facts.parsed:
        return _leave("unreadable", "body unreadable, no pin")

    current = config.current(facts.agent)
    turn = facts.turn

    # 2. side requests and subagents follow a pin, never make one
    if turn == F.SIDE:
        if side_went is not None and side_went in config.servers:
            return Decision(side_went, NONE, "side-follows-side", "follows this session's earlier side request")
        if facts.has_history:
            return _leave("side-unseen", "side request of a conversation not seen begin")
        if current is None:
            return _leave("side-not-routed", "agent not routed")
        return Decision(current, NONE, "side-current", "side, no pin yet")
    if turn == F.SUBAGENT:
        return _leave("subagent-unseen", "subagent of a conversation not seen begin")

    # 3. the agent is not routed
    if current is None:
        return _leave("not-routed", "agent not routed", CREATE)
    # 4. opening turn
    if turn == F.OPENING:
        return Decision(current, CREATE, "opening", "pinned")
    # 5. a continuation never seen begin — unless the router sent this session's side
    # request somewhere moments ago: then that request was the conversation's opening
    # (opencode's opening looks like its title request when it sends no tools), and the
    # conversation continues where it went.
    if turn == F.CONTINUATION:
        if side_went is not None and side_went in config.servers:
            return Decision(side_went, CREATE, "continuation-after-side", "began with a side-looking request, pinned")
        return _leave("continuation-unseen", "not seen begin", CREATE)
    # 6. a turn that cannot be told, with a session: the current server — but a body that
    # carries history is a conversation under way that the router never saw begin, and
    # pinning it elsewhere would move it (the guarantee outranks the rule's letter).
    if facts.has_history:
        return _leave("unknown-turn-unseen", "turn unknown, history: not seen begin", CREATE)
    return Decision(current, CREATE, "unknown-turn", "turn unknown, pinned")
