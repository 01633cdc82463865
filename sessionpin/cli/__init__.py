"""The ``sessionpin`` command: see where every conversation is, and switch servers safely.

Rules this package keeps:
- It works whether or not a proxy runs. It reads and writes the config file and the
  shared store, never the proxy: the running router reloads the config within 1 s and
  reads pins from the store, so ``use``, ``move`` and ``forget`` need no signal. It
  reaches a proxy only by HTTP (its status) — it never imports the shell.
- "Running conversations" are the conversations with a pin in the store: every
  conversation the proxy saw in the last 29 to 30 days. Side requests never make a pin,
  so they are never counted as conversations. "Active" means a request in the last hour,
  as the proxy last flushed it (every few seconds).
- Every user error is one line on stderr, ``sessionpin: <what>; <what to do>``, and a
  non-zero exit (1; 2 for a usage error). No tracebacks for user errors.
- Read commands take ``--json``. Nothing here shows or stores prompt content: the store
  holds ids, server names, times and counts only.

Modules: ``parser`` (the command line), ``context`` (config, store, pins as rows),
``proxies`` (finding live proxies), ``look`` (status, sessions), ``change`` (use, move,
forget, servers), ``launch`` (env, exec, run), ``doctor``, ``storecmd`` (store copy),
``tools`` (classify, pool), ``serverpools`` (pools, drain, undrain), ``ledgercmd`` (show,
costs, and the ledger's columns of sessions).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

from ..config import configedit
from ..store import StoreError
from .change import cmd_forget, cmd_move, cmd_servers, cmd_servers_add, cmd_servers_remove, cmd_use
from .common import Fail, err
from .context import make_ctx
from .doctor import cmd_doctor
from .launch import cmd_env, cmd_exec, cmd_run
from .ledgercmd import cmd_costs, cmd_show
from .look import cmd_sessions, cmd_status
from .parser import parser
from .serverpools import cmd_drain, cmd_pools
from .storecmd import cmd_store
from .tools import cmd_delegate, cmd_pool

COMMANDS = {
    "pool": cmd_pool,
    "status": cmd_status,
    "sessions": cmd_sessions,
    "use": cmd_use,
    "move": cmd_move,
    "forget": cmd_forget,
    "env": cmd_env,
    "exec": cmd_exec,
    "doctor": cmd_doctor,
    "pools": cmd_pools,
    "drain": cmd_drain,
    "undrain": cmd_drain,
    "store": cmd_store,
    "show": cmd_show,
    "costs": cmd_costs,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The stores log their faults (for the proxy's log); here the command's one error line
    # says it, so Python's last-resort handler must not print them a second time.
    logging.getLogger("sessionpin").addHandler(logging.NullHandler())
    p = parser()
    try:
        args, extra = p.parse_known_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    command = args.command
    if command == "classify":
        try:
            return cmd_delegate("sessionpin.offline.classify", [*extra, *args.rest])
        except Fail as e:
            err(f"sessionpin: {e}")
            return e.code
    if extra and command != "run":
        p.error(f"unrecognized arguments: {' '.join(extra)}")  # exits 2
    if command is None:
        p.print_help(sys.stderr)
        return 2
    ctx = make_ctx(getattr(args, "config", None), getattr(args, "store", None))
    # they show a loss, decide about it, or (use) change only the config and say the loss
    ctx.lost_ok = command in ("status", "doctor", "store", "use")
    try:
        if command == "run":
            return cmd_run(ctx, args, extra)
        if command == "servers":
            if args.servers_command == "add":
                return ctx.settle(cmd_servers_add(ctx, args))
            if args.servers_command == "remove":
                return ctx.settle(cmd_servers_remove(ctx, args))
            return ctx.settle(cmd_servers(ctx, args))
        return ctx.settle(COMMANDS[command](ctx, args))
    except Fail as e:
        err(f"sessionpin: {e}")
        return e.code
    except configedit.EditError as e:
        err(f"sessionpin: {e}")
        return 1
    except StoreError as e:
        # a read that met the repair of pages the check (run while the command read) found
        # damaged: the damage is what to say, as when the read ended first (``settle``)
        try:
            ctx.settle(1)
        except Fail as damaged:
            err(f"sessionpin: {damaged}")
            return damaged.code
        except Exception:
            pass
        shown = ctx.opened_store_url() or ctx.store_shown
        text = str(e).rstrip(".")
        text = text if shown in text else f"store {shown}: {text}"     # a Redis error names its store
        err(f"sessionpin: {text}; check --store or SESSIONPIN_STORE (`sessionpin doctor`)")
        return 1
    except KeyboardInterrupt:
        err("sessionpin: interrupted")
        return 130
    except BrokenPipeError:
        # `sessionpin sessions | head`: stop quietly.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    finally:
        try:
            ctx.close()
        except Exception:
            pass


if __name__ == "__main__":
    sys.exit(main())
