"""Read the requests out of a mitmproxy flow file (``mitmdump -w``) without mitmproxy.

Rules this module keeps:
- A flow file is a sequence of tnetstrings (``<length>:<payload><type>``, type one of
  ``, ; # ^ ! ~ ] }``), one per flow, each a dict of the flow's state. Only what a request
  needs is read: ``type``, and ``request``'s method, scheme, host, port, path, headers and
  content. Other flow types (tcp, udp, dns) and flows without a request are skipped.
- ``content`` is the raw body as it crossed the wire (still gzip/zstd encoded): the caller
  decodes it with the request's Content-Encoding, as the reader does for a live request.
- Pure: bytes in, requests out, no mitmproxy import. A file that is not a flow file, or that
  stops mid-flow, raises ``FlowFileError`` after the complete flows before it were yielded.
- Nesting is bounded (``MAX_DEPTH``) so a hostile file cannot exhaust the stack.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

MAX_DEPTH = 64
_MAX_LENGTH_DIGITS = 12


class FlowFileError(ValueError):
    """The data is not (or stops being) a sequence of tnetstrings."""


class FlowRequest(NamedTuple):
    index: int                                  # the flow's position in the file (0-based, all flow types)
    method: str
    url: str
    headers: list[tuple[bytes, bytes]]
    body: bytes | None                          # raw, still content-encoded


def looks_like_flowfile(data: bytes) -> bool:
    """The data starts like a tnetstring dict: ``<digits>:`` (a JSON file starts with ``{``)."""
    colon = data.find(b":", 0, _MAX_LENGTH_DIGITS + 1)
    return colon > 0 and data[:colon].isdigit()


def _parse(data: bytes, pos: int, depth: int, stop: int) -> tuple[object, int]:
    """One tnetstring at ``pos`` that ends before ``stop``: (value, position after it)."""
    if depth > MAX_DEPTH:
        raise FlowFileError("nested too deeply")
    colon = data.find(b":", pos, pos + _MAX_LENGTH_DIGITS + 1)
    if colon == -1 or colon == pos or not data[pos:colon].isdigit():
        raise FlowFileError(f"not a tnetstring at byte {pos}")
    length = int(data[pos:colon])
    start = colon + 1
    end = start + length
    if end >= stop:
        raise FlowFileError(f"truncated at byte {pos}" if stop == len(data) else f"bad length at byte {pos}")
    kind = data[end : end + 1]
    after = end + 1
    if kind == b",":
        return data[start:end], after
    if kind == b";":
        return data[start:end].decode("utf-8", "surrogateescape"), after
    if kind == b"#":
        try:
            return int(data[start:end]), after
        except ValueError:
            raise FlowFileError(f"bad integer at byte {pos}") from None
    if kind == b"^":
        try:
            return float(data[start:end]), after
        except ValueError:
            raise FlowFileError(f"bad float at byte {pos}") from None
    if kind == b"!":
        if data[start:end] not in (b"true", b"false"):
            raise FlowFileError(f"bad boolean at byte {pos}")
        return data[start:end] == b"true", after
    if kind == b"~":
        if length:
            raise FlowFileError(f"bad null at byte {pos}")
        return None, after
    if kind == b"]":
        items = []
        p = start
        while p < end:
            item, p = _parse(data, p, depth + 1, end)
            items.append(item)
        if p != end:
            raise FlowFileError(f"bad list at byte {pos}")
        return items, after
    if kind == b"}":
        out: dict[object, object] = {}
        p = start
        while p < end:
            key, p = _parse(data, p, depth + 1, end)
            if p >= end:
                raise FlowFileError(f"dict key without value at byte {pos}")
            value, p = _parse(data, p, depth + 1, end)
            if isinstance(key, bytes):
                key = key.decode("utf-8", "surrogateescape")
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise FlowFileError(f"bad dict key at byte {pos}")
            out[key] = value
        if p != end:
            raise FlowFileError(f"bad dict at byte {pos}")
        return out, after
    raise FlowFileError(f"unknown tnetstring type {kind!r} at byte {end}")


def loads_all(data: bytes) -> Iterator[object]:
    """Every tnetstring value in ``data``, in order (whitespace between them is allowed)."""
    pos = 0
    n = len(data)
    while True:
        while pos < n and data[pos] in b" \t\r\n":
            pos += 1
        if pos >= n:
            return
        value, pos = _parse(data, pos, 0, n)
        yield value


def _str(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return ""


def _bytes(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    return b""


def request_of(index: int, flow: object) -> FlowRequest | None:
    """The request of one flow state dict, or None for other flow types."""
    if not isinstance(flow, dict) or flow.get("type", "http") != "http":
        return None
    req = flow.get("request")
    if not isinstance(req, dict):
        return None
    method = _str(req.get("method")) or "GET"
    scheme = _str(req.get("scheme")) or "http"
    host = _str(req.get("host")) or _str(req.get("authority"))
    port = req.get("port")
    path = _str(req.get("path")) or "/"
    default = {"http": 80, "https": 443}.get(scheme)
    hostport = f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6 literal
    if isinstance(port, int) and port != default:
        hostport = f"{hostport}:{port}"
    url = f"{scheme}://{hostport}{path}" if host else path
    headers: list[tuple[bytes, bytes]] = []
    raw_headers = req.get("headers")
    if isinstance(raw_headers, (list, tuple)):
        for pair in raw_headers:
            if isinstance(pair, (list, tuple)) and len(pair) == 2:
                headers.append((_bytes(pair[0]), _bytes(pair[1])))
    content = req.get("content")
    body = content if isinstance(content, bytes) else (_bytes(content) if isinstance(content, str) else None)
    return FlowRequest(index=index, method=method, url=url, headers=headers, body=body)


def read_requests(data: bytes) -> Iterator[FlowRequest]:
    """The HTTP requests of a flow file, in order. Raises FlowFileError where the file goes bad."""
    if not looks_like_flowfile(data):
        raise FlowFileError("not a mitmproxy flow file")
    for index, flow in enumerate(loads_all(data)):
        if not isinstance(flow, dict):
            raise FlowFileError(f"flow {index} is not a dict")
        req = request_of(index, flow)
        if req is not None:
            yield req
