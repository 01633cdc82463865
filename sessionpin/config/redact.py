"""What looks like a key, and how to name a value without showing it.

A second line of defence behind the allowlists (``headers.py``) and the config's checks:
a key pasted where a name was expected (``key_env = "sk-ant-…"``), or carried inside a
header the router forwards (a ``User-Agent`` or ``x-stainless-*`` holding a token), must
neither leave with a moved request nor be echoed in an error, a log line or a refusal.

Rules this module keeps:
- ``contains_key(text)`` is true when some part of the text reads as a credential:
  * a vendor's key prefix at a word start followed by at least 16 key characters
    (``sk-``, ``sk-ant-``, ``xai-``, ``gsk_``, ``ghp_``, ``github_pat_``, ``AIza``, ``AKIA``,
    ``eyJ`` — a JWT or base64 JSON —, …);
  * a run of 32 or more letters and digits that is hex with both digits and letters
    (DeepSeek/Together/z.ai keys, hashes), or mixes upper case, lower case and digits
    (Mistral, Cohere, random base62);
  * a run of 40 or more base64/base64url characters mixing upper case, lower case and digits.
  Names and ids real agents send stay clear of it: UUIDs (runs of at most 12), opencode's
  ``ses_…`` (26 after the prefix), beta flags and user agents (no upper case in long runs);
  tests/test_headers.py checks every recorded header value.
- ``shown(value)`` names a value by its first few characters and its length only
  (``sk-a…(40 chars)``), whatever it is.
- ``scrub(text)`` replaces every word of a message holding a key-looking part with ``[redacted]``.
- ``unquoted(message)`` replaces every value a message quotes as Python prints one (``b'…'``,
  ``bytearray(b'…')``, ``'…'``: how mitmproxy's and h11's parse errors show a peer's bytes — a
  header line with the agent's key, a request line with ``?key=``, the first line of an answer)
  with its size: such a message is logged, put in the flow's error and sent to the agent, and a
  peer's bytes are content, whatever their shape, so the key heuristic is not enough there.
It is a heuristic: it errs towards calling things keys, because the places it guards
(forwarded headers, error messages) lose little when a harmless value is dropped.
"""

from __future__ import annotations

import codecs
import re

# Vendor key prefixes (case-sensitive), each followed by >= 16 key characters.
KEY_PREFIXES = (
    "sk-", "sk_", "rk_", "pk_live_", "xai-", "gsk_", "csk-", "pplx-", "nvapi-", "fw_", "r8_",
    "hf_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "glpat-", "xoxb-", "xoxp-",
    "xoxa-", "xoxr-", "xoxs-", "AIza", "AKIA", "ASIA", "sess-", "eyJ",
)
_KEYCHARS = r"[A-Za-z0-9_\-+/=.~]"
_PREFIXED = re.compile(
    r"(?<![A-Za-z0-9])(?:" + "|".join(re.escape(p) for p in KEY_PREFIXES) + r")" + _KEYCHARS + r"{16,}"
)
_ALNUM_RUN = re.compile(r"[A-Za-z0-9]{32,}")
_B64_RUN = re.compile(r"[A-Za-z0-9+/_\-]{40,}={0,2}")
_HEX = re.compile(r"[0-9A-Fa-f]+")


def _mixed(run: str) -> bool:
    """Upper case, lower case and digits all present: random base62/base64, not a word."""
    return any(c.isupper() for c in run) and any(c.islower() for c in run) and any(c.isdigit() for c in run)


def _random_run(run: str) -> bool:
    if _HEX.fullmatch(run):
        return any(c.isdigit() for c in run) and any(c.isalpha() for c in run)
    return _mixed(run)


_TOKEN = re.compile(_KEYCHARS + "+")


def contains_key(text: str) -> bool:
    """Whether some part of ``text`` reads as a credential (see the module's rules)."""
    if not isinstance(text, str) or len(text) < 19:
        return False   # shorter than the shortest key form (a prefix and 16 key characters)
    return bool(_PREFIXED.search(text)) or any(
        _random_run(m.group()) for m in _ALNUM_RUN.finditer(text)
    ) or any(_mixed(m.group()) for m in _B64_RUN.finditer(text))


def shown(value: str) -> str:
    """A value named without being shown: at most its first 4 characters (fewer for a
    short one) and its length, e.g. ``sk-a…(40 chars)``."""
    value = str(value)
    keep = min(4, len(value) // 4)
    head = "".join(c if c.isprintable() else "?" for c in value[:keep])
    return f"{head}…({len(value)} chars)"


def scrub(text: str) -> str:
    """``text`` with every word that holds a key-looking part replaced by ``[redacted]``
    (the whole word: a z.ai key is ``<hex>.<secret>``, and only its hex reads as random)."""
    return _TOKEN.sub(lambda m: "[redacted]" if contains_key(m.group()) else m.group(), text)


# A value as Python's repr() prints it, where a message quotes one: bytes (``b'…'``) or a
# bytearray (``bytearray(b'…')``) first, then a str (``'…'``); not inside a word (an apostrophe
# in "server's" opens nothing). Only its start is found by a pattern; its end is the next quote
# of the same kind that no backslash escapes, found by ``str.find`` (a 256 KiB head's repr: a
# few milliseconds at most, where a pattern walking it took 25-50). Bytes first: a message may
# also hold a raw character in quotes (h2's "Illegal character '\n' in header value: b'…'"),
# which must not pair with the bytes' opening quote (it is then hidden too: a character).
_BYTES_START = re.compile(r"(?<![\w'\"])(?:bytearray\()?b['\"]")
_STR_START = re.compile(r"(?<![\w'\"])['\"]")


def _closing(text: str, quote: str, at: int) -> int:
    """Where the quote opened before ``at`` ends (-1: it does not)."""
    floor = at
    while True:
        k = text.find(quote, at)
        if k < 0:
            return -1
        if not _escaped(text, k, floor):
            return k
        at = k + 1


def _escaped(text: str, k: int, floor: int) -> bool:
    """Whether an odd run of backslashes (after ``floor``) ends at ``k``: counted in C, in
    windows growing fourfold, so a long run costs its length once, not a step per backslash."""
    width = 64
    while True:
        low = max(floor, k - width)
        seg = text[low:k]
        run = len(seg) - len(seg.rstrip("\\"))
        if run < len(seg) or low == floor:
            return run % 2 == 1
        width *= 4


def _quoted_size(body: str, is_bytes: bool) -> str:
    try:
        # the repr's escapes undone in C
        n = len(codecs.escape_decode(body.encode("latin-1", "replace"))[0])
    except (ValueError, UnicodeError):
        n = len(body)
    return f"({n} {'bytes' if is_bytes else 'characters'}, not shown)"


def _replace_quoted(text: str, start: re.Pattern, is_bytes: bool) -> str:
    out, at = [], 0
    while (m := start.search(text, at)) is not None:
        quote = m.group()[-1]
        end = _closing(text, quote, m.end())
        if end < 0:         # never closed (cut short?): the rest is hidden, not shown
            out += [text[at:m.start()], _quoted_size(text[m.end():], is_bytes)]
            return "".join(out)
        if m.group().startswith("bytearray(") and text.startswith(")", end + 1):
            stop = end + 2
        else:
            stop = end + 1
        out += [text[at:m.start()], _quoted_size(text[m.end():end], is_bytes)]
        at = stop
    out.append(text[at:])
    return "".join(out)


def unquoted(message: str) -> str:
    """``message`` with every value it quotes as Python prints one replaced by its size
    (``Invalid header line: b'x-api-key sk-…'`` → ``Invalid header line: (23 bytes, not shown)``).
    A message without a quote character is returned as it is, unread."""
    if not isinstance(message, str) or ("'" not in message and '"' not in message):
        return message
    return _replace_quoted(_replace_quoted(message, _BYTES_START, True), _STR_START, False)
