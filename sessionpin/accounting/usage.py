"""What a server says an answer cost: its usage, read from the response as it streams.

``UsageReader(api, content_encoding)`` is a valid ``flow.response.stream`` callable (every
chunk is returned unchanged, at once); ``message(data)`` reads one WebSocket message (Codex's
Responses socket: one event per message, possibly several answers per socket); ``body(data)``
reads a whole JSON answer (a request that did not ask for a stream; ``whole=True`` reads one
passing as a stream — a chunked answer the router streams — at its end, up to ``max_event``
bytes). ``result()`` gives the ``Usage`` of the answer, the model and id the server named,
and the server's own cache diagnostic when it sent one. Pure: no mitmproxy, no I/O, no
clock; never raises.

Rules it keeps (docs/ledger.md says what each figure means):
- Only events that carry a usage object are parsed: an SSE event is parsed only if it holds
  the bytes ``"usage"`` (inside a JSON string a quote is always escaped, so these bytes only
  occur as a key). A chunk is cut at its last blank line (the end of an event) and searched
  for those bytes: a chunk without them costs a few scans in C, whatever its events; the work
  per streamed byte is bounded, and the text of an answer is never decoded.
- Anthropic messages: ``message_start.message.usage``, then ``message_delta.usage``, whose
  fields are cumulative: a field the delta states replaces the start's (``output_tokens``
  always; the input and cache fields when the server restates them). ``input_tokens``
  excludes the cache: input = input_tokens + cache_read_input_tokens +
  cache_creation_input_tokens. ``cache_creation.ephemeral_5m_input_tokens`` and
  ``ephemeral_1h_input_tokens`` split the cache write; without them it is all 5 minutes
  (the default lifetime). ``output_tokens_details.thinking_tokens`` (where the server sends
  it: a part of ``output_tokens``) is the reasoning. ``message.diagnostics.cache_miss_reason`` (``{type,
  cache_missed_input_tokens}``, beta ``cache-diagnosis-2026-04-07``) is the provider's reason.
- OpenAI chat: the last chunk's ``usage`` (``prompt_tokens`` includes the cache;
  ``prompt_tokens_details.cached_tokens``, else DeepSeek's ``prompt_cache_hit_tokens``,
  else a top-level ``cached_tokens``; ``completion_tokens_details.reasoning_tokens``).
- OpenAI Responses: ``response.completed`` (or ``.incomplete``/``.failed``)'s
  ``response.usage`` (``input_tokens`` includes the cache; ``input_tokens_details.
  cached_tokens``; ``output_tokens_details.reasoning_tokens``) and
  ``response.prompt_cache_diagnostics`` (``{type: cache_miss, reason, cache_missed_tokens}``).
- A usage object counts once per answer: the last one the answer sent wins (a server that
  repeats usage in several chunks restates it, it does not add to it). So of a chunk's events
  holding ``"usage"`` only the first and the last ``USAGE_EVENTS`` are parsed (found by C
  scans): a decompressed chunk of a million such events costs a few scans, not a million
  parses on the event loop.
- A figure above ``MAX_TOKENS`` (10**9: a thousand times the largest context window) is not
  stated (0; a diagnostic's ``missed``, None): one absurd number (``18446744073709551615``)
  never reaches the store's int64 sums, and no conversation's sums can pass them.
- A name the server gives (the model, the id, a diagnostic's reason) is cut to ``MAX_NAME``
  (200) characters: it becomes a store record's field and a Prometheus label.
- An empty chunk is no data, never the end (mitmproxy passes an empty HTTP/2 DATA frame
  mid-stream as one, as it passes the end): the end is ``result()``, which reads what is left
  (a last event without its blank line, a JSON answer passing as a stream).
- Bounded memory: an event longer than ``max_event`` is dropped (``overflow``); a
  compressed body is decompressed as it comes (``lineage_stream._Inflate``: at most
  ``MAX_DECODED`` in all and ``INFLATE_SLACK`` + ``INFLATE_RATIO`` times the compressed bytes
  so far; beyond, ``overflow``).
"""

from __future__ import annotations

import re

import msgspec

from ..reader import facts
from ..lineage.lineage_stream import _Inflate

MAX_EVENT = 4 * 1024 * 1024
_USAGE = b'"usage"'
_USAGE_RE = re.compile(re.escape(_USAGE))     # (a regex search: far faster than ``in`` on runs of one byte)
_EVENT_END = re.compile(rb"\r?\n\r?\n")
# A figure above this is not a token count of any turn (the largest context windows are ~10**7
# tokens): it reads as not stated. It keeps every sum an int64 (the store's ``hincr``) for more
# than 10**9 turns of a conversation, and a server's one absurd number out of the ledger.
MAX_TOKENS = 10**9
USAGE_EVENTS = 8        # per chunk, the first and the last this many events holding "usage" are read
MAX_NAME = 200          # characters of a model, id or reason the server names (a server may name 1 MB ones)


class Usage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Tokens of one answer (or a sum of answers), as the server reported them."""
    input: int = 0             # every input token, cached or not (OpenTelemetry's gen_ai.usage.input_tokens)
    output: int = 0            # every output token, reasoning included
    cache_read: int = 0        # input tokens read from the prompt cache
    cache_write_5m: int = 0    # input tokens written to the cache for 5 minutes
    cache_write_1h: int = 0    # input tokens written to the cache for 1 hour
    reasoning: int = 0         # output tokens spent reasoning, where the server says (part of output)

    @property
    def cache_write(self) -> int:
        return self.cache_write_5m + self.cache_write_1h

    @property
    def uncached(self) -> int:
        """Input tokens neither read from nor written to the cache (billed at the input price)."""
        return max(0, self.input - self.cache_read - self.cache_write)

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(input=self.input + other.input, output=self.output + other.output,
                     cache_read=self.cache_read + other.cache_read,
                     cache_write_5m=self.cache_write_5m + other.cache_write_5m,
                     cache_write_1h=self.cache_write_1h + other.cache_write_1h,
                     reasoning=self.reasoning + other.reasoning)


FIELDS = ("input", "output", "cache_read", "cache_write_5m", "cache_write_1h", "reasoning")


class Diagnostic(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The provider's own word on a cache miss."""
    reason: str                # e.g. "messages_changed", "model_changed" (Anthropic), the Responses reason
    missed: int | None = None  # tokens after the divergence, as the provider estimates them


class Read(msgspec.Struct, frozen=True, kw_only=True):
    api: str
    usage: Usage | None = None         # None: the answer stated no usage
    model: str | None = None           # the model the server says answered
    id: str | None = None              # message / completion / response id
    diagnostic: Diagnostic | None = None
    overflow: bool = False


# ---------------------------------------------------------------- the shapes read (usage only)


class _ACacheCreation(msgspec.Struct):
    ephemeral_5m_input_tokens: int | None = None
    ephemeral_1h_input_tokens: int | None = None


class _AOutputDetails(msgspec.Struct):
    thinking_tokens: int | None = None


class _AUsage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_creation: _ACacheCreation | None = None
    output_tokens_details: _AOutputDetails | None = None


class _AMissReason(msgspec.Struct):
    type: str | None = None
    cache_missed_input_tokens: int | None = None


class _ADiagnostics(msgspec.Struct):
    cache_miss_reason: _AMissReason | str | None = None


class _AMessage(msgspec.Struct):
    id: str | None = None
    model: str | None = None
    usage: _AUsage | None = None
    diagnostics: _ADiagnostics | None = None


class _AEvent(msgspec.Struct):
    type: str | None = None
    message: _AMessage | None = None
    usage: _AUsage | None = None
    diagnostics: _ADiagnostics | None = None


class _ABody(msgspec.Struct):       # a whole (non-streamed) Anthropic message
    id: str | None = None
    model: str | None = None
    usage: _AUsage | None = None
    diagnostics: _ADiagnostics | None = None


class _CPromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _CCompletionDetails(msgspec.Struct):
    reasoning_tokens: int | None = None


class _CUsage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _CPromptDetails | None = None
    completion_tokens_details: _CCompletionDetails | None = None
    prompt_cache_hit_tokens: int | None = None      # DeepSeek
    cached_tokens: int | None = None                # Moonshot (Kimi)


class _CChunk(msgspec.Struct):      # a chunk, or a whole completion
    id: str | None = None
    model: str | None = None
    usage: _CUsage | None = None


class _RInputDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _ROutputDetails(msgspec.Struct):
    reasoning_tokens: int | None = None


class _RUsage(msgspec.Struct):
    input_tokens: int | None = None
    output_tokens: int | None = None
    input_tokens_details: _RInputDetails | None = None
    output_tokens_details: _ROutputDetails | None = None


class _RDiagnostics(msgspec.Struct):
    type: str | None = None
    reason: str | dict | None = None
    cache_missed_tokens: int | None = None


class _RResponse(msgspec.Struct):
    id: str | None = None
    model: str | None = None
    usage: _RUsage | None = None
    prompt_cache_diagnostics: _RDiagnostics | None = None


class _REvent(msgspec.Struct):
    type: str | None = None
    response: _RResponse | None = None


_EVENTS = {facts.ANTHROPIC_MESSAGES: msgspec.json.Decoder(_AEvent), facts.OPENAI_CHAT: msgspec.json.Decoder(_CChunk),
           facts.OPENAI_RESPONSES: msgspec.json.Decoder(_REvent)}
_BODIES = {facts.ANTHROPIC_MESSAGES: msgspec.json.Decoder(_ABody), facts.OPENAI_CHAT: msgspec.json.Decoder(_CChunk),
           facts.OPENAI_RESPONSES: msgspec.json.Decoder(_RResponse)}
APIS = tuple(_EVENTS)
_R_FINAL = ("response.completed", "response.incomplete", "response.failed", "response.done")


def _last_end(buf: bytes) -> int:
    """Where the last complete event of ``buf`` ends (after its blank line), 0 if none does."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf != -1 else 0, crlf + 4 if crlf != -1 else 0)


def _span(buf: bytes, at: int, lo: int, hi: int) -> tuple[int, int]:
    """The event of ``buf[lo:hi]`` holding the byte at ``at``: after the blank line before it, up
    to the blank line after it."""
    lf, crlf = buf.rfind(b"\n\n", lo, at), buf.rfind(b"\n\r\n", lo, at)
    start = max(lf + 2 if lf != -1 else lo, crlf + 3 if crlf != -1 else lo)
    ends = [e for e in (buf.find(b"\n\n", at, hi), buf.find(b"\n\r\n", at, hi)) if e != -1]
    return start, min(ends) if ends else hi


def _usage_blocks(buf: bytes) -> list[bytes]:
    """The events of ``buf`` (whole events) holding ``"usage"``: the first and the last
    ``USAGE_EVENTS`` of them, in order, found by C scans. A usage object is restated, not
    added to (the last one stated wins), so the events between are passed over: a chunk of
    a million of them costs a few scans, not a million parses."""
    spans: list[tuple[int, int]] = []
    pos, n = 0, len(buf)
    while len(spans) < USAGE_EVENTS:
        m = _USAGE_RE.search(buf, pos)
        if m is None:
            return [buf[s:e] for s, e in spans]
        span = _span(buf, m.start(), pos, n)
        spans.append(span)
        pos = span[1]
    last: list[tuple[int, int]] = []
    end = n
    while len(last) < USAGE_EVENTS:
        at = buf.rfind(_USAGE, pos, end)
        if at == -1:
            break
        span = _span(buf, at, pos, end)
        last.append(span)
        end = span[0]
    return [buf[s:e] for s, e in spans + last[::-1]]


def _n(v: int | None) -> int:
    """A token count as stated: one above ``MAX_TOKENS`` (or not a positive integer) is not one."""
    return v if isinstance(v, int) and 0 < v <= MAX_TOKENS else 0


def _cut(v: str | None) -> str | None:
    """A name the server gave (model, id, a diagnostic's reason), at most ``MAX_NAME`` characters."""
    return v[:MAX_NAME] if isinstance(v, str) and v else None


def _missed(v: int | None) -> int | None:
    return v if isinstance(v, int) and 0 <= v <= MAX_TOKENS else None


class UsageReader:
    """Feed it the body's chunks (``reader(chunk)`` returns the chunk), then ``result()``."""

    def __init__(self, api: str, content_encoding: str = "", max_event: int = MAX_EVENT, whole: bool = False) -> None:
        self.api = api
        self.max_event = max_event
        self.whole = whole                 # a JSON answer passing as a stream: read at its end (bounded)
        self._body = bytearray()
        self._events = _EVENTS.get(api)
        self._broken = self._events is None
        self._pending = bytearray()        # the event under way (its start came in an earlier chunk)
        self._dropping = False
        self._overflow = False
        self._id: str | None = None
        self._model: str | None = None
        self._diag: Diagnostic | None = None
        self._a: dict[str, int | None] = {}      # Anthropic: the usage fields as last stated
        self._usage: Usage | None = None
        self._inflate = None
        codings = [c.strip().lower() for c in (content_encoding or "").split(",")
                   if c.strip().lower() not in ("", "identity")]
        if len(codings) > 1:
            self._broken = True
        elif codings:
            try:
                self._inflate = _Inflate(codings[0])
            except Exception:
                self._broken = True

    # mitmproxy calls the stream callable with each chunk, and with b"" at the end — and with b""
    # for an empty HTTP/2 DATA frame mid-stream too (legal, a server's choice): so an empty chunk
    # is no data, never the end; the end is ``result()`` (taken once the answer has ended)
    def __call__(self, chunk: bytes) -> bytes:
        try:
            if self._broken or not chunk:
                return chunk
            if self.whole:
                if len(self._body) + len(chunk) > self.max_event:
                    self._overflow = self._broken = True
                    self._body.clear()
                else:
                    self._body += chunk
                return chunk
            self._lines(self._inflate.feed(chunk) if self._inflate is not None else chunk)
        except OverflowError:
            self._overflow = self._broken = True
        except Exception:
            self._broken = True
        return chunk

    def message(self, data: bytes | str) -> Read | None:
        """One WebSocket message from the server; the answer's ``Read`` when it ended one."""
        try:
            if isinstance(data, str):
                data = data.encode("utf-8", "surrogatepass")
            if self._events is None or _USAGE_RE.search(data) is None:
                return None
            if len(data) > self.max_event:
                self._overflow = True
                return None
            ev = self._events.decode(data)
            if isinstance(ev, _REvent) and ev.type in _R_FINAL:
                self._responses(ev)
                read = self.result()
                self._usage = self._diag = self._id = self._model = None
                return read
            self._event(bytes(data))
        except Exception:
            pass
        return None

    def body(self, data: bytes | None) -> None:
        """A whole JSON answer (not streamed)."""
        decoder = _BODIES.get(self.api)
        if decoder is None or not data:
            return
        try:
            if self._inflate is not None:
                data = self._inflate.feed(data)
            if _USAGE_RE.search(data) is None:
                return
            b = decoder.decode(data)
        except Exception:
            return
        if isinstance(b, _ABody):
            self._id, self._model = b.id, b.model
            self._anthropic_usage(b.usage)
            self._anthropic_diag(b.diagnostics)
        elif isinstance(b, _CChunk):
            self._chat(b)
        elif isinstance(b, _RResponse):
            self._responses(_REvent(type="response.completed", response=b))

    def result(self) -> Read:
        try:
            if not self._broken:
                self._end()          # the last event, if the stream ended without its blank line
        except Exception:
            self._broken = True
        usage = self._usage
        if self.api == facts.ANTHROPIC_MESSAGES and self._a:
            usage = self._anthropic_total()
        return Read(api=self.api, usage=usage, model=_cut(self._model), id=_cut(self._id), diagnostic=self._diag,
                    overflow=self._overflow)

    # ------------------------------------------------------------ SSE

    def _lines(self, data: bytes) -> None:
        """Whole events are cut at their blank line; only those holding ``"usage"`` are read
        line by line. The rest costs a few scans in C per chunk, never a Python step per line,
        and an event arriving in many chunks is gathered in one buffer (linear, not quadratic)."""
        tail = bytes(self._pending[-3:])          # a blank line may straddle two chunks
        probe = tail + data if tail else data
        end = _last_end(probe) - len(tail)        # where, in ``data``, the last complete event ends
        if end <= 0:
            if not self._dropping:
                self._pending += data
                if len(self._pending) > self.max_event:
                    self._overflow = self._dropping = True
                    self._pending.clear()
            return
        if self._dropping:                        # the end of an event over the bound: skip it
            self._dropping = False
            buf = data[max(0, _EVENT_END.search(probe).end() - len(tail)):end]
        else:
            buf = bytes(self._pending) + data[:end] if self._pending else data[:end]
        for block in _usage_blocks(buf):
            self._block(block)
        self._pending = bytearray(data[end:])
        if len(self._pending) > self.max_event:
            self._overflow = self._dropping = True
            self._pending.clear()

    def _block(self, block: bytes) -> None:
        """One event's lines: its data lines joined, as SSE says."""
        data = []
        for line in block.splitlines():
            if line.startswith(b"data:"):
                data.append(line[6:] if line.startswith(b"data: ") else line[5:])
        if data:
            self._event(b"\n".join(data))

    def _end(self) -> None:
        """What is left when the stream has ended (again: nothing left)."""
        if self.whole:
            body, self._body = bytes(self._body), bytearray()
            self.body(body)
            return
        if self._pending and not self._dropping and _USAGE_RE.search(self._pending) is not None:
            self._block(bytes(self._pending))
        self._pending = bytearray()

    # ------------------------------------------------------------ events

    def _event(self, data: bytes) -> None:
        try:
            ev = self._events.decode(data)
        except (msgspec.DecodeError, RecursionError):
            return          # another shape (an error event): no usage to take from it
        if isinstance(ev, _AEvent):
            if ev.type == "message_start" and ev.message is not None:
                m = ev.message
                self._id, self._model = m.id or self._id, m.model or self._model
                self._anthropic_usage(m.usage)
                self._anthropic_diag(m.diagnostics)
            elif ev.type == "message_delta":
                self._anthropic_usage(ev.usage)
                self._anthropic_diag(ev.diagnostics)
        elif isinstance(ev, _CChunk):
            self._chat(ev)
        elif isinstance(ev, _REvent) and ev.type in _R_FINAL:
            self._responses(ev)

    def _anthropic_usage(self, u: _AUsage | None) -> None:
        if u is None:
            return
        for name in ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
            v = getattr(u, name)
            if v is not None:
                self._a[name] = v
        if u.output_tokens_details is not None and u.output_tokens_details.thinking_tokens is not None:
            self._a["thinking"] = u.output_tokens_details.thinking_tokens
        if u.cache_creation is not None:
            if u.cache_creation.ephemeral_5m_input_tokens is not None:
                self._a["5m"] = u.cache_creation.ephemeral_5m_input_tokens
            if u.cache_creation.ephemeral_1h_input_tokens is not None:
                self._a["1h"] = u.cache_creation.ephemeral_1h_input_tokens

    def _anthropic_total(self) -> Usage:
        a = self._a
        read, write = _n(a.get("cache_read_input_tokens")), _n(a.get("cache_creation_input_tokens"))
        one_h = min(_n(a.get("1h")), write)
        return Usage(input=_n(a.get("input_tokens")) + read + write, output=_n(a.get("output_tokens")),
                     cache_read=read, cache_write_5m=write - one_h, cache_write_1h=one_h,
                     reasoning=_n(a.get("thinking")))

    def _anthropic_diag(self, d: _ADiagnostics | None) -> None:
        if d is None or d.cache_miss_reason is None:
            return
        r = d.cache_miss_reason
        if isinstance(r, str):
            self._diag = Diagnostic(reason=_cut(r) or "")
        elif r.type:
            self._diag = Diagnostic(reason=_cut(r.type) or "", missed=_missed(r.cache_missed_input_tokens))

    def _chat(self, ev: _CChunk) -> None:
        self._id = self._id or ev.id
        self._model = ev.model or self._model
        u = ev.usage
        if u is None:
            return
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else None
        if cached is None:
            cached = u.prompt_cache_hit_tokens if u.prompt_cache_hit_tokens is not None else u.cached_tokens
        reasoning = u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details is not None else None
        self._usage = Usage(input=_n(u.prompt_tokens), output=_n(u.completion_tokens), cache_read=_n(cached),
                            reasoning=_n(reasoning))

    def _responses(self, ev: _REvent) -> None:
        r = ev.response
        if r is None:
            return
        self._id, self._model = r.id or self._id, r.model or self._model
        u = r.usage
        if u is not None:
            cached = u.input_tokens_details.cached_tokens if u.input_tokens_details is not None else None
            reasoning = u.output_tokens_details.reasoning_tokens if u.output_tokens_details is not None else None
            self._usage = Usage(input=_n(u.input_tokens), output=_n(u.output_tokens), cache_read=_n(cached),
                                reasoning=_n(reasoning))
        d = r.prompt_cache_diagnostics
        if d is not None and d.type == "cache_miss":
            reason = d.reason if isinstance(d.reason, str) else \
                d.reason.get("type") if isinstance(d.reason, dict) else None
            self._diag = Diagnostic(reason=_cut(str(reason or "cache_miss")) or "", missed=_missed(d.cache_missed_tokens))
        elif d is not None and d.type in ("comparison_response_not_found", "unavailable"):
            self._diag = Diagnostic(reason=d.type)
