"""The Redis store's clients (redis-py's asyncio API) and how their errors read to callers.

Rules it keeps:
- Pooling, connecting, reconnecting, timeouts and retries are redis-py's; we only
  configure them. Two clients share one configuration and differ in one thing:
  **reads** are retried (twice, 100 ms apart, on connection errors, timeouts and LOADING),
  **writes never are**. A write whose reply was lost may have been applied;
  sending it again could apply an ``incr`` twice, or make a ``set(nx=True)``/``cas`` that
  succeeded answer False. So a write fails at once and the caller decides.
- Timeouts: 1 s to connect, ``timeout`` (URL, default 2 s) per command; a durable write
  that waits for replicas may take ``wait_timeout_ms`` more. Connections idle for 30 s are
  PINGed before use (``health_check_interval``), and one the server closed is replaced
  before a command is sent on it (redis-py checks for EOF when it takes one from the pool
  — but skips that check while its "maintenance notifications" are on, which redis-py 8
  does by default on RESP3: after a Redis restart the first write on each pooled
  connection would fail. We turn them off; they are a managed-Redis feature we do not use).
- TLS (``rediss://``) verifies the server's certificate and host name, against the
  system's CAs or ``?ca=PATH``; there is no option to turn that off.
- Every error leaves as a ``StoreError`` whose message names the store by its safe URL.
  Unreachable, timing out, LOADING, READONLY, OOM, MISCONF, cluster down, bad
  credentials → ``StoreUnavailable`` (``NotDurable`` for a durable write); WRONGTYPE →
  ``WrongType``; anything else Redis refuses → ``StoreError``. The password is scrubbed
  from any text that reaches a message, and redis-py's exception is not chained (it may
  hold the connection, and with it the password).
- A connection lost under asyncio's feet while a command is being written is a lost
  connection even when asyncio says so with a ``TypeError`` (python/cpython#136234: on
  the Pythons that have it, ``_SelectorSocketTransport.writelines`` on a transport that
  was just lost calls the ``None`` it left behind). redis-py drops that connection; we
  answer "unavailable", as for any connection lost mid-command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.maint_notifications import MaintNotificationsConfig
from redis.exceptions import (ConnectionError, RedisClusterException, RedisError, ResponseError,
                              TimeoutError)

from .base import NotDurable, StoreError, StoreUnavailable, WrongType
from .redisurl import RedisURL

CONNECT_TIMEOUT = 1.0
HEALTH_CHECK_INTERVAL = 30
READ_RETRIES = 2

# Replies that mean "not now", never "no": the caller may retry later.
UNAVAILABLE_REPLIES = ("LOADING", "READONLY", "OOM", "MISCONF", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN",
                       "NOREPLICAS", "BUSY", "NOAUTH", "WRONGPASS", "NOPERM", "MOVED", "ASK")


def make_clients(cfg: RedisURL) -> tuple[Any, Any]:
    """(reads, writes): redis-py clients for ``cfg`` (nothing connects until first use)."""
    common: dict[str, Any] = dict(
        username=cfg.username, password=cfg.password, decode_responses=True,
        socket_connect_timeout=CONNECT_TIMEOUT, health_check_interval=HEALTH_CHECK_INTERVAL,
        client_name="sessionpin", maint_notifications_config=MaintNotificationsConfig(enabled=False))
    if cfg.tls:
        common.update(ssl=True, ssl_cert_reqs="required", ssl_check_hostname=True, ssl_ca_certs=cfg.ca)
    read_retry = Retry(ExponentialBackoff(cap=0.1, base=0.05), READ_RETRIES)
    write_timeout = cfg.timeout + (cfg.wait_timeout_ms / 1000 if cfg.wait else 0)
    if cfg.cluster:
        # require_full_coverage=False: our keys live in one slot; a master without a
        # replica down elsewhere in the cluster must not stop us.
        def cluster(retry: Retry, timeout: float) -> RedisCluster:
            return RedisCluster(host=cfg.host, port=cfg.port, require_full_coverage=False, retry=retry,
                                socket_timeout=timeout, **common)
        return cluster(read_retry, cfg.timeout), cluster(Retry(NoBackoff(), 0), write_timeout)
    if cfg.path is not None:
        common.update(unix_socket_path=cfg.path)
    else:
        common.update(host=cfg.host, port=cfg.port)
    reads = Redis(db=cfg.db, retry=read_retry, socket_timeout=cfg.timeout, **common)
    writes = Redis(db=cfg.db, retry=Retry(NoBackoff(), 0), socket_timeout=write_timeout, **common)
    return reads, writes


def scrub(text: str, password: str | None) -> str:
    if password:
        text = text.replace(password, "***")
    return text


def code(e: BaseException) -> str:
    """The reply's error code (redis-py strips it from the text of the errors it knows)."""
    status = getattr(e, "status_code", None)
    if status:
        return str(status)
    return str(e).split(" ", 1)[0].upper() if isinstance(e, ResponseError) else ""


def reason(e: BaseException, password: str | None) -> str:
    text = str(e).strip() or type(e).__name__
    # redis-py prefixes pipeline errors with the command, arguments included: drop them.
    if text.startswith("Command # "):
        text = text.split("caused error: ", 1)[-1]
    status = code(e)
    if status and not text.startswith(status):
        text = f"{status} {text}"
    return scrub(text, password)[:300]


def asyncio_lost_it(e: BaseException) -> bool:
    """Is ``e`` asyncio's own failure to write on a transport it had just lost (see the
    module's rules), rather than a bug of ours? Told by where it was raised."""
    if not isinstance(e, (TypeError, AttributeError)):
        return False
    tb, last = e.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return False
    where = last.tb_frame.f_code
    return Path(where.co_filename).parts[-2:] == ("asyncio", "selector_events.py") and \
        where.co_name in ("writelines", "write", "_write_ready", "_write_sendmsg", "_write_send")


def translate(e: BaseException, cfg: RedisURL, *, write: bool, durable: bool, key: str | None = None) -> StoreError:
    """The StoreError a caller sees for ``e``."""
    lost = asyncio_lost_it(e)
    why = "connection lost while sending (asyncio: python/cpython#136234)" if lost else reason(e, cfg.password)
    where = f"{cfg.safe}" + (f" ({key!r})" if key is not None else "")
    if isinstance(e, ResponseError) and code(e) == "WRONGTYPE":
        return WrongType(f"{where}: the key holds another type")
    if isinstance(e, (UnicodeError, ValueError)) and not isinstance(e, RedisError):
        return StoreError(f"{where}: {why}")
    unavailable = lost or isinstance(e, (ConnectionError, TimeoutError, RedisClusterException, OSError))
    if isinstance(e, ResponseError):
        unavailable = code(e) in UNAVAILABLE_REPLIES
    elif not unavailable and not isinstance(e, RedisError):
        raise e  # not ours to translate (a bug, a cancellation)
    if not unavailable:
        return StoreError(f"{where}: {why}")
    if write:
        # A refusal (a reply) means Redis did not run the command; a broken connection or a
        # timeout leaves it unknown whether it ran before the reply was lost.
        what = "refused" if isinstance(e, ResponseError) else "not acknowledged"
        cls = NotDurable if durable else StoreUnavailable
        return cls(f"{where}: {'durable ' if durable else ''}write {what}: {why}")
    return StoreUnavailable(f"{where}: cannot read: {why}")
