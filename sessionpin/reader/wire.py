"""The parts of an inference request body that the facts need, as msgspec structs.

Rules this module keeps:
- Decode only what a fact needs: model, stream, system / instructions, tools (whether any, not
  read), metadata.user_id, prompt_cache_key, previous_response_id, and for every message or
  input item only its ``role`` and ``type``. Message contents stay ``msgspec.Raw`` (skipped,
  not built), so a long conversation costs a scan, not a tree of Python objects.
- Unknown fields are ignored (msgspec's default), so new client fields never break a read.
- A field of the wrong type raises ``msgspec.ValidationError`` in the fast path; the reader
  then reads the top level as ``dict[str, Raw]`` and decodes each field on its own, so one bad field does not
  hide the others.
"""

from __future__ import annotations

import msgspec
from msgspec import Raw, Struct

from . import knownarrays
from .scan import skip_ws

# A Raw that was not in the body (a real JSON value is never empty).
ABSENT = Raw(b"")


class Block(Struct):
    """A content block or part: Anthropic ``{"type":"text","text":…}``, OpenAI chat
    ``{"type":"text"}``, Responses ``{"type":"input_text"}``. Other fields (cache_control,
    source, tool_use_id, nested content…) are skipped."""

    type: str | None = None
    text: str | None = None


# ``system`` / message content: a string, or a list of blocks.
Content = str | list[Block] | None


class Message(Struct):
    """A chat message or a Responses input item: only what says who spoke."""

    role: str | None = None
    type: str | None = None
    content: Raw = ABSENT


def is_history(m: Message) -> bool:
    """The item shows the conversation under way: an assistant message, or a Responses item
    only a model turn makes (a tool call, its output, reasoning, a compaction). Other typed
    items (Codex's ``additional_tools``, a developer ``message``) are part of any opening."""
    if m.role == "assistant":
        return True
    t = m.type
    if t is None or t == "message":
        return False
    return t == "reasoning" or t.startswith("compaction") or t.endswith(("_call", "_output"))


class Metadata(Struct):
    user_id: str | None = None


class Body(Struct):
    """The request body of every inference api (Anthropic Messages and count_tokens,
    OpenAI chat/completions and Responses) in one struct: absent fields stay at their default."""

    model: str | None = None
    stream: bool | None = None
    system: Content = None
    instructions: Content = None          # Responses: the system prompt
    messages: list[Message] | None = None
    input: str | list[Message] | None = None  # Responses
    tools: list[Raw] | None = None        # read only as "any or none" (``any_items``: the array whole, as one item)
    metadata: Metadata | None = None
    prompt_cache_key: str | None = None
    previous_response_id: str | None = None


# The fields of Body and their types, for the field-by-field fallback.
FIELD_TYPES: dict[str, object] = {
    "model": str | None,
    "stream": bool | None,
    "system": Content,
    "instructions": Content,
    "messages": list[Message] | None,
    "input": str | list[Message] | None,
    "tools": list[Raw] | None,
    "metadata": Metadata | None,
    "prompt_cache_key": str | None,
    "previous_response_id": str | None,
}

body_decoder = msgspec.json.Decoder(Body)
loose_decoder = msgspec.json.Decoder(dict[str, Raw])
content_decoder = msgspec.json.Decoder(Content)
field_decoders = {name: msgspec.json.Decoder(t) for name, t in FIELD_TYPES.items()}


def decode_fields(fields: dict[str, msgspec.Raw]) -> tuple[dict[str, object], str]:
    """Each facts field on its own, so one of a wrong type spoils only itself: the
    values that decoded, and "" or which fields did not."""
    values: dict[str, object] = {}
    bad: list[str] = []
    for name, decoder in field_decoders.items():
        raw = fields.get(name)
        if raw is None:
            continue
        try:
            if name == "tools":
                values[name] = any_items(raw)
                continue
            if name == "messages":        # a conversation's history sent again: its new items decoded
                values[name], scanned = knownarrays.decode(raw, decoder)
                count(scanned)
                continue
            count(len(raw))
            values[name] = decoder.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            bad.append(name)
    return values, ("wrong shape: " + ", ".join(bad)) if bad else ""


def any_items(raw: msgspec.Raw) -> list[Raw] | None:
    """``tools`` from the top level's raw member, where only whether there are any is read
    (``turns.has_tools``): told by the array's first bytes (the top level was decoded, so the
    value is well-formed JSON), not by a second scan of every tool's schema (92 KB in a
    Claude Code request, 35 µs). A non-empty array is kept whole, as one item; anything but an
    array or null is the wrong type, as the typed read says."""
    view = memoryview(raw)
    if len(view) and view[0] == 0x5B:       # [
        first = skip_ws(view, 1)          # in C: a hostile array of megabytes of spaces is no loop
        return [] if first < len(view) and view[first] == 0x5D else [raw]
    if view == b"null":
        return None
    raise msgspec.ValidationError("Expected `array | null`")


class Steps:
    """Bytes scanned by the reader: every find, copy and decode adds what it scanned.
    Tests reset ``n`` and assert it stays within k × the body's size (never timing)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


STEPS = Steps()


def count(n: int) -> None:
    STEPS.n += n
