"""What each recorded request IS, known from how it was produced (see docs/traffic.md).

``expect.identifiable`` is False on the few non-model requests where nothing in the request (User-Agent,
headers) names the agent that sent it; ``expect.agent`` is still the true sender.

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
    "title-tool-result": "side",
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
    {"match": r"/api/event_logging/", "kind": "telemetry", "identifiable": False,
     "note": "Non-model: telemetry batch (User-Agent Bun/..., nothing names Claude Code)."},
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
        {"match": r"downloads\.claude\.ai/model-catalog", "kind": "model-catalog", "identifiable": False,
         "note": "Non-model: model catalog fetch (another host, User-Agent axios/...)."},
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

# ---------------------------------------------------------------- opencode

OC_TITLE = {"kind": "title", "note": "Title request of a new session: no tools, same session headers and x-opencode-request as the main turn."}

SCENARIOS["oc-zen"] = {
    "flow": "oc-zen.flow", "agent": "opencode", "scenario": "zen-messages",
    "note": "opencode run -m opencode/claude-sonnet-4-5 'RUNTOOL: ...' against the OpenCode Zen gateway (fake).",
    "requests": [
        dict(OC_TITLE, note="Title request on /zen/v1/responses with gpt-5.4-nano although the main model is a claude on /zen/v1/messages."),
        {"kind": "opening"},
        {"kind": "tool-result", "note": "Same x-opencode-request (user message id) as the opening turn."},
    ],
}

SCENARIOS["oc-zen-task"] = {
    "flow": "oc-zen-task.flow", "agent": "opencode", "scenario": "zen-task",
    "note": "opencode run -m opencode/claude-sonnet-4-5 'RUNTASK: ...': the fake answers a task tool call.",
    "requests": [
        OC_TITLE,
        {"kind": "opening"},
        {"kind": "subagent", "note": "Child session: its own x-opencode-session plus x-parent-session-id (expect.session is the PARENT); no title request for the child."},
        {"kind": "tool-result", "note": "Parent turn after the task result."},
    ],
}

SCENARIOS["oc-zen-cont"] = {
    "flow": "oc-zen-cont.flow", "agent": "opencode", "scenario": "zen-continue",
    "note": "opencode run --session <id of zen-messages> 'hello again': same id, whole history, no title request.",
    "requests": [{"kind": "resume"}],
}

SCENARIOS["oc-zen-fork"] = {
    "flow": "oc-zen-fork.flow", "agent": "opencode", "scenario": "zen-fork",
    "note": "opencode run --session <id> --fork 'hello from a fork': a NEW session id with the full history, no title request.",
    "requests": [{"kind": "fork"}],
}

SCENARIOS["oc-zen-chat"] = {
    "flow": "oc-zen-chat.flow", "agent": "opencode", "scenario": "zen-chat",
    "note": "opencode run -m opencode/glm-5.1 'RUNTOOL: ...': main turns on /zen/v1/chat/completions.",
    "requests": [dict(OC_TITLE, note="Title on /zen/v1/responses (gpt-5.4-nano) while the main model uses chat/completions."),
                 {"kind": "opening"}, {"kind": "tool-result"}],
}

SCENARIOS["oc-zen-gpt"] = {
    "flow": "oc-zen-gpt.flow", "agent": "opencode", "scenario": "zen-responses",
    "note": "opencode run -m opencode/gpt-5.1-codex 'RUNTOOL: ...': main turns on /zen/v1/responses.",
    "requests": [OC_TITLE, {"kind": "opening"}, {"kind": "tool-result"}],
}

SCENARIOS["oc-go"] = {
    "flow": "oc-go.flow", "agent": "opencode", "scenario": "go-chat",
    "note": "opencode run -m opencode-go/kimi-k2.6 'RUNTOOL: ...' against the OpenCode Go gateway (/zen/go/v1/chat/completions).",
    "requests": [dict(OC_TITLE, note="Title on the same endpoint and model as the main turn (kimi-k2.6)."),
                 {"kind": "opening"}, {"kind": "tool-result"}],
}

SCENARIOS["oc-anthropic"] = {
    "flow": "oc-anthropic.flow", "agent": "opencode", "scenario": "anthropic-task",
    "note": "opencode run -m anthropic/claude-sonnet-4-5 'RUNTASK: ...' straight to api.anthropic.com: x-session-id/x-session-affinity, no x-opencode-* headers.",
    "requests": [
        dict(OC_TITLE, note="Title with claude-haiku-4-5-20251001, no tools."),
        {"kind": "opening"},
        {"kind": "subagent", "note": "Child session in x-session-id/x-session-affinity, parent in x-parent-session-id (expect.session is the PARENT)."},
        {"kind": "tool-result"},
    ],
    "other": [{"match": r"registry\.npmjs\.org", "kind": "plugin-check", "identifiable": False,
               "note": "Non-model: opencode looks up its plugin package on the npm registry (User-Agent npm/...)."}],
}

# ---------------------------------------------------------------- pi

PI_NOTE = (" pi sends the SDK's User-Agent (OpenAI/JS or Anthropic/JS), no agent header: only the system prompt"
           " ('operating inside pi, a coding agent harness') names pi.")

SCENARIOS["pi-chat"] = {
    "flow": "pi-chat.flow", "agent": "pi", "scenario": "zen-chat", "conversation": "pi-zen-chat-A",
    "note": "pi -p --model opencode/glm-5.1 'RUNTOOL: ...', then pi -p --continue 'hello again'. No session id on chat/completions." + PI_NOTE,
    "requests": [{"kind": "opening"}, {"kind": "tool-result"},
                 {"kind": "resume", "note": "pi --continue in a new process: same conversation, whole history, still no id." + PI_NOTE}],
}

SCENARIOS["pi-messages"] = {
    "flow": "pi-messages.flow", "agent": "pi", "scenario": "zen-messages", "conversation": "pi-zen-messages-A",
    "note": "pi -p --model opencode/claude-sonnet-4-5 'RUNTOOL: ...', then --continue. No session id on /zen/v1/messages." + PI_NOTE,
    "requests": [{"kind": "opening"}, {"kind": "tool-result"}, {"kind": "resume"}],
}

SCENARIOS["pi-responses"] = {
    "flow": "pi-responses.flow", "agent": "pi", "scenario": "zen-responses",
    "note": "pi -p --model opencode/gpt-5.1-codex 'RUNTOOL: ...', then --continue. On /zen/v1/responses pi sends session_id, x-client-request-id and body prompt_cache_key (all the pi session id)." + PI_NOTE,
    "requests": [{"kind": "opening"}, {"kind": "tool-result"}, {"kind": "resume"}],
}

SCENARIOS["pi-go"] = {
    "flow": "pi-go.flow", "agent": "pi", "scenario": "go-chat",
    "note": "Two conversations through the OpenCode Go gateway (opencode-go/kimi-k2.6): A = 'RUNTOOL: ...' (2 requests), B = a new unrelated prompt, then --continue of B. No session id anywhere: fingerprints must tell A from B and tie B's turns." + PI_NOTE,
    "requests": [
        {"kind": "opening", "conversation": "pi-go-A"},
        {"kind": "tool-result", "conversation": "pi-go-A"},
        {"kind": "opening", "conversation": "pi-go-B"},
        {"kind": "resume", "conversation": "pi-go-B"},
    ],
}

# ---------------------------------------------------------------- Codex

CX_WS = {"match": r"api\.openai\.com/v1/responses", "kind": "websocket-upgrade", "max": 2,
         "note": "GET /v1/responses WebSocket upgrade (request_kind prewarm in x-codex-turn-metadata); the fake answers 426 and Codex falls back to HTTPS POST."}

SCENARIOS["cx-tool"] = {
    "flow": "cx-tool.flow", "agent": "codex", "scenario": "exec-tool",
    "note": "codex exec 'RUNTOOL: ...' with an API key (api.openai.com). Tools come in an input item of type additional_tools (responses-lite); the fake calls the custom tool exec.",
    "requests": [{"kind": "opening"}, {"kind": "tool-result", "note": "After the custom_tool_call_output of exec."}],
    "other": [CX_WS],
}

SCENARIOS["cx-task"] = {
    "flow": "cx-task.flow", "agent": "codex", "scenario": "exec-subagent",
    "note": "codex exec 'RUNTASK: ...': the fake calls collaboration.spawn_agent.",
    "requests": [
        {"kind": "opening"},
        {"kind": "tool-result", "note": "Parent after spawn_agent's output."},
        {"kind": "subagent", "note": "Subagent: same session-id, its own thread-id, x-openai-subagent collab_spawn, turn metadata thread_source subagent, history_initialization warm_fork with the parent's history."},
    ],
    "other": [dict(CX_WS, note=CX_WS["note"] + " The second one is the subagent's (x-openai-subagent).")],
}

SCENARIOS["cx-resume"] = {
    "flow": "cx-resume.flow", "agent": "codex", "scenario": "exec-resume",
    "note": "codex exec resume <id of exec-tool> 'hello again': same session-id, history_initialization cold_resume.",
    "requests": [{"kind": "resume"}],
}

SCENARIOS["cx-fork"] = {
    "flow": "cx-fork.flow", "agent": "codex", "scenario": "exec-fork",
    "note": "codex exec fork <id of exec-tool> 'hello from a fork': a NEW session-id, history_initialization cold_fork, forked_from_thread_id = the parent.",
    "requests": [{"kind": "fork"}],
}

SCENARIOS["cx-zstd"] = {
    "flow": "cx-zstd.flow", "agent": "codex", "scenario": "exec-metrics",
    "note": "codex exec 'RUNTASK: ...' again, kept for its zstd-compressed OTLP metrics POST (the only zstd body Codex sent with API-key auth).",
    "requests": [{"kind": "opening", "skip": True}, {"kind": "tool-result", "skip": True}, {"kind": "subagent", "skip": True}],
    "other": [{"match": r"ab\.chatgpt\.com/otlp", "kind": "telemetry", "identifiable": False,
               "note": "Non-model: OTLP metrics, Content-Encoding zstd, User-Agent OTel-OTLP-Exporter-Rust (nothing names Codex)."}],
}

SCENARIOS["cc-suggest"] = {
    "flow": "cc-suggest.flow", "agent": "claude-code", "scenario": "suggest",
    "note": "Interactive claude in tmux with CLAUDE_CODE_ENABLE_PROMPT_SUGGESTION=1 (prompt suggestions did not appear without it against the fake).",
    "requests": [
        {"kind": "title"},
        {"kind": "opening"},
        {"kind": "tool-result"},
        {"kind": "prompt-suggestion", "note": "Prompt suggestion after the turn ended: request-class auxiliary, x-claude-1p-request-class followup-generation, same tools and history as main plus a trailing [SUGGESTION MODE...] user message."},
        {"kind": "continuation", "note": "Next prompt: its history does NOT contain the suggestion exchange (n=6, same length as the suggestion request)."},
        {"kind": "prompt-suggestion"},
    ],
}

SCENARIOS["cc-noattr"] = {
    "flow": "cc-noattr.flow", "agent": "claude-code", "scenario": "no-billing-line",
    "note": "claude -p 'RUNTASK: ...' with CLAUDE_CODE_ATTRIBUTION_HEADER=0 and CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1: system[0] has NO x-anthropic-billing-header line (the billing-line fallback says 'not stated'), the request-class headers are still sent.",
    "requests": [{"kind": "opening"}, {"kind": "tool-result"}, {"kind": "subagent"}, {"kind": "subagent-notification"}],
}

SCENARIOS["cc-bearer"] = {
    "flow": "cc-bearer.flow", "agent": "claude-code", "scenario": "bearer",
    "note": "claude -p 'hello' with ANTHROPIC_AUTH_TOKEN instead of an API key: the credential goes in Authorization: Bearer (as with OAuth), no x-api-key.",
    "requests": [{"kind": "opening"}],
}

SCENARIOS["cx-tui"] = {
    "flow": "cx-tui.flow", "agent": "codex", "scenario": "tui",
    "note": "Interactive codex (TUI in tmux, API key): 'RUNTOOL: ...', /compact, one more prompt. User-Agent codex-tui/..., originator codex-tui.",
    "requests": [
        {"kind": "opening"},
        {"kind": "tool-result"},
        {"kind": "title", "note": "Thread title: a SEPARATE thread with its own session-id/thread-id and no link to the conversation, x-codex-turn-metadata thread_source thread_title, no x-openai-subagent. Only thread_source says it is a side request."},
        {"kind": "title-tool-result", "note": "The title thread ran a tool round because the fake answered its prompt (which quotes the user's RUNTOOL) with an exec call: an artefact of the fake, kept because it shows the title thread carries tools and history."},
        {"kind": "compaction", "note": "/compact: request_kind compaction, compaction {trigger manual, implementation responses_compaction_v2}, input ends with a compaction_trigger item. The fake's text answer made Codex report a compaction error."},
        {"kind": "after-compaction", "note": "Next prompt; history unchanged because the compaction failed against the fake."},
    ],
    "other": [dict(CX_WS, note="GET /v1/responses WebSocket upgrade from the TUI (prewarm); the second is the title thread's.")],
}

# ---------------------------------------------------------------- lineage (scripts/record/lineage.sh)
#
# Recorded with FAKE_LINEAGE=1 (unique answer texts, signed thinking, reasoning items) and kept with
# each request's RESPONSE (``"responses": True``): the ids a router must remember come from there.
# ``lineage`` labels which conversation a request belongs to (A, B, A-fork) and, on the first request
# of a fork, which conversation it was forked from (``fork_of``): the ground truth for
# tests/test_lineage.py.


def _lin(kind: str, who: str, fork_of: str | None = None, **extra) -> dict:
    lineage = {"conversation": who, **({"fork_of": fork_of} if fork_of else {})}
    return dict({"kind": kind, "lineage": lineage}, **extra)


LINEAGE_ROUNDS = [  # a tool round, the same conversation resumed with a tool round, then forked
    _lin("opening", "A"), _lin("tool-result", "A"),
    _lin("resume", "A"), _lin("tool-result", "A"),
    _lin("fork", "A-fork", "A"), _lin("tool-result", "A-fork"),
]

SCENARIOS["cc-lineage"] = {
    "flow": "cc-lineage.flow", "agent": "claude-code", "scenario": "lineage", "responses": True,
    "note": ("claude -p 'RUNTOOL: ...', then claude -p --resume <id> 'RUNTOOL: resumed, ...', then claude -p "
             "--resume <id> --fork-session 'RUNTOOL: forked, ...' (the fake's lineage mode: signed thinking blocks). "
             "Each request's response is kept (request-id header, message_start id)."),
    "requests": [
        _lin("opening", "A"),
        _lin("tool-result", "A", note="cc_prev_req and diagnostics.previous_message_id name the opening's response."),
        _lin("resume", "A", note="--resume <id> in a new process: same session id; cc_prev_req / previous_message_id name the last response of the first process."),
        _lin("tool-result", "A"),
        _lin("fork", "A-fork", "A", note="--fork-session: a NEW session id; cc_prev_req / previous_message_id name the parent's last response; the parent's history with its thinking signatures and tool_use ids."),
        _lin("tool-result", "A-fork"),
    ],
}

for _name, _model, _api in (("oc-lineage", "opencode/claude-sonnet-4-5", "/zen/v1/messages"),
                            ("oc-lineage-gpt", "opencode/gpt-5.1-codex", "/zen/v1/responses")):
    SCENARIOS[_name] = {
        "flow": f"{_name}.flow", "agent": "opencode", "scenario": _name[3:], "responses": True,
        "note": (f"opencode run -m {_model} 'RUNTOOL: ...', then run -s <id> 'RUNTOOL: resumed, ...', then run -s <id> "
                 f"--fork 'RUNTOOL: forked, ...' ({_api}). No header links the fork to its parent: only its history."),
        "requests": [_lin("title", "A", note=OC_TITLE["note"]), *LINEAGE_ROUNDS],
    }

SCENARIOS["cx-lineage"] = {
    "flow": "cx-lineage.flow", "agent": "codex", "scenario": "exec-lineage", "responses": True,
    "note": ("codex exec 'RUNTOOL: ...', codex exec resume <id> 'RUNTOOL: resumed, ...', codex exec fork <id> "
             "'RUNTOOL: forked, ...'; the WebSocket refused (426), so every turn is an HTTPS POST."),
    "requests": LINEAGE_ROUNDS,
    "other": [dict(CX_WS, max=3, each=[{"lineage": {"conversation": "A"}}, {"lineage": {"conversation": "A"}},
                                       {"lineage": {"conversation": "A-fork", "fork_of": "A"}}],
                   note="GET /v1/responses WebSocket upgrade (prewarm), answered 426. The fork's already carries "
                        "history_initialization cold_fork and forked_from_thread_id in x-codex-turn-metadata.")],
}

SCENARIOS["cx-ws"] = {
    "flow": "cx-ws.flow", "agent": "codex", "scenario": "websocket", "responses": True,
    "note": ("The same three commands as exec-lineage with the fake's WebSocket mode: the upgrade is accepted (101) and every "
             "turn goes over the socket as response.create messages; 'websocket' holds the messages both ways."),
    "requests": [],
    "other": [dict(CX_WS, max=3, each=[{"lineage": {"conversation": "A"}}, {"lineage": {"conversation": "A"}},
                                       {"lineage": {"conversation": "A-fork", "fork_of": "A"}}],
                   note="GET /v1/responses WebSocket upgrade, accepted: a warm-up response.create (generate false, "
                        "no input) answered by an empty response, then one response.create per turn whose "
                        "previous_response_id is the socket's previous response and whose input holds only the "
                        "items that response has not seen.")],
}

PI_LINEAGE_NOTE = ("Two pi -p 'Say hello in one word.' in the same directory (A, then B: the same opening), each "
                   "continued once with pi -p -c 'Now say it in French.', then pi -p --fork <A's session file> "
                   "'Now say it in German.'.")
for _name, _model in (("pi-lineage-chat", "opencode/glm-5.1"), ("pi-lineage-messages", "opencode/claude-sonnet-4-5"),
                      ("pi-lineage-responses", "opencode/gpt-5.1-codex")):
    SCENARIOS[_name] = {
        "flow": f"{_name}.flow", "agent": "pi", "scenario": _name[3:], "responses": True,
        "note": f"{PI_LINEAGE_NOTE} Model {_model}." + PI_NOTE,
        "requests": [
            _lin("opening", "A", conversation="A"), _lin("resume", "A", conversation="A"),
            _lin("opening", "B", conversation="B"), _lin("resume", "B", conversation="B"),
            _lin("fork", "A-fork", "A", conversation="A-fork"),
        ],
    }
