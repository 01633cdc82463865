"""The turn a request is: opening, continuation, side request, subagent — or unknown.

Rules it keeps (docs/facts.md; seeds/000's turn rule, made stronger):
- count_tokens is a side request; Claude Code by ``x-claude-code-request-class``, then the
  billing line of system[0]; opencode by ``x-parent-session-id`` and the title request
  (no tools, no history); Codex by ``x-openai-subagent`` and ``x-codex-turn-metadata``;
  everyone else by history (an assistant turn, or a Responses item only a model makes).
"""

from __future__ import annotations

from . import wire
from .kinds import (ANTHROPIC_COUNT_TOKENS, BILLING_PREFIX, CLAUDE_CODE, CODEX, CONTINUATION, OPENCODE, OPENING,
                    SIDE, SUBAGENT, UNKNOWN_AGENT, UNKNOWN_TURN)
from .sessions import codex_turn_metadata

def has_history(b: wire.Body) -> bool:
    """The body carries an assistant turn (or a Responses item only a model makes)."""
    if b.previous_response_id:
        return True
    for m in b.messages or ():
        if m.role == "assistant":
            return True
    if isinstance(b.input, list):
        return any(wire.is_history(item) for item in b.input)
    return False



def billing_line(b: wire.Body) -> str | None:
    """Claude Code's ``x-anthropic-billing-header: …`` line in system[0], if any."""
    system = b.system
    first: str | None = None
    if isinstance(system, str):
        first = system
    elif system:
        first = system[0].text
    if first is not None and first.lstrip().startswith(BILLING_PREFIX):
        return first.strip().split("\n", 1)[0]
    return None


def has_tools(b: wire.Body) -> bool:
    return bool(b.tools)


# ---------------------------------------------------------------- turn


def _by_history(history: bool, ok: bool, who: str) -> tuple[str, str]:
    if not ok:
        return UNKNOWN_TURN, f"{who}: body unreadable"
    if history:
        return CONTINUATION, f"{who}: assistant message in history"
    return OPENING, f"{who}: no assistant message"


def turn_of(
    api: str, agent: str, h: dict[str, str], b: wire.Body, history: bool, ok: bool, parent_rule: str | None
) -> tuple[str, str]:
    """(turn, the rule that decided it)."""
    if api == ANTHROPIC_COUNT_TOKENS:
        return SIDE, "count_tokens"
    if agent == CLAUDE_CODE:
        return _claude_turn(h, b, history, ok)
    if agent == CODEX:
        return _codex_turn(h, history, ok)
    if parent_rule:
        return SUBAGENT, f"{agent}: {parent_rule}"
    if agent == OPENCODE and ok and not has_tools(b) and not history:
        return SIDE, "opencode: no tools, no history (title)"
    return _by_history(history, ok, agent if agent != UNKNOWN_AGENT else "unknown agent")


_SIDE_1P_CLASSES = frozenset({"summary-extraction", "followup-generation"})   # title, prompt suggestion
_REQUEST_CLASS = {
    "subagent": (SUBAGENT, "request-class subagent"),
    "auxiliary": (SIDE, "request-class auxiliary"),
    "compaction": (CONTINUATION, "request-class compaction"),
}


def _claude_turn(h: dict[str, str], b: wire.Body, history: bool, ok: bool) -> tuple[str, str]:
    cls = h.get("x-claude-code-request-class", "").strip().lower()
    if cls == "main":
        return _by_history(history, ok, "request-class main")
    if cls in _REQUEST_CLASS:
        return _REQUEST_CLASS[cls]
    if not cls:
        # x-claude-1p-request-class says "main" for the auto-mode classifier and for
        # compaction, so only its specific values are taken (a client that sends it
        # without the request-class header).
        p1 = h.get("x-claude-1p-request-class", "").strip().lower()
        if "subagent" in p1:
            return SUBAGENT, f"1p request-class {p1[:24]}"
        if p1 in _SIDE_1P_CLASSES:
            return SIDE, f"1p request-class {p1}"
    # Older clients (or an unknown class): the billing line of system[0] (seeds/000).
    prefix = f"request-class {cls[:24]!r} unknown; " if cls else ""
    if not ok:
        return UNKNOWN_TURN, prefix + "body unreadable"
    line = billing_line(b)
    if line is None:
        return UNKNOWN_TURN, prefix + "no request class, no billing line: role not stated"
    if "cc_is_subagent=true" in line.replace(" ", ""):
        return SUBAGENT, prefix + "billing line: cc_is_subagent"
    if not has_tools(b):
        return SIDE, prefix + "billing line, no tools"
    if history:
        return CONTINUATION, prefix + "billing line, tools, assistant message in history"
    return OPENING, prefix + "billing line, tools, no assistant message"


def _codex_turn(h: dict[str, str], history: bool, ok: bool) -> tuple[str, str]:
    sub = h.get("x-openai-subagent", "").strip().lower()
    if sub == "compact":
        # Codex runs its compaction as a "compact" subagent of the main conversation.
        return CONTINUATION, "codex: x-openai-subagent compact"
    if sub:
        return SUBAGENT, "codex: x-openai-subagent"
    meta = codex_turn_metadata(h)
    if meta.get("thread_source") == "subagent":
        return SUBAGENT, "codex: turn-metadata thread_source subagent"
    source = meta.get("thread_source")
    if isinstance(source, str) and source not in ("", "user"):
        # The TUI names a thread from a separate thread (thread_source "thread_title") with
        # its own session id and no parent link: a one-shot side request. Any other
        # non-user source is treated alike, so it never decides a pin.
        return SIDE, f"codex: turn-metadata thread_source {source[:24]}"
    if meta.get("request_kind") == "prewarm":
        return SIDE, "codex: turn-metadata request_kind prewarm"
    if meta.get("history_initialization") in ("cold_resume", "cold_fork"):
        return CONTINUATION, f"codex: turn-metadata history_initialization {meta['history_initialization']}"
    return _by_history(history, ok, "codex")


def upgrade_turn(h: dict[str, str]) -> tuple[str, str, bool]:
    """(turn, the rule, history) of Codex's Responses WebSocket upgrade, told by its headers
    alone (it has no body). Every upgrade says ``request_kind: prewarm`` — the socket's
    warm-up, not a side request: the socket carries the thread's turns — so only the
    thread's origin counts: ``history_initialization`` new is the thread's opening,
    cold_resume/cold_fork a thread under way; a subagent's or a title thread's socket
    is what its thread is."""
    sub = h.get("x-openai-subagent", "").strip().lower()
    meta = codex_turn_metadata(h)
    init = meta.get("history_initialization", "")
    history = init in ("cold_resume", "cold_fork")
    if sub == "compact":
        return CONTINUATION, "codex socket: x-openai-subagent compact", True
    if sub or meta.get("thread_source") == "subagent":
        return SUBAGENT, "codex socket: subagent", history
    source = meta.get("thread_source")
    if source not in (None, "", "user"):
        return SIDE, f"codex socket: thread_source {source[:24]}", history
    if history:
        return CONTINUATION, f"codex socket: history_initialization {init}", True
    return OPENING, "codex socket: a new thread", False
