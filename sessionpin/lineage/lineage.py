"""A conversation is its lineage: what ties a request to the conversation it continues or forks.

Pure (no mitmproxy, no I/O, no clock) and never raises: bad input gives empty signals or a
chain with ``parsed=False``. Only ids and hashes leave this module, never a prompt's text.

Rules it keeps (sources: the recordings in tests/fixtures/traffic, docs/traffic.md "Lineage";
docs/facts.md "Lineage" lists each rule and its limits):
- ``signals``: the links a request states outright, explicit ones only. Codex's
  ``x-codex-turn-metadata`` (header, or ``client_metadata`` in a body) names the parent thread
  (``forked_from_thread_id``, ``parent_thread_id``): a session id. Claude Code names the previous
  response of its process: ``cc_prev_req=<request-id>`` in the billing line, body
  ``diagnostics.previous_message_id``; a Responses body its ``previous_response_id``: anchors the
  router remembers from earlier responses. They matter only for a request carrying history:
  Claude Code sends them on every request after a process's first, so an opening after
  ``/clear`` names the old conversation too, and an opening is always a new conversation.
- ``chain``: the history as a hash chain. Items are grouped into runs: a *model* run (assistant
  messages; Responses reasoning, ``*_call``, compaction items: what one response made) and a
  *client* run (user and tool messages, ``*_output`` items). ``system``/``developer`` items,
  the system prompt and instructions are not part of it (clients rebuild them per process: dates,
  git status, billing line). Each run is reduced to what identifies it: a model run to its
  tool-call ids, the server's opaque tokens (thinking signatures, redacted thinking, encrypted
  reasoning) and its text; a client run to its texts (client-injected context blocks excepted,
  see ``CONTEXT_PREFIXES``) and the ids of the tool calls it answers. Tool inputs, tool results,
  thinking text and every other field, cache-control markers included, are never read. A string
  content reads like one text block holding it. The state after each model run is a key.
- A model run's identity is the same whether read from a later request or from the response
  that made it (``lineage_stream`` hashes the stream alike): ``extend(head, answer)`` is the key
  the next request will have at that turn.
- ``turns`` bounds the read to the first N model runs: the cost is that of the items read (a
  large body is walked item by item), so the root key (``turns=1``) costs about what the facts
  reader already pays; the whole chain costs one msgspec pass over the history.
- A read bounded by ``turns`` also has a budget (``TURNS_BUDGET``: 8 MiB of the history and
  10,000 items): a history whose first N model runs do not fit in it has no keys
  (``parsed=False``, "over the read's budget") — its root is not known, on either side of a
  fork, as for a history never seen. Real first exchanges are a few items and well under a
  MiB; a pathological body (a million tiny messages, or one huge message, before the first
  answer) then costs a bounded read, never the whole body (issue 20). The N-th model run ends
  at the item after it, which need not fit: the item that crosses the budget is read for its
  role and type alone, from its first bytes (``lineage_wire.KindOnly``) — a first answer
  followed by a 9 MB tool result (a PDF read as base64) has its root, and so does every
  request and fork that carries it, all read the same way. Such a root is not proven for the
  next request (``root_of``: it is read again, within the budget).
"""

from __future__ import annotations

import hashlib
import re
from typing import Iterable

import msgspec
from msgspec import Raw

from ..reader import facts
from . import lineage_wire as lw

MODEL, CLIENT = b"M", b"C"
_SEED = hashlib.blake2b(b"sessionpin lineage v1", digest_size=16).digest()

# Client-made context a client may rewrite between requests of one conversation (Claude Code's
# reminders, among them its attribution block; Codex's environment context with the date and
# cwd): not part of a client run's identity.
CONTEXT_PREFIXES = ("<system-reminder>", "<environment_context>")

# A model item's type (Responses input items without a role).
MODEL_TYPES = frozenset({"reasoning", "compaction", "compaction_summary"})
_SKIP_TYPES = frozenset({"additional_tools"})


# ---------------------------------------------------------------- identities


def _blake(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def token_digest(token: str) -> bytes:
    return _blake(token.encode("utf-8", "surrogatepass"))


class TextDigest:
    """blake2b-128 of a text with surrounding whitespace stripped, fed in pieces: leading
    whitespace is dropped, trailing whitespace held back until more text follows (at most
    ``HOLD`` characters of it: a longer run is hashed as it is)."""

    HOLD = 65536

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)
        self._started = False
        self._held = ""

    def feed(self, text: str) -> None:
        if not text:
            return
        if not self._started:
            text = text.lstrip()
            if not text:
                return
            self._started = True
        body = text.rstrip()
        if body:
            if self._held:
                self._h.update(self._held.encode("utf-8", "surrogatepass"))
            _update_text(self._h, body)
            self._held = text[len(body):]
        else:
            self._held += text
        if len(self._held) > self.HOLD:
            self._h.update(self._held.encode("utf-8", "surrogatepass"))
            self._held = ""

    def digest(self) -> bytes:
        return self._h.copy().digest()


def text_digest(text: str) -> bytes:
    d = TextDigest()
    d.feed(text)
    return d.digest()


def model_digest(ids: Iterable[str], tokens: Iterable[bytes], text: bytes) -> bytes:
    """What identifies one response: its tool-call ids and token digests (sets: their order is
    the client's business) and the digest of its text."""
    h = hashlib.blake2b(digest_size=16)
    for tag, values in ((b"i", sorted({i.encode("utf-8", "surrogatepass") for i in ids})), (b"t", sorted(set(tokens)))):
        for v in values:
            h.update(tag + len(v).to_bytes(4, "big") + v)
    h.update(b"x" + text)
    return h.digest()


# A long text is hashed in pieces of this many characters: the same digest (blake2b is a
# stream) without a copy of the whole text or two (a megabyte's fresh pages faulted in on
# every request whose history opens with it: ~0.5 of the 2.7 ms of its root, issue 22).
_PIECE = 64 * 1024


def _update_text(h, text: str) -> None:
    """``h.update(text.encode("utf-8", "surrogatepass"))``, a long ASCII text in pieces."""
    if len(text) > _PIECE and text.isascii():
        for k in range(0, len(text), _PIECE):
            h.update(text[k:k + _PIECE].encode("ascii"))
    else:
        h.update(text.encode("utf-8", "surrogatepass"))


def _update_tagged(h, tag: bytes, value: str) -> None:
    """``h.update(tag + len(data).to_bytes(4, "big") + data)``, ``data`` the value's UTF-8."""
    if len(value) > _PIECE and value.isascii():
        h.update(tag + len(value).to_bytes(4, "big"))      # ASCII: a character is a byte
        _update_text(h, value)
        return
    data = value.encode("utf-8", "surrogatepass")
    h.update(tag + len(data).to_bytes(4, "big"))
    h.update(data)


def _step(state: bytes, tag: bytes, run: bytes) -> bytes:
    return _blake(state + tag + run)


def extend(head: str, answer_digest: str) -> str | None:
    """The key a request whose history ends at ``head`` will have once the answer with
    ``answer_digest`` (``lineage_stream.Answer.digest``) is in it. None for bad input."""
    try:
        return _step(bytes.fromhex(head), MODEL, bytes.fromhex(answer_digest)).hex()
    except (ValueError, TypeError):
        return None


def _kind(item: lw.Item) -> bytes | None:
    role, typ = item.role, item.type
    if role in ("system", "developer"):
        return None
    if role == "assistant":
        return MODEL
    if role is not None:
        return CLIENT
    if typ is None or typ in _SKIP_TYPES:
        return None
    if typ in MODEL_TYPES or typ.endswith("_call"):
        return MODEL
    return CLIENT


class _Run:
    """The identity of one run, accumulated item by item."""

    def __init__(self, kind: bytes) -> None:
        self.kind = kind
        self.ids: list[str] = []
        self.tokens: list[bytes] = []
        self.text = TextDigest()
        self.client = hashlib.blake2b(digest_size=16)

    def add(self, item: lw.Item) -> None:
        content = item.content
        if self.kind == MODEL:
            if isinstance(content, str):
                self.text.feed(content)
            elif content:
                for part in content:
                    if part.type in ("text", "output_text") and part.text:
                        self.text.feed(part.text)
                    elif part.id and part.type in ("tool_use", "server_tool_use"):
                        self.ids.append(part.id)
                    elif part.signature and part.type == "thinking":
                        self.tokens.append(token_digest(part.signature))
                    elif part.data and part.type == "redacted_thinking":
                        self.tokens.append(token_digest(part.data))
            for call in item.tool_calls or ():
                if call.id:
                    self.ids.append(call.id)
            if item.call_id:
                self.ids.append(item.call_id)
            if item.encrypted_content:
                self.tokens.append(token_digest(item.encrypted_content))
            return
        parts: list[tuple[bytes, str]] = []
        if isinstance(content, str):
            parts.append((b"u", content))
        elif content:
            for part in content:
                if part.text is not None and part.type in (None, "text", "input_text"):
                    parts.append((b"u", part.text))
                elif part.tool_use_id:
                    parts.append((b"r", part.tool_use_id))
        for tag, value in ((b"r", item.tool_call_id), (b"r", item.call_id)):
            if value:
                parts.append((tag, value))
        if not parts and item.type and item.type != "message":
            parts.append((b"y", item.type))  # an item of another kind: at least what it is
        for tag, value in parts:
            if tag == b"u":
                value = value.strip()
                if not value or value.startswith(CONTEXT_PREFIXES):
                    continue
            _update_tagged(self.client, tag, value)

    def digest(self) -> bytes:
        if self.kind == MODEL:
            return model_digest(self.ids, self.tokens, self.text.digest())
        return self.client.digest()


# ---------------------------------------------------------------- the chain


class Chain(msgspec.Struct, frozen=True, kw_only=True):
    keys: tuple[str, ...] = ()    # the state after each model run read, oldest first (hex)
    head: str | None = None       # the state after the last item, when the whole history was read
    turns: int = 0                # model runs read (= len(keys))
    partial: bool = False         # previous_response_id: the history goes on a stored response
    parsed: bool = True           # False: the body holds no readable history (see reason)
    reason: str = ""


TURNS_BUDGET = lw.Budget(size=8 * 1024 * 1024, items=10_000)
OVER_BUDGET = "the history before the turns asked for is over the read's budget"

_FLAVOUR = {facts.ANTHROPIC_MESSAGES: "anthropic", facts.ANTHROPIC_COUNT_TOKENS: "anthropic",
            facts.OPENAI_CHAT: "chat", facts.OPENAI_RESPONSES: "responses"}


def chain(body: bytes | None, api: str, turns: int | None = None, content_encoding: str = "",
          members: dict[str, Raw] | None = None, ends: list[int] | None = None,
          walk_from: int = lw.FAST_MIN) -> Chain:
    """The hash chain of a request body's history (decoded body; or give its content-encoding).
    ``turns``: stop after that many model runs (None: read it all). ``members``: the body's top
    level as raw members, decoded already (the facts reader's: ``perflow.Body``), read instead
    of the body. ``ends``: a walked history's item ends (``lineage_wire.walk``). ``walk_from``:
    with ``turns``, a body this large or larger is walked item by item. Never raises."""
    try:
        return _chain(body, api, turns, content_encoding, members, ends, walk_from)
    except Exception as e:  # pragma: no cover - a last resort; the property tests look for it
        return Chain(parsed=False, reason=f"internal error: {type(e).__name__}")


def _chain(body, api, turns, content_encoding, members=None, ends=None, walk_from=lw.FAST_MIN) -> Chain:
    flavour = _FLAVOUR.get(api)
    if flavour is None:
        return Chain(parsed=False, reason="not an inference api")
    data, problem = facts.decode_body(body, content_encoding or "")
    if problem:
        return Chain(parsed=False, reason=problem)
    try:
        return _chain_of(data, flavour, turns, members, ends, walk_from)
    except lw.OverBudget:
        return Chain(parsed=False, reason=OVER_BUDGET)


def _chain_of(data: bytes, flavour: str, turns: int | None, members: dict[str, Raw] | None = None,
              ends: list[int] | None = None, walk_from: int = lw.FAST_MIN) -> Chain:
    items, previous = lw.history(data, flavour, whole=turns is None, budget=None if turns is None else TURNS_BUDGET,
                                 members=members, ends=ends, walk_from=walk_from)
    if items is None:
        return Chain(parsed=False, reason="no history")
    if isinstance(items, str):  # Responses: the whole input is one user text
        items = iter([lw.Item(role="user", content=items)])
    state, keys, run = _SEED, [], None
    stopped = False
    for item in items:
        kind = _kind(item)
        if isinstance(item, lw.KindOnly) and (kind in (None, MODEL) or run is None or run.kind != MODEL):
            raise lw.OverBudget     # past the budget, its kind alone says only that a model run ended
        if kind is None:
            continue
        if run is not None and kind != run.kind:
            state = _step(state, run.kind, run.digest())
            if run.kind == MODEL:
                keys.append(state.hex())
                if turns is not None and len(keys) >= turns:
                    stopped, run = True, None
                    break
            run = None
        if isinstance(item, lw.KindOnly):
            raise lw.OverBudget     # the turns asked for go on past the budget
        if run is None:
            run = _Run(kind)
        run.add(item)
    if run is not None:
        state = _step(state, run.kind, run.digest())
        if run.kind == MODEL:
            keys.append(state.hex())
    if previous is None and flavour == "responses" and len(data) >= lw.FAST_MIN:
        previous = _previous_response_id(data)  # a walked body was not decoded at the top
    return Chain(keys=tuple(keys), head=None if stopped else state.hex(), turns=len(keys),
                 partial=bool(previous))


class FirstRun(msgspec.Struct, frozen=True):
    """What proves a history's root for its conversation's next request: the bytes the root was
    read from — the body from its first byte through the item that ended the first model run
    (``first``; the history array's items begin at ``at``, just after its ``[``) — and that root."""

    api: str
    first: bytes
    at: int
    root: str


def root_of(body: bytes | None, api: str, content_encoding: str = "", members: dict[str, Raw] | None = None,
            known: FirstRun | None = None) -> tuple[str | None, FirstRun | None]:
    """``chain(body, api, turns=1).keys[0]`` (None: none), and what proves it for the next request
    of the conversation (None: nothing can — a history read at once rather than walked, or one
    with no item yet after its first model run). With ``known``, the previous request's proof: a
    history that begins with the same bytes (compared in C: ~50 µs a megabyte) through the item
    that ended the first model run has that root — the same items, parsed the same way, end the
    same first run at the same item — and nothing is decoded or hashed again (a 1 MB opening's
    root costs ~2.2 ms, every continuation). A small history (under ``FAST_MIN``) is read at
    once, as the request path reads it, and walked too for its proof (its first run is a few
    items: the walk stops there) — proven only when the walk reads the same first run — so
    every conversation's continuations can be proven (``proven_root``). Never raises."""
    try:
        return _root_of(body, api, content_encoding, members, known)
    except Exception:  # pragma: no cover - a last resort, as chain()'s
        return None, None


def proven_root(body: bytes | None, api: str, known: FirstRun) -> str | None:
    """The root ``known`` proves for ``body`` (not content-encoded), or None when it proves
    nothing for it (read it with ``root_of``). The check alone: one ``memcmp`` of the proof's
    bytes when the body begins with them (~1 µs for a request of tens of KB: cheap enough for
    the event loop), else where the history begins (``array_start``: the members before it
    skimmed, ~20 µs) and the history's bytes compared. Never raises."""
    try:
        if body is None or known.api != api or api not in _FLAVOUR:
            return None
        data = body if isinstance(body, bytes) else bytes(body)
        return known.root if _proves(data, api, known) else None
    except Exception:  # pragma: no cover - a last resort, as chain()'s
        return None


def _proves(data: bytes, api: str, known: FirstRun) -> bool:
    # The same bytes from the body's first: the same members before the history, its array
    # begun at the same place, the same items through the first run — parsed the same way.
    if data.startswith(known.first):        # memcmp (a memoryview's == goes byte by byte)
        return True
    # Members before the history changed (a system prompt, a setting): the history's own bytes.
    s = lw.array_start(data, b"input" if _FLAVOUR[api] == "responses" else b"messages")
    return s != -1 and data[s:s + len(known.first) - known.at] == known.first[known.at:]


def _root_of(body, api, content_encoding, members, known) -> tuple[str | None, FirstRun | None]:
    flavour = _FLAVOUR.get(api)
    if flavour is None:
        return None, None
    data, problem = facts.decode_body(body, content_encoding or "")
    if problem:
        return None, None
    if known is not None and known.api == api and _proves(data, api, known):
        return known.root, known
    ends: list[int] = []
    c = chain(data, api, turns=1, members=members, ends=ends)
    root = c.keys[0] if c.keys else None
    if root is not None and len(data) < lw.FAST_MIN:
        # Read at once, as the request path reads it; walked too, for the items' ends, and
        # proven only where the walk reads the same first run (one that stops at an item that
        # is not an object, where the whole read skips it, proves nothing).
        try:
            walked = _chain_of(data, flavour, 1, None, ends, walk_from=0)
        except lw.OverBudget:            # a first run past the walk's budget: unproven
            return root, None
        if walked.keys[:1] != (root,) or walked.head is not None:
            return root, None
    elif root is None or c.head is not None:     # the first run not ended
        return root, None
    if not ends or ends[-1] < 0:                 # not walked, or its run ended by an item past the budget
        return root, None
    s = lw.array_start(data, b"input" if flavour == "responses" else b"messages")
    return root, FirstRun(api=api, first=bytes(data[:ends[-1]]), at=s, root=root)


_PREVIOUS = re.compile(rb'"previous_response_id"\s*:\s*"')


def _previous_response_id(data: bytes) -> bool:
    """A Responses body names a stored response. In such a body nested objects are rare (tool
    arguments and outputs are strings, where a quote is escaped), so the key's presence with a
    string value is taken as the top-level field."""
    return _PREVIOUS.search(data) is not None


# ---------------------------------------------------------------- explicit signals


class Signals(msgspec.Struct, frozen=True, kw_only=True):
    sessions: tuple[str, ...] = ()   # parent session ids named outright (look up their pins)
    anchors: tuple[str, ...] = ()    # "req:<id>", "msg:<id>", "resp:<id>": look up the anchor index
    fork: bool = False               # the client says it forked (Codex cold_fork)
    resume: bool = False             # the client says it resumed (Codex cold_resume)


class _Diagnostics(msgspec.Struct):
    previous_message_id: str | None = None


class _SignalBody(msgspec.Struct):
    system: str | list[lw.Part] | None = None
    diagnostics: _Diagnostics | None = None
    previous_response_id: str | None = None
    client_metadata: dict[str, str] | None = None


_signal_body = msgspec.json.Decoder(_SignalBody)
_signal_fields = {"system": msgspec.json.Decoder(str | list[lw.Part] | None),
                  "diagnostics": msgspec.json.Decoder(_Diagnostics | None),
                  "previous_response_id": msgspec.json.Decoder(str | None),
                  "client_metadata": msgspec.json.Decoder(dict[str, str] | None)}
_PREV_REQ = re.compile(r"(?:^|[;\s])cc_prev_req=([^;\s]+)")


# Where each api keeps its links, the member nearest the end first (Claude Code sends system,
# then diagnostics, after its messages: the tail read from system holds both).
_SIGNAL_NAMES = {"anthropic": ("system", "diagnostics"), "chat": (),
                 "responses": ("client_metadata", "previous_response_id")}


def _signal_body_of(data: bytes, flavour: str | None) -> _SignalBody:
    fields = None
    if flavour == "chat":
        return _SignalBody()
    if len(data) >= lw.FAST_MIN:  # the links sit before or after the history: read only those
        for key, names in ((b"messages", _SIGNAL_NAMES["anthropic"]), (b"input", _SIGNAL_NAMES["responses"])):
            if flavour is None or key == (b"input" if flavour == "responses" else b"messages"):
                fields = lw.top_fields(data, _SIGNAL_NAMES[flavour] if flavour else names, key)
                if fields is not None:
                    break
    if fields is None:
        try:
            return _signal_body.decode(data)
        except msgspec.ValidationError:
            pass
        except (msgspec.DecodeError, RecursionError):
            return _SignalBody()
        try:
            fields = lw._loose.decode(data)
        except (msgspec.DecodeError, RecursionError):
            return _SignalBody()
    values = {}
    for name, decoder in _signal_fields.items():
        if name in fields:
            try:
                values[name] = decoder.decode(fields[name])
            except (msgspec.DecodeError, RecursionError):
                pass
    return _SignalBody(**values)


def signals(headers: object, body: bytes | None = None, content_encoding: str = "", api: str | None = None) -> Signals:
    """The links a request states outright (headers; and the body, decoded or with its
    content-encoding, when given; ``api`` says where to look in it). Never raises."""
    try:
        return _signals(headers, body, content_encoding, api)
    except Exception:  # pragma: no cover - a last resort; the property tests look for it
        return Signals()


def _signals(headers, body, content_encoding, api) -> Signals:
    h = facts.header_map(headers)
    b = _SignalBody()
    if body is not None:
        data, problem = facts.decode_body(body, content_encoding or "")
        if not problem and data.strip():
            b = _signal_body_of(data, _FLAVOUR.get(api))
    meta = facts.codex_turn_metadata(h)
    if not meta and b.client_metadata and "x-codex-turn-metadata" in b.client_metadata:
        meta = facts.codex_turn_metadata({"x-codex-turn-metadata": b.client_metadata["x-codex-turn-metadata"]})
    sessions = [sid for sid in (facts.clean_id(meta.get("forked_from_thread_id")),
                                facts.clean_id(meta.get("parent_thread_id"))) if sid]
    anchors = []
    line = _billing_text(b.system)
    if line:
        m = _PREV_REQ.search(line)
        if m and facts.clean_id(m.group(1)):
            anchors.append("req:" + m.group(1))
    if b.diagnostics is not None and facts.clean_id(b.diagnostics.previous_message_id):
        anchors.append("msg:" + b.diagnostics.previous_message_id.strip())
    if facts.clean_id(b.previous_response_id):
        anchors.append("resp:" + b.previous_response_id.strip())
    init = meta.get("history_initialization", "")
    return Signals(sessions=tuple(dict.fromkeys(sessions)), anchors=tuple(anchors),
                   fork=init == "cold_fork", resume=init == "cold_resume")


def _billing_text(system: object) -> str | None:
    first = system if isinstance(system, str) else system[0].text if system else None
    if isinstance(first, str) and first.lstrip().startswith(facts.BILLING_PREFIX):
        return first.strip().split("\n", 1)[0]
    return None
