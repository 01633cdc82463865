"""The file store's SQL: every write operation inside one transaction, every read query.

Rules they keep (those of ``base``, as ``MemoryStore`` states them):
- A write takes ``(c, now, *args)``: ``c`` is a connection inside ``BEGIN IMMEDIATE``,
  ``now`` the transaction's time (every expiry it computes is ``now + ttl``). What it
  touched is noted by SQLite itself, for the second copy (``copies.track``).
- A key touched by a write is first dropped if it has expired (``live``), so an expired
  hash never lends its old fields to a new one.
- A type error raises ``WrongType`` (a non-integer ``StoreError``) from inside the
  transaction; the caller rolls the whole transaction back, so ``apply`` changes nothing.
- Reads take ``(c, now, ...)`` and run on a reader connection; a read of several
  statements is one read transaction (one snapshot).
"""

from __future__ import annotations

import math
import sqlite3
from typing import Sequence

from .base import Check, Delete, Expire, HIncr, HSet, Set, StoreError, WrongType, Write, ZAdd, ZRem
from .memory import HASH, STRING, ZSET, as_int, prefix_end

Conn = sqlite3.Connection
_KIND_NAME = {STRING: "string", HASH: "hash", ZSET: "sorted set"}


def expired(expires_at: float | None, now: float) -> bool:
    return expires_at is not None and expires_at <= now


def wrong(key: str, kind: str) -> WrongType:
    return WrongType(f"{key!r} holds a {_KIND_NAME.get(kind, kind)}")


def score_of(score: float) -> float:
    s = float(score)
    if math.isnan(s):
        raise StoreError("score is not a number (NaN)")
    return s


# == helpers inside a write transaction ===================================================

def live(c: Conn, now: float, key: str):
    """(kind, value, expires_at) of a live key, or None (an expired row is deleted here)."""
    row = c.execute("SELECT kind, value, expires_at FROM entries WHERE key = ?", (key,)).fetchone()
    if row is not None and expired(row[2], now):
        c.execute("DELETE FROM entries WHERE key = ?", (key,))
        return None
    return row


def for_write(c: Conn, now: float, key: str, kind: str) -> float | None:
    """Make ``key`` a live ``kind`` (creating it empty); return its expiry."""
    row = live(c, now, key)
    if row is None:
        c.execute("INSERT INTO entries (key, kind, value, expires_at) VALUES (?, ?, NULL, NULL)", (key, kind))
        return None
    if row[0] != kind:
        raise wrong(key, row[0])
    return row[2]


def _drop_if_empty(c: Conn, key: str, table: str) -> None:
    if c.execute(f"SELECT 1 FROM {table} WHERE key = ? LIMIT 1", (key,)).fetchone() is None:
        c.execute("DELETE FROM entries WHERE key = ?", (key,))   # redis: an empty hash/zset is no key


def _put_string(c: Conn, now: float, key: str, value: str, ttl: float | None, row) -> None:
    if row is not None and row[0] != STRING:
        c.execute("DELETE FROM entries WHERE key = ?", (key,))    # the trigger takes its fields/members
    x = None if ttl is None else now + ttl
    c.execute(
        "INSERT INTO entries (key, kind, value, expires_at) VALUES (?, 's', ?, ?) "
        "ON CONFLICT (key) DO UPDATE SET kind = 's', value = excluded.value, expires_at = excluded.expires_at",
        (key, value, x))


def _string_is(c: Conn, now: float, key: str, expected: str | None) -> bool:
    row = live(c, now, key)
    if row is None:
        return expected is None
    return row[0] == STRING and row[1] == expected


# == strings ==============================================================================

def op_set(c: Conn, now: float, key: str, value: str, ttl: float | None, nx: bool) -> bool:
    if not nx and (ttl is None or ttl > 0):
        # One statement where the key is absent or a string (live or expired, it is overwritten
        # all the same), instead of reading the row back first: the lineage watch's anchors
        # and roots are such SETs. Another type: its row goes (the trigger takes its fields or
        # members) and the string is made. (The copy's triggers see the insert or the update.)
        x = None if ttl is None else now + ttl
        if c.execute("INSERT INTO entries (key, kind, value, expires_at) VALUES (?, 's', ?, ?) "
                     "ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at "
                     "WHERE kind = 's'", (key, value, x)).rowcount == 0:
            c.execute("DELETE FROM entries WHERE key = ?", (key,))
            c.execute("INSERT INTO entries (key, kind, value, expires_at) VALUES (?, 's', ?, ?)", (key, value, x))
        return True
    row = live(c, now, key)
    if nx and row is not None:
        return False
    if ttl is not None and ttl <= 0:      # redis refuses; "expires now" is a delete
        if row is not None:
            c.execute("DELETE FROM entries WHERE key = ?", (key,))
        return True
    _put_string(c, now, key, value, ttl, row)
    return True


def op_cas(c: Conn, now: float, key: str, expected: str | None, value: str | None,
           ttl: float | None) -> bool:
    if not _string_is(c, now, key, expected):
        return False
    if value is None or (ttl is not None and ttl <= 0):
        c.execute("DELETE FROM entries WHERE key = ?", (key,))
    else:
        _put_string(c, now, key, value, ttl, live(c, now, key))
    return True


def op_delete(c: Conn, now: float, key: str) -> bool:
    found = live(c, now, key) is not None
    if found:
        c.execute("DELETE FROM entries WHERE key = ?", (key,))
    return found


def op_expire(c: Conn, now: float, key: str, ttl: float) -> bool:
    if live(c, now, key) is None:
        return False
    if ttl <= 0:
        c.execute("DELETE FROM entries WHERE key = ?", (key,))
    else:
        c.execute("UPDATE entries SET expires_at = ? WHERE key = ?", (now + ttl, key))
    return True


def op_incr(c: Conn, now: float, key: str, by: int) -> int:
    row = live(c, now, key)
    if row is None:
        n = by
        c.execute("INSERT INTO entries (key, kind, value, expires_at) VALUES (?, 's', ?, NULL)", (key, str(n)))
    else:
        if row[0] != STRING:
            raise wrong(key, row[0])
        n = as_int(row[1]) + by
        c.execute("UPDATE entries SET value = ? WHERE key = ?", (str(n), key))
    return n


# == hashes ===============================================================================

def _set_field(c: Conn, key: str, field: str, value: str) -> None:
    c.execute("INSERT INTO fields (key, field, value) VALUES (?, ?, ?) "
              "ON CONFLICT (key, field) DO UPDATE SET value = excluded.value", (key, field, value))


def op_hset(c: Conn, now: float, key: str, field: str, value: str) -> None:
    for_write(c, now, key, HASH)
    _set_field(c, key, field, value)


def op_hsetnx(c: Conn, now: float, key: str, field: str, value: str) -> bool:
    for_write(c, now, key, HASH)
    done = c.execute("INSERT INTO fields (key, field, value) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
                     (key, field, value)).rowcount == 1
    return done


def op_hdel(c: Conn, now: float, key: str, field: str) -> bool:
    row = live(c, now, key)
    if row is None:
        return False
    if row[0] != HASH:
        raise wrong(key, row[0])
    if c.execute("DELETE FROM fields WHERE key = ? AND field = ?", (key, field)).rowcount == 0:
        return False
    _drop_if_empty(c, key, "fields")
    return True


def op_hincr(c: Conn, now: float, key: str, field: str, by: int) -> int:
    for_write(c, now, key, HASH)
    row = c.execute("SELECT value FROM fields WHERE key = ? AND field = ?", (key, field)).fetchone()
    n = (0 if row is None else as_int(row[0])) + by
    _set_field(c, key, field, str(n))
    return n


# == sorted sets ==========================================================================

def op_zadd(c: Conn, now: float, key: str, member: str, score: float) -> None:
    s = score_of(score)
    for_write(c, now, key, ZSET)
    c.execute("INSERT INTO zsets (key, member, score) VALUES (?, ?, ?) "
              "ON CONFLICT (key, member) DO UPDATE SET score = excluded.score", (key, member, s))


def op_zrem(c: Conn, now: float, key: str, member: str) -> bool:
    row = live(c, now, key)
    if row is None:
        return False
    if row[0] != ZSET:
        raise wrong(key, row[0])
    if c.execute("DELETE FROM zsets WHERE key = ? AND member = ?", (key, member)).rowcount == 0:
        return False
    _drop_if_empty(c, key, "zsets")
    return True


def op_zremrange(c: Conn, now: float, key: str, lo: float, hi: float) -> int:
    row = live(c, now, key)
    if row is None:
        return 0
    if row[0] != ZSET:
        raise wrong(key, row[0])
    n = c.execute("DELETE FROM zsets WHERE key = ? AND score BETWEEN ? AND ?", (key, lo, hi)).rowcount
    if n:
        _drop_if_empty(c, key, "zsets")
    return n


# == several keys =========================================================================

def op_apply(c: Conn, now: float, checks: Sequence[Check], writes: Sequence[Write]) -> bool:
    if not all(_string_is(c, now, ch.key, ch.value) for ch in checks):
        return False
    for w in writes:     # a type error raises here; the caller rolls back every write before it
        if isinstance(w, Set):
            op_set(c, now, w.key, w.value, w.ttl, False)
        elif isinstance(w, Delete):
            op_delete(c, now, w.key)
        elif isinstance(w, HSet):
            op_hset(c, now, w.key, w.field, w.value)
        elif isinstance(w, HIncr):
            op_hincr(c, now, w.key, w.field, w.by)
        elif isinstance(w, ZAdd):
            op_zadd(c, now, w.key, w.member, w.score)
        elif isinstance(w, ZRem):
            op_zrem(c, now, w.key, w.member)
        elif isinstance(w, Expire):
            op_expire(c, now, w.key, w.ttl)
        else:
            raise StoreError(f"apply: unknown write {w!r}")
    return True


# == reads ================================================================================

def _row(c: Conn, now: float, key: str, kind: str):
    """The live row of ``key`` if it holds ``kind`` (None if absent); WrongType otherwise."""
    row = c.execute("SELECT kind, value, expires_at FROM entries WHERE key = ?", (key,)).fetchone()
    if row is None or expired(row[2], now):
        return None
    if row[0] != kind:
        raise wrong(key, row[0])
    return row


def q_get(c: Conn, now: float, key: str) -> str | None:
    row = _row(c, now, key, STRING)
    return None if row is None else row[1]


def q_mget(c: Conn, now: float, keys: Sequence[str]) -> list[str | None]:
    found: dict[str, str] = {}
    wanted = list(dict.fromkeys(keys))
    for i in range(0, len(wanted), 500):       # SQLite's bound-parameter limit, with room
        chunk = wanted[i:i + 500]
        marks = ",".join("?" * len(chunk))
        for key, kind, value, x in c.execute(
                f"SELECT key, kind, value, expires_at FROM entries WHERE key IN ({marks})", chunk):
            if kind == STRING and not expired(x, now):
                found[key] = value
    return [found.get(k) for k in keys]


def q_ttl(c: Conn, now: float, key: str) -> float | None:
    row = c.execute("SELECT expires_at FROM entries WHERE key = ?", (key,)).fetchone()
    if row is None or row[0] is None or expired(row[0], now):
        return None
    return row[0] - now


def q_hget(c: Conn, now: float, key: str, field: str) -> str | None:
    if _row(c, now, key, HASH) is None:
        return None
    row = c.execute("SELECT value FROM fields WHERE key = ? AND field = ?", (key, field)).fetchone()
    return None if row is None else row[0]


def q_hgetall(c: Conn, now: float, key: str) -> dict[str, str]:
    if _row(c, now, key, HASH) is None:
        return {}
    return dict(c.execute("SELECT field, value FROM fields WHERE key = ?", (key,)))


def q_zcount(c: Conn, now: float, key: str, lo: float, hi: float) -> int:
    if _row(c, now, key, ZSET) is None:
        return 0
    return c.execute("SELECT count(*) FROM zsets WHERE key = ? AND score BETWEEN ? AND ?",
                     (key, lo, hi)).fetchone()[0]


def q_zscore(c: Conn, now: float, key: str, member: str) -> float | None:
    if _row(c, now, key, ZSET) is None:
        return None
    row = c.execute("SELECT score FROM zsets WHERE key = ? AND member = ?", (key, member)).fetchone()
    return None if row is None else float(row[0])


def q_zrange(c: Conn, now: float, key: str, lo: float, hi: float, limit: int | None) -> list[tuple[str, float]]:
    if _row(c, now, key, ZSET) is None or (limit is not None and limit <= 0):
        return []               # (the type is checked first: redis answers WRONGTYPE)
    sql = "SELECT member, score FROM zsets WHERE key = ? AND score BETWEEN ? AND ? ORDER BY score, member"
    params: tuple = (key, lo, hi)
    if limit is not None:
        sql += " LIMIT ?"
        params += (limit,)
    return [(m, float(s)) for m, s in c.execute(sql, params)]


def q_zpage(c: Conn, now: float, key: str, lo: float, hi: float, after: tuple[str, float] | None, limit: int,
            reverse: bool) -> list[tuple[str, float]]:
    # Keyset paging on the (key, score, member) index: each page is a seek and ``limit``
    # rows, whatever the page's depth (an OFFSET would walk every row before it).
    if _row(c, now, key, ZSET) is None or limit <= 0:
        return []
    sql = "SELECT member, score FROM zsets WHERE key = ? AND score BETWEEN ? AND ?"
    params: tuple = (key, lo, hi)
    if after is not None:
        cmp = "<" if reverse else ">"
        sql += f" AND (score {cmp} ? OR (score = ? AND member {cmp} ?))"
        params += (float(after[1]), float(after[1]), after[0])
    sql += " ORDER BY score DESC, member DESC LIMIT ?" if reverse else " ORDER BY score, member LIMIT ?"
    return [(m, float(s)) for m, s in c.execute(sql, params + (limit,))]


def q_hgetall_many(c: Conn, now: float, keys: Sequence[str]) -> list[dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    wanted = list(dict.fromkeys(keys))
    for i in range(0, len(wanted), 500):       # SQLite's bound-parameter limit, with room
        chunk = wanted[i:i + 500]
        marks = ",".join("?" * len(chunk))
        for key, kind, x, field, value in c.execute(
                "SELECT e.key, e.kind, e.expires_at, f.field, f.value FROM entries e "
                f"LEFT JOIN fields f ON f.key = e.key WHERE e.key IN ({marks})", chunk):
            if expired(x, now):
                continue
            if kind != HASH:
                raise wrong(key, kind)
            h = found.get(key)
            if h is None:
                h = found[key] = {}
            if field is not None:
                h[field] = value
    return [dict(found.get(k, ())) for k in keys]


def q_keys(c: Conn, now: float, prefix: str) -> list[str]:
    end = prefix_end(prefix)
    sql = "SELECT key FROM entries WHERE key >= ? AND (expires_at IS NULL OR expires_at > ?)"
    params: tuple = (prefix, now)
    if end is not None:
        sql += " AND key < ?"
        params += (end,)
    return [r[0] for r in c.execute(sql + " ORDER BY key", params)]
