"""The requests of a mitmproxy flow file (``mitmdump -w``), read by mitmproxy's own reader.

Rules this module keeps:
- The file is read by ``mitmproxy.io.FlowReader``: the reader that wrote it, which also
  migrates files written by older mitmproxy versions. This is a tool's module
  (``sessionpin classify``), not the core: mitmproxy is imported only when a flow file is
  read, so classifying JSON requests does not load it.
- Only what a request needs leaves here: method, URL, headers (raw byte pairs, as sent)
  and ``raw_content``, the body as it crossed the wire (still gzip/zstd encoded: the
  caller decodes it with the request's Content-Encoding, as the reader does for a live
  request). Other flow types (tcp, udp, dns) are skipped; ``index`` still counts them.
- A file that is not a flow file, that stops mid-flow, or that the reader cannot take
  (a newer flow format, nesting deep enough to exhaust the stack) raises
  ``FlowFileError`` after the complete flows before it were yielded: never another
  exception, whatever the bytes.
"""

from __future__ import annotations

import io
from typing import Iterator, NamedTuple

_MAX_LENGTH_DIGITS = 12      # mitmproxy's reader refuses a longer length prefix too


class FlowFileError(ValueError):
    """The data is not (or stops being) a flow file mitmproxy can read."""


class FlowRequest(NamedTuple):
    index: int                                  # the flow's position in the file (0-based, all flow types)
    method: str
    url: str
    headers: list[tuple[bytes, bytes]]
    body: bytes | None                          # raw, still content-encoded


def looks_like_flowfile(data: bytes) -> bool:
    """The data starts like a tnetstring: ``<digits>:`` (a JSON file starts with ``{``)."""
    colon = data.find(b":", 0, _MAX_LENGTH_DIGITS + 1)
    return colon > 0 and data[:colon].isdigit()


def read_requests(data: bytes) -> Iterator[FlowRequest]:
    """The HTTP requests of a flow file, in order. Raises FlowFileError where the file goes bad."""
    if not looks_like_flowfile(data):
        raise FlowFileError("not a mitmproxy flow file")
    from mitmproxy import exceptions, http
    from mitmproxy.io import FlowReader

    buf = io.BytesIO(data)
    flows = iter(FlowReader(buf).stream())
    index = 0
    while True:
        start = buf.tell()
        try:
            f = next(flows)
        except StopIteration:
            return
        except exceptions.FlowReadException as e:
            raise FlowFileError(_why(index, start, e)) from None
        except RecursionError:
            raise FlowFileError(f"flow {index} at byte {start}: nested too deeply") from None
        except Exception as e:   # whatever the bytes: one clear error, never a traceback
            raise FlowFileError(f"flow {index} at byte {start}: {type(e).__name__}: {e}") from None
        if isinstance(f, http.HTTPFlow):
            req = f.request
            yield FlowRequest(index=index, method=req.method, url=req.url, headers=list(req.headers.fields),
                              body=req.raw_content)
        index += 1


def _why(index: int, start: int, e: Exception) -> str:
    # FlowReader says "Invalid data format." for every tnetstring fault; its cause says
    # which. An IndexError there is its read of the type byte past the end: a cut file.
    cause = e.__cause__
    if isinstance(cause, IndexError):
        return f"truncated: the file ends inside flow {index} (which starts at byte {start})"
    return f"flow {index} at byte {start}: {cause or e}"
