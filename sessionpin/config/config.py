"""The router's configuration: a TOML file, validated into plain data.

Rules this module keeps:
- The file names servers (an origin plus an optional path prefix, a key's environment
  variable, an auth style, model renames), pools of servers (members, a policy, an
  affinity: docs/serverpools.md) and, per agent, the server or pool new conversations go to.
  Nothing else: which server a *running* conversation uses is the pin's business.
- A pool and a server may not share a name; a pool's members are configured servers,
  each once; weights are positive integers for members of a "weighted" pool only.
- Validation is strict: an unknown key, a bad URL, an agent name sessionpin does not
  know, or an agent pointed at a server that is not configured is an error. Every error
  is one line naming the file, the line and the key:
  ``config.toml:12: agents.claude-code.server: no server named 'glmm' (servers: anthropic, glm)``.
  The values are read by tomllib; a key's line by ``configedit.key_lines`` (tomlkit's
  document model, the one TOML reader that knows where things were written), only when
  there is an error to report.
- A missing file is an empty configuration: nothing is in scope, nothing is routed.
- Parsing is pure (text in, ``Config`` out); only ``load`` touches the disk, and no
  key is read here (``key_env`` names a variable that is read when a request is routed).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
import re
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable
from urllib.parse import urlsplit

from ..reader import paths
from ..reader.facts import AGENTS
from ..accounting.prices import KINDS as PRICE_KINDS
from ..accounting.prices import Price
from .redact import contains_key, scrub, shown

AUTH_STYLES = ("x-api-key", "bearer")
SERVER_KEYS = ("url", "key_env", "auth", "models", "prices")
AGENT_KEYS = ("server",)
POOL_KEYS = ("members", "policy", "weights", "affinity")
POLICIES = ("round-robin", "weighted", "least-active", "quota")
AFFINITIES = ("hard", "soft")
TOP_KEYS = ("servers", "pools", "agents")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DEFAULT_PORT = {"http": 80, "https": 443}


class ConfigError(Exception):
    """A configuration that cannot be used; ``str()`` is one line: file:line: key: message."""

    def __init__(self, path: str | None, line: int | None, key: str | None, message: str):
        self.path = path
        self.line = line
        self.key = key
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        where = Path(self.path).name if self.path else "config"
        if self.line:
            where += f":{self.line}"
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    scheme: str
    host: str
    port: int
    prefix: str = ""                  # "" or e.g. "/api/anthropic" (no trailing slash)
    key_env: str | None = None        # environment variable holding this server's key
    auth: str | None = None           # "x-api-key" | "bearer" | None: the style the agent used
    models: tuple[tuple[str, str], ...] = ()   # (glob, name), first match wins
    prices: tuple[tuple[str, Price], ...] = ()  # (model glob, price per million tokens): docs/ledger.md

    @property
    def origin(self) -> str:
        default = _DEFAULT_PORT.get(self.scheme)
        port = "" if self.port == default else f":{self.port}"
        return f"{self.scheme}://{self.host}{port}"

    @property
    def base(self) -> str:
        """Where this API's endpoints are (``paths.api_base``): ``/v1`` for a bare origin,
        ``/zen/v1`` for ``…/zen/v1``, ``/api/anthropic/v1`` for ``…/api/anthropic``."""
        return paths.api_base(self.prefix)

    def base_for(self, endpoint: str) -> str:
        """Where this API has ``endpoint`` (``paths.api_base``): ``base``, but for an OpenAI
        endpoint at a URL holding a version before its last segment (Gemini's
        ``…/v1beta/openai``), the URL's path itself."""
        return paths.api_base(self.prefix, endpoint)

    def at(self, host: str, port: int, scheme: str | None = None) -> bool:
        """Whether host:port (and scheme, when given) is this server's address — the one
        test of "does this address belong to that server" (names compare case-blind,
        without a trailing dot)."""
        if scheme is not None and scheme.lower() != self.scheme:
            return False
        return str(host).lower().rstrip(".") == self.host and port == self.port

    def addresses(self, scheme: str, host: str, port: int, path: str) -> bool:
        """Whether a request to scheme://host:port/path is addressed to this server."""
        return self.at(host, port, scheme) and _under(path, self.prefix)

    def map_model(self, model: str) -> str:
        """The name this server knows ``model`` by: the first matching glob's, else unchanged."""
        return map_model(self.models, model)


@dataclass(frozen=True)
class Pool:
    """Servers that share an agent's new conversations (docs/serverpools.md)."""
    name: str
    members: tuple[str, ...]                   # server names, in written order
    policy: str = "round-robin"                # round-robin | weighted | least-active | quota
    weights: tuple[tuple[str, int], ...] = ()  # member -> weight (weighted only; absent: 1)
    affinity: str = "hard"                     # hard: a pin never moves; soft: a hint (replicas)

    def weight(self, member: str) -> int:
        return dict(self.weights).get(member, 1)

    @property
    def revision(self) -> str:
        """A hash of the definition: allocations record it, and a change of it is recorded."""
        text = json.dumps([self.members, self.policy, sorted(self.weights), self.affinity])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Agent:
    name: str
    server: str | None = None         # None: not routed; a server's or a pool's name


@dataclass(frozen=True)
class Config:
    path: str | None = None
    servers: dict[str, Server] = field(default_factory=dict)
    agents: dict[str, Agent] = field(default_factory=dict)
    pools: dict[str, Pool] = field(default_factory=dict)

    @functools.cached_property
    def renames(self) -> bool:
        """Whether a request may have its model renamed (a server's model map, or a pool's
        member's, which a pin keeps): the reader then says where the model lies."""
        return bool(self.pools) or any(s.models for s in self.servers.values())

    def server_for(self, scheme: str, host: str, port: int, path: str) -> Server | None:
        """The configured server a request addresses: at its origin, the longest prefix the
        path is under wins; a path under none of them (``/zen/v1/…`` at a server written as
        ``…/api/anthropic``) is the first written server's at that origin — a server is an
        API at its origin, and the origin is sessionpin's to route (``paths.scope`` says
        which of its paths are inference)."""
        best: Server | None = None
        first: Server | None = None
        for server in self.servers.values():
            if not server.at(host, port, scheme):
                continue
            first = first or server
            if _under(path, server.prefix) and (best is None or len(server.prefix) > len(best.prefix)):
                best = server
        return best or first

    def scope(self, method: str, scheme: str, host: str, port: int,
              path: str) -> tuple[Server | None, paths.Scope]:
        """The one rule of what a request is to sessionpin: the configured server it
        addresses (``server_for``) and ``paths.scope`` of its path under that server's
        prefix (no server at its origin: the path alone). The router, the body limit and
        the connect check all ask this, so no routed request escapes a guard: a server
        written ``…/api/paas/v4`` has its ``/api/paas/v4/chat/completions`` routed *and*
        bounded."""
        source = self.server_for(scheme, host, port, path)
        return source, paths.scope(method, path, source.prefix if source else None)

    def addresses_origin(self, scheme: str, host: str, port: int) -> bool:
        """Whether scheme://host:port is the origin of any configured server."""
        return self.server_at(host, port, scheme) is not None

    def server_at(self, host: str, port: int, scheme: str | None = None) -> Server | None:
        """A configured server at host:port (the first one, when several share an origin)."""
        return next((s for s in self.servers.values() if s.at(host, port, scheme)), None)

    def current(self, agent: str) -> str | None:
        """The server (or pool) new conversations of ``agent`` go to; None: not routed."""
        a = self.agents.get(agent)
        return a.server if a else None

    def pools_of(self, server: str) -> list[Pool]:
        """The pools ``server`` is a member of."""
        return [p for p in self.pools.values() if server in p.members]


def repointed(old: Config, new: Config) -> list[tuple[str, str, str]]:
    """The servers ``new`` names at another origin than ``old`` did: (name, was, now). The
    conversations pinned to them since before are refused (``ladder.moved``), so a reload says so."""
    return [(name, s.origin, new.servers[name].origin) for name, s in old.servers.items()
            if name in new.servers and new.servers[name].origin != s.origin]


def default_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_config_dir("sessionpin")) / "config.toml"


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and validate ``path`` (default: ``default_path()``); a missing file is an empty Config."""
    p = Path(path) if path else default_path()
    try:
        raw = read_trusted(p)
        if raw is None:
            return Config(path=str(p))
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(str(p), None, None, f"not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise ConfigError(str(p), None, None, f"cannot read: {e.strerror or e}") from None
    return parse(text, str(p))


MAX_BYTES = 1 << 20     # a config names a few servers: a larger file is something else given as one


def read_trusted(p: Path) -> bytes | None:
    """The config file's bytes (None: there is none), read only if it is trusted (``_trusted``:
    else ``ConfigError``); what the proxy's watcher and every command read.

    Only a regular file of at most ``MAX_BYTES`` is read; anything else is a ``ConfigError``
    saying what it is. The watcher reads the path on the proxy's loop four times a second: a
    FIFO's open() waited there for a writer (every request stalled), a device or a log file
    given as the config was read whole each time, and a directory was skipped in silence.
    Opened non-blocking, so a FIFO is looked at, not waited on."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(str(p), None, None, f"not a regular file ({_file_kind(st.st_mode)}): refusing it; "
                              f"the config is a TOML file")
        _trusted(p, st)
        if st.st_size > MAX_BYTES:
            raise _too_big(p, st.st_size)
        with os.fdopen(fd, "rb") as f:
            fd = -1                                  # the file object closes it
            data = f.read(MAX_BYTES + 1)             # bounded: it may have grown since fstat
        if len(data) > MAX_BYTES:
            raise _too_big(p, len(data))
        return data
    finally:
        if fd >= 0:
            os.close(fd)


def _too_big(p: Path, size: int) -> ConfigError:
    return ConfigError(str(p), None, None, f"{size} bytes, more than a sessionpin config holds ({MAX_BYTES} at most): "
                       f"refusing it; is this the config file?")


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"


def _trusted(p: Path, st: os.stat_result) -> None:
    """The config names where requests go and with which keys: a file another user owns, or
    that others may write, could point a server's URL (and its key) anywhere, and the proxy
    reloads it within a second. Refused, saying how to fix it (root's files are trusted: root
    can change anything anyway). A link is followed: it is the file it names that is judged."""
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(str(p), None, None, f"owned by another user (uid {st.st_uid}; sessionpin runs as uid "
                          f"{os.geteuid()}), who could send your keys elsewhere: refusing it; take it over "
                          f"(chown) or copy it to a file of your own")
    if st.st_mode & 0o022:
        raise ConfigError(str(p), None, None, f"writable by other users (mode {st.st_mode & 0o777:o}), who could "
                          f"send your keys elsewhere: refusing it; run 'chmod go-w {p}'")


def _url_shown(url: str) -> str:
    """A URL the config refuses, as an error quotes it: without what may hold a credential (a
    user and password, a query, a fragment), by its first characters and length if the rest
    still reads as a key."""
    cut = url.split("?", 1)[0].split("#", 1)[0]
    if "@" in cut.split("/", 3)[2 if "://" in cut else 0]:
        scheme, sep, rest = cut.rpartition("://")
        cut = scheme + sep + "…@" + rest.split("@", 1)[1]
    hidden = "" if cut == url else " (its user, query or fragment not shown)"
    return (shown(cut) if contains_key(cut) else repr(cut)) + hidden


def parse(text: str, path: str | None = None) -> Config:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = re.search(r"\s*\(at line (\d+), column \d+\)$", msg)
        line = int(m.group(1)) if m else getattr(e, "lineno", None)
        if m:
            msg = msg[: m.start()]
        elif msg.endswith(" (at end of document)"):
            msg = msg[: -len(" (at end of document)")]
            line = text.count("\n") + 1
        raise ConfigError(path, line, None, f"TOML syntax: {msg}") from None
    return _Validator(text, path).config(doc)


def map_model(models: Iterable[tuple[str, str]], model: str) -> str:
    """``model`` renamed by a model map (``Server.models``): the first matching glob's name."""
    if type(models) is tuple:       # a server's map (hashable): asked twice a request, the same few models
        return _mapped(models, model)
    return _map(models, model)


@functools.lru_cache(maxsize=1024)   # bounded: a model name is the client's
def _mapped(models: tuple[tuple[str, str], ...], model: str) -> str:
    return _map(models, model)


def _map(models: Iterable[tuple[str, str]], model: str) -> str:
    for pattern, name in models:
        if fnmatch.fnmatchcase(model, pattern):
            return name
    return model


def _under(path: str, prefix: str) -> bool:
    if not prefix:
        return True
    if not path.startswith(prefix):
        return False
    rest = path[len(prefix):]
    return rest == "" or rest[0] in "/?"


class _Validator:
    def __init__(self, text: str, path: str | None):
        self.path = path
        self.text = text

    def line_of(self, keys: tuple[str, ...]) -> int | None:
        # Only an error needs a line: the document model is read then, not on every load.
        from .configedit import EditError, key_lines
        try:
            return _find_line(key_lines(self.text), keys)
        except EditError:
            return None

    def error(self, keys: tuple[str, ...], message: str) -> ConfigError:
        # (a message quotes what the operator wrote; a key pasted where a name or a URL belongs
        # must not be echoed by the log, status and the CLI: what reads as one is redacted)
        return ConfigError(self.path, self.line_of(keys), ".".join(_show(k) for k in keys), scrub(message))

    def table(self, value: object, keys: tuple[str, ...]) -> dict:
        if not isinstance(value, dict):
            raise self.error(keys, f"must be a table, not {_kind(value)}")
        return value

    def string(self, value: object, keys: tuple[str, ...]) -> str:
        if not isinstance(value, str):
            raise self.error(keys, f"must be a string, not {_kind(value)}")
        return value

    def unknown(self, table: dict, known: tuple[str, ...], keys: tuple[str, ...]) -> None:
        for k in table:
            if k not in known:
                raise self.error(keys + (k,), f"unknown key (known: {', '.join(known)})")

    def config(self, doc: dict) -> Config:
        self.unknown(doc, TOP_KEYS, ())
        servers: dict[str, Server] = {}
        for name, body in self.table(doc.get("servers", {}), ("servers",)).items():
            servers[name] = self.server(name, self.table(body, ("servers", name)))
        pools: dict[str, Pool] = {}
        for name, body in self.table(doc.get("pools", {}), ("pools",)).items():
            pools[name] = self.pool(name, self.table(body, ("pools", name)), servers)
        seen: dict[tuple[str, str], str] = {}
        for s in servers.values():
            other = seen.setdefault((s.origin, s.prefix), s.name)
            # Several accounts of one provider share its URL: allowed for members of one
            # pool that each have a key of their own (the agent's key cannot be told to
            # belong to one of them, so each always gets its own: allocate.addressed_as).
            if other != s.name and not (s.key_env and servers[other].key_env and any(
                    s.name in p.members and other in p.members for p in pools.values())):
                shared = " (only members of one pool, each with its own key_env, may share one)" if pools else ""
                raise self.error(("servers", s.name, "url"), f"same origin and prefix as server '{other}'{shared}")
        agents: dict[str, Agent] = {}
        for name, body in self.table(doc.get("agents", {}), ("agents",)).items():
            agents[name] = self.agent(name, self.table(body, ("agents", name)), servers, pools)
        return Config(path=self.path, servers=servers, agents=agents, pools=pools)

    def server(self, name: str, body: dict) -> Server:
        at = ("servers", name)
        if not _NAME.match(name):
            raise self.error(at, "a server name is letters, digits, '_', '-' and '.'")
        self.unknown(body, SERVER_KEYS, at)
        if "url" not in body:
            raise self.error(at, "missing url (e.g. url = \"https://api.anthropic.com\")")
        url = self.string(body["url"], at + ("url",)).strip()
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise self.error(at + ("url",), f"not a URL: {e}") from None
        if parts.scheme not in _DEFAULT_PORT:
            raise self.error(at + ("url",), f"must start with https:// or http://, got {_url_shown(url)}")
        if not parts.hostname:
            raise self.error(at + ("url",), f"no host in {_url_shown(url)}")
        if parts.query or parts.fragment or parts.username or parts.password:
            raise self.error(at + ("url",), "an origin and a path prefix only: no query, fragment or user")
        prefix = parts.path.rstrip("/")
        key_env = None
        if "key_env" in body:
            # It names a variable. A key pasted here would be echoed by status, the log and
            # refusals, so a value that reads as a key is refused, and no refused value is
            # shown beyond its first characters and length.
            key_env = self.string(body["key_env"], at + ("key_env",)).strip() or None
            if key_env and contains_key(key_env):
                raise self.error(at + ("key_env",), f"looks like a key, not a variable name: {shown(key_env)}; "
                                                    "put the key in the proxy's environment and name the variable here")
            if key_env and not _ENV_NAME.match(key_env):
                raise self.error(at + ("key_env",), f"not an environment variable name: {shown(key_env)} "
                                                    "(letters, digits and '_', not starting with a digit)")
        auth = None
        if "auth" in body:
            written = self.string(body["auth"], at + ("auth",)).strip()
            auth = written.lower() or None
            if auth not in (None, *AUTH_STYLES):
                # said as written (lower case hid a mixed-case key from the redaction) and, when
                # it reads as a credential (``Bearer <key>``: the key itself, not its style), by
                # its first characters and length only
                said = shown(written) if contains_key(written) else repr(written)
                raise self.error(at + ("auth",), f"must be one of {', '.join(AUTH_STYLES)} (the style the key "
                                                 f"is sent in, not the key), got {said}")
        models: list[tuple[str, str]] = []
        if "models" in body:
            for pattern, target in self.table(body["models"], at + ("models",)).items():
                target = self.string(target, at + ("models", pattern))
                if not target:
                    raise self.error(at + ("models", pattern), "maps to an empty model name")
                models.append((pattern, target))
        prices: list[tuple[str, Price]] = []
        for pattern, table in self.table(body.get("prices", {}), at + ("prices",)).items():
            where = at + ("prices", pattern)
            table = self.table(table, where)
            self.unknown(table, PRICE_KINDS, where)
            values = {}
            for k, v in table.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != v or v == float("inf"):
                    raise self.error(where + (k,), f"must be a price per million tokens (a number >= 0), got {v!r}")
                values[k] = float(v)
            prices.append((pattern, Price(**values)))
        return Server(
            name=name, url=url, scheme=parts.scheme, host=parts.hostname.lower().rstrip("."),
            port=port or _DEFAULT_PORT[parts.scheme], prefix=prefix, key_env=key_env, auth=auth,
            models=tuple(models), prices=tuple(prices),
        )

    def pool(self, name: str, body: dict, servers: dict[str, Server]) -> Pool:
        at = ("pools", name)
        if not _NAME.match(name):
            raise self.error(at, "a pool name is letters, digits, '_', '-' and '.'")
        if name in servers:
            raise self.error(at, f"a pool and a server may not share a name: server '{name}' exists")
        self.unknown(body, POOL_KEYS, at)
        if "members" not in body:
            raise self.error(at, 'missing members (e.g. members = ["glm-a", "glm-b"])')
        raw = body["members"]
        if not isinstance(raw, list):
            raise self.error(at + ("members",), f"must be an array of server names, not {_kind(raw)}")
        if not raw:
            raise self.error(at + ("members",), "must name at least one server")
        members: list[str] = []
        for m in raw:
            m = self.string(m, at + ("members",)).strip()
            if m not in servers:
                known = ", ".join(servers) or "none configured"
                raise self.error(at + ("members",), f"no server named {m!r} (servers: {known})")
            if m in members:
                raise self.error(at + ("members",), f"{m!r} is listed twice")
            members.append(m)
        policy = self.string(body.get("policy", "round-robin"), at + ("policy",)).strip()
        if policy not in POLICIES:
            raise self.error(at + ("policy",), f"must be one of {', '.join(POLICIES)}, got {policy!r}")
        affinity = self.string(body.get("affinity", "hard"), at + ("affinity",)).strip()
        if affinity not in AFFINITIES:
            raise self.error(at + ("affinity",), f"must be one of {', '.join(AFFINITIES)}, got {affinity!r}")
        weights: list[tuple[str, int]] = []
        if "weights" in body:
            if policy != "weighted":
                raise self.error(at + ("weights",), f'weights are for policy = "weighted" (this pool is {policy})')
            for member, w in self.table(body["weights"], at + ("weights",)).items():
                if member not in members:
                    raise self.error(at + ("weights", member), f"not a member of pool {name} "
                                     f"(members: {', '.join(members)})")
                if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                    raise self.error(at + ("weights", member), f"must be a whole number >= 1, not {w!r}")
                weights.append((member, w))
        return Pool(name=name, members=tuple(members), policy=policy, weights=tuple(weights), affinity=affinity)

    def agent(self, name: str, body: dict, servers: dict[str, Server], pools: dict[str, Pool]) -> Agent:
        at = ("agents", name)
        if name not in AGENTS:
            raise self.error(at, f"unknown agent (known: {', '.join(AGENTS)})")
        self.unknown(body, AGENT_KEYS, at)
        server = self.string(body.get("server", ""), at + ("server",)).strip() or None
        if server is not None and server not in servers and server not in pools:
            known = ", ".join(servers) or "none configured"
            extra = f"; pools: {', '.join(pools)}" if pools else ""
            raise self.error(at + ("server",), f"no server named {server!r} (servers: {known}{extra})")
        return Agent(name=name, server=server)


def _kind(value: object) -> str:
    return {str: "a string", int: "a number", float: "a number", bool: "true/false",
            list: "an array", dict: "a table"}.get(type(value), type(value).__name__)


def _show(key: str) -> str:
    return key if re.match(r"^[A-Za-z0-9_-]+$", key) else f'"{key}"'


def _find_line(written: list[tuple[tuple[str, ...], int]], keys: tuple[str, ...]) -> int | None:
    """The line ``keys`` was written on: the longest written prefix of it (a table's header
    line when the key itself is absent), else the first line that writes inside it."""
    best, best_len = None, 0
    for path, n in written:
        k = len(path)
        if k <= len(keys) and path == keys[:k] and k > best_len:
            best, best_len = n, k
    if best_len < len(keys):
        # The key itself was not written on a line of its own ([servers.a] names
        # "servers"): the first line that writes inside it.
        for path, n in written:
            if path[: len(keys)] == keys:
                return n
    return best
