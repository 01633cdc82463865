"""Where a body's top-level ``"model"`` value lies, byte for byte (the rewrite renames it there
and nowhere else: every other byte is the agent's).

The body is decoded once (in C) into its top-level keys and raw values — or that decode is
handed in (``top``) by the facts reader, which made it anyway (issue 22: the body read once);
then a walk over just those keys finds where each value starts, and a raw value's length says
where it ends, so the cost does not grow with the size of messages. A body whose model cannot
be located exactly (duplicate top-level keys, not an object, not a string) raises
``ModelNotFound``: the rewrite then refuses rather than send it unmapped.
"""

from __future__ import annotations

import re

import msgspec

from .scan import back_over, skip_ws


class ModelNotFound(ValueError):
    """The body's top-level model could not be located byte for byte."""


_decode_top = msgspec.json.Decoder(dict[str, msgspec.Raw])
_decode_str = msgspec.json.Decoder(str)
# msgspec's message for a complete value followed by more text; its offset is one past the
# first byte after the value and the spaces after it (tests/test_wire.py checks the text).
_TRAILING = re.compile(r"trailing characters \(byte (\d+)\)")
_encode = msgspec.json.encode


def model_span(body: bytes, top: dict[str, msgspec.Raw] | None = None) -> tuple[int, int]:
    """The byte span of the top-level "model" value (the quotes included). ``top``: the
    body's top level as ``dict[str, Raw]`` when the caller decoded it already (its raw values
    are views of ``body``)."""
    if top is None:
        try:
            top = _decode_top.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ModelNotFound(f"body is not a JSON object ({e})") from None
        except RecursionError:
            raise ModelNotFound("body nested too deeply") from None
    if "model" not in top:
        raise ModelNotFound("no top-level model")
    if not bytes(top["model"]).startswith(b'"'):
        raise ModelNotFound("the model is not a string")
    span = _laid_out(body, top)
    return span if span is not None else _walk(body, top)


# The layouts serialisers write: compact (JavaScript's JSON.stringify, serde, Go) and Python's
# ``json.dumps`` default; each has one separator of each kind and no other space between tokens.
_LAYOUTS = ((b",", b":"), (b", ", b": "))
# Each layout's member heads (the separator, the key as the encoder writes it, then the colon),
# by key: the same dozen keys on every request. Bounded: a body's own keys are the client's.
_HEADS: tuple[dict[str, bytes], dict[str, bytes]] = ({}, {})
_HEADS_MAX = 512


def _laid_out(body: bytes, top: dict) -> tuple[int, int] | None:
    """The fast path of ``model_span``: when ``body`` is ``top``'s members in order, each key
    as the encoder writes it, laid out as one of ``_LAYOUTS``, the model's span; else None
    (``_walk`` reads the body's own layout). It checks the same things ``_walk`` does at the
    same places (each key, each separator, each value's ends, the closing brace at the end),
    so what it accepts ``_walk`` accepts with the same span: it only skips reading the keys
    and the spaces between tokens. The layout is the one the first colon says (a space after
    it, or not): a body of neither fails a check and is walked."""
    n = len(body)
    if n < 2 or body[0] != 0x7B or body[-1] != 0x7D or not top:
        return None
    first = _encode(next(iter(top)))
    layout = 1 if body.startswith(b": ", 1 + len(first)) else 0
    comma = len(_LAYOUTS[layout][0])
    heads = _HEADS[layout]
    # each member's head with the separator before it (one compare per member); the first
    # member's without it
    i, span = 1 - comma, None
    for name, raw in top.items():
        head = heads.get(name)
        if head is None:
            head = _LAYOUTS[layout][0] + _encode(name) + _LAYOUTS[layout][1]
            if len(heads) < _HEADS_MAX:
                heads[name] = head
        if i < 1:
            if not body.startswith(head[comma:], 1):
                return None
            i = 1 + len(head) - comma
        else:
            if not body.startswith(head, i):
                return None
            i += len(head)
        size = len(raw)
        if size <= 128:
            if not size or not body.startswith(raw, i):
                return None
        else:       # its ends, compared in place (a full compare would copy megabytes)
            view = memoryview(raw)
            if not (body.startswith(view[:64], i) and body.startswith(view[size - 64:], i + size - 64)):
                return None
        if name == "model":
            span = (i, i + size)
        i += size
    return span if i == n - 1 and span is not None else None


def _walk(body: bytes, top: dict) -> tuple[int, int]:
    n = len(body)
    i = skip_ws(body, 0)
    if i >= n or body[i] != 0x7B:  # {
        raise ModelNotFound("body is not a JSON object")
    i += 1
    span = None
    seen = 0
    for _ in range(len(top) + 1):
        i = skip_ws(body, i)
        if i < n and body[i] == 0x7D:  # }
            break
        if i >= n or body[i] != 0x22:
            raise ModelNotFound("unexpected bytes in the body")
        j = _string_end(body, i)
        name = body[i + 1:j - 1]
        # a key without escapes is its bytes (the decoder above checked them: UTF-8, no control)
        name = _decode_str.decode(body[i:j]) if b"\\" in name else name.decode()
        i = j
        i = skip_ws(body, i)
        if i >= n or body[i] != 0x3A:  # :
            raise ModelNotFound("unexpected bytes in the body")
        i += 1
        i = skip_ws(body, i)
        raw = top.get(name)
        # The value here must be the raw value the decoder kept for this key. Its ends
        # are compared (a full compare would copy megabytes of messages): with unique
        # keys they always match; a duplicate key misaligns the walk, which shows here
        # or in the key count and closing brace checked below.
        if raw is None or not _same_ends(body, i, memoryview(raw)):
            # a duplicate key (the decoder kept the last) or an unexpected layout
            raise ModelNotFound("duplicate top-level keys")
        size = len(raw)
        if name == "model":
            span = (i, i + size)
        seen += 1
        i += size
        i = skip_ws(body, i)
        if i < n and body[i] == 0x2C:  # ,
            i += 1
    if seen != len(top) or span is None or i >= n or body[i] != 0x7D or skip_ws(body, i + 1) != n:
        raise ModelNotFound("duplicate top-level keys")
    return span


def _same_ends(body: bytes, i: int, raw: memoryview, k: int = 64) -> bool:
    """Whether ``raw`` (not empty) is at ``body[i:]``: whole when short, else its first and
    last ``k`` bytes (compared in place: no copy)."""
    size = len(raw)
    if not size or i + size > len(body):
        return False
    if size <= 2 * k:
        return body.startswith(raw, i)
    return body.startswith(raw[:k], i) and body.startswith(raw[size - k:], i + size - k)




def _string_end(body: bytes, i: int) -> int:
    """Index just past the JSON string starting at body[i] (a quote), found by msgspec in C:
    a key of tens of thousands of escaped quotes was a Python step per quote (60,000 of them:
    57 ms on the event loop). msgspec reads the string, then stops at the first byte after it
    that is not a space ("trailing characters"); the spaces before that byte are stepped back
    over in C."""
    try:
        _decode_str.decode(memoryview(body)[i:])
    except msgspec.ValidationError:
        raise ModelNotFound("unexpected bytes in the body") from None
    except msgspec.DecodeError as e:
        at = _TRAILING.search(str(e))
        if at is None:
            raise ModelNotFound("unterminated string") from None
        after = i + int(at.group(1)) - 1           # the first byte after the string that is not a space
        return back_over(body, b" \t\r\n", after, i + 2)
    return len(body)         # the body is that string alone (the walk then finds no colon)
