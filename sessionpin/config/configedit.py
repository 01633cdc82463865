"""Change one setting of the config file and leave every other byte as it was.

The operator's file holds comments that explain choices ("glm is slow before 9am"), so
the ``sessionpin`` command never re-serialises it.

Rules this module keeps:
- TOML is read here by one reader only: tomlkit, the style-preserving document model
  (Poetry edits pyproject.toml with it). ``layout`` asks it where each table header,
  key and multi-line value was written; ``config``'s error messages find a key's line
  through ``key_lines``, the same reading. No line lexer of our own.
- A changed value is changed by tomlkit in place (the key's spacing and its trailing
  comment stay). Tables are added and removed as whole lines at the places the layout
  gives, because where a comment belongs is a layout choice tomlkit does not make our
  way: a comment group right above a header, after a blank line, belongs to that header
  (tomlkit files it under the table before).
- Only the lines that hold the changed setting change (or the table added or removed);
  comments, blank lines, order, quoting and line endings elsewhere stay byte for byte.
  Lines inside multi-line strings and arrays are never taken for tables or comments.
- A form this module does not edit (an inline table, a setting written as dotted keys
  where a table is needed, an array of tables) raises ``EditError``: never a half edit.
  The caller still parses the new text with ``config.parse`` and checks it says what
  was asked.
- The functions here are pure (text in, text out), except ``write_atomic``, which
  replaces the file in one rename (temp file in the same directory, fsync'd, the old
  file's mode kept): a reader, such as the running proxy that reloads the file within
  1 s, sees the old text or the new text, never a mix.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tomlkit
from tomlkit.container import OutOfOrderTableProxy
from tomlkit.exceptions import TOMLKitError
from tomlkit.items import AoT, Comment, InlineTable, SingleKey, Table, Whitespace


class EditError(ValueError):
    """The edit could not be made safely; the file was not changed."""


# --- the layout, as tomlkit reads it ------------------------------------------------

# Control characters cannot appear in TOML text, so these marks cannot collide with it.
_MARK = re.compile("\x00([0-9]+)\x01")
_LINE = re.compile(r"[^\n]*\n|[^\n]+\Z")


@dataclass(frozen=True)
class Line:
    index: int                          # 0-based
    text: str                           # with its line ending
    kind: str                           # header | array | key | value | comment | blank | other
    path: tuple[str, ...] | None = None  # the table a header opens, the key a key line sets

    @property
    def blank(self) -> bool:
        return self.kind == "blank"

    @property
    def comment(self) -> bool:
        return self.kind == "comment"

    @property
    def header(self) -> tuple[str, ...] | None:
        return self.path if self.kind == "header" else None


def _parse(text: str) -> tomlkit.TOMLDocument:
    try:
        return tomlkit.parse(text)
    except (TOMLKitError, ValueError) as e:
        raise EditError(f"the config is not TOML sessionpin can edit ({e}); nothing written") from None


def _marks(text: str) -> list[tuple[tuple[str, ...], str, int]]:
    """(path, what, line) of every table header, key and value end, in the order written.

    Each item's indentation in the document model gets a numbered mark (and each value's
    trailing space an end mark); rendering the document and finding the marks tells the
    line of each. A rendering that is not the text back, marks removed, is refused."""
    doc = _parse(text)
    found: list[tuple[tuple[str, ...], str]] = []

    def mark(item, path: tuple[str, ...], what: str, end: bool = False) -> None:
        tag = f"\x00{len(found)}\x01"
        found.append((path, what))
        if end:
            item.trivia.comment_ws = tag + item.trivia.comment_ws
        else:
            item.trivia.indent = tag + item.trivia.indent

    def walk(body, prefix: tuple[str, ...]) -> None:
        for key, item in body:
            if key is None or isinstance(item, (Whitespace, Comment)):
                continue
            path = prefix + (key.key,)
            if isinstance(item, AoT):
                for t in item.body:
                    mark(t, path, "array")
                    walk(t.value.body, path)
            elif isinstance(item, Table):
                mark(item, path, "header")   # a super table renders no header: its mark stays unseen
                walk(item.value.body, path)
            else:
                mark(item, path, "key")
                mark(item, path, "end", end=True)
                if isinstance(item, InlineTable):
                    walk(item.value.body, path)

    walk(doc.body, ())
    rendered = doc.as_string()
    if _MARK.sub("", rendered) != text:
        raise EditError("tomlkit does not read this config back as written; nothing written; edit it by hand")
    out = []
    line, pos = 1, 0
    for m in _MARK.finditer(rendered):
        line += rendered.count("\n", pos, m.start())
        pos = m.start()
        path, what = found[int(m.group(1))]
        out.append((path, what, line))
    return out


def key_lines(text: str) -> list[tuple[tuple[str, ...], int]]:
    """(key path, 1-based line) of every table header and ``key = value`` written, for
    error messages (``config``). Keys inside inline tables and dotted keys are there with
    their full path. Raises EditError if the text is not TOML tomlkit reads back."""
    return [(path, line) for path, what, line in _marks(text) if what != "end"]


def _split_lines(text: str) -> list[str]:
    # TOML's newline is LF or CRLF (str.splitlines would also split at a U+2028 in a string).
    return _LINE.findall(text)


def layout(text: str) -> list[Line]:
    """Every line of ``text`` with what it holds, as tomlkit read it."""
    raw = _split_lines(text)
    kinds: dict[int, tuple[str, tuple[str, ...]]] = {}
    inside: set[int] = set()
    start: dict[tuple[str, ...], int] = {}
    for path, what, n in _marks(text):
        i = n - 1
        if what == "end":
            inside.update(range(start.get(path, i) + 1, i + 1))
        else:
            start[path] = i
            kinds.setdefault(i, (what, path))      # the first thing a line writes
    lines = []
    for i, s in enumerate(raw):
        if i in inside:
            lines.append(Line(i, s, "value"))
        elif i in kinds:
            lines.append(Line(i, s, kinds[i][0], kinds[i][1]))
        elif not s.strip():
            lines.append(Line(i, s, "blank"))
        elif s.lstrip().startswith("#"):
            lines.append(Line(i, s, "comment"))
        else:
            lines.append(Line(i, s, "other"))
    return lines


# --- tables -------------------------------------------------------------------------


def _newline(text: str) -> str:
    return "\r\n" if "\r\n" in text else "\n"


def _headers(lines: list[Line]) -> list[int]:
    return [ln.index for ln in lines if ln.kind in ("header", "array")]


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


def _key(k: str) -> str:
    return SingleKey(k).as_string()


def _string(v: str) -> str:
    return tomlkit.string(v).as_string()


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


def _refuse(setting: str, form: str, by_hand: str) -> EditError:
    return EditError(f"could not change {setting} safely: it is written as {form}, which sessionpin does not "
                     f"edit; nothing written; edit it by hand: {by_hand}")


def _is_table(item) -> bool:
    # An out-of-order table ([agents.a] ... [servers.x] ... [agents.b]) reads as a proxy.
    return isinstance(item, (Table, OutOfOrderTableProxy))


def _form(item) -> str:
    if isinstance(item, InlineTable):
        return "an inline table"
    if isinstance(item, AoT):
        return "an array of tables"
    return "a value, not a table"


# --- the edits ----------------------------------------------------------------------


def set_agent_server(text: str, agent: str, server: str | None) -> str:
    """Set ``[agents.<agent>] server``; None writes "" (not routed)."""
    value = server or ""
    setting = f"agents.{agent}.server"
    by_hand = f'[agents.{_key(agent)}] server = {_string(value)}'
    doc = _parse(text)
    block = [f"[agents.{_key(agent)}]", f"server = {_string(value)}"]
    agents = doc.get("agents")
    if agents is None:
        return _append_table(text, block)
    if not _is_table(agents):
        raise _refuse(setting, f"agents = ... ({_form(agents)})", by_hand)
    entry = agents.get(agent)
    if entry is None:
        return _append_table(text, block)
    if not _is_table(entry):
        raise _refuse(setting, f"{_key(agent)} = ... ({_form(entry)})", by_hand)
    if "server" in entry:
        # a basic string item, not the bare value: tomlkit 0.15 gives a bare value the old one's
        # quotes ('a' stayed a literal string), 0.13 a basic string; this is the same on both.
        # tomlkit keeps the key's spacing and trailing comment either way.
        entry["server"] = tomlkit.string(value)
        return doc.as_string()
    # The table exists without a server line: add one right under its header.
    lines = layout(text)
    header = next((ln for ln in lines if ln.header == ("agents", agent)), None)
    if header is None:
        raise _refuse(setting, "dotted keys with no [agents." + _key(agent) + "] header", by_hand)
    nl = _newline(text)
    head = header.text if header.text.endswith(("\n", "\r")) else header.text + nl
    return "".join(head + f"server = {_string(value)}{nl}" if ln is header else ln.text for ln in lines)


def add_server(text: str, name: str, url: str, key_env: str | None = None,
               auth: str | None = None) -> str:
    """Add a ``[servers.<name>]`` table after the last server table (or at the end)."""
    block = [f"[servers.{_key(name)}]", f"url = {_string(url)}"]
    if key_env:
        block.append(f"key_env = {_string(key_env)}")
    if auth:
        block.append(f"auth = {_string(auth)}")
    servers_item = _parse(text).get("servers")
    if servers_item is not None and not _is_table(servers_item):
        raise _refuse(f"servers.{name}", f"servers = ... ({_form(servers_item)})", " ".join(block))
    lines = layout(text)
    servers = [ln.index for ln in lines if ln.header and ln.header[0] == "servers"]
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
    lines = layout(text)
    drop: set[int] = set()
    for ln in lines:
        h = ln.header
        if h and len(h) >= 2 and h[0] == "servers" and h[1] == name:
            start = ln.index
            while start - 1 >= 0 and lines[start - 1].comment:
                start -= 1
            drop.update(range(start, _block_end(lines, ln.index)))
    if not drop:
        servers = _parse(text).get("servers")
        if _is_table(servers) and name in servers:
            raise _refuse(f"servers.{name}", "an inline table or dotted keys",
                          f"delete the [servers.{_key(name)}] setting")
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


def _make_dirs(d: Path) -> None:
    """``d`` and its missing parents, each made 0700 (``mkdir``'s mode only loses the umask's bits)."""
    missing = []
    while not d.exists() and d.parent != d:
        missing.append(d)
        d = d.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            continue
        os.chmod(p, 0o700)


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` in one rename; keep its mode without write for group and
    others (0600 for a new file). Directories made for it are 0700 whatever the umask: a
    config directory others can write lets them replace the file (a server's URL, with its
    key, pointed elsewhere; the proxy reloads it).

    A config that is a symbolic link (dotfiles kept in a repository, stow, chezmoi) is written
    where it points: replacing the link with a file left the file it named as it was, and the
    next re-link (a dotfiles sync) silently put the old choices back in force. A link into a
    read-only place (a Nix store) fails to write, saying so, rather than be replaced."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    _make_dirs(path.parent)
    try:
        mode = path.stat().st_mode & 0o7777 & ~0o022
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
