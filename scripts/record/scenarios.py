"""What each recorded request IS, known from how it was produced (see docs/traffic.md).

Each scenario: the flow file, the agent, and ``requests`` — one label per inference request of the
flow, in flow order. A label's ``kind`` names what the request is; ``skip`` leaves it out of the
fixture set (e.g. most of a 27-request count_tokens burst). ``other`` picks a few non-inference
requests by URL regex.
"""

# kind -> turn (the reader's turn for this kind of request)
TURN_OF_KIND = {
    "opening": "opening",
    "tool-result": "continuation",
    "continuation": "continuation",
    "resume": "continuation",
    "fork": "continuation",
    "compaction": "continuation",
    "after-compaction": "continuation",
    "subagent-notification": "continuation",
    "title": "side",
    "prompt-suggestion": "side",
    "classifier": "side",
    "count-tokens": "side",
    "subagent": "subagent",
    "subagent-tool-result": "subagent",
    "subagent-continuation": "subagent",
}

SCENARIOS: dict[str, dict] = {}


def _labels(*kinds: str, **extra) -> list[dict]:
    """One label per kind; a kind ending in '-' is skipped (kept out of the fixture set)."""
    out = []
    for kind in kinds:
        skip = kind.endswith("-")
        out.append(dict({"kind": kind.rstrip("-")}, **({"skip": True} if skip else {}), **extra))
    return out


CC_OTHER = [
    {"match": r"/api/claude_code/settings", "kind": "settings", "note": "Non-model: managed settings fetch, no session id."},
    {"match": r"/api/claude_code/policy_limits", "kind": "policy-limits", "note": "Non-model: policy limits, no session id."},
    {"match": r"/api/event_logging/", "kind": "telemetry", "note": "Non-model: telemetry batch."},
]

SCENARIOS["cc-print"] = {
    "flow": "cc-print.flow", "agent": "claude-code", "scenario": "print",
    "note": "claude -p 'RUNTOOL: ...' --allowedTools 'Bash(echo:*)'; the fake answers a Bash tool_use, then text.",
    "requests": [
        {"kind": "opening", "note": "First turn of a -p session (User-Agent sdk-cli)."},
        {"kind": "tool-result", "note": "Same prompt id, history carries the Bash tool_use and its tool_result."},
    ],
    "other": CC_OTHER + [{"match": r"/api/eval/", "kind": "eval", "note": "Non-model: feature-flag evaluation."}],
}

SCENARIOS["cc-print-task"] = {
    "flow": "cc-print-task.flow", "agent": "claude-code", "scenario": "print-task",
    "note": "claude -p 'RUNTASK: ...' --allowedTools Agent; the fake answers an Agent tool_use.",
    "requests": [
        {"kind": "opening"},
        {"kind": "tool-result", "note": "Parent turn after the Agent tool_use: the agent was launched in the background."},
        {"kind": "subagent", "note": "The subagent's own first request, sent AFTER the parent's next turn (background agent)."},
        {"kind": "subagent-notification", "note": "Parent turn started by the finished background agent's notification (new prompt id)."},
    ],
}

SCENARIOS["cc-interactive"] = {
    "flow": "cc-inter.flow", "agent": "claude-code", "scenario": "interactive",
    "note": "Interactive claude in tmux, non-essential traffic ON, auto mode on (the default).",
    "requests": [
        {"kind": "title", "note": "Session title (x-claude-1p-request-class summary-extraction), haiku, sent before the opening turn."},
        {"kind": "opening", "note": "First prompt 'RUNTOOL: ...' (User-Agent cli)."},
        {"kind": "tool-result", "note": "After the Bash tool result."},
        {"kind": "continuation", "note": "Second prompt 'RUNTASK: ...' in the same session."},
        {"kind": "classifier", "note": "Auto-mode classifier for the Agent call (not streamed, max_tokens 64, stop at </block>). The first fake answers were unusable, so Claude Code retried it 10 times; only the first is kept."},
        *_labels(*["classifier-"] * 9),
        {"kind": "tool-result", "note": "After the Agent call was refused ('auto mode's check had no usable answer')."},
        {"kind": "continuation", "note": "Third prompt 'RUNTASK: ...'."},
        {"kind": "classifier", "note": "Auto-mode classifier, answered <block>no (allow)."},
        {"kind": "tool-result", "note": "Parent turn after the Agent tool_use (agent backgrounded)."},
        {"kind": "subagent", "note": "Subagent first request: request-class subagent, x-claude-code-agent-id/-type, 1p class blocking-subagent."},
        {"kind": "subagent-continuation", "note": "The subagent's second request (it was re-prompted after a plain-text answer)."},
        *_labels("subagent-continuation-", "subagent-continuation-"),
        {"kind": "subagent-notification", "note": "Parent turn started by the finished subagent's notification."},
        {"kind": "count-tokens", "note": "/context: first of a burst of 27 count_tokens requests (messages only)."},
        *_labels(*["count-tokens-"] * 10),
        {"kind": "count-tokens", "note": "/context burst: the one with a single tool (Skill)."},
        {"kind": "count-tokens", "note": "/context burst: the one with all main tools."},
        *_labels(*["count-tokens-"] * 14),
        {"kind": "compaction", "note": "/compact: x-claude-code-compaction manual, request-class compaction, same history as main."},
        {"kind": "compaction", "note": "/compact retried once (the fake's summary had no <summary> block)."},
        {"kind": "after-compaction", "note": "Next prompt after /compact: x-claude-code-context-compacted, history replaced by the summary."},
    ],
    "other": [
        {"match": r"downloads\.claude\.ai/model-catalog", "kind": "model-catalog", "note": "Non-model: model catalog fetch (another host)."},
        {"match": r"/api/claude_cli/bootstrap", "kind": "bootstrap", "note": "Non-model: bootstrap."},
    ],
}

SCENARIOS["cc-resume"] = {
    "flow": "cc-resume.flow", "agent": "claude-code", "scenario": "resume",
    "note": "The interactive session resumed in print mode: first `claude -p --continue`, then `claude -p --resume <id>`.",
    "requests": [
        {"kind": "resume", "note": "--continue: same session id, whole (compacted) history, cc_prev_req in system[0]."},
        {"kind": "resume", "note": "--resume <id> in a new process: same session id, history now includes the --continue turn."},
        {"kind": "tool-result", "note": "After the Bash tool result of the resumed turn."},
    ],
}

SCENARIOS["cc-fork"] = {
    "flow": "cc-fork.flow", "agent": "claude-code", "scenario": "fork",
    "note": "`claude -p --resume <id> --fork-session 'RUNTOOL: ...'`: a NEW session id carrying the parent's history.",
    "requests": [
        {"kind": "fork", "note": "First request of the fork: new session id, parent's full history."},
        {"kind": "tool-result", "note": "After the Bash tool result, still the fork's session id."},
    ],
}
