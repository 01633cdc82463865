"""What a server answered, read from the response as it streams.

``StreamReader(api)`` is fed the response body's chunks as they arrive (it is a valid
``flow.response.stream`` callable: it returns every chunk unchanged, at once) and then says what
identifies the answer (``result()``): the message or response id, the tool-call ids, a hash of
the assistant's text, and the digest ``lineage.extend`` chains onto the request's history.
Pure: no mitmproxy, no I/O, no clock; never raises.

Rules it keeps:
- Anthropic SSE: ``message_start`` gives the message id; ``content_block_start`` tool_use ids
  and redacted thinking; ``text_delta`` the text, ``signature_delta`` the thinking signatures;
  ``message_stop`` ends a complete answer.
- OpenAI chat SSE: the chunk ``id``; choice 0's ``delta.content`` and ``delta.tool_calls[].id``;
  ``[DONE]`` or a ``finish_reason`` ends it.
- Responses SSE (and Codex's WebSocket, one event per message: ``message()``): ``response.created``
  gives the response id; ``output_item.added``/``done`` the call ids and encrypted reasoning;
  ``output_text.delta`` the text; ``response.completed`` or ``response.incomplete`` (stopped at
  ``max_output_tokens``: the client keeps the answer) ends it, ``response.failed`` does not.
- The same identity as ``lineage.chain`` reads from a later request: the texts joined and
  stripped, the ids and token digests as sets.
- An empty chunk is no data, never the end (mitmproxy passes an empty HTTP/2 DATA frame
  mid-stream as one, as it passes the end): the end is ``result()``, which reads what is left.
- Bounded memory: an event (or line) longer than ``max_event`` bytes is dropped and the result
  says ``overflow``; the text is hashed as it comes, never kept; at most ``MAX_IDS`` tool ids.
  A compressed body (gzip, deflate, br, zstd) is decompressed as it comes, at most
  ``MAX_DECODED`` bytes in all and at most ``INFLATE_SLACK`` + ``INFLATE_RATIO`` times the
  compressed bytes fed so far (real SSE compresses 5-30:1 streamed, up to ~60:1 for a
  chat-completions stream compressed whole, its chunks' boilerplate repeated; a bomb's small
  chunk would otherwise give up to ``MAX_DECODED`` at once): beyond either, the answer is not read further
  (``overflow``). Every decompressor is asked for at most one byte past its room (brotli's
  ``output_buffer_limit`` too), so nothing beyond the bound is ever made.
- Bounded work per chunk: the chunk is cut at its last event end and the events split out
  by C scans (``re.split``); a Python step is taken per event holding ``data:``, never per
  line or per blank line; and at most ``EVENT_SLACK`` + one per ``WIRE_PER_EVENT`` bytes of
  the body as it came (compressed) events are read (a real event is tens of bytes even
  compressed; a bomb of ``data:{}`` would be a million events from a few kilobytes): beyond,
  the answer is not read further (``overflow``).
"""

from __future__ import annotations

import re
import zlib

import msgspec

from ..reader import facts
from . import lineage

MAX_EVENT = 1024 * 1024
MAX_IDS = 1024
MAX_DECODED = 64 * 1024 * 1024
# Decoded bytes allowed beyond INFLATE_RATIO times the compressed bytes fed so far.
INFLATE_SLACK = 1024 * 1024
INFLATE_RATIO = 128
_EVENT_END = re.compile(rb"\r?\n\r?\n")
EVENT_SLACK = 4096
WIRE_PER_EVENT = 2


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    api: str
    id: str | None = None             # Anthropic message id, chat completion id, Responses response id
    tool_ids: tuple[str, ...] = ()    # tool-call ids, in the order they came
    text_hash: str = ""               # blake2b-128 of the stripped text (hex)
    digest: str = ""                  # what identifies the answer in a later request's chain (hex)
    complete: bool = False            # the stream ended the way a finished answer ends
    overflow: bool = False            # something was too large to read: the digest may not match


# ---------------------------------------------------------------- events, only what is read


class _AMessage(msgspec.Struct):
    id: str | None = None


class _ABlock(msgspec.Struct):
    type: str | None = None
    id: str | None = None
    text: str | None = None
    data: str | None = None
    signature: str | None = None


class _ADelta(msgspec.Struct):
    type: str | None = None
    text: str | None = None
    signature: str | None = None


class _AEvent(msgspec.Struct):
    type: str | None = None
    index: int | None = None
    message: _AMessage | None = None
    content_block: _ABlock | None = None
    delta: _ADelta | None = None


class _CCall(msgspec.Struct):
    id: str | None = None


class _CDelta(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_CCall] | None = None


class _CChoice(msgspec.Struct):
    index: int = 0
    delta: _CDelta | None = None
    finish_reason: str | None = None


class _CChunk(msgspec.Struct):
    id: str | None = None
    choices: list[_CChoice] | None = None


class _RResponse(msgspec.Struct):
    id: str | None = None


class _RItem(msgspec.Struct):
    type: str | None = None
    call_id: str | None = None
    encrypted_content: str | None = None


class _REvent(msgspec.Struct):
    type: str | None = None
    response: _RResponse | None = None
    item: _RItem | None = None
    delta: str | None = None


_DECODERS = {facts.ANTHROPIC_MESSAGES: msgspec.json.Decoder(_AEvent), facts.OPENAI_CHAT: msgspec.json.Decoder(_CChunk),
             facts.OPENAI_RESPONSES: msgspec.json.Decoder(_REvent)}


class _Inflate:
    """Incremental decompression with a total output cap and a cap on the ratio of output to
    input: ``feed`` raises ``OverflowError`` rather than make more than its room."""

    def __init__(self, coding: str) -> None:
        self.coding, self.total, self.fed, self._d = coding, 0, 0, None
        if coding in ("gzip", "x-gzip"):
            self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif coding == "deflate":
            self._d = zlib.decompressobj(zlib.MAX_WBITS)
        elif coding == "br":
            import brotli
            self._d = brotli.Decompressor()
        elif coding == "zstd":
            try:
                from compression import zstd
            except ImportError:
                from backports import zstd
            self._d = zstd.ZstdDecompressor()
        else:
            raise ValueError(coding)

    def feed(self, data: bytes) -> bytes:
        self.fed += len(data)
        room = min(MAX_DECODED, INFLATE_SLACK + INFLATE_RATIO * self.fed) - self.total
        if room < 0:
            raise OverflowError
        # each is asked for one byte past the room: that byte says there was more
        if self.coding == "br":
            out = self._d.process(data, output_buffer_limit=room + 1)
            if len(out) > room or not self._d.can_accept_more_data():
                raise OverflowError
        elif self.coding == "zstd":
            out = self._d.decompress(data, max_length=room + 1)
        else:
            out = self._d.decompress(data, room + 1)
        if len(out) > room:
            raise OverflowError
        self.total += len(out)
        return out


def _last_end(buf) -> int:
    """Where the last complete event of ``buf`` ends (after its blank line), 0 if none does."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\n\r\n")
    return max(lf + 2 if lf != -1 else 0, crlf + 3 if crlf != -1 else 0)


def event_data(block: bytes) -> bytes | None:
    """One event's data lines joined, as SSE says (``None``: it has none)."""
    if block.startswith(b"data:") and b"\n" not in block and b"\r" not in block:
        return block[6:] if block.startswith(b"data: ") else block[5:]      # the usual event: one line
    data = [line[6:] if line.startswith(b"data: ") else line[5:]
            for line in block.splitlines() if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


class StreamReader:
    """Feed it the body's chunks (``reader(chunk)`` returns the chunk), then ``result()``."""

    def __init__(self, api: str, content_encoding: str = "", max_event: int = MAX_EVENT) -> None:
        self.api = api
        self.max_event = max_event
        self._decoder = _DECODERS.get(api)
        self._pending = bytearray()       # the event under way (its start came in an earlier chunk)
        self._tail = b""                  # the stream's last two bytes (a blank line may straddle chunks)
        self._wire = 0                    # the body's bytes as they came
        self._read = 0                    # events read
        self._dropping = False
        self._done = False
        self._id: str | None = None
        self._ids: list[str] = []
        self._tokens: list[bytes] = []
        self._signature: dict[int, list[str]] = {}
        self._text = lineage.TextDigest()
        self._complete = False
        self._overflow = False
        self._broken = self._decoder is None
        self._inflate = None
        codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip().lower() not in ("", "identity")]
        if len(codings) > 1:
            self._broken = True
        elif codings:
            try:
                self._inflate = _Inflate(codings[0])
            except Exception:
                self._broken = True

    # mitmproxy calls the stream callable with each chunk, and with b"" at the end — and with b""
    # for an empty HTTP/2 DATA frame mid-stream too (legal, a server's choice): so an empty chunk
    # is no data, never the end (taken for it, the rest of the answer went unread and its root
    # unrecorded); the end is ``result()`` (taken once the answer has ended)
    def __call__(self, chunk: bytes) -> bytes:
        self.feed(chunk)
        return chunk

    def feed(self, chunk: bytes) -> bytes:
        try:
            if self._broken or self._done or not chunk:
                return chunk
            self._wire += len(chunk)
            data = self._inflate.feed(chunk) if self._inflate is not None else chunk
            self._lines(data)
        except OverflowError:
            self._overflow = self._broken = True
        except Exception:
            self._broken = True
        return chunk

    def message(self, data: bytes | str) -> None:
        """One WebSocket message: a whole event (Codex's Responses WebSocket)."""
        try:
            if isinstance(data, str):
                data = data.encode("utf-8", "surrogatepass")
            if len(data) > self.max_event:
                self._overflow = True
            elif not self._broken:
                self._event(bytes(data))
        except Exception:
            self._broken = True

    def result(self) -> Answer:
        try:
            if not self._broken and not self._done:
                self._end()          # the last event, if the stream ended without its blank line
        except Exception:
            self._broken = True
        ids = tuple(self._ids)
        tokens = list(self._tokens) + [lineage.token_digest("".join(p)) for _, p in sorted(self._signature.items())]
        text = self._text.digest()
        return Answer(api=self.api, id=self._id, tool_ids=ids, text_hash=text.hex(),
                      digest=lineage.model_digest(ids, tokens, text).hex(),
                      complete=self._complete and not self._broken, overflow=self._overflow)

    # ------------------------------------------------------------ SSE

    def _lines(self, data: bytes) -> None:
        """Whole events are cut at their blank line by C scans; one Python step per event that
        holds ``data:``. An event growing past ``max_event`` is dropped up to its end."""
        tail = self._tail                         # a blank line may straddle two chunks
        probe = tail + data if tail else data
        self._tail = probe[-2:]
        last = _last_end(probe)
        if last == 0:
            if not self._dropping:
                self._pending += data
                if len(self._pending) > self.max_event:
                    self._drop()
            return
        end = last - len(tail)                    # where, in ``data``, the last complete event ends
        if self._dropping:                        # the end of an event over the bound: skip it
            self._dropping = False
            buf = data[max(0, _EVENT_END.search(probe).end() - len(tail)):end]
        else:
            buf = bytes(self._pending) + data[:end] if self._pending else data[:end]
        self._pending = bytearray(data[end:])
        self._events(buf)
        if len(self._pending) > self.max_event:
            self._drop()

    def _events(self, buf: bytes) -> None:
        if b"data:" not in buf:
            return
        budget = EVENT_SLACK + self._wire // WIRE_PER_EVENT
        for block in _EVENT_END.split(buf):
            if b"data:" in block:
                data = event_data(block)
                if data is None:
                    continue
                self._read += 1
                if self._read > budget:
                    raise OverflowError
                if len(data) > self.max_event:
                    self._overflow = True
                else:
                    self._event(data)

    def _drop(self) -> None:
        self._overflow = self._dropping = True
        self._pending.clear()

    def _end(self) -> None:
        if self._pending and not self._dropping:
            self._events(bytes(self._pending))
        self._pending = bytearray()
        self._done = True

    # ------------------------------------------------------------ events

    def _event(self, data: bytes) -> None:
        if data.strip() == b"[DONE]":
            if self.api == facts.OPENAI_CHAT:
                self._complete = True
            return
        try:
            ev = self._decoder.decode(data)
        except (msgspec.DecodeError, RecursionError):
            return  # an event of another shape (or an error event): nothing to take from it
        if self.api == facts.ANTHROPIC_MESSAGES:
            self._anthropic(ev)
        elif self.api == facts.OPENAI_CHAT:
            self._chat(ev)
        else:
            self._responses(ev)

    def _add_id(self, value: str | None) -> None:
        if value and value not in self._ids:
            if len(self._ids) >= MAX_IDS:
                self._overflow = True
            else:
                self._ids.append(value)

    def _anthropic(self, ev: _AEvent) -> None:
        t = ev.type
        if t == "message_start" and ev.message is not None:
            self._id = ev.message.id
        elif t == "content_block_start" and ev.content_block is not None:
            block = ev.content_block
            if block.type in ("tool_use", "server_tool_use"):
                self._add_id(block.id)
            elif block.type == "redacted_thinking" and block.data:
                self._tokens.append(lineage.token_digest(block.data))
            elif block.type == "text" and block.text:
                self._text.feed(block.text)
            elif block.type == "thinking" and block.signature:
                self._signature.setdefault(ev.index or 0, []).append(block.signature)
        elif t == "content_block_delta" and ev.delta is not None:
            delta = ev.delta
            if delta.type == "text_delta" and delta.text:
                self._text.feed(delta.text)
            elif delta.type == "signature_delta" and delta.signature:
                self._signature.setdefault(ev.index or 0, []).append(delta.signature)
        elif t == "message_stop":
            self._complete = True

    def _chat(self, ev: _CChunk) -> None:
        if self._id is None and ev.id:
            self._id = ev.id
        for choice in ev.choices or ():
            if choice.index != 0:
                continue
            if choice.delta is not None:
                if choice.delta.content:
                    self._text.feed(choice.delta.content)
                for call in choice.delta.tool_calls or ():
                    self._add_id(call.id)
            if choice.finish_reason:
                self._complete = True

    def _responses(self, ev: _REvent) -> None:
        t = ev.type or ""
        if t in ("response.created", "response.in_progress") and ev.response is not None and self._id is None:
            self._id = ev.response.id
        elif t in ("response.output_item.added", "response.output_item.done") and ev.item is not None:
            item = ev.item
            if item.type and item.type.endswith("_call"):
                self._add_id(item.call_id)
            if t == "response.output_item.done" and item.encrypted_content and item.type in lineage.MODEL_TYPES:
                self._tokens.append(lineage.token_digest(item.encrypted_content))
        elif t == "response.output_text.delta" and ev.delta:
            self._text.feed(ev.delta)
        elif t in ("response.completed", "response.incomplete"):
            # incomplete: the answer stopped at max_output_tokens (or a content filter) and the
            # client keeps what came, as chat's finish_reason "length" and Anthropic's
            # message_stop after max_tokens; response.failed is not an answer
            self._complete = True
