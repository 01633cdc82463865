"""``store copy FROM TO``: move sessionpin's state between stores (file → Redis and back).

Rules it keeps:
- The copy is ``sessionpin.store.copy``'s: every live key with the TTL it has left,
  idempotent (a second run copies nothing), keys only TO has left alone. It prints the
  counts. Proxy heartbeats (``proxy:…``) are not copied: they say which proxy runs on
  *that* store, and a copied one would make TO look used by a proxy that is not on it.
- FROM must exist (a file store is not created by reading it); TO is created if it is a
  file that does not exist yet.
- It refuses to write into a store a proxy is using (a heartbeat in TO, i.e. a proxy
  that announced itself there in the last 30 s) unless ``--force``: a proxy on TO makes
  pins while the copy runs, and the copy replaces any key whose value differs — a
  conversation pinned there since would be moved back to where FROM had it. Copying out
  of a store a proxy uses is allowed (reads only); pins made after the copy are not in TO,
  and the command says so (a second run after stopping the proxy copies just those).
- Both URLs are shown masked; FROM and TO must be different stores.
- The store's identity (``store.identity``) is not copied as a key: TO takes FROM's, and
  accepts the one it had (a restore brings back the store the proxies remember; TO's own
  keys are still there). A TO its proxies found lost is a restore: no ``--force`` needed.
- A Redis TO's eviction count (``evicted_keys``), read before the copy, is settled in its
  identity: the keys it evicted until then are back as far as FROM had them (a restore).
- ``store accept-loss``: start over on a store that lost what it held (docs/store.md),
  Redis' evictions until the command read its count included.
"""

from __future__ import annotations

import argparse
import time

from ..records import pins
from ..records.documents import HEARTBEAT_PREFIX, read_heartbeat
from ..store import Store, StoreError, identity, open_store, safe_url
from ..store.copy import copy
from .common import Fail, dump_json, out, plural
from .context import Ctx, store_file


def cmd_store(ctx: Ctx, args: argparse.Namespace) -> int:
    if args.store_command == "accept-loss":
        return cmd_store_accept_loss(ctx, args)
    if args.store_command != "copy":
        raise Fail("give a store command: `sessionpin store copy FROM TO` or `sessionpin store accept-loss`", 2)
    return cmd_store_copy(ctx, args)


def cmd_store_accept_loss(ctx: Ctx, args: argparse.Namespace) -> int:
    """The operator starts over on a store that lost what it held (docs/store.md)."""
    store = ctx.need_store()
    memory = identity.Memory(ctx.store_url)
    now = time.time()
    # Redis' eviction count, read first: what it evicted until now is accepted, not what it evicts later
    evicted = ctx.run(store.evictions()) if hasattr(store, "evictions") else None
    remembered = memory.load()
    was, _ = ctx.run(identity.read(store))
    evictions = identity.evictions(remembered.evicted if remembered else {}, was.evicted if was else {},
                                   evicted)[0] if remembered is not None else 0
    dropped = ctx.run(pins.drop_lost(store, now))     # index entries of lost pins: decided afresh
    new, accepted, partial = ctx.run(identity.accept_loss(store, remembered, now, evicted))
    partial = max(partial, dropped)
    n = sum(c[0] for c in ctx.run(pins.counts(store, now)).values())
    try:
        memory.save(identity.Remembered(store.url, new.id, n, now, dict(evicted or {})))
    except OSError as e:
        raise Fail(f"accepted, but cannot write what this machine remembers of {store.url} ({memory.path}): "
                   f"{e.strerror or e}") from None
    if args.json:
        dump_json({"store": store.url, "identity": new.id, "accepted": accepted, "lost_pins": partial, "pins": n,
                   "evicted_keys": evictions})
        return 0
    if accepted or partial or evictions:
        what = []
        if accepted:
            what.append(f"the store{'s' if len(accepted) > 1 else ''} it was before ({', '.join(accepted)})")
        if partial:
            what.append(f"{plural(partial, 'lost pin')} reported by proxies")
        if evictions:
            what.append(f"the {plural(evictions, 'key')} Redis evicted")
        out(f"Accepted the loss of {' and '.join(what)} in {store.url}: it is store {new.id} now, holding "
            f"{plural(n, 'pin')}.")
    else:
        out(f"{store.url} is store {new.id}, holding {plural(n, 'pin')}; no loss was recorded. Proxies that "
            "remembered pins it no longer has stop refusing them.")
    out("Proxies route again within a second; a conversation whose pin was lost is decided afresh at its next "
        "request.")
    return 0


def cmd_store_copy(ctx: Ctx, args: argparse.Namespace) -> int:
    src_url, dst_url = args.source, args.destination
    src_shown, dst_shown = safe_url(src_url), safe_url(dst_url)
    if _same(src_url, dst_url):
        raise Fail(f"FROM and TO are the same store ({src_shown}); give two different stores")
    f = store_file(src_url)
    if f is not None and not f.exists():
        raise Fail(f"no store at {f}: nothing to copy from; check FROM")
    src, dst = _open(src_url), None
    try:
        dst = _open(dst_url)
        counts, src_proxies, dst_proxies = ctx.run(_copy(src, dst, args.force))
    except StoreError as e:     # names the store it is about (masked) and the cause
        raise Fail(f"{e}; nothing more was copied (a second run goes on where this one stopped)") from None
    finally:
        for s in (src, dst):
            if s is not None:
                try:
                    ctx.run(s.close())     # a file store's ordinary writes reach disk here
                except StoreError:
                    pass
    if counts is None:              # a proxy uses TO (and TO is not a restore of a lost store)
        who = ", ".join(f"pid {b.pid} on {b.host}" for b in dst_proxies)
        raise Fail(f"a proxy uses {dst_shown} ({who}; its heartbeat is at most 30 s old): it makes pins while "
                   "a copy runs, and the copy would replace a newer pin of the same conversation (moving it); "
                   "stop that proxy first (its heartbeat lapses 30 s later), or give --force to copy anyway")
    if args.json:
        dump_json({"from": src_shown, "to": dst_shown, "copied": counts.copied, "equal": counts.equal,
                   "skipped": counts.skipped, "heartbeats_left_out": len(src_proxies)})
        return 0
    out(f"Copied {plural(counts.copied, 'key')} from {src_shown} to {dst_shown}; "
        f"{counts.equal} already there and equal, {counts.skipped} gone before they were read.")
    if src_proxies:
        out(f"Left out {plural(len(src_proxies), 'proxy heartbeat')}: a proxy uses {src_shown}, so pins it makes "
            "from now on are not in the copy. Stop it and run the copy again: the second run copies only "
            "what changed.")
    return 0


async def _copy(src: Store, dst: Store, force: bool):
    """(counts, heartbeats in FROM, heartbeats in TO); counts None when TO is in use and not forced.

    A TO whose proxies said it lost what it held is a restore: they refuse every routed
    request meanwhile, so none of them makes a pin the copy could replace."""
    src_proxies = await _heartbeats(src)
    dst_proxies = await _heartbeats(dst)
    if dst_proxies and not force and not await identity.losses(dst):
        return None, src_proxies, dst_proxies
    src_identity, _ = await identity.read(src)
    # what a Redis TO evicted until now is settled by the copy (a restore brings it back)
    evicted = await dst.evictions() if hasattr(dst, "evictions") else None
    # the store's own keys (its identity, its losses) are not data: the identity is carried below
    counts = await copy(src, dst, exclude=[HEARTBEAT_PREFIX, "store:"])
    await pins.reindex(dst)         # TO's own pins keep their index entries (a lost pin's trace)
    await identity.carry(dst, src_identity)
    await identity.settle_evictions(dst, evicted)
    return counts, src_proxies, dst_proxies


async def _heartbeats(store: Store) -> list:
    """The proxies that announced themselves in ``store`` (a heartbeat lives 30 s)."""
    keys = await store.keys(HEARTBEAT_PREFIX)
    beats = [read_heartbeat(v) for v in (await store.mget(keys) if keys else [])]
    return [b for b in beats if b is not None]


def _open(url: str) -> Store:
    try:
        return open_store(url)
    except (StoreError, OSError) as e:
        raise Fail(f"cannot open the store {safe_url(url)}: {e}") from None


def _same(a: str, b: str) -> bool:
    fa, fb = store_file(a), store_file(b)
    if fa is not None or fb is not None:
        return fa is not None and fb is not None and fa.resolve() == fb.resolve()
    return a == b and not a.startswith("memory:")
