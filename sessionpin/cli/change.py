"""``use``, ``move``, ``forget``, ``servers``: the operator's decisions, each after its warning.

Rules it keeps:
- A config edit changes only the setting asked for (``configedit``), is checked by
  parsing the new text (the result must say what was asked and nothing else may
  change), and is written in one rename. A choice already in force writes nothing.
- Moving a running conversation (``move``, and ``forget`` of a routed one) needs
  ``--yes`` or an answer at a terminal; without either it is refused. The change is a
  compare-and-set on the pin that was shown: one that changed meanwhile is left alone.
- Removing a server that pinned conversations go to, or came from, says how many and
  needs ``--force``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..config import config as configmod
from ..config import configedit
from ..records import pins
from ..reader.facts import AGENTS
from ..reader.ids import short
from ..store import StoreError
from ..store import identity
from .common import HOUR, NOT_SEEN_BEGIN, Fail, ago, dump_json, err, out, plural, table, where
from .context import Ctx, describe_running, resolve
from .proxies import (Proxy, config_mismatch, find_proxies, find_proxy, key_state, live, proxy_keys,
                      proxy_lines)

MOVE_RISKS = """\
Its next request carries the whole conversation so far to {to}, which may refuse it:
  - the history may be longer than {to}'s context window (400, "maximum context length");
  - thinking blocks signed by {frm} do not verify on {to} (400, invalid signature);
  - {to} may not take this conversation's model or key (403/404).
A conversation stays on the server it began on for these reasons; move it only if it cannot continue there."""


def cmd_use(ctx: Ctx, args: argparse.Namespace) -> int:
    agent = args.agent
    if agent not in AGENTS:
        raise Fail(f"unknown agent {agent!r} (known: {', '.join(AGENTS)})")
    if args.not_routed and args.server:
        raise Fail("give a SERVER or --not-routed, not both")
    if not args.not_routed and not args.server:
        raise Fail(f"give the server for new {agent} conversations, or --not-routed "
                   f"(e.g. `sessionpin use {agent} glm`)", 2)
    target = None if args.not_routed else args.server
    cfg = ctx.config()
    if target is not None and target not in cfg.servers and target not in cfg.pools:
        known = ", ".join(cfg.servers) or "none configured"
        pools = f"; pools: {', '.join(cfg.pools)}" if cfg.pools else ""
        what = "server or pool" if cfg.pools else "server"
        raise Fail(f"no {what} named {target!r} in {ctx.config_path} (servers: {known}{pools}); "
                   f"add it with `sessionpin servers add {target} URL`")
    current = cfg.current(agent)
    if current == target:
        state = f"already go to {target}" if target else "are already not routed"
        out(f"New {agent} conversations {state}; nothing written.")
        for p in live(find_proxies(ctx)):
            mismatch = config_mismatch(p, ctx.config_path)
            if mismatch:
                err(mismatch)
        return 0
    new_text = configedit.set_agent_server(ctx.config_text(), agent, target)
    check(ctx, new_text, f"agents.{agent}.server",
          lambda c: c.current(agent) == target and c.servers == cfg.servers and c.pools == cfg.pools
          and {a: x.server for a, x in c.agents.items() if a != agent}
          == {a: x.server for a, x in cfg.agents.items() if a != agent},
          f'[agents.{agent}] server = "{target or ""}"')
    write_config(ctx, new_text)
    arrow = f"New {agent} conversations → {where(target)}"
    if target in cfg.pools:
        p = cfg.pools[target]
        arrow += f" (pool: {', '.join(p.members)}; {p.policy}, {p.affinity} affinity)"
    if target is None:
        arrow += f" (left alone: they go where {agent} sends them)"
    out(f"{arrow}. (was: {where(current)})")
    try:
        out(describe_running(ctx, agent))
    except (Fail, StoreError) as e:  # the change is made; only the report of what stays is missing
        err(f"sessionpin: warning: could not count the running conversations: {e}")
        return 0
    proxies = find_proxies(ctx)
    for line in proxy_lines(ctx, ctx.config_path, proxies):
        out(line)
    warn_key(cfg, target, find_proxy(ctx, proxies))
    return 0


def write_config(ctx: Ctx, text: str) -> None:
    try:
        configedit.write_atomic(ctx.config_path, text)
    except OSError as e:
        raise Fail(f"cannot write {ctx.config_path}: {e.strerror or e}; nothing changed") from None


def warn_key(cfg: configmod.Config, target: str | None, proxy: Proxy) -> None:
    if target is None:
        return
    if target in cfg.pools:
        for member in cfg.pools[target].members:
            warn_key(cfg, member, proxy)
        return
    server = cfg.servers[target]
    if not server.key_env:
        err(f"Note: {target} has no key_env, so only requests addressed to {server.origin} can go there "
            f"(with the agent's own key); the proxy refuses the others rather than send a key to the wrong server.")
        return
    is_set, checked = key_state(server, proxy_keys(proxy))
    if is_set is False:
        err(f"Warning: ${server.key_env} is not set in {checked}; the proxy needs it to send requests to {target}.")


def check(ctx: Ctx, new_text: str, setting: str, ok, by_hand: str) -> configmod.Config:
    """Parse the edited text; refuse (nothing written) unless it says exactly what was asked."""
    try:
        new_cfg = configmod.parse(new_text, str(ctx.config_path))
    except configmod.ConfigError as e:
        raise Fail(f"could not change {setting} in {ctx.config_path} safely ({e}); nothing written; "
                   f"edit it by hand: {by_hand}") from None
    if not ok(new_cfg):
        raise Fail(f"could not change {setting} in {ctx.config_path} safely (it is written in a form "
                   f"sessionpin does not edit, e.g. an inline table); nothing written; edit it by hand: {by_hand}")
    return new_cfg


def confirm(args: argparse.Namespace, question: str, refusal: str) -> None:
    if args.yes:
        return
    if not sys.stdin or not sys.stdin.isatty():
        raise Fail(f"{refusal}: confirm with --yes (stdin is not a terminal, so sessionpin cannot ask)")
    sys.stderr.write(question + " [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline()
    if answer.strip().lower() not in ("y", "yes"):
        raise Fail(f"{refusal}: not confirmed")


def _saved(ctx: Ctx, what: str, done: bool, sid: str) -> None:
    if not done:
        raise Fail(f"{short(sid)} changed while you looked (the proxy or another command wrote its pin); "
                   f"nothing written: {what} again after `sessionpin sessions`")


def cmd_move(ctx: Ctx, args: argparse.Namespace) -> int:
    if args.not_routed and args.server:
        raise Fail("give a SERVER or --not-routed, not both")
    if not args.not_routed and not args.server:
        raise Fail("give the server to move the conversation to, or --not-routed", 2)
    target = None if args.not_routed else args.server
    cfg = ctx.config()
    if target is not None and target not in cfg.servers:
        known = ", ".join(cfg.servers) or "none configured"
        raise Fail(f"no server named {target!r} in {ctx.config_path} (servers: {known})")
    store = ctx.need_store()
    row = resolve(ctx, args.session)
    sid, pin = row.session, row.pin
    if row.lost:
        return _move_lost(ctx, args, row, target, cfg)
    at = cfg.servers[target].origin if target is not None else ""
    # the same server, its name re-pointed since the pin (ladder.moved: the proxies refuse it)
    repointed = target is not None and pin.server == target and bool(pin.at) and pin.at != at
    if pin.server == target and not repointed:
        out(f"{short(sid)} ({pin.agent}) is already {'on ' + target if target else 'not routed'}; nothing written.")
        return 0
    frm, to = where(pin.server), where(target)
    if repointed:
        frm, to = f"{frm} (then at {pin.at})", f"{to} (now at {at})"
    err(f"Moving running conversation {short(sid)} ({pin.agent}, last seen {ago(row.seen.last, time.time())}) "
        f"from {frm} to {to}.")
    err(MOVE_RISKS.format(frm=frm if pin.server else "the server it began on",
                          to=to if target else "the server the agent addresses"))
    confirm(args, "Move it?", f"{short(sid)} not moved")
    now = time.time()
    new = pins.Pin(agent=pin.agent, server=target, since=now, renewed=now, rule="operator", turn=pin.turn,
                   source=pin.source, at=at)
    _saved(ctx, "move it", ctx.run(pins.move(store, sid, row.loaded, new)), sid)
    out(f"Moved {short(sid)} ({pin.agent}) from {frm} to {to}. Its next request goes to {to}"
        + (f" (left alone: where {pin.agent} sends it)." if target is None else "."))
    warn_key(cfg, target, find_proxy(ctx))
    return 0


def _move_lost(ctx: Ctx, args: argparse.Namespace, row, target: str | None, cfg: configmod.Config) -> int:
    """A conversation whose pin the store lost (the proxies refuse it): the operator says
    where it goes. Back where it was pinned moves nothing (no question asked); elsewhere is a
    move like any other. Written only while its pin is still absent."""
    sid, pin = row.session, row.pin
    frm, to = where(pin.server), where(target)
    if pin.server != target:
        err(f"The store lost the pin of {short(sid)} ({pin.agent}: {row.lost}); it was {frm}. Putting it {to} "
            f"moves it.")
        err(MOVE_RISKS.format(frm=frm if pin.server else "the server it began on",
                              to=to if target else "the server the agent addresses"))
        confirm(args, "Move it?", f"{short(sid)} not moved")
    now = time.time()
    new = pins.Pin(agent=pin.agent, server=target, since=now, renewed=now, rule="operator",
                   at=cfg.servers[target].origin if target is not None else "")
    _saved(ctx, "move it", ctx.run(pins.move(ctx.need_store(), sid, row.loaded, new)), sid)
    _settled_loss(ctx, sid)
    placed = f"on {target}" if target else "not routed"
    out(f"Put {short(sid)} ({pin.agent}), whose pin the store had lost, {'back ' if pin.server == target else ''}"
        f"{placed}. Its next request goes to {to}" + (f" (left alone: where {pin.agent} sends it)." if target is None
                                                      else "."))
    warn_key(cfg, target, find_proxy(ctx))
    return 0


def _settled_loss(ctx: Ctx, sid: str) -> None:
    """The operator decided this lost pin: a proxy's record of it is moot (``accept-loss``
    would count it). Best effort: the record no longer refuses anything once the pin is
    there again, or the tombstone is newer than it."""
    try:
        ctx.run(ctx.need_store().hdel(identity.LOSSES_KEY, identity.PARTIAL + sid))
    except StoreError:
        pass


def cmd_forget(ctx: Ctx, args: argparse.Namespace) -> int:
    store = ctx.need_store()
    row = resolve(ctx, args.session)
    sid, pin = row.session, row.pin
    if row.lost:
        if pin.server is not None:
            err(f"The store lost the pin of {short(sid)} ({pin.agent}, on {pin.server}: {row.lost}); the proxies "
                f"refuse it. Forgetting it lets its next request be decided afresh: {NOT_SEEN_BEGIN}, so it leaves "
                f"{pin.server} for the server {pin.agent} addresses.")
            err(MOVE_RISKS.format(frm=pin.server, to="that server"))
            confirm(args, "Forget it?", f"{short(sid)} not forgotten")
        _saved(ctx, "forget it", ctx.run(pins.forget(store, sid, row.loaded)), sid)
        _settled_loss(ctx, sid)
        out(f"Forgot {short(sid)} ({pin.agent}, was {where(pin.server)}; its pin had been lost). Its next request "
            f"is decided afresh: {NOT_SEEN_BEGIN}.")
        return 0
    if pin.server is not None:
        err(f"Forgetting {short(sid)} ({pin.agent}, on {pin.server}) moves it: its next request is decided "
            f"afresh, and {NOT_SEEN_BEGIN}, so it leaves {pin.server} for the server {pin.agent} addresses.")
        err(MOVE_RISKS.format(frm=pin.server, to="that server"))
        confirm(args, "Forget it?", f"{short(sid)} not forgotten")
    _saved(ctx, "forget it", ctx.run(pins.forget(store, sid, row.loaded)), sid)
    out(f"Forgot {short(sid)} ({pin.agent}, was {where(pin.server)}). Its next request is decided afresh: "
        f"{NOT_SEEN_BEGIN}.")
    return 0


def cmd_servers(ctx: Ctx, args: argparse.Namespace) -> int:
    cfg = ctx.config()
    if args.json:
        dump_json([{"name": s.name, "url": s.url, "key_env": s.key_env, "auth": s.auth,
                    "models": dict(s.models)} for s in cfg.servers.values()])
        return 0
    if not cfg.servers:
        out(f"No servers in {ctx.config_path}; add one with `sessionpin servers add NAME URL --key-env VAR`.")
        return 0
    grid = [["SERVER", "URL", "KEY FROM", "AUTH"]]
    for s in cfg.servers.values():
        grid.append([s.name, s.url, f"${s.key_env}" if s.key_env else "the agent", s.auth or "as the agent sent it"])
    for line in table(grid):
        out(line)
    return 0


def cmd_servers_add(ctx: Ctx, args: argparse.Namespace) -> int:
    cfg = ctx.config()
    name = args.name
    if name in cfg.servers:
        raise Fail(f"a server named {name!r} exists ({cfg.servers[name].url}); "
                   f"remove it first (`sessionpin servers remove {name}`) or edit {ctx.config_path}")
    new_text = configedit.add_server(ctx.config_text(), name, args.url, args.key_env, args.auth)
    try:
        new_cfg = configmod.parse(new_text, str(ctx.config_path))
    except configmod.ConfigError as e:
        raise Fail(f"cannot add server {name!r}: {e}; nothing written") from None
    if new_cfg.agents != cfg.agents or {k: v for k, v in new_cfg.servers.items() if k != name} != cfg.servers \
            or name not in new_cfg.servers:
        raise Fail(f"could not add server {name!r} to {ctx.config_path} safely; nothing written; "
                   f"add a [servers.{name}] table by hand")
    write_config(ctx, new_text)
    server = new_cfg.servers[name]
    out(f"Added server {name}: {server.url}.")
    for line in takes(server):
        out(line)
    if server.key_env:
        where_set = "set" if os.environ.get(server.key_env) else "not set"
        out(f"Its key comes from ${server.key_env} ({where_set} in this shell; the proxy reads its own environment).")
    else:
        out(f"It has no key_env: only requests addressed to {server.origin} can go there, with the agent's own key.")
    out(f"No agent sends new conversations there yet: `sessionpin use AGENT {name}`.")
    return 0


# The endpoints each agent sends (docs/traffic.md); gemini-cli speaks none of them.
AGENT_ENDPOINTS = {
    "claude-code": ("/messages", "/messages/count_tokens"),
    "opencode": ("/messages", "/chat/completions", "/responses"),
    "pi": ("/messages", "/chat/completions", "/responses"),
    "codex": ("/responses",),
}


def takes(server: configmod.Server) -> list[str]:
    """What a server takes (docs/router.md, Scope): which endpoints of which agents, where
    requests addressed to it are matched, and where requests moved to it arrive."""
    lines = [f"It takes the inference requests addressed to {server.origin} (at {server.base}/<endpoint>, "
             "or any other plain prefix + /v1/<endpoint>) of:"]
    for agent, endpoints in AGENT_ENDPOINTS.items():
        extra = " (HTTPS and its WebSocket)" if agent == "codex" else ""
        lines.append(f"  {agent:<12} {', '.join(e.lstrip('/') for e in endpoints)}{extra}")
    lines.append(f"Requests moved here from another server arrive at {server.origin}{server.base}/<endpoint> "
                 f"(e.g. {server.base}/messages, {server.base}/chat/completions).")
    return lines


def cmd_servers_remove(ctx: Ctx, args: argparse.Namespace) -> int:
    cfg = ctx.config()
    name = args.name
    if name not in cfg.servers:
        known = ", ".join(cfg.servers) or "none configured"
        raise Fail(f"no server named {name!r} in {ctx.config_path} (servers: {known})")
    pools = [p.name for p in cfg.pools_of(name)]
    if pools:
        raise Fail(f"{name} is a member of pool {', '.join(pools)}; take it out of the pool's members in "
                   f"{ctx.config_path} first (or `sessionpin drain {name}` to stop new conversations going there)")
    users = [a for a, x in cfg.agents.items() if x.server == name]
    if users:
        raise Fail(f"new {', '.join(users)} conversations go to {name}; first send them elsewhere: "
                   f"`sessionpin use {users[0]} OTHER` (or --not-routed)")
    now = time.time()
    rows = ctx.rows()
    pinned = [r for r in rows if r.pin.server == name]
    came = [r for r in rows if r.pin.source == name and r.pin.server != name]
    if (pinned or came) and not args.force:
        if pinned:
            by: dict[str, int] = {}
            for r in pinned:
                by[r.pin.agent] = by.get(r.pin.agent, 0) + 1
            detail = ", ".join(f"{n} {a}" for a, n in sorted(by.items()))
            active = sum(1 for r in pinned if r.seen.last >= now - HOUR)
            err(f"{plural(len(pinned), 'running conversation')} {'is' if len(pinned) == 1 else 'are'} pinned to "
                f"{name} ({detail}; {active} active in the last hour).")
            err(f"Once {name} is removed the proxy refuses their requests with 424 (an error no agent retries), "
                f"naming {name}, until each is moved (`sessionpin move SESSION SERVER`) or forgotten "
                f"(`sessionpin forget SESSION`). "
                f"They are never moved by themselves. List them: `sessionpin sessions --server {name}`.")
        if came:
            err(f"{plural(len(came), 'running conversation')} began addressed to {name} and "
                f"{'is' if len(came) == 1 else 'are'} pinned elsewhere ({', '.join(sorted({where(r.pin.server) for r in came}))}): "
                f"they keep following their pins, but new conversations addressed to {name} will pass untouched.")
        raise Fail(f"{name} not removed: run again with --force to remove it anyway")
    new_text = configedit.remove_server(ctx.config_text(), name)
    check(ctx, new_text, f"servers.{name}",
          lambda c: name not in c.servers and c.agents == cfg.agents
          and c.servers == {k: v for k, v in cfg.servers.items() if k != name},
          f"delete the [servers.{name}] table")
    write_config(ctx, new_text)
    out(f"Removed server {name} from {ctx.config_path}.")
    if pinned:
        out(f"{plural(len(pinned), 'conversation')} pinned to {name} now get 424 until moved or forgotten: "
            f"`sessionpin sessions --server {name}`.")
    return 0
