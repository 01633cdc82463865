"""The body reader: a large request's facts, and its prompt's shape, read on a process of its own.

Why a process: reading a large body comes down to a few long C calls (msgspec's decode of
the whole body when the large-body reader cannot bound it, the freeing of what that built,
a model's span found by a decode of the top level) that hold the GIL. On a thread they hold
mitmproxy's event loop all the same: a continuation of 45 MiB of tiny messages before its
first answer held every other client about a second (issue 20). In a process of its own the
event loop only writes the body to a pipe, a chunk at a time.

Rules it keeps:
- Pure: bytes in, plain data out. ``facts_of``: the same facts ``facts.read`` gives, plus the
  model's span in the decoded body when the reader did not find it itself (so a model rename
  does not decode the body again on the event loop). ``shape_of``: ``promptshape.shape`` (the
  ledger's, after the answer: a digest per message, in Python, each remembered for the next
  bodies by their length, CRC and ends as the ledger does), None past ``MAX_SHAPE_ITEMS``
  messages — a history that long is compared with nothing (its digests would cost the proxy
  tens of MB to keep and to take back; real sessions have a few thousand messages).
- The protocol is framed and one request at a time (stdin → stdout):
    request: 4-byte big-endian length + msgpack [task, method, url, headers, encoding, api],
             then 8-byte big-endian length + the raw body; task is "facts" or "shape"
    answer:  4-byte big-endian length + msgpack of the Facts (or the Shape, or nil)
  Started with ``--shared FD`` (Linux: an anonymous memory file, ``offprocess``), the body
  is not on the pipe but at the start of that file, its length in the request: the proxy
  writes it there with one copy (a pipe cost the proxy's event loop ~1 ms per MB: sixteen
  writes a MB, each a wakeup, and asyncio's buffer moved behind them). One request at a
  time, so one region; the proxy writes the next body only after this one's answer.
- Nothing of a body leaves the process but its facts (hashes, names); nothing is logged.
- ``serve`` stops at the end of its input: the proxy ends it by closing the pipe.

Run as ``python -m sessionpin.decision.bodyreader`` (``sessionpin.proxy.offprocess`` starts it).
"""

from __future__ import annotations

import os
import sys
from typing import Any, BinaryIO

import msgspec

from ..reader import facts as F
from ..reader import knownvalues, promptshape
from .rewrite import model_span

HEAD_LEN = 4
BODY_LEN = 8
MAX_HEAD = 1024 * 1024       # method, url, headers: far above what mitmproxy takes in a head
MAX_SHAPE_ITEMS = 50_000     # messages a shape digests at most (a 1 MiB body holds ~35,000 tiny ones)
FACTS, SHAPE = "facts", "shape"
MAX_SHARED = 1 << 32         # bytes a request may say its shared body has (the proxy takes 64 MiB at most)

_encoder = msgspec.msgpack.Encoder()
_head_decoder = msgspec.msgpack.Decoder(tuple[str, str, str, list[tuple[bytes, bytes]], str, str | None])
_facts_decoder = msgspec.msgpack.Decoder(F.Facts)
_shape_decoder = msgspec.msgpack.Decoder(promptshape.Shape | None)


def request_head(method: str, url: str, headers: Any, encoding: str, api: str | None, body_len: int,
                 task: str = FACTS) -> bytes:
    """What precedes the body on the pipe."""
    fields = [(_b(k), _b(v)) for k, v in headers]
    head = _encoder.encode((task, method, url, fields, encoding, api))
    return len(head).to_bytes(HEAD_LEN, "big") + head + body_len.to_bytes(BODY_LEN, "big")


def encode_answer(answer: F.Facts | promptshape.Shape | None) -> bytes:
    data = _encoder.encode(answer)
    return len(data).to_bytes(HEAD_LEN, "big") + data


def decode_shape(data: bytes) -> promptshape.Shape | None:
    return _shape_decoder.decode(data)


def shape_of(body: bytes | None, api: str, encoding: str, seen: promptshape.Seen | None = None,
             runs: promptshape.Runs | None = None) -> promptshape.Shape | None:
    """``promptshape.shape``, or None when it has more than ``MAX_SHAPE_ITEMS`` messages.
    ``seen``: the digests of messages worked out for earlier bodies, ``runs``: the messages
    arrays shaped lately (``serve`` keeps both). With ``runs``, the body's top level is read
    with the messages a kept array repeats stood in for (``knownvalues.members``: the same
    members as the whole decode, or that decode): a conversation's next turn decodes its new
    messages and the members around them, not its history again (issue 22: a 1 MB Claude Code
    turn 350 → 170 µs here, pi's 800 → 290)."""
    members = None
    # (a Responses body's input is not stood in for: its members read cost more than its decode)
    if runs is not None and body and api in (F.ANTHROPIC_MESSAGES, F.OPENAI_CHAT) \
            and not (encoding and encoding.strip().lower() not in ("", "identity")):
        try:
            members = knownvalues.members(body, arrays=[(run.array, run.ends) for run in runs.kept])
        except (msgspec.DecodeError, RecursionError):
            members = None          # not JSON: the shape's own decode says so (None)
    return promptshape.shape(body, api, encoding, seen, max_items=MAX_SHAPE_ITEMS, members=members, runs=runs)


def decode_answer(data: bytes) -> F.Facts:
    facts = _facts_decoder.decode(data)
    if facts.model_span is not None:   # msgpack gives a list; Facts holds a tuple
        facts = msgspec.structs.replace(facts, model_span=tuple(facts.model_span))
    return facts


def facts_of(method: str, url: str, headers: Any, body: bytes | None, encoding: str, api: str | None) -> F.Facts:
    """``facts.read`` and, for a body with a model whose span the reader did not find, that span
    (``rewrite.model_span``: the top level decoded once). Never raises."""
    facts = F.read(method, url, headers, body, encoding, api=api)
    if facts.parsed and facts.model is not None and facts.model_span is None and body:
        try:
            data, problem = F.decode_body(body, encoding)
            if not problem:
                start, end = model_span(data)
                if 0 <= start < end:
                    facts = msgspec.structs.replace(facts, model_span=(start, end))
        except Exception:   # no span: the rename finds it itself, as before
            pass
    return facts


def _read_exactly(inp: BinaryIO, n: int) -> bytes | None:
    data = inp.read(n)
    if data is None or len(data) < n:
        return None
    return data


def _read_shared(fd: int, n: int) -> bytes | None:
    if n > MAX_SHARED:
        return None
    try:
        data = os.pread(fd, n, 0)
    except (OSError, OverflowError, MemoryError):
        return None
    return data if len(data) == n else None


def serve(inp: BinaryIO, out: BinaryIO, shared: int | None = None) -> None:
    """Answer requests until the input ends (or is not this protocol); ``shared``: the file
    descriptor the bodies are in (``--shared``), else they follow their heads. The message digests
    worked out are kept for the next shapes (a conversation's every turn sends its history
    again: the ledger's own memo, here; bounded by ``promptshape.SEEN_BOUND``), and the messages
    arrays shaped lately, so that a repeated history is found by its bytes, not digest by digest
    (``promptshape.Runs``)."""
    seen: promptshape.Seen = {}
    runs = promptshape.Runs()
    while True:
        size = _read_exactly(inp, HEAD_LEN)
        if size is None:
            return
        n = int.from_bytes(size, "big")
        if n > MAX_HEAD:
            return
        head = _read_exactly(inp, n)
        body_len = _read_exactly(inp, BODY_LEN)
        if head is None or body_len is None:
            return
        n = int.from_bytes(body_len, "big")
        body = _read_exactly(inp, n) if shared is None else _read_shared(shared, n)
        if body is None:
            return
        try:
            task, method, url, headers, encoding, api = _head_decoder.decode(head)
        except msgspec.DecodeError:
            return
        if task == SHAPE:
            answer = shape_of(body, api or "", encoding, seen, runs) if api else None
        else:
            answer = facts_of(method, url, headers, body, encoding, api)
        out.write(encode_answer(answer))
        out.flush()
        del body


def _b(v: str | bytes) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode("utf-8", "surrogateescape")


if __name__ == "__main__":   # pragma: no cover - run by the proxy, tested through it
    serve(sys.stdin.buffer, sys.stdout.buffer,
          int(sys.argv[2]) if len(sys.argv) == 3 and sys.argv[1] == "--shared" else None)
