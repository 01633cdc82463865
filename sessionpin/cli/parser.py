"""The command line: every command, its arguments and its help."""

from __future__ import annotations

import argparse
from typing import NoReturn

from ..config import config as configmod
from ..reader.facts import AGENTS


class Parser(argparse.ArgumentParser):
    """argparse, with one-line errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def parser() -> Parser:
    common = Parser(add_help=False, allow_abbrev=False)
    common.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS,
                        help="the config file (default: $SESSIONPIN_CONFIG, else the user config dir)")
    common.add_argument("--store", metavar="URL", default=argparse.SUPPRESS,
                        help="the store URL (default: $SESSIONPIN_STORE, else file:<user state dir>/state.db)")
    p = Parser(prog="sessionpin", parents=[common], allow_abbrev=False,
               description="Keep each running coding-agent conversation on the server it began on: "
                           "see where every conversation is, and switch servers safely.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    def cmd(name: str, help: str, **kw) -> Parser:
        return sub.add_parser(name, help=help, description=kw.pop("description", help), parents=[common],
                              allow_abbrev=False, **kw)

    c = cmd("run", "start mitmdump (or mitmweb) with the router; other arguments go to mitmdump",
            description="Start mitmdump with the sessionpin router, listening on 127.0.0.1:8080 unless "
                        "the arguments say otherwise; it prints one line per decision. Unknown arguments "
                        "go to mitmdump.")
    c.add_argument("--web", action="store_true", help="start mitmweb instead, with the comment column shown")
    c.add_argument("--verbose", action="store_true",
                   help="also show mitmproxy's connection lines and its line per flow")
    c.add_argument("--dry-run", action="store_true", help="print the command instead of running it")

    c = cmd("env", "print the shell lines that point an agent at the proxy")
    c.add_argument("agent", metavar="AGENT", help=", ".join(AGENTS))
    c.add_argument("--reverse", metavar="PORT", type=int, help="reverse mode: the base-URL setting instead")
    c.add_argument("--proxy", metavar="URL",
                   help="the proxy URL (default: the running proxy's, else http://127.0.0.1:8080)")
    c.add_argument("--confdir", metavar="DIR",
                   help="mitmproxy's confdir holding the CA (default: the running proxy's, else ~/.mitmproxy)")
    c.add_argument("--json", action="store_true")

    c = cmd("exec", "run a command with the proxy's environment (sessionpin exec -- claude)")
    c.add_argument("--agent", metavar="AGENT", help="whose variables to set (default: from the command name; else all)")
    c.add_argument("--proxy", metavar="URL")
    c.add_argument("--confdir", metavar="DIR")
    c.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND...")

    c = cmd("status", "config, store, servers, agents, pins per server, and which proxies answer")
    c.add_argument("--json", action="store_true")

    c = cmd("use", "send an agent's NEW conversations to a server or pool (running ones stay where they are)")
    c.add_argument("agent", metavar="AGENT", help=", ".join(AGENTS))
    c.add_argument("server", metavar="SERVER|POOL", nargs="?")
    c.add_argument("--not-routed", action="store_true", help="leave the agent's new conversations alone")

    c = cmd("sessions", "one row per pinned conversation")
    c.add_argument("--agent", metavar="AGENT")
    c.add_argument("--server", metavar="SERVER")
    c.add_argument("--not-routed", action="store_true", help="only conversations pinned 'not routed'")
    c.add_argument("--json", action="store_true")

    c = cmd("show", "one conversation's turns: tokens, cache reads, misses and their reasons, cost")
    c.add_argument("session", metavar="SESSION", help="its id, a unique prefix, or the short id shown")
    c.add_argument("--limit", type=int, default=0, metavar="N", help="only the last N turns (0: all)")
    c.add_argument("--json", action="store_true")

    c = cmd("costs", "tokens, cache reads and cost summed per conversation, server, agent or model")
    c.add_argument("--by", choices=("session", "server", "agent", "model"), default="server")
    c.add_argument("--json", action="store_true")

    c = cmd("move", "move one running conversation to another server (after a warning)")
    c.add_argument("session", metavar="SESSION", help="its id, a unique prefix, or the short id shown")
    c.add_argument("server", metavar="SERVER", nargs="?")
    c.add_argument("--not-routed", action="store_true", help="leave its requests alone from now on")
    c.add_argument("--yes", "-y", action="store_true", help="do not ask")

    c = cmd("forget", "drop one conversation's pin (its next request is decided afresh)")
    c.add_argument("session", metavar="SESSION", help="its id, a unique prefix, or the short id shown")
    c.add_argument("--yes", "-y", action="store_true", help="do not ask")

    c = cmd("servers", "list, add or remove servers")
    c.add_argument("--json", action="store_true")
    ss = c.add_subparsers(dest="servers_command", metavar="add|remove", parser_class=Parser)
    a = ss.add_parser("add", help="add a server", parents=[common], allow_abbrev=False)
    a.add_argument("name", metavar="NAME")
    a.add_argument("url", metavar="URL", help="an origin plus an optional path prefix")
    a.add_argument("--key-env", metavar="VAR", help="the environment variable holding its key")
    a.add_argument("--auth", choices=configmod.AUTH_STYLES, help="how it takes its key (default: as the agent sent it)")
    r = ss.add_parser("remove", help="remove a server", parents=[common], allow_abbrev=False)
    r.add_argument("name", metavar="NAME")
    r.add_argument("--force", action="store_true",
                   help="remove it even if pinned conversations go to it or came from it")

    c = cmd("pools", "server pools: members, cursor, active conversations, exhaustion, drains (--history: records); "
                     "`pools reset MEMBER` forgets a member's quota state")
    c.add_argument("pool", metavar="POOL", nargs="?", help="only this pool (or `reset`, followed by a MEMBER)")
    c.add_argument("member", metavar="MEMBER", nargs="?",
                   help="with `reset`: the member whose quota state (exhaustion, headroom) every proxy forgets")
    c.add_argument("--history", action="store_true", help="the recorded allocations, moves, drains and "
                                                          "definition changes, oldest first")
    c.add_argument("--limit", type=int, default=50, metavar="N", help="with --history: the last N (0: all)")
    c.add_argument("--json", action="store_true")

    c = cmd("drain", "stop new conversations going to a pool member (running ones stay)")
    c.add_argument("member", metavar="MEMBER")
    c.set_defaults(undo=False)
    c = cmd("undrain", "let a drained pool member take new conversations again")
    c.add_argument("member", metavar="MEMBER")
    c.set_defaults(undo=True)

    c = cmd("doctor", "check the config, store, CA, proxy and keys; say what to fix")
    c.add_argument("--confdir", metavar="DIR")
    c.add_argument("--json", action="store_true")

    c = cmd("store", "copy every pin and record from one store into another (file ↔ Redis); accept a loss")
    st = c.add_subparsers(dest="store_command", metavar="copy|accept-loss", parser_class=Parser)
    a = st.add_parser("accept-loss", parents=[common], allow_abbrev=False,
                      help="start over on a store that lost what it held (proxies refuse until then)",
                      description="A store that came back empty, with another identity, without pins a proxy "
                                  "served, or that Redis evicted keys from is refused by every proxy that remembers it. This accepts the loss: "
                                  "the store keeps what it holds now, and proxies route again within a second "
                                  "(a conversation whose pin was lost is decided afresh). To restore instead, "
                                  "copy a backup in: `sessionpin store copy BACKUP URL`.")
    a.add_argument("--json", action="store_true")
    a = st.add_parser("copy", parents=[common], allow_abbrev=False,
                      help="copy every live key, with its remaining TTL, from FROM to TO (idempotent)",
                      description="Copy every live key (pins, activity, the pool's records), with the TTL it "
                                  "has left, from the store FROM into the store TO. Running it again copies "
                                  "only what changed. Keys only TO has are left alone.")
    a.add_argument("source", metavar="FROM", help="a store URL: file:PATH, redis://…, rediss://…, unix://…")
    a.add_argument("destination", metavar="TO", help="a store URL (a file store is created if missing)")
    a.add_argument("--force", action="store_true",
                   help="copy even though a proxy uses TO (its newer pins may be replaced by FROM's)")
    a.add_argument("--json", action="store_true")

    c = cmd("classify", "read recorded requests and say what each one is (FILE...)", add_help=False)
    c.add_argument("rest", nargs=argparse.REMAINDER)
    c = cmd("pool", "the OpenCode session-id pool: spares and bindings per provider and model")
    c.add_argument("--ttl-ms", type=int, metavar="MS",
                   help="a spare verified within this is fresh (default: the pool's default)")
    c.add_argument("--json", action="store_true")
    return p
