"""The shape of a request's prompt, as a prompt cache sees it: what a later turn can reuse.

A provider's prompt cache reuses a request's prefix, in the order the server lays the prompt
out: tools, then the system prompt, then the messages. ``shape(body, api)`` reduces a request
to that order as digests and sizes — the model, a digest of the tools, of the system prompt,
and of each message, with their lengths in bytes — and ``compare(prev, cur)`` says how much of
the previous request's prompt the current one repeats, and where and why it stops.

Rules it keeps:
- Only digests (CRC-32 with the length: fast, for comparing a request with the next one) and
  byte lengths leave this module, never a prompt's text.
- ``cache_control`` markers are not part of a digest: clients move their breakpoint to the
  newest message each turn, which changes no cached token. They are found by their key
  (``"cache_control":{…}``: inside a JSON string a quote is always escaped, so the bytes only
  occur as a key) and cut out before hashing.
- Claude Code's billing line (a system block ``x-anthropic-billing-header: …``, new on every
  request, before the cached system prompt) is not part of the system prompt's digest: the
  API must leave it out of what it caches, or no Claude Code turn would ever read from cache.
- A message of one text reads the same as a string or as one text block (the API makes
  the one the other; Claude Code switches between them for its newest message).
- OpenAI chat and Responses put the system prompt in the messages (``system``/``developer``
  items, ``instructions``): the leading ones count as the system prompt.
- A Responses request that continues a stored response (``previous_response_id``) carries only
  its new items: its shape is ``partial`` and its history cannot be compared.
- ``compare`` gives the share of the previous prompt's bytes the current one repeats from the
  start (1.0: all of it, the history only grew), the first message that differs, and the
  first difference's kind: ``model``, ``tools``, ``system`` or ``messages``. The share is of
  bytes, an estimate of the share of tokens (the cache counts tokens; the proxy has no
  tokenizer).
- Pure, never raises: a body that cannot be read gives ``None``.
"""

from __future__ import annotations

import bisect
import re
import zlib
from collections import OrderedDict
from typing import Callable, NamedTuple

import msgspec
from msgspec import Raw

from . import arrays, facts
from .encodings import decode_body
from .scan import back_over, skip_ws

_MARKER = re.compile(rb',?\s*"cache_control"\s*:\s*\{[^{}]*\}')    # what ``_unmarked`` removes
_MARKER_KEY = b'"cache_control"'
_MARKER_REST = re.compile(rb'\s*:\s*\{[^{}]*\}')
_SPACE = b" \t\n\r\x0b\x0c"    # the regex's \s, for bytes
# a message whose content list begins with a text block (the only kind ``_canonical`` may
# change): matched at its start, so other messages cost nothing more
_TEXT_FIRST = re.compile(rb'\{\s*(?:"role"\s*:\s*"[a-z]*"\s*,\s*)?"content"\s*:\s*\[\s*\{\s*"type"\s*:\s*"text"')
_LEADING = frozenset({"system", "developer"})
_BILLING = facts.BILLING_PREFIX.encode()


class Shape(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    model: str = ""
    tools: str = ""                       # digest ("" none)
    tools_len: int = 0
    system: str = ""
    system_len: int = 0
    messages: tuple[str, ...] = ()        # a digest per message (or Responses input item)
    lengths: tuple[int, ...] = ()         # its length in bytes
    partial: bool = False                 # continues a stored response: the history is not all here

    @property
    def size(self) -> int:
        return self.tools_len + self.system_len + sum(self.lengths)


class Difference(msgspec.Struct, frozen=True, kw_only=True):
    share: float          # of the previous prompt's bytes, repeated from the start by this one
    kind: str = ""        # "" (only grew), "model", "tools", "system", "messages", "unknown"
    at: int | None = None  # the first message that differs (0-based), for "messages"


class _Body(msgspec.Struct):
    model: str | None = None
    tools: Raw = Raw()              # (msgspec takes no Raw in a union: empty means absent)
    system: Raw = Raw()
    instructions: Raw = Raw()
    messages: list[Raw] | None = None
    input: Raw = Raw()              # a list of items, or a string
    previous_response_id: str | None = None


class _Flat(_Body):
    """``_Body`` with the messages array kept whole (``Runs``: its bytes are compared)."""
    messages: Raw = Raw()       # type: ignore[assignment]


class _Role(msgspec.Struct):
    role: str | None = None


class _Text(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str


_body = msgspec.json.Decoder(_Body)
_flat = msgspec.json.Decoder(_Flat)
_loose = msgspec.json.Decoder(dict[str, Raw])
_one_text = msgspec.json.Decoder(list[_Text])
_encode = msgspec.json.Encoder().encode
_role = msgspec.json.Decoder(_Role)
_items = msgspec.json.Decoder(list[Raw])


# A message's digest, by its bytes as sent: a conversation's next request repeats every earlier
# message byte for byte, so with ``seen`` (the caller's, kept between requests) only its new
# ones (and the one whose cache mark moved) are worked out again — the marker cut and the
# one-text canonical form cost a decode and an encode per message, hundreds of messages a
# turn. Keyed by length, CRC-32 and the first and last bytes; bounded (the oldest half
# dropped when full).
Seen = dict[tuple[int, int, bytes, bytes], tuple[str, int]]
SEEN_BOUND = 50_000


def _message_digest(raw: bytes | Raw, seen: Seen | None) -> tuple[str, int]:
    if seen is None:
        return _digest(bytes(raw), message=True)
    view = memoryview(raw)            # a Raw is a view of the body: nothing copied for a hit
    n = len(view)
    k = (n, zlib.crc32(view), view[:32].tobytes(), view[n - 32:].tobytes() if n > 32 else b"")
    got = seen.get(k)
    if got is None:
        got = seen[k] = _digest(bytes(raw), message=True, crc=k[1])
        if len(seen) > SEEN_BOUND:
            for old in list(seen)[:SEEN_BOUND // 2]:
                del seen[old]
    return got


# The tools array and the system prompt: the same bytes on every turn of a client process
# (Claude Code's 92 KB of tool schemas), so the last few are remembered with their digest and
# found again by their length then a compare (memcmp: a few µs) — the marker cut and the CRC
# cost 50 µs a turn. Memory only; bounded in number and size.
WHOLE_MEMO = 16
WHOLE_MEMO_MAX = 1 << 20
_whole: list[tuple[bytes, tuple[str, int]]] = []      # most recent first


def _digest_whole(raw: bytes | memoryview) -> tuple[str, int]:
    """``_digest(raw)`` of a tools array or a system prompt, remembered. ``raw`` may be a view
    of the body: it is copied only when it is new (92 KB of tool schemas a turn, otherwise)."""
    n = len(raw)
    for i, (known, got) in enumerate(_whole):
        if len(known) == n and known.startswith(raw):     # (a memoryview's == is a Python-speed compare)
            if i:
                _whole.insert(0, _whole.pop(i))
            return got
    raw = bytes(raw)
    got = _digest(raw)
    if n <= WHOLE_MEMO_MAX:
        _whole.insert(0, (raw, got))
        del _whole[WHOLE_MEMO:]
    return got


def _unmarked(raw: bytes) -> bytes:
    """``_MARKER.sub(b"", raw)``, found by the key's bytes: the regex, which begins with
    optional parts, tries every position of the text and every run of spaces in it (5 ms
    for a real Claude Code system prompt of 144 KB, on every turn); ``bytes.find`` then a match
    at each key is the same removal (tests/test_promptshape.py compares the two)."""
    out: list[bytes] = []
    done, p = 0, raw.find(_MARKER_KEY)
    while p != -1:
        m = _MARKER_REST.match(raw, p + len(_MARKER_KEY))
        if m is None:
            p = raw.find(_MARKER_KEY, p + 1)
            continue
        start = back_over(raw, _SPACE, p, done)   # back over the ``\s*`` (in C) and the ``,?`` before the key
        if start > done and raw[start - 1] == 0x2C:
            start -= 1
        out.append(raw[done:start])
        done = m.end()
        p = raw.find(_MARKER_KEY, done)
    if not out:
        return raw
    out.append(raw[done:])
    return b"".join(out)


def _digest(raw: bytes, message: bool = False, crc: int | None = None) -> tuple[str, int]:
    """``crc``: ``raw``'s CRC-32, when the caller has it (``_message_digest``'s key): a message
    with no mark to cut and no other form is not read a second time for it (a new message of
    1 MB: 0.45 ms)."""
    clean = _unmarked(raw)
    if message and _TEXT_FIRST.match(clean) is not None:
        clean = _canonical(clean)
    # CRC-32 and the length: a digest to compare a message with itself a turn later, not a
    # secret (it never leaves the proxy's memory; what is stored is a blake2b of the digests),
    # at a tenth of blake2b's cost on a multi-megabyte history.
    if clean is not raw or crc is None:
        crc = zlib.crc32(clean)
    return f"{crc:08x}{len(clean):x}", len(clean)


def _canonical(raw: bytes) -> bytes:
    """A message of one text in one form: the API reads a string content as one text block,
    and clients switch between the two (Claude Code sends its newest message as blocks, to
    mark it, and the same message as a string the turn after)."""
    try:
        fields = _loose.decode(raw)
        content = fields.get("content")
        if content is None or not bytes(content).startswith(b"["):
            return raw
        blocks = _one_text.decode(content)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return raw
    if len(blocks) != 1 or blocks[0].type != "text":
        return raw
    fields["content"] = Raw(_encode(blocks[0].text))
    return _encode(fields)


def _opens_list(raw: memoryview) -> bool:
    """``raw.lstrip().startswith(b"[")`` without copying it (a Raw member begins at its value;
    spaces before it only if a body is hand-made)."""
    head = bytes(raw[:64]).lstrip()
    return head.startswith(b"[") if head or len(raw) <= 64 else bytes(raw).lstrip().startswith(b"[")


def _present(raw: memoryview) -> bool:
    """A member that is there and not null."""
    return len(raw) > 0 and not (len(raw) == 4 and raw.tobytes() == b"null")


def _role_of(raw: bytes) -> str | None:
    try:
        return _role.decode(raw).role
    except Exception:
        return None


# The message arrays shaped lately, kept by the body reader between bodies (``Runs``).
RUNS = 8                    # arrays kept
RUNS_BYTES = 32 << 20       # their bytes, at most (a few conversations of a few MB each)


class _Run(NamedTuple):
    array: bytes                    # a messages array as sent
    ends: list[int]                 # where each message ends in it (exclusive)
    digests: list[str]
    lengths: list[int]
    key: str | None = None          # whose (``Runs.take``'s key)


class Runs:
    """The messages arrays shaped lately, each with where its messages end and their digests
    (Anthropic's and OpenAI chat's ``messages``, a Responses ``input`` list: every item, the
    leading system / developer ones too, whose digests ``shape`` leaves out of the messages').

    A conversation's next turn sends its array again with a few messages more (and its cache
    mark moved to the newest message). The longest byte prefix it shares with a kept array
    (found by halving, each half one ``startswith``: memcmp's speed) holds that array's first
    messages byte for byte, so their digests are taken back without a step per message — a
    step each (~1.2 µs with ``Seen``) was 13 ms a turn for 11,000 messages. Only the new
    messages are digested. Any layout: in a compact array (what every client sends) each
    message's place follows from the lengths before it; in one with spaces between its items
    (a hand-made body, ``json.dumps``' default) the spaces are stepped over for the new
    messages only (``arrays.item_ends``). Bounded: ``RUNS`` arrays, ``RUNS_BYTES`` bytes (or
    the caller's). Memory only; digests and lengths leave it, never a message."""

    def __init__(self, limit: int = RUNS, max_bytes: int = RUNS_BYTES) -> None:
        self._order: OrderedDict[int, _Run] = OrderedDict()     # by id, the oldest first
        self._keyed: dict[str | None, list[_Run]] = {}          # the same runs by key, most recent first
        self.limit, self.max_bytes = limit, max_bytes
        self._bytes = 0
        self._extended: _Run | None = None   # the one this array continues (``take``): ``keep`` replaces it

    @property
    def kept(self) -> list[_Run]:
        """The arrays kept, most recent first."""
        return list(reversed(self._order.values()))

    def take(self, array: bytes, key: str | None = None) -> tuple[list[str], list[int], list[int], list[Raw], int]:
        """For ``array`` (a messages array): the digests, lengths and ends of the messages a
        kept array gives back, the messages left to digest, and where in ``array`` the bytes
        before the first of them end (its place, past any spaces, is ``arrays.item_ends``').
        ``key``: only the arrays kept under it are compared (a conversation's own, on the event
        loop: no other conversation's array costs a compare); None: every array kept (the body
        reader's). Raises as ``_items.decode`` does when it is not an array."""
        best: _Run | None = None
        known = 0
        self._extended = None
        for run in reversed(self._order.values()) if key is None else self._keyed.get(key, ()):
            k = _shared(run, array)
            if k > known:
                best, known = run, k
        if best is not None:
            given = best.digests[:known], best.lengths[:known], best.ends[:known]
            at = skip_ws(array, best.ends[known - 1])
            if known >= len(best.ends) - 1:    # all its messages, or all but the one whose mark moved
                self._extended = best
            if at == len(array) - 1 and array[at] == 0x5D:         # ]: nothing new
                return (*given, [], at)
            if at < len(array) and array[at] == 0x2C:               # ,
                return (*given, _items.decode(b"[" + array[at + 1:]), at + 1)
        return [], [], [], _items.decode(array), 1

    def keep(self, array: bytes, ends: list[int], digests: list[str], lengths: list[int],
             key: str | None = None) -> None:
        """Keep ``array`` first. The kept array the last ``take`` gave every message of, or
        all but its last (a client moves its cache mark to the newest message each turn),
        goes: this one begins with those messages, so what it would give back this one gives
        too, but that last message, whose digest ``Seen`` still holds (a conversation's turns
        take one place, not one each)."""
        extended, self._extended = self._extended, None
        if len(array) > self.max_bytes // 2:
            return
        if extended is not None and self._order.get(id(extended)) is extended:
            self._drop(extended)
        run = _Run(array, ends, digests, lengths, key)
        self._order[id(run)] = run
        self._keyed.setdefault(key, []).insert(0, run)
        self._bytes += len(array)
        while len(self._order) > self.limit or self._bytes > self.max_bytes:
            self._drop(next(iter(self._order.values())))

    def _drop(self, run: _Run) -> None:
        del self._order[id(run)]
        same = self._keyed[run.key]
        for i, r in enumerate(same):        # (a conversation's few: its lanes)
            if r is run:
                del same[i]
                break
        if not same:
            del self._keyed[run.key]
        self._bytes -= len(run.array)


def _shared(run: _Run, array: bytes) -> int:
    """How many of ``run``'s messages ``array`` repeats from its start: told by one compare
    when it is all or all but the last (``arrays.repeats``: what a conversation's next turn
    sends), otherwise found by halving (``_common_prefix``)."""
    return arrays.repeats(run.array, run.ends, array) or bisect.bisect_right(run.ends, _common_prefix(run.array, array))


def _common_prefix(a: bytes, b: bytes) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (``arrays.common_prefix``)."""
    return arrays.common_prefix(a, b)


def shape(body: bytes | None, api: str, content_encoding: str = "", seen: Seen | None = None,
          max_items: int | None = None, members: dict[str, Raw] | None = None,
          runs: Runs | None = None, key: str | None = None) -> Shape | None:
    """The request's shape; None when it cannot be read, or has more than ``max_items``
    messages (said before any is digested: a digest per message is the costly part).
    ``seen``: digests of messages already worked out, kept by the caller between requests
    (the same shape, faster: see ``_message_digest``). ``members``: the body's top level as
    raw members, decoded already (the facts reader's, as sent: ``perflow.Body``), read
    instead of the body — one decode of the body fewer. ``runs``: the messages arrays shaped
    lately, kept by the caller (``Runs``: a conversation's repeated messages digested once);
    ``key``: the conversation's, to compare its messages with its own arrays only."""
    try:
        return _shape(body, api, content_encoding, seen, max_items, members, runs, key)
    except Exception:
        return None


_member_decoders = {"model": msgspec.json.Decoder(str | None), "messages": msgspec.json.Decoder(list[Raw] | None),
                    "previous_response_id": msgspec.json.Decoder(str | None)}


def _body_of(members: dict[str, Raw], flat: bool = False) -> _Body:
    """``_body.decode(body)`` (``flat``: ``_flat``'s) from the body's raw members: the same
    fields, of the same types (one of a wrong type raises, as the whole decode does)."""
    b = _Flat() if flat else _Body()
    for name in ("tools", "system", "instructions", "input", *(("messages",) if flat else ())):
        raw = members.get(name)
        if raw is not None:
            setattr(b, name, raw)
    for name, decoder in _member_decoders.items():
        raw = members.get(name)
        if raw is not None and not (flat and name == "messages"):
            setattr(b, name, decoder.decode(raw))
    return b


def _shape(body: bytes | None, api: str, content_encoding: str, seen: Seen | None = None,
           max_items: int | None = None, members: dict[str, Raw] | None = None,
           runs: Runs | None = None, key: str | None = None) -> Shape | None:
    if not body or api not in (facts.ANTHROPIC_MESSAGES, facts.OPENAI_CHAT, facts.OPENAI_RESPONSES):
        return None
    # with ``runs``, the messages array (Responses: the input list) is kept whole, to be compared
    flat = runs is not None and api != facts.OPENAI_RESPONSES       # (Responses' input is Raw already)
    if members is not None:
        b = _body_of(members, flat=flat)
    else:
        if content_encoding and content_encoding.strip().lower() not in ("", "identity"):
            body, why = decode_body(body, content_encoding)
            if why:
                return None
        b = (_flat if flat else _body).decode(body)
    items: list = []                # Raw views of the body (or bytes)
    known: tuple[list[str], list[int], list[int], int] | None = None   # what a kept array gave back
    array = None                    # the array whose items a kept one may give back (``runs``)
    system: list[bytes] = []
    if api == facts.OPENAI_RESPONSES:
        instructions = memoryview(b.instructions)
        if _present(instructions):
            system.append(instructions)
        raw = memoryview(b.input)
        if _opens_list(raw):
            if runs is not None:
                array = raw
            else:
                items = list(_items.decode(raw))
        elif _present(raw):
            items = [raw]
    else:
        raw = memoryview(b.system)        # views of the body: nothing copied but what is hashed
        if _opens_list(raw):
            system += [block for block in _items.decode(raw) if _BILLING not in bytes(memoryview(block)[:200])]
        elif _present(raw):
            system.append(raw)
        if isinstance(b, _Flat):
            if _present(memoryview(b.messages)):
                array = memoryview(b.messages)
        else:
            items = list(b.messages or ())
    if array is not None:
        array = bytes(array)
        given_d, given_l, given_e, items, start = runs.take(array, key)     # type: ignore[union-attr]
        known = (given_d, given_l, given_e, start)
    lead = 0                # OpenAI's leading system / developer items: the system prompt's
    if api != facts.ANTHROPIC_MESSAGES:
        given = len(known[0]) if known else 0

        def item(i: int):       # the i-th item: given back by a kept array, or new
            return items[i - given] if i >= given else _kept_item(array, known[2], i)    # type: ignore[index,arg-type]
        while lead < given + len(items) and _role_of(item(lead)) in _LEADING:
            lead += 1
        system += [item(i) for i in range(lead)]
        if known is None:
            items = items[lead:]
            lead = 0
    if max_items is not None and len(items) + (len(known[0]) if known else 0) - lead > max_items:
        return None
    tools = memoryview(b.tools)
    tools, tools_len = _digest_whole(tools) if _present(tools) else ("", 0)
    sys_d, sys_len = _digest_whole(b"\x00".join(system)) if system else ("", 0)
    digests, lengths = (known[0], known[1]) if known else ([], [])     # (fresh lists: ``take``'s slices)
    for raw in items:
        d, n = _message_digest(raw, seen)
        digests.append(d)
        lengths.append(n)
    if known is not None:               # kept for the next turn: where each message ends
        runs.keep(array, known[2] + arrays.item_ends(array, items, known[3]), digests, lengths, key)     # type: ignore[union-attr]
    return Shape(model=b.model or "", tools=tools, tools_len=tools_len, system=sys_d, system_len=sys_len,
                 messages=tuple(digests[lead:]), lengths=tuple(lengths[lead:]), partial=bool(b.previous_response_id))


def _kept_item(array: bytes, ends: list[int], i: int) -> memoryview:
    """The ``i``-th item of ``array`` (a kept array gave it back: its end is ``ends[i]``), as a
    view: past the ``[`` or the comma before it and any white space."""
    start = skip_ws(array, 1 if i == 0 else skip_ws(array, ends[i - 1]) + 1)
    return memoryview(array)[start:ends[i]]


def compare(prev: Shape, cur: Shape) -> Difference:
    """How much of ``prev``'s prompt ``cur`` repeats from the start, and where it stops."""
    size = prev.size or 1
    if prev.model != cur.model:
        return Difference(share=0.0, kind="model")
    if prev.tools != cur.tools:
        return Difference(share=0.0, kind="tools")
    done = prev.tools_len
    if prev.system != cur.system:
        return Difference(share=done / size, kind="system")
    done += prev.system_len
    if prev.partial or cur.partial:
        return Difference(share=1.0)      # the history lives on the server: assumed continued
    at = repeated(prev.messages, cur.messages)
    if at == len(prev.messages):
        return Difference(share=1.0)
    return Difference(share=(done + sum(prev.lengths[:at])) / size, kind="messages", at=at)


def repeated(prev: tuple[str, ...], cur: tuple[str, ...]) -> int:
    """How many of ``prev``'s digests ``cur`` repeats from the start (``len(prev)``: all of
    them). Compared a slice at a time in C, halving: a digest at a time in Python was ~1 ms of
    the event loop per 10,000 messages, on every turn of a long conversation."""
    return _halving(min(len(prev), len(cur)), lambda lo, mid: prev[lo:mid] == cur[lo:mid])


_halving = arrays.halving
