"""``env``, ``exec``, ``run``: point an agent at the proxy, or start the proxy.

``run`` starts mitmdump (or mitmweb) as a program with the router script; by default it
shows one line per decision (``flow_detail=0``: mitmdump's own per-flow lines off; the
router drops mitmproxy's connection chatter) — ``--verbose`` brings both back.
A store URL holding a password is handed to mitmdump in ``$SESSIONPIN_STORE``, never on
its command line (which ``ps`` shows to every user, and which ``run`` prints): the
printed command shows it masked. So do the secrets an operator passes to mitmdump after
``--`` (``--set upstream_auth=…``, ``--upstream-auth``, ``--proxyauth``, ``web_password``, a
store URL with a password, a ``--mode upstream:http://user:pass@…``): the line ``run`` prints
goes to a terminal, and to the journal of a service manager.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Sequence

from ..reader.facts import AGENTS
from ..store import safe_url
from .common import Fail, dump_json, err, out
from .context import Ctx
from .proxies import DEFAULT_LISTEN, Proxy, confdir_of, find_proxies, find_proxy, live

CA_FILE = "mitmproxy-ca-cert.pem"
WEB_COLUMNS = ["icon", "method", "path", "status", "size", "time", "comment"]
# How each agent's runtime is told to trust the mitmproxy CA.
NODE_AGENTS = ("claude-code", "opencode", "pi", "gemini-cli")
# Reverse mode: the variable that moves the agent's base URL, and the origin it replaces.
REVERSE = {
    "claude-code": ("ANTHROPIC_BASE_URL", "https://api.anthropic.com", ""),
}
# The reverse-mode port the hints suggest: one per origin, so one proxy can listen for all
# (README, "Pointing each agent at the proxy").
REVERSE_PORT = {"claude-code": 8081, "codex": 8083}
# A command name -> the agent it is (for ``exec``).
COMMAND_AGENT = {"claude": "claude-code", "opencode": "opencode", "pi": "pi", "codex": "codex",
                 "gemini": "gemini-cli"}


def agent_env(agent: str | None, proxy_url: str, ca: Path) -> dict[str, str]:
    env = {"HTTPS_PROXY": proxy_url, "HTTP_PROXY": proxy_url}
    if agent is None or agent in NODE_AGENTS:
        env["NODE_EXTRA_CA_CERTS"] = str(ca)
    if agent is None or agent == "codex":
        env["SSL_CERT_FILE"] = str(ca)
        env["CODEX_CA_CERTIFICATE"] = str(ca)
    return env


def proxy_target(ctx: Ctx, args: argparse.Namespace, proxies: list[Proxy] | None = None) -> tuple[str, Path, Proxy]:
    proxy = find_proxy(ctx, proxies)
    if args.proxy:
        url = args.proxy if "://" in args.proxy else f"http://{args.proxy}"
    elif proxy.answering and proxy.url:
        url = proxy.url
    else:
        url = f"http://{DEFAULT_LISTEN[0]}:{DEFAULT_LISTEN[1]}"
    return url, confdir_of(proxy, args.confdir) / CA_FILE, proxy


def cmd_env(ctx: Ctx, args: argparse.Namespace) -> int:
    agent = args.agent
    if agent not in AGENTS:
        raise Fail(f"unknown agent {agent!r} (known: {', '.join(AGENTS)})")
    if args.reverse is not None:
        return _reverse_env(agent, args)
    proxies = find_proxies(ctx)
    url, ca, proxy = proxy_target(ctx, args, proxies)
    env = agent_env(agent, url, ca)
    running = live(proxies)
    if args.json:
        dump_json({"agent": agent, "mode": "proxy", "env": env, "ca_exists": ca.exists(),
                   "proxy_answering": proxy.answering, "proxies": [p.as_json() for p in running]})
        return 0
    out(f"# {agent} through the sessionpin proxy at {url}: eval \"$(sessionpin env {agent})\"")
    if not proxy.answering:
        out(f"# no proxy is answering yet ({proxy.why}); start one: sessionpin run")
    if len(running) > 1:
        # every live proxy on the store, so the operator sees which one this points at
        out(f"# {len(running)} proxies answer on this store: "
            + ", ".join(f"{p.url} (pid {p.pid})" for p in running)
            + ("" if args.proxy else "; these lines point at the first (the newest)")
            + f"; another: sessionpin env {agent} --proxy URL")
    if not ca.exists():
        out(f"# {ca} does not exist yet: the proxy creates it when it first starts")
    for k, v in env.items():
        out(f"export {k}={shlex.quote(v)}")
    if agent in REVERSE_PORT:
        out(f"# or reverse mode, no CA: `sessionpin env {agent} --reverse {REVERSE_PORT[agent]}`")
    return 0


def _reverse_env(agent: str, args: argparse.Namespace) -> int:
    port = args.reverse
    if agent == "codex":
        # Codex 0.171.0 ignores OPENAI_BASE_URL; it reads openai_base_url from its config
        # (~/.codex/config.toml) or from -c on its command line.
        origin = "https://api.openai.com"
        setting = f'openai_base_url="http://127.0.0.1:{port}/v1"'
        if args.json:
            dump_json({"agent": agent, "mode": "reverse", "env": {}, "codex_config": setting,
                       "proxy_command": f"sessionpin run --mode reverse:{origin}@{port}"})
            return 0
        out("# codex in reverse mode: plain HTTP to the proxy on loopback, no CA to trust.")
        out(f"# The proxy must listen in reverse mode: sessionpin run --mode reverse:{origin}@{port}")
        out(f"# Codex reads its base URL from its config, not the environment: add to ~/.codex/config.toml")
        out(f"#   {setting}")
        out(f"# or run: codex -c '{setting}'")
        return 0
    if agent not in REVERSE:
        raise Fail(f"{agent} has no base-URL variable sessionpin knows; set its provider's base URL to "
                   f"http://127.0.0.1:{port} in its own config, or use proxy mode (drop --reverse)")
    var, origin, path = REVERSE[agent]
    env = {var: f"http://127.0.0.1:{port}{path}"}
    if args.json:
        dump_json({"agent": agent, "mode": "reverse", "env": env,
                   "proxy_command": f"sessionpin run --mode reverse:{origin}@{port}"})
        return 0
    out(f"# {agent} in reverse mode: plain HTTP to the proxy on loopback, no CA to trust.")
    out(f"# The proxy must listen in reverse mode: sessionpin run --mode reverse:{origin}@{port}")
    for k, v in env.items():
        out(f"export {k}={shlex.quote(v)}")
    return 0


def cmd_exec(ctx: Ctx, args: argparse.Namespace) -> int:
    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise Fail("give the command to run after --, e.g. `sessionpin exec -- claude`", 2)
    agent = args.agent
    if agent is not None and agent not in AGENTS:
        raise Fail(f"unknown agent {agent!r} (known: {', '.join(AGENTS)})")
    if agent is None:
        agent = COMMAND_AGENT.get(Path(command[0]).name)
    url, ca, proxy = proxy_target(ctx, args)
    ctx.close()
    if not proxy.answering and not args.proxy:
        err(f"sessionpin: warning: no proxy is answering ({proxy.why}); {command[0]} may fail to connect")
    env = {**os.environ, **agent_env(agent, url, ca)}
    exe = shutil.which(command[0], path=env.get("PATH"))
    if exe is None:
        raise Fail(f"command not found: {command[0]}", 127)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(exe, command, env)
    except OSError as e:
        raise Fail(f"cannot run {command[0]}: {e.strerror or e}", 126) from None
    return 0  # not reached


def route_script() -> Path:
    """The mitmdump script that loads the router, shipped inside the package."""
    return Path(__file__).resolve().parent.parent / "mitmscript" / "route.py"


def find_tool(name: str) -> str:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found:
        return found
    raise Fail(f"{name} not found next to {sys.executable} or on PATH; install mitmproxy 12 "
               "(pip install 'mitmproxy>=12,<13')")


def _has(extra: Sequence[str], *flags: str) -> bool:
    return any(a in flags or any(a.startswith(f + "=") for f in flags if f.startswith("--")) for a in extra)


def _sets(extra: Sequence[str], option: str) -> bool:
    return any(a.startswith(option + "=") for a in extra)


def run_command(ctx: Ctx, web: bool, extra: Sequence[str], verbose: bool = False) -> list[str]:
    tool = "mitmweb" if web else "mitmdump"
    cmd = [find_tool(tool)]
    if not _has(extra, "--listen-host"):
        cmd += ["--listen-host", DEFAULT_LISTEN[0]]
    if not _has(extra, "-p", "--listen-port"):
        cmd += ["--listen-port", str(DEFAULT_LISTEN[1])]
    cmd += ["-s", str(route_script()),
            "--set", "connection_strategy=lazy",
            "--set", f"sessionpin_config={ctx.config_path}"]
    if not store_env(ctx):
        cmd += ["--set", f"sessionpin_store={ctx.store_url}"]
    if verbose:
        cmd += ["--set", "sessionpin_connection_log=true"]
    elif not web and not _sets(extra, "flow_detail"):
        cmd += ["--set", "flow_detail=0"]      # the router prints one line per decision
    if web and not _sets(extra, "web_columns"):
        cmd += ["--set", "web_columns=" + ",".join(WEB_COLUMNS)]
    return cmd + list(extra)


def private_umask() -> int:
    """Make what mitmdump creates private whatever the caller's umask (its confdir 0700 and the
    CA files in it 0600, the store's directories): the umask, with every bit for group and
    others set, is inherited across ``exec``. Returns the umask it had."""
    old = os.umask(0o077)
    os.umask(old | 0o077)
    return old


SECRET_OPTIONS = ("upstream_auth", "proxyauth", "web_password")      # mitmproxy's, holding a password
SECRET_FLAGS = ("--upstream-auth", "--proxyauth", "--web-password")
_USERINFO = re.compile(r"(?<=//)[^/@\s]+@")


def shown_command(cmd: Sequence[str]) -> list[str]:
    """``cmd`` as ``run`` prints it: every secret it carries masked (``***``), the rest as is."""
    out: list[str] = []
    for i, arg in enumerate(cmd):
        before = cmd[i - 1] if i else ""
        if before in SECRET_FLAGS:
            arg = "***"
        elif before == "--set" and "=" in arg:
            name, _, value = arg.partition("=")
            if name in SECRET_OPTIONS:
                arg = f"{name}=***"
            elif name == "sessionpin_store":
                arg = f"{name}={safe_url(value)}"
        elif before in ("--mode", "-m") or arg.startswith("--mode="):
            arg = _USERINFO.sub("***@", arg)
        out.append(arg)
    return out


def store_env(ctx: Ctx) -> dict[str, str]:
    """The environment that hands mitmdump a store URL holding a password (else none)."""
    return {} if safe_url(ctx.store_url) == ctx.store_url else {"SESSIONPIN_STORE": ctx.store_url}


def cmd_run(ctx: Ctx, args: argparse.Namespace, extra: Sequence[str]) -> int:
    ctx.config()  # a broken config stops here, with its one line
    extra = [a for a in extra if a != "--"] if extra[:1] == ["--"] else list(extra)
    cmd = run_command(ctx, args.web, extra, args.verbose)
    env = store_env(ctx)
    shown = shlex.join(shown_command(cmd))
    if env:
        shown = f"SESSIONPIN_STORE={shlex.quote(ctx.store_shown)} {shown}"
    if args.dry_run:
        out(shown)
        return 0
    err(f"sessionpin: {shown}")
    sys.stdout.flush()
    sys.stderr.flush()
    private_umask()
    try:
        os.execve(cmd[0], cmd, {**os.environ, **env})
    except OSError as e:
        raise Fail(f"cannot start {cmd[0]}: {e.strerror or e}", 126) from None
    return 0  # not reached
