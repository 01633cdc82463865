"""What a request is: its api, agent, session and turn.

``read(method, url, headers, body)`` is a pure function (no mitmproxy, no I/O) and
never raises: bad input gives ``Facts`` with ``parsed=False`` and the reason, plus
whatever could still be read (e.g. the session from a header when the body is garbage).
"""

from __future__ import annotations

import msgspec

# api
ANTHROPIC_MESSAGES = "anthropic-messages"
ANTHROPIC_COUNT_TOKENS = "anthropic-count-tokens"
OPENAI_CHAT = "openai-chat"
OPENAI_RESPONSES = "openai-responses"
OTHER = "other"
INFERENCE_APIS = frozenset({ANTHROPIC_MESSAGES, ANTHROPIC_COUNT_TOKENS, OPENAI_CHAT, OPENAI_RESPONSES})

# agent
CLAUDE_CODE = "claude-code"
OPENCODE = "opencode"
PI = "pi"
CODEX = "codex"
GEMINI_CLI = "gemini-cli"
UNKNOWN_AGENT = "unknown"
AGENTS = (CLAUDE_CODE, OPENCODE, PI, CODEX, GEMINI_CLI)

# turn
OPENING = "opening"
CONTINUATION = "continuation"
SIDE = "side"
SUBAGENT = "subagent"
UNKNOWN_TURN = "unknown"

# A fingerprint session id starts with this; no client id does (they are uuids, ses_…, …).
FINGERPRINT_PREFIX = "fp:"


class Facts(msgspec.Struct, frozen=True, kw_only=True):
    api: str                      # one of the api constants
    agent: str                    # one of AGENTS or "unknown"
    session: str | None = None    # the conversation whose pin this request follows
    session_source: str | None = None  # where it came from: "header:x-claude-code-session-id", "metadata.user_id", "fingerprint", ...
    turn: str | None = None       # opening | continuation | side | subagent | unknown; None when api is "other"
    model: str | None = None      # top-level body model
    stream: bool | None = None    # the client asked for a stream
    has_history: bool = False     # the body carries assistant turns (a conversation already under way)
    parsed: bool = True           # False: the body could not be read (see reason)
    reason: str = ""              # which rule decided the turn, or why the body was unparsed
