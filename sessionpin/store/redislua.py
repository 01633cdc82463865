"""The Redis store's server-side scripts (compare-and-set, ``apply``) and their arguments.

Rules they keep:
- A script touches only the keys it is given (``KEYS``), all under the store's one hash
  tag, so on Redis Cluster each runs on the one node that owns that slot.
- **A failing script changes nothing.** Redis does not roll a script back, so every check
  that could fail — the ``Check``s, types, "is this field an integer" — runs before the
  first write, on a model of what the writes before it in the same ``apply`` leave (the
  key's type, the hash fields set, the sorted-set members added or removed): the writes
  then run in order exactly as ``memory.py`` runs them, and none of them can fail.
- Both start with ``#!lua`` (Redis >= 7.0 "flagged" scripts): Redis refuses such a
  write script as a whole before it runs (OOM, READONLY replica, MISCONF, cross-slot
  keys) instead of failing at its first write.
- Integers are what Redis' ``HINCRBY`` takes: ``0``, or an optional ``-`` and decimal
  digits without a leading zero, within 64 bits (``memory.py`` follows Python's ``int()``,
  which also takes ``+5``, ``" 5"`` or ``007``). The check is never looser than Redis',
  so a checked ``HINCRBY`` cannot fail — except on a 64-bit overflow of the sum, which
  Lua's doubles cannot check and which would fail at that write.
- A TTL travels as whole milliseconds (``PX``); a non-positive one has already been
  turned into a delete by the caller (``set(…, ttl<=0)`` deletes, as in ``memory.py``).
"""

from __future__ import annotations

import math
from typing import Sequence

from .base import Check, Delete, Expire, HIncr, HSet, Set, StoreError, Write, ZAdd, ZRem

WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"
NOT_INTEGER = "ERR hash value is not an integer"

# ARGV: has_expected ("1"/"0"), expected, op ("set"/"del"), value, ttl_ms ("" = no TTL)
CAS = """#!lua
local t = redis.call('TYPE', KEYS[1])['ok']
if ARGV[1] == '1' then
  if t ~= 'string' or redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
elseif t ~= 'none' then
  return 0
end
if ARGV[3] == 'del' then
  redis.call('DEL', KEYS[1])
elseif ARGV[5] == '' then
  redis.call('SET', KEYS[1], ARGV[4])
else
  redis.call('SET', KEYS[1], ARGV[4], 'PX', ARGV[5])
end
return 1
"""

# KEYS: hashes; answers each one's HGETALL (a flat field, value list), in order. One command for
# a batch: a pipeline of HGETALLs costs the client a command object and a reply parse each.
HGETALL_MANY = """#!lua flags=no-writes
local out = {}
for i, k in ipairs(KEYS) do
  out[i] = redis.call('HGETALL', k)
end
return out
"""

# KEYS: the checks' keys, then one key per write.
# ARGV[1]: how many checks; then per check: has_value ("1"/"0"), value;
# then per write three values: op, a, b —
#   set value ttl_ms|""  ·  del "" ""  ·  hset field value  ·  hincr field by
#   zadd member score  ·  zrem member ""  ·  expire "" ttl_ms
APPLY = """#!lua
local n = tonumber(ARGV[1])
for i = 1, n do
  local t = redis.call('TYPE', KEYS[i])['ok']
  if ARGV[2 * i] == '1' then
    if t ~= 'string' or redis.call('GET', KEYS[i]) ~= ARGV[2 * i + 1] then return 0 end
  elseif t ~= 'none' then
    return 0
  end
end

local base = 2 * n + 2
local function is_int(v)
  if v == '0' then return true end
  if not string.match(v, '^%-?[1-9]%d*$') then return false end
  local digits = string.gsub(v, '^%-', '')
  if #digits < 19 then return true end
  if #digits > 19 then return false end
  if string.sub(v, 1, 1) == '-' then return digits <= '9223372036854775808' end
  return digits <= '9223372036854775807'
end
-- Play the writes on a model first: the type each key has after the writes before it,
-- the hash fields they set, the sorted-set members they add or remove.
local kind, fresh, fields, members, count = {}, {}, {}, {}, {}
local function type_of(k)
  if kind[k] == nil then kind[k] = redis.call('TYPE', k)['ok'] end
  return kind[k]
end
local function reset(k, t)
  kind[k] = t; fresh[k] = true; fields[k] = {}; members[k] = {}; count[k] = 0
end
for j = 1, #KEYS - n do
  local k = KEYS[n + j]
  local o = base + 3 * (j - 1)
  local op = ARGV[o]
  local t = type_of(k)
  if op == 'set' then
    reset(k, 'string')
  elseif op == 'del' then
    reset(k, 'none')
  elseif op == 'hset' or op == 'hincr' then
    if t ~= 'none' and t ~= 'hash' then return redis.error_reply('""" + WRONGTYPE + """') end
    fields[k] = fields[k] or {}
    local f = ARGV[o + 1]
    if op == 'hincr' then
      local cur = fields[k][f]
      if cur == nil and not fresh[k] and t == 'hash' then cur = redis.call('HGET', k, f) end
      if cur and not is_int(cur) then return redis.error_reply('""" + NOT_INTEGER + """') end
      fields[k][f] = '0'   -- an integer plus an integer: an integer
    else
      fields[k][f] = ARGV[o + 2]
    end
    kind[k] = 'hash'
  elseif op == 'expire' then
    -- a TTL on whatever the key holds then (absent: nothing): it cannot fail
  else -- zadd, zrem: a sorted set whose last member goes is no key any more
    if t ~= 'none' and t ~= 'zset' then return redis.error_reply('""" + WRONGTYPE + """') end
    if count[k] == nil then
      members[k] = {}
      count[k] = (t == 'zset') and redis.call('ZCARD', k) or 0
    end
    local m = ARGV[o + 1]
    if members[k][m] == nil then
      members[k][m] = (t == 'zset' and not fresh[k] and redis.call('ZSCORE', k, m)) and true or false
    end
    if op == 'zadd' then
      if not members[k][m] then count[k] = count[k] + 1 end
      members[k][m] = true
      kind[k] = 'zset'
    elseif members[k][m] then
      members[k][m] = false
      count[k] = count[k] - 1
      if count[k] == 0 then reset(k, 'none') end
    end
  end
end

for j = 1, #KEYS - n do
  local k = KEYS[n + j]
  local o = base + 3 * (j - 1)
  local op = ARGV[o]
  if op == 'set' then
    if ARGV[o + 2] == '' then redis.call('SET', k, ARGV[o + 1])
    else redis.call('SET', k, ARGV[o + 1], 'PX', ARGV[o + 2]) end
  elseif op == 'del' then redis.call('DEL', k)
  elseif op == 'hset' then redis.call('HSET', k, ARGV[o + 1], ARGV[o + 2])
  elseif op == 'hincr' then redis.call('HINCRBY', k, ARGV[o + 1], ARGV[o + 2])
  elseif op == 'zadd' then redis.call('ZADD', k, ARGV[o + 2], ARGV[o + 1])
  elseif op == 'expire' then redis.call('PEXPIRE', k, ARGV[o + 2])
  else redis.call('ZREM', k, ARGV[o + 1]) end
end
return 1
"""


def ttl_ms(ttl: float | None) -> str:
    """A positive TTL as whole milliseconds, at least 1 ("" for none)."""
    if ttl is None:
        return ""
    return str(max(1, round(ttl * 1000)))


def score(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        raise StoreError("a sorted-set score cannot be NaN (Redis refuses it)")
    return repr(value)


def cas_args(expected: str | None, value: str | None, ttl: float | None) -> list[str]:
    deletes = value is None or (ttl is not None and ttl <= 0)
    return ["0" if expected is None else "1", expected or "",
            "del" if deletes else "set", value or "", "" if deletes else ttl_ms(ttl)]


def apply_args(prefix: str, checks: Sequence[Check], writes: Sequence[Write]) -> tuple[list[str], list[str]]:
    keys = [prefix + c.key for c in checks]
    args = [str(len(checks))]
    for c in checks:
        args += ["0", ""] if c.value is None else ["1", c.value]
    for w in writes:
        keys.append(prefix + w.key)
        if isinstance(w, Set):
            if w.ttl is not None and w.ttl <= 0:
                args += ["del", "", ""]
            else:
                args += ["set", w.value, ttl_ms(w.ttl)]
        elif isinstance(w, Delete):
            args += ["del", "", ""]
        elif isinstance(w, HSet):
            args += ["hset", w.field, w.value]
        elif isinstance(w, HIncr):
            args += ["hincr", w.field, str(int(w.by))]
        elif isinstance(w, ZAdd):
            args += ["zadd", w.member, score(w.score)]
        elif isinstance(w, ZRem):
            args += ["zrem", w.member, ""]
        elif isinstance(w, Expire):
            args += ["expire", "", ttl_ms(w.ttl)]
        else:
            raise StoreError(f"unknown write {w!r}")
    return keys, args
