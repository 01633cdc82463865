"""The names the reader uses for what a request is: apis, agents, turns, id forms.

Plain constants shared by the reader's modules (``facts``, ``sessions``, ``turns``) and
everything that reads ``Facts``; ``facts`` re-exports them, so ``facts.OPENING`` and
``kinds.OPENING`` are the same name.
"""

from __future__ import annotations

from .paths import ANTHROPIC_COUNT_TOKENS, ANTHROPIC_MESSAGES, OPENAI_CHAT, OPENAI_RESPONSES, OTHER  # noqa: F401

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

# A client session id longer than this is not taken (it would become a store key).
MAX_ID = 256
# Claude Code's metadata.user_id longer than this is not read for a session.
MAX_USER_ID = 1024

# Claude Code's per-request line at the top of system[0].
BILLING_PREFIX = "x-anthropic-billing-header:"


def text(value: object) -> str:
    """A header name/value, method or url as str; bytes that are not UTF-8 never raise."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:  # lone surrogates (e.g. from surrogateescape)
            return value.encode("utf-8", "surrogatepass").decode("utf-8", "backslashreplace")
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")       # the usual case, at C speed
        except UnicodeDecodeError:
            return value.decode("utf-8", "backslashreplace")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value).decode("utf-8", "backslashreplace")
    return ""
