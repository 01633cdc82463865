"""Redis store URLs: what they may say, and the safe form every message shows.

Rules it keeps:
- Accepted: ``redis://[user[:pass]@]host[:port][/db]``, ``rediss://…`` (TLS) and
  ``unix://[user[:pass]@]/path/to.sock[?db=N]``, each with options in the query:
  ``prefix`` (default ``{sessionpin}:``; it must hold a hash tag, ``{…}``, so that every
  key — and so every multi-key script — is in one slot on Redis Cluster),
  ``durability`` (``fsync-always``, the default, or ``accept-weaker``), ``wait`` (replicas
  a durable write waits for, default 0), ``wait_timeout_ms`` (default 1000),
  ``timeout`` (seconds per command, default 2), ``cluster`` (``1``: Redis Cluster),
  ``ca`` (a CA bundle for ``rediss://``; default: the system's).
- Anything else in the query is refused, naming the option (never its value): a typo must
  not silently weaken durability, and a ``?password=`` must not sit in a URL we show.
- ``safe`` is the URL with the password replaced by ``***``: it is what ``url``,
  ``describe()``, exceptions and logs carry. The password lives only in ``password``.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from .base import StoreError

SCHEMES = ("redis", "rediss", "unix")
DEFAULT_PREFIX = "{sessionpin}:"
FSYNC_ALWAYS = "fsync-always"
ACCEPT_WEAKER = "accept-weaker"
DEFAULT_TIMEOUT = 2.0
DEFAULT_WAIT_TIMEOUT_MS = 1000
_OPTIONS = {"prefix", "durability", "wait", "wait_timeout_ms", "timeout", "cluster", "ca", "db"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class RedisURL:
    safe: str
    tls: bool
    host: str | None
    port: int
    path: str | None          # a unix socket
    db: int
    username: str | None
    password: str | None
    prefix: str
    durability: str
    wait: int
    wait_timeout_ms: int
    timeout: float
    cluster: bool
    ca: str | None

    def __repr__(self) -> str:  # the dataclass default would print the password
        return f"RedisURL({self.safe!r})"


def has_hash_tag(prefix: str) -> bool:
    """Whether the prefix decides every key's slot: a ``{`` then a ``}`` after at least one
    character, both inside the prefix (Redis hashes only the first such tag of a key)."""
    start = prefix.find("{")
    return start >= 0 and prefix.find("}", start + 2) > start


def mask(url: str) -> str:
    """The URL as written, password masked (for messages about a URL we could not parse).

    Errs on the side of hiding: a password holding an unescaped ``/``, ``?`` or ``@`` (which
    a URL parser would read as the path, the query or the host) is still masked whole,
    and an ``@`` in the query of a URL without a password masks the text before it."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    before_query = rest.partition("?")[0]
    if "@" in before_query:
        auth, _, tail = before_query.rpartition("@")
        tail += rest[len(before_query):]
    elif "@" in rest:
        auth, _, tail = rest.partition("@")
    else:
        return url
    user, colon, _ = auth.partition(":")
    if "/" in user or "?" in user:        # not a user name: the host or path came first
        user, colon = "", ":"
    return f"{scheme}://{user}{':***' if colon else ''}@{tail}"


def parse(url: str) -> RedisURL:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise StoreError(f"store URL {mask(url)!r}: {e}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise StoreError(f"store URL {mask(url)!r}: not a Redis URL (redis://, rediss://, unix://)")
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    query: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in _OPTIONS:
            raise StoreError(f"store URL {mask(url.split('?')[0])!r}: unknown option {name!r} "
                             f"(known: {', '.join(sorted(_OPTIONS))})")
        if name in query:
            raise StoreError(f"store URL {mask(url.split('?')[0])!r}: option {name!r} given twice")
        query[name] = value

    # the safe form, built from the parts (so nothing we did not understand is echoed)
    userinfo = ""
    if username is not None or password is not None:
        userinfo = quote(username or "", safe="") + (":***" if password is not None else "") + "@"
    if scheme == "unix":
        if parts.hostname:
            raise StoreError(f"store URL {mask(url)!r}: unix:// takes a socket path (unix:///path/to.sock)")
        host, path = None, unquote(parts.path)
        if not path:
            raise StoreError(f"store URL {mask(url)!r} names no socket")
        location = quote(path)
        db_text = query.get("db", "0")
    else:
        host, path = parts.hostname, None
        if not host:
            raise StoreError(f"store URL {mask(url)!r} names no host")
        if "db" in query:
            raise StoreError(f"store URL {mask(url)!r}: give the database as the path ({scheme}://host/1)")
        shown = f"[{host}]" if ":" in host else host
        location = f"{shown}:{port or 6379}"
        db_text = parts.path.lstrip("/") or "0"
    db = _int(url, "database", db_text, 0)
    if scheme != "unix" and parts.path.strip("/"):
        location += f"/{db}"
    prefix = query.get("prefix", DEFAULT_PREFIX)
    if not has_hash_tag(prefix):
        raise StoreError(f"store URL {mask(url)!r}: prefix {prefix!r} has no hash tag like {{name}}: "
                         "every key must share one slot so that multi-key writes stay atomic on a cluster")
    durability = query.get("durability", FSYNC_ALWAYS)
    if durability not in (FSYNC_ALWAYS, ACCEPT_WEAKER):
        raise StoreError(f"store URL {mask(url)!r}: durability is {FSYNC_ALWAYS} (default) or {ACCEPT_WEAKER}")
    cluster_text = query.get("cluster", "0").lower()
    if cluster_text not in _TRUE + _FALSE:
        raise StoreError(f"store URL {mask(url)!r}: cluster is 1 or 0")
    cluster = cluster_text in _TRUE
    if cluster and (scheme == "unix" or db):
        raise StoreError(f"store URL {mask(url)!r}: a Redis Cluster is reached over TCP and has only database 0")
    if "ca" in query and scheme != "rediss":
        raise StoreError(f"store URL {mask(url)!r}: ca= is for rediss:// (TLS)")
    try:
        timeout = float(query.get("timeout", DEFAULT_TIMEOUT))
    except ValueError:
        timeout = -1.0
    if not 0 < timeout <= 600:
        raise StoreError(f"store URL {mask(url)!r}: timeout is seconds, > 0")
    wait = _int(url, "wait", query.get("wait", "0"), 0)
    wait_timeout_ms = _int(url, "wait_timeout_ms", query.get("wait_timeout_ms", str(DEFAULT_WAIT_TIMEOUT_MS)), 1)

    shown_query = "&".join(f"{k}={quote(v, safe='{}:/')}" for k, v in query.items() if k != "db" or scheme == "unix")
    safe = f"{scheme}://{userinfo}{location}" + (f"?{shown_query}" if shown_query else "")
    return RedisURL(safe=safe, tls=scheme == "rediss", host=host, port=port or 6379, path=path, db=db,
                    username=username, password=password, prefix=prefix, durability=durability, wait=wait,
                    wait_timeout_ms=wait_timeout_ms, timeout=timeout, cluster=cluster, ca=query.get("ca"))


def _int(url: str, what: str, text: str, least: int) -> int:
    try:
        n = int(text)
    except ValueError:
        n = least - 1
    if n < least:
        raise StoreError(f"store URL {mask(url)!r}: {what} must be an integer >= {least}")
    return n
