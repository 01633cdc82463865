"""Change one setting of the config file and leave every other byte as it was.

The operator's file holds comments that explain choices ("glm is slow before 9am"), so
the ``sessionpin`` command never re-serialises it. It edits lines instead.

Rules this module keeps:
- Only the lines that hold the changed setting change (or the table added or removed);
  comments, blank lines, order and quoting elsewhere stay byte for byte. A trailing
  comment on a rewritten line is kept.
- Lines inside multi-line strings are never taken for tables or keys.
- The functions here are pure (text in, text out). They do not judge the result: the
  caller parses the new text with ``config.parse`` and checks it says what was asked
  (``check``), so a form this module does not understand (an inline table, a dotted key
  elsewhere) is refused rather than half-edited.
- ``write_atomic`` replaces the file in one rename (temp file in the same directory,
  fsync'd, the old file's mode kept): a reader, such as the running proxy that reloads
  the file within 1 s, sees the old text or the new text, never a mix.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class EditError(ValueError):
    """The edit could not be made safely; the file was not changed."""


# --- a small line lexer: enough TOML to find tables and keys -----------------------


@dataclass(frozen=True)
class Line:
    index: int
    text: str                  # with its line ending
    in_string: bool            # begins inside a multi-line string
    header: tuple[str, ...] | None = None   # the table this line opens, if it is a header
    array: bool = False        # the header is an array of tables ([[...]])
    key: tuple[str, ...] | None = None      # the key this line sets, if it is key = value
    value_start: int = 0       # where the value begins (key lines)
    value_end: int = 0         # where a single-line value ends (before its comment)

    @property
    def blank(self) -> bool:
        return not self.in_string and not self.text.strip()

    @property
    def comment(self) -> bool:
        return not self.in_string and self.text.lstrip().startswith("#")


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t":
        i += 1
    return i


def _basic_string(s: str, i: int) -> tuple[str, int]:
    """s[i] is the opening quote; return (value, index after the closing quote)."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == '"':
            try:
                return json.loads(s[i:j + 1]), j + 1
            except ValueError:
                return s[i + 1:j], j + 1
        j += 1
    raise ValueError("unterminated string")


def _literal_string(s: str, i: int) -> tuple[str, int]:
    j = s.find("'", i + 1)
    if j < 0:
        raise ValueError("unterminated string")
    return s[i + 1:j], j + 1


def _keys(s: str, i: int) -> tuple[tuple[str, ...], int]:
    """A dotted key starting at s[i]: (parts, index after it)."""
    parts: list[str] = []
    while True:
        i = _skip_ws(s, i)
        if i < len(s) and s[i] == '"':
            part, i = _basic_string(s, i)
        elif i < len(s) and s[i] == "'":
            part, i = _literal_string(s, i)
        else:
            m = BARE_KEY.match(s, i)
            if not m:
                raise ValueError("no key")
            part, i = m.group(), m.end()
        parts.append(part)
        i = _skip_ws(s, i)
        if i < len(s) and s[i] == ".":
            i += 1
            continue
        return tuple(parts), i


def _value_end(s: str, i: int) -> int:
    """End of a single-line value starting at s[i] (before spaces and a comment)."""
    if s.startswith(('"""', "'''"), i):
        return len(s.rstrip("\r\n"))
    if i < len(s) and s[i] == '"':
        return _basic_string(s, i)[1]
    if i < len(s) and s[i] == "'":
        return _literal_string(s, i)[1]
    end = s.find("#", i)
    body = s[i:] if end < 0 else s[i:end]
    return i + len(body.rstrip())


def _multiline_state(text: str, state: str | None) -> str | None:
    """The multi-line string open at the end of ``text``, given the one open at its start."""
    i = 0
    while i < len(text):
        if state is not None:
            j = text.find(state, i) if state == "'''" else _find_unescaped(text, '"""', i)
            if j < 0:
                return state
            i = j + 3
            while i < len(text) and text[i] == state[0]:   # """" ends with one quote inside
                i += 1
            state = None
            continue
        c = text[i]
        if c == "#":
            return None
        if text.startswith(('"""', "'''"), i):
            state = text[i:i + 3]
            i += 3
            continue
        if c == '"':
            try:
                i = _basic_string(text, i)[1]
            except ValueError:
                return None
            continue
        if c == "'":
            try:
                i = _literal_string(text, i)[1]
            except ValueError:
                return None
            continue
        i += 1
    return state


def _find_unescaped(s: str, needle: str, i: int) -> int:
    while True:
        j = s.find(needle, i)
        if j < 0:
            return -1
        backslashes = 0
        k = j - 1
        while k >= 0 and s[k] == "\\":
            backslashes += 1
            k -= 1
        if backslashes % 2 == 0:
            return j
        i = j + 1


def lex(text: str) -> list[Line]:
    lines: list[Line] = []
    state: str | None = None
    for index, raw in enumerate(text.splitlines(keepends=True)):
        in_string = state is not None
        line = Line(index, raw, in_string)
        if not in_string:
            line = _classify(line)
        state = _multiline_state(raw, state)
        lines.append(line)
    return lines


def _classify(line: Line) -> Line:
    s = line.text
    i = _skip_ws(s, 0)
    if i >= len(s) or s[i] == "#":
        return line
    try:
        if s[i] == "[":
            array = s.startswith("[[", i)
            keys, j = _keys(s, i + (2 if array else 1))
            if not s.startswith("]]" if array else "]", j):
                return line
            return Line(line.index, s, False, header=keys, array=array)
        keys, j = _keys(s, i)
        if j < len(s) and s[j] == "=":
            start = _skip_ws(s, j + 1)
            return Line(line.index, s, False, key=keys, value_start=start, value_end=_value_end(s, start))
    except ValueError:
        pass
    return line


# --- tables -------------------------------------------------------------------------


def _newline(text: str) -> str:
    return "\r\n" if "\r\n" in text else "\n"


def _headers(lines: list[Line]) -> list[int]:
    return [ln.index for ln in lines if ln.header is not None]


def _block_end(lines: list[Line], header: int) -> int:
    """Index after the last line that belongs to the table opened at ``header``.

    The table runs to the next header, except that a comment group right above the next
    header, separated from this table by a blank line, belongs to that next header.
    """
    nxt = next((i for i in _headers(lines) if i > header), len(lines))
    if nxt == len(lines):
        end = nxt
    else:
        c = nxt
        while c - 1 > header and lines[c - 1].comment:
            c -= 1
        end = c if c < nxt and lines[c - 1].blank else nxt
    while end - 1 > header and lines[end - 1].blank:
        end -= 1
    return end


def _quote_key(k: str) -> str:
    return k if BARE_KEY.fullmatch(k) else json.dumps(k, ensure_ascii=False)


def _string(v: str) -> str:
    return json.dumps(v, ensure_ascii=False)


def _find_table(lines: list[Line], keys: tuple[str, ...]) -> int | None:
    for ln in lines:
        if ln.header == keys and not ln.array:
            return ln.index
    return None


def _replace_value(line: Line, value: str) -> str:
    s = line.text
    return s[:line.value_start] + value + s[line.value_end:]


def _append_table(text: str, lines_to_add: list[str]) -> str:
    nl = _newline(text)
    out = text
    if out and not out.endswith(("\n", "\r")):
        out += nl
    if out.strip():
        if not out.endswith(nl + nl):
            out += nl
    else:
        out = ""
    return out + "".join(line + nl for line in lines_to_add)


# --- the edits ----------------------------------------------------------------------


def set_agent_server(text: str, agent: str, server: str | None) -> str:
    """Set ``[agents.<agent>] server``; None writes "" (not routed)."""
    value = _string(server or "")
    lines = lex(text)
    nl = _newline(text)
    table = _find_table(lines, ("agents", agent))
    if table is not None:
        end = next((i for i in _headers(lines) if i > table), len(lines))
        for ln in lines[table + 1:end]:
            if ln.key == ("server",):
                lines[ln.index] = Line(ln.index, _replace_value(ln, value), False)
                return "".join(x.text for x in lines)
        # The table exists without a server line: add one right under its header.
        header = lines[table].text
        ending = "" if header.endswith(("\n", "\r")) else nl
        new = header + ending + f"server = {value}{nl}"
        return "".join(new if x.index == table else x.text for x in lines)
    parent = _find_table(lines, ("agents",))
    if parent is not None:
        # [agents] with a dotted key: claude-code.server = "glm"
        end = next((i for i in _headers(lines) if i > parent), len(lines))
        for ln in lines[parent + 1:end]:
            if ln.key == (agent, "server"):
                lines[ln.index] = Line(ln.index, _replace_value(ln, value), False)
                return "".join(x.text for x in lines)
    return _append_table(text, [f"[agents.{_quote_key(agent)}]", f"server = {value}"])


def add_server(text: str, name: str, url: str, key_env: str | None = None,
               auth: str | None = None) -> str:
    """Add a ``[servers.<name>]`` table after the last server table (or at the end)."""
    block = [f"[servers.{_quote_key(name)}]", f"url = {_string(url)}"]
    if key_env:
        block.append(f"key_env = {_string(key_env)}")
    if auth:
        block.append(f"auth = {_string(auth)}")
    lines = lex(text)
    servers = [ln.index for ln in lines if ln.header and ln.header[0] == "servers" and not ln.array]
    if not servers:
        return _append_table(text, block)
    nl = _newline(text)
    end = _block_end(lines, servers[-1])
    before = "".join(x.text for x in lines[:end])
    after = "".join(x.text for x in lines[end:])
    if before and not before.endswith(("\n", "\r")):
        before += nl
    new = nl + "".join(line + nl for line in block)
    if after and not after.startswith(("\n", "\r\n")):
        new += nl
    return before + new + after


def remove_server(text: str, name: str) -> str:
    """Remove ``[servers.<name>]`` (and its sub-tables, and the comments just above it)."""
    lines = lex(text)
    drop: set[int] = set()
    for ln in lines:
        h = ln.header
        if h and len(h) >= 2 and h[0] == "servers" and h[1] == name:
            start = ln.index
            while start - 1 >= 0 and lines[start - 1].comment:
                start -= 1
            drop.update(range(start, _block_end(lines, ln.index)))
    if not drop:
        return text
    kept: list[str] = []
    for ln in lines:
        if ln.index in drop:
            continue
        # Two blank lines meeting where the table was: keep one.
        if ln.blank and kept and not kept[-1].strip() and (ln.index - 1) in drop:
            continue
        kept.append(ln.text)
    while kept and not kept[0].strip():
        kept.pop(0)
    out = "".join(kept)
    nl = _newline(text)
    stripped = out.rstrip()
    return stripped + nl if stripped else ""


# --- writing ------------------------------------------------------------------------


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` in one rename; keep its mode (0600 for a new file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o600
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
