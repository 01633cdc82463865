"""Undoing a request body's content-codings, within bounds, and the request size limit.

Rules this module keeps:
- ``decode_body(body, content_encoding)`` -> (decoded, "") or (b"", why not): ``gzip``,
  ``deflate`` (zlib or raw), ``br``, ``zstd`` (Codex sends zstd bodies), ``identity``, and
  lists (``gzip, zstd``, undone right to left). zstd comes from the standard library (3.14)
  or ``backports.zstd`` (installed with mitmproxy 12), else ``zstandard``; brotli with
  mitmproxy. Never raises.
- Bounded: a body (raw or decoded) over ``MAX_BODY`` is "too large" and decompression stops
  at that size (a small bomb cannot take memory); at most ``MAX_FRAMES`` concatenated frames
  and ``MAX_CODINGS`` codings are undone; frames are fed in chunks, so the work is linear
  in the bytes (``wire.STEPS`` counts it).
- ``MAX_REQUEST_BODY`` is the largest request the proxy takes at all, and
  ``body_too_large(content_length)`` says from the header alone when to answer 413 before
  buffering.
Pure: bytes in, bytes out.
"""

from __future__ import annotations

import zlib

from . import wire

# A decoded body larger than this is not read ("too large").
MAX_BODY = 64 * 1024 * 1024
# The largest request body the proxy takes at all: the shell answers 413 before buffering
# more (``body_too_large``). The reader's own limit, so any body the proxy buffers is one
# it can read; above the largest request an agent sends (Anthropic's Messages API takes at
# most 32 MB; the recorded requests are under 1 MB).
MAX_REQUEST_BODY = MAX_BODY


def body_too_large(content_length: str | bytes | None, limit: int = MAX_REQUEST_BODY) -> bool:
    """Whether a request must be refused (413) from its ``Content-Length`` header alone,
    before its body is buffered: a declared length over ``limit``, or a header that is not
    one decimal length (a list of equal ones is one, as RFC 9110 allows): a length that
    cannot be trusted is not waited for. ``None`` (no header: chunked or HTTP/2 without
    one) is False; the shell then counts the bytes as they come."""
    if content_length is None:
        return False
    text = content_length.decode("latin-1") if isinstance(content_length, (bytes, bytearray)) else str(content_length)
    values = {v.strip() for v in text.split(",")}
    if len(values) != 1:
        return True
    (value,) = values
    if not value.isascii() or not value.isdigit() or len(value) > 19:
        return True
    return int(value) > limit


class _TooLarge(Exception):
    pass


# A body is one frame (gzip member, zstd frame) from every recorded client; a few more are
# legal, thousands of tiny ones are only a way to make the reader work: each frame costs a
# decompressor, so their number is capped.
MAX_FRAMES = 64
# At most this many content-codings are undone (each may cost up to MAX_BODY of work).
MAX_CODINGS = 4


def _frames(data: bytes, limit: int, decompressor, decompress) -> bytes:
    """Every concatenated frame (gzip members, zstd frames) decompressed, at most ``limit``
    bytes; a frame cut short is an error. ``decompress(d, chunk, room)`` feeds one frame.

    The input is fed in chunks that double within a frame, so what a decompressor copies
    back as unused (the bytes after its frame) is at most one chunk, not the rest of the
    body for every frame."""
    out = bytearray()
    view = memoryview(data)
    pos = frames = 0
    while pos < len(data):
        frames += 1
        if frames > MAX_FRAMES:
            raise ValueError("too many frames")
        d = decompressor()
        chunk = 256
        while True:
            part = view[pos:pos + chunk]
            # Below the room, a decompressor takes all it is given (or stops at its frame's end).
            out += decompress(d, part, limit + 1 - len(out))
            wire.count(len(part))
            if len(out) > limit:
                raise _TooLarge
            if d.eof:
                pos += len(part) - len(d.unused_data)
                break
            pos += len(part)
            if pos >= len(data):
                raise ValueError("truncated")
            chunk = min(chunk * 2, 1 << 20)
    wire.count(len(out))
    return bytes(out)


def _zlib(data: bytes, limit: int, wbits: int) -> bytes:
    return _frames(data, limit, lambda: zlib.decompressobj(wbits), lambda d, b, room: d.decompress(b, room))


def _gzip(data: bytes, limit: int) -> bytes:
    return _zlib(data, limit, 16 + zlib.MAX_WBITS)


def _deflate(data: bytes, limit: int) -> bytes:
    # HTTP "deflate" is zlib-wrapped; some clients send it raw.
    try:
        return _zlib(data, limit, zlib.MAX_WBITS)
    except zlib.error:
        return _zlib(data, limit, -zlib.MAX_WBITS)


def _br(data: bytes, limit: int) -> bytes:
    import brotli  # a dependency of the proxy; imported only when a body needs it

    d = brotli.Decompressor()
    try:
        out = d.process(data, output_buffer_limit=limit + 1)
    except TypeError:  # brotli < 1.2 has no limit
        out = brotli.decompress(data)
        if len(out) > limit:
            raise _TooLarge
        return out
    wire.count(len(data) + len(out))
    if len(out) > limit or not d.can_accept_more_data():    # (more made than the limit lets out)
        raise _TooLarge
    if not d.is_finished():
        raise ValueError("truncated")
    return out


def _zstd(data: bytes, limit: int) -> bytes:
    try:
        from compression import zstd  # Python >= 3.14
    except ImportError:
        try:
            from backports import zstd  # installed with the proxy on Python 3.12/3.13
        except ImportError:
            return _zstd_zstandard(data, limit)
    return _frames(data, limit, zstd.ZstdDecompressor, lambda d, b, room: d.decompress(b, max_length=room))


def _zstd_zstandard(data: bytes, limit: int) -> bytes:
    import zstandard  # type: ignore[import-not-found]

    reader = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True)
    out = reader.read(limit + 1)
    wire.count(len(data) + len(out))
    if len(out) > limit:
        raise _TooLarge
    return out


_DECODERS = {"gzip": _gzip, "x-gzip": _gzip, "deflate": _deflate, "br": _br, "zstd": _zstd}


def decode_body(body: bytes | None, content_encoding: str) -> tuple[bytes, str]:
    """(decoded body, "") or (b"", why it cannot be read)."""
    if body is None:
        return b"", "no body"
    if not isinstance(body, (bytes, bytearray, memoryview)):
        return b"", "body is not bytes"
    if len(body) > MAX_BODY:
        return b"", "too large"
    data = bytes(body)
    codings = [c.strip().lower() for c in content_encoding.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if len(codings) > MAX_CODINGS:
        return b"", "too many content-encodings"
    for coding in reversed(codings):
        decode = _DECODERS.get(coding)
        if decode is None:
            return b"", f"unknown content-encoding {coding[:32]!r}"
        try:
            data = decode(data, MAX_BODY)
        except _TooLarge:
            return b"", "too large"
        except Exception:
            return b"", f"bad {coding} body"
    return data, ""
