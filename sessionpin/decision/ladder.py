"""The pin ladder: where one inference request goes, and what happens to its session's pin.

``decide(facts, pin, config, source, title_went)`` is pure: no clock, no store, no I/O.
``source`` is the configured server the request addresses (None: it addresses none);
``title_went`` is where this session's opencode title-shaped request went moments ago
(the side memory; None when there is none). The first rule that applies decides
(seeds/000, made stronger):

0. Not an inference request, an unknown agent, or no session id: leave it alone, pin
   nothing — nothing can keep such a conversation together.
1. The session has a pin of the same agent: go to its pinned server ("not routed" =
   leave it alone) and renew the pin — **whatever the config says about the origin the
   request addresses** (a server removed from the config, an emptied config). A pinned
   server that is no longer configured is refused (``answers.NO_RETRY_STATUS``, 424: only
   the operator can bring it back or move the conversation, so no client may retry it), never moved;
   so is one whose server name now points at another host than the pin recorded (``moved``). A pin of another
   agent is neither followed nor overwritten: the request is left alone when that pin is
   "not routed" or names the server it addresses, and refused (424) when it names another
   server — which conversation it is cannot be told, and leaving it alone would send a
   conversation pinned elsewhere to the server it addressed.
   Without a pin, a request that addresses no configured server is out of scope.
   - A body that could not be read (``parsed=False``) and has no pin is left alone,
     pinned nothing: its turn is unknowable, and guessing "opening" would pin a running
     conversation to the wrong server.
2. Side requests and subagents never create a pin:
   - a side request with no pin goes to the agent's current server (a title request
     races the opening turn and must land where it will), unless it carries a
     conversation's history: that conversation began unseen, leave it alone. It is not
     remembered — except an opencode title-shaped one (see 5);
   - a subagent with no pin is left alone: its parent was never seen begin.
3. The agent is not routed: leave it alone, pin "not routed".
4. Opening turn: the agent's current server, and pin it.
5. A continuation the router never saw begin: leave it alone, pin "not routed" —
   unless it is opencode's and this session's title-shaped request (no tools, no
   history) went somewhere moments ago: opencode's opening reads like its title when it
   sends no tools, so that request was the opening; follow it and pin. No other side
   request — a count_tokens, a classifier, another agent's title — adopts a conversation.
6. A turn that cannot be told, with a session: the agent's current server, and pin it;
   with history it is a conversation under way never seen begin: as rule 5.

7. A conversation never seen begin that forks or resumes a conversation the router knows
   (``parent``: found by the client's explicit links or by the history's lineage,
   ``sessionpin.lineage.lineage``) follows its parent's pin: to the parent's server, pinned; "not
   routed" when the parent is; refused (424, as rule 1) when the parent's server is gone. This is
   checked before rules 2-6: a fork's first request is a continuation never seen begin.

So a request with no pin that carries history is always left alone, but for rule 5's
one exception and rule 7's forks (tests/test_route.py holds this as a property).

``pin_action`` is "create" (write a new pin for ``target``; ``None`` = not routed),
"renew" (a pin was followed: renew it if ``pins.renew_due``) or "none".
"""

from __future__ import annotations

import enum

import msgspec

from ..reader import facts as F
from .answers import NO_RETRY_STATUS
from ..config.config import Config, Server
from ..records.pins import Pin

CREATE = "create"
RENEW = "renew"
NONE = "none"

# outcomes, for metrics and logs
ROUTED = "routed"          # sent to a configured server (maybe the one it addressed)
LEFT_ALONE = "left-alone"  # passed untouched
REFUSED = "refused"        # answered by the proxy with an error


class Rule(enum.StrEnum):
    """The ladder's rule ids: stable strings (metrics labels, flow metadata, a pin's ``rule``
    in the store), compared by name in code. A ``StrEnum`` equals its string, so a pin
    written before, whose rule is a plain string, still compares equal."""
    OUT_OF_SCOPE = "out-of-scope"
    UNKNOWN_AGENT = "unknown-agent"
    NO_SESSION = "no-session"
    OTHER_AGENT_PIN = "other-agent-pin"
    PINNED_NOT_ROUTED = "pinned-not-routed"
    PINNED_SERVER_GONE = "pinned-server-gone"
    PINNED_SERVER_MOVED = "pinned-server-moved"
    PINNED = "pinned"
    FORK_NOT_ROUTED = "fork-not-routed"
    FORK_OF_GONE = "fork-of-gone"
    FORK_OF_MOVED = "fork-of-moved"
    FORK = "fork"
    UNREADABLE = "unreadable"
    SIDE_UNSEEN = "side-unseen"
    SIDE_NOT_ROUTED = "side-not-routed"
    SIDE_CURRENT = "side-current"
    SUBAGENT_UNSEEN = "subagent-unseen"
    NOT_ROUTED = "not-routed"
    OPENING = "opening"
    CONTINUATION_AFTER_TITLE = "continuation-after-title"
    CONTINUATION_UNSEEN = "continuation-unseen"
    UNKNOWN_TURN_UNSEEN = "unknown-turn-unseen"
    UNKNOWN_TURN = "unknown-turn"
    SOFT_MOVE = "soft-move"
    STORE_UNREADABLE = "store-unreadable"
    UNNAMED_PATH = "unnamed-path"


class Decision(msgspec.Struct, frozen=True):
    target: str | None           # configured server name; None: leave the request alone
    pin_action: str              # create | renew | none
    rule: Rule                   # short rule id, stable (metrics, metadata)
    why: str                     # a few words for people (flow comment, logs)
    refuse: int | None = None    # a status to answer with instead of forwarding

    @property
    def outcome(self) -> str:
        if self.refuse:
            return REFUSED
        return ROUTED if self.target is not None else LEFT_ALONE


def _leave(rule: Rule, why: str, pin_action: str = NONE) -> Decision:
    return Decision(None, pin_action, rule, why)


def in_scope(facts: F.Facts) -> bool:
    """Whether a request can be routed at all: an inference request of a known agent with a session."""
    return facts.api in F.INFERENCE_APIS and facts.agent in F.AGENTS and bool(facts.session)


def is_title_shaped(facts: F.Facts) -> bool:
    """opencode's title request — or its opening when it offers no tools: no tools, no history."""
    return (facts.agent == F.OPENCODE and facts.turn == F.SIDE and facts.parsed and not facts.has_history
            and not facts.has_tools and facts.api != F.ANTHROPIC_COUNT_TOKENS)


def moved(pin: Pin, config: Config) -> bool:
    """Whether ``pin``'s server is configured at another host than the pin recorded: the name
    was re-pointed (an edit, a name reused for another provider, or another proxy sharing the
    store whose config says otherwise). The host is the server: the conversation's history, and
    the server's key, would go to a host the conversation never talked to. A path prefix changed
    at the same origin is the same server (a provider's endpoint moved). A pin that recorded no
    address (made before pins did) is not compared."""
    server = config.servers.get(pin.server) if pin.server else None
    return server is not None and bool(pin.at) and pin.at != server.origin


def decide(facts: F.Facts, pin: Pin | None, config: Config, source: Server | None,
           title_went: str | None = None, parent: Pin | None = None) -> Decision:
    if facts.api not in F.INFERENCE_APIS:
        return _leave(Rule.OUT_OF_SCOPE, "not an inference request")
    if facts.agent not in F.AGENTS:
        return _leave(Rule.UNKNOWN_AGENT, "agent not recognised")
    if not facts.session:
        return _leave(Rule.NO_SESSION, "no session id")

    # 1. a pin decides, wherever the request was addressed
    if pin is not None:
        if pin.agent != facts.agent:
            # Ids are each agent's own (UUIDs, ses_…): the same id read as another agent is the
            # same conversation read otherwise (opencode's and pi's Claude Pro/Max providers send
            # Claude Code's User-Agent) or a forged one — which cannot be told. Pinned to a
            # server other than the one it addresses, it is refused; else left alone as before.
            # (a server name re-pointed since the pin is not the server the pin names: ``moved``)
            if pin.server is not None and (source is None or pin.server != source.name or moved(pin, config)):
                return Decision(None, NONE, Rule.OTHER_AGENT_PIN, f"session pinned by {pin.agent} to {pin.server}",
                                refuse=NO_RETRY_STATUS)
            return _leave(Rule.OTHER_AGENT_PIN, f"session pinned by {pin.agent}")
        if pin.server is None:
            return _leave(Rule.PINNED_NOT_ROUTED, "pinned: not routed", RENEW)
        if pin.server not in config.servers:
            return Decision(None, NONE, Rule.PINNED_SERVER_GONE, f"pinned to {pin.server}, no longer configured",
                            refuse=NO_RETRY_STATUS)
        if moved(pin, config):
            return Decision(None, NONE, Rule.PINNED_SERVER_MOVED, f"pinned to {pin.server} at {pin.at}, "
                            f"now at {config.servers[pin.server].origin}", refuse=NO_RETRY_STATUS)
        return Decision(pin.server, RENEW, Rule.PINNED, "pin")
    # 7. a fork or resume of a conversation the router knows follows its parent
    if parent is not None and parent.agent == facts.agent and facts.has_history:
        if parent.server is None:
            return _leave(Rule.FORK_NOT_ROUTED, "fork of a conversation not routed", CREATE)
        if parent.server not in config.servers:
            return Decision(None, NONE, Rule.FORK_OF_GONE, f"fork of a conversation pinned to {parent.server}, "
                            "no longer configured", refuse=NO_RETRY_STATUS)
        if moved(parent, config):
            return Decision(None, NONE, Rule.FORK_OF_MOVED, f"fork of a conversation pinned to {parent.server} "
                            f"at {parent.at}, now at {config.servers[parent.server].origin}", refuse=NO_RETRY_STATUS)
        return Decision(parent.server, CREATE, Rule.FORK, "fork, follows its parent")
    if source is None:
        return _leave(Rule.OUT_OF_SCOPE, "no pin, not addressed to a configured server")

    if not facts.parsed:
        return _leave(Rule.UNREADABLE, "body unreadable, no pin")

    current = config.current(facts.agent)
    turn = facts.turn

    # 2. side requests and subagents follow a pin, never make one
    if turn == F.SIDE:
        if facts.has_history:
            return _leave(Rule.SIDE_UNSEEN, "side request of a conversation not seen begin")
        if current is None:
            return _leave(Rule.SIDE_NOT_ROUTED, "agent not routed")
        return Decision(current, NONE, Rule.SIDE_CURRENT, "side, no pin yet")
    if turn == F.SUBAGENT:
        return _leave(Rule.SUBAGENT_UNSEEN, "subagent of a conversation not seen begin")

    # 3. the agent is not routed
    if current is None:
        return _leave(Rule.NOT_ROUTED, "agent not routed", CREATE)
    # 4. opening turn (an "opening" that carries history is a contradiction: as rule 5)
    if turn == F.OPENING and not facts.has_history:
        return Decision(current, CREATE, Rule.OPENING, "pinned")
    # 5. a continuation never seen begin — unless opencode's title-shaped opening went
    # somewhere moments ago (rule 5 above)
    if turn in (F.CONTINUATION, F.OPENING):
        if facts.agent == F.OPENCODE and title_went is not None and title_went in config.servers:
            return Decision(title_went, CREATE, Rule.CONTINUATION_AFTER_TITLE,
                            "began with a title-shaped request, pinned")
        return _leave(Rule.CONTINUATION_UNSEEN, "not seen begin", CREATE)
    # 6. a turn that cannot be told, with a session: the current server — but a body that
    # carries history is a conversation under way that the router never saw begin.
    if facts.has_history:
        return _leave(Rule.UNKNOWN_TURN_UNSEEN, "turn unknown, history: not seen begin", CREATE)
    return Decision(current, CREATE, Rule.UNKNOWN_TURN, "turn unknown, pinned")
