"""``sessionpin classify FILE...``: the facts of saved requests, one JSON object per line.

Rules this command keeps:
- A FILE is either a JSON request ``{"method", "url", "headers", "body"}`` (headers a list of
  ``[name, value]`` pairs or an object; body a JSON value, a string, or null) or a mitmproxy
  flow file (``mitmdump -w``), told apart by content, not by name.
- A JSON request's body is already decoded: it is read as identity-encoded whatever its
  Content-Encoding header says. A flow's body is raw and decoded by its Content-Encoding.
- One line per request: ``file``, ``index`` (the flow's position, 0 for a JSON request),
  ``method``, ``url``, then every field of ``Facts`` (null where a fact does not apply).
  Nothing from a prompt is printed, and no credential a URL carries: ``url`` is printed without
  its user and password, and with each query parameter's value replaced by ``…`` but ``beta``'s
  (Claude Code's ``?beta=true``), whose value is kept unless it reads as a key — Gemini's
  ``?key=AIza…`` is a credential, and these lines get pasted into bug reports.
- A file that cannot be read gives one line on stderr naming it, the others are still
  classified, and the exit status is 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote_plus

import msgspec

from ..config.redact import contains_key
from ..reader import facts
from . import flowfile

USAGE = "usage: sessionpin classify FILE...\n"


class BadFile(Exception):
    """A file that is not a request we can read; the message says why."""


def json_request(data: bytes) -> tuple[str, str, Any, bytes | None, str | None]:
    """(method, url, headers, body, content_encoding) of a JSON request file."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise BadFile(f"not JSON ({e.__class__.__name__})") from None
    if not isinstance(obj, dict):
        raise BadFile("not a JSON object")
    method, url = obj.get("method"), obj.get("url")
    if not isinstance(method, str) or not isinstance(url, str):
        raise BadFile('needs string "method" and "url"')
    headers = obj.get("headers", [])
    if isinstance(headers, dict):
        headers = [[k, v] for k, v in headers.items()]
    if not isinstance(headers, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in headers
    ):
        raise BadFile('"headers" must be a list of [name, value] string pairs or an object of strings')
    body = obj.get("body")
    if body is None:
        raw = None
    elif isinstance(body, str):
        raw = body.encode("utf-8", "surrogatepass")
    else:
        raw = msgspec.json.encode(body)
    return method, url, [tuple(p) for p in headers], raw, "identity"


SHOWN_QUERY = frozenset({"beta"})      # the query parameters whose values are printed (as headers.QUERY)


def shown_url(url: str) -> str:
    """``url`` as a line prints it: no user or password, the query's values but ``beta``'s as ``…``."""
    base, sep, query = url.partition("?")
    scheme, slashes, rest = base.partition("://")
    if slashes:
        authority, slash, path = rest.partition("/")
        if "@" in authority:
            base = f"{scheme}://…@{authority.rpartition('@')[2]}{slash}{path}"
    if not sep:
        return base
    query, hash_, _fragment = query.partition("#")
    parts = []
    for part in query.split("&"):
        name, eq, value = part.partition("=")
        keep = unquote_plus(name) in SHOWN_QUERY and not contains_key(unquote_plus(value))
        parts.append(part if keep or not eq else f"{name}=…")
    return base + "?" + "&".join(parts) + ("#…" if hash_ else "")


def _line(path: str, index: int, method: str, url: str, f: facts.Facts) -> str:
    out: dict[str, Any] = {"file": path, "index": index, "method": method, "url": shown_url(url)}
    out.update(msgspec.structs.asdict(f))
    out.pop("model_span", None)      # where the model sits in the body: the rewriter's, not a fact
    return json.dumps(out, ensure_ascii=False)


def classify_file(path: str) -> Iterator[str]:
    """The output lines for one file; raises BadFile (possibly after some lines)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise BadFile(e.strerror or e.__class__.__name__) from None
    if flowfile.looks_like_flowfile(data):
        try:
            for req in flowfile.read_requests(data):
                f = facts.read(req.method, req.url, req.headers, req.body)
                yield _line(path, req.index, req.method, req.url, f)
        except flowfile.FlowFileError as e:
            raise BadFile(f"bad flow file: {e}") from None
        return
    if not data.lstrip().startswith(b"{"):
        raise BadFile("neither a JSON request nor a mitmproxy flow file")
    method, url, headers, body, encoding = json_request(data)
    yield _line(path, 0, method, url, facts.read(method, url, headers, body, encoding))


def main(argv: list[str]) -> int:
    """Classify every FILE; 0 if all were read, 1 if any was not, 2 on a usage error."""
    if not argv or argv[0] in ("-h", "--help"):
        (sys.stdout if argv else sys.stderr).write(USAGE)
        return 0 if argv else 2
    status = 0
    for path in argv:
        try:
            for line in classify_file(path):
                print(line, flush=False)
        except BadFile as e:
            sys.stdout.flush()
            print(f"sessionpin classify: {path}: {e}", file=sys.stderr)
            status = 1
    sys.stdout.flush()
    return status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
