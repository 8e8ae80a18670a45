"""The names a Redis store uses on the server, what an entry is charged, and its Lua scripts.

An entry of namespace ``ns`` is the string ``tc:ns:<key>``, with no hash tag, so that a
cluster spreads entries over its nodes. The bookkeeping of the namespace lives under
three names that share the hash tag ``{ns}`` (one node, so one script can update them
atomically):

- ``tc:{ns}:order``, a sorted set of the keys scored by a write clock;
- ``tc:{ns}:sizes``, a hash of each key's payload length;
- ``tc:{ns}:stats``, a hash of totals: ``bytes`` (charged against the budget),
  ``payload`` (payload bytes) and ``clock``.

Nothing read from the server is trusted: a total that is not a non-negative integer,
payload bytes above the bytes charged, or a charge above the budget that every write
keeps (left by a process with a larger budget, or planted) is recomputed from the sizes
hash before a script uses it, and a size that is not a non-negative integer counts as 0;
:func:`parse_count` does the same check in Python.

Each entry is charged what torchcache writes for it: the value (a record of header,
key and payload, see :mod:`~torchcache.stores.packed.format`), the entry's name, and
the key twice with a score and a size in the bookkeeping. The scripts compute the same
charge as :func:`charge`, so every process agrees on the totals.

The scripts touch only the declared bookkeeping keys, except that on a single server
(not a cluster) :data:`PUT` also unlinks the entries it evicts, so that a write and
its evictions are one atomic step. Scripts carry no flags, so they also run on Redis 6:
the first write of :data:`FORGET` is a ``HDEL``, which a server out of memory allows,
so entries can still be removed from a full server.
"""

from __future__ import annotations

from ..packed.format import HEADER

__all__ = ["FORGET", "MAX_COUNT", "PUT", "REBUILD", "STATS_PATTERN", "Keyspace", "charge", "parse_count"]

#: The largest count taken from the server (Lua numbers are doubles: exact below 2**53).
MAX_COUNT = (1 << 53) - 1

#: Charged per entry on top of its payload and names: the record header, a score and a size.
_FIXED = HEADER.size + 16


def _key_bytes(key: str) -> int:
    """Bytes of a key's packed form inside the record (see ``encode_key``)."""
    return len(key) // 2 if len(key) % 2 == 0 else 33


def parse_count(value: object) -> int | None:
    """A count read from the server: a non-negative integer up to :data:`MAX_COUNT`, else ``None``.

    Example:
        >>> parse_count(b"12"), parse_count(b"-100000000000"), parse_count(b"1.5"), parse_count(None)
        (12, None, None, None)
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        number = value
    elif isinstance(value, (bytes, str)) and 0 < len(value) <= 20:
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        if not text.isascii() or not text.isdigit():
            return None
        number = int(text)
    else:
        return None
    return number if 0 <= number <= MAX_COUNT else None


def charge(prefix_len: int, key: str, payload: int) -> int:
    """Bytes charged against the budget for an entry.

    Args:
        prefix_len: Length of the namespace's entry prefix (``tc:ns:``).
        key: The entry's key (hex).
        payload: The payload's length.

    Example:
        >>> charge(len("tc:ns:"), "ab" * 16, 1000)  # record 1031 + name 38 + bookkeeping 64 + 16
        1149
    """
    return payload + _FIXED + _key_bytes(key) + prefix_len + 3 * len(key)


class Keyspace:
    """The server-side names of one namespace.

    Example:
        >>> space = Keyspace("ab12")
        >>> space.name("00ff"), space.meta
        ('tc:ab12:00ff', ('tc:{ab12}:order', 'tc:{ab12}:sizes', 'tc:{ab12}:stats'))
    """

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.prefix = f"tc:{namespace}:"
        tag = f"tc:{{{namespace}}}:"
        self.meta = (tag + "order", tag + "sizes", tag + "stats")
        #: What ``SCAN MATCH`` takes to find the entries (the namespace has no glob characters).
        self.pattern = self.prefix + "*"

    def name(self, key: str) -> str:
        """The name of a key's entry."""
        return self.prefix + key

    def key_of(self, name: bytes | str) -> str | None:
        """The key an entry name stands for, or ``None`` if it is not one of this namespace's."""
        text = name.decode("utf-8", "replace") if isinstance(name, bytes) else name
        return text[len(self.prefix) :] if text.startswith(self.prefix) else None


#: Namespaces on a server are found by their stats key.
STATS_PATTERN = "tc:{*}:stats"

_CHARGE = f"""
local fixed = {_FIXED} + tonumber(ARGV[1])
local function charge(k, n)
  local kb = 33
  if #k % 2 == 0 then kb = #k / 2 end
  return n + fixed + kb + 3 * #k
end
local function count_of(v)
  local n = tonumber(v)
  if n == nil or n ~= n or n < 0 or n ~= math.floor(n) or n > {MAX_COUNT} then return nil end
  return n
end
local function recount(sizes)
  local flat = redis.call('HGETALL', sizes)
  local used, payload = 0, 0
  for i = 1, #flat, 2 do
    local n = count_of(flat[i + 1]) or 0
    used = used + charge(flat[i], n)
    payload = payload + n
  end
  return used, payload
end
local function totals(order, sizes, stats, budget)
  if redis.call('TYPE', stats).ok ~= 'hash' then  -- another client's value: the totals are counted again
    redis.call('DEL', stats)
  end
  local t = redis.call('HMGET', stats, 'bytes', 'payload', 'clock')
  local used, payload, clock = count_of(t[1] or 0), count_of(t[2] or 0), count_of(t[3] or -1)
  local lost = not t[1] and redis.call('HLEN', sizes) > 0  -- no totals beside entries: removed or evicted
  if lost or used == nil or payload == nil or payload > used or used > budget then
    used, payload = recount(sizes)
  end
  if clock == nil then
    local top = redis.call('ZRANGE', order, -1, -1, 'WITHSCORES')
    clock = math.floor(count_of(top[2]) or 0)
  end
  return used, payload, clock
end
"""

#: KEYS: order, sizes, stats. ARGV: prefix length, budget, entry prefix to unlink victims
#: with (empty on a cluster), then key, payload length pairs. Records each key as the
#: newest write, evicting the newest entries first (MRU) while the next one does not fit.
#: Returns the evicted keys.
PUT = (
    _CHARGE
    + """
local order, sizes, stats = KEYS[1], KEYS[2], KEYS[3]
local budget, unlink = tonumber(ARGV[2]), ARGV[3]
local used, payload, clock = totals(order, sizes, stats, budget)
local victims = {}
for i = 4, #ARGV, 2 do
  local k, n = ARGV[i], tonumber(ARGV[i + 1])
  local old = redis.call('HGET', sizes, k)
  if old then
    local on = count_of(old) or 0
    redis.call('HDEL', sizes, k)
    redis.call('ZREM', order, k)
    used = math.max(0, used - charge(k, on))
    payload = math.max(0, payload - on)
  end
  local c = charge(k, n)
  while used + c > budget do
    local top = redis.call('ZPOPMAX', order)
    if #top == 0 then
      used, payload = 0, 0
      break
    end
    local v = top[1]
    local vn = count_of(redis.call('HGET', sizes, v) or 0) or 0
    redis.call('HDEL', sizes, v)
    used = math.max(0, used - charge(v, vn))
    payload = math.max(0, payload - vn)
    victims[#victims + 1] = v
  end
  clock = clock + 1
  redis.call('ZADD', order, clock, k)
  redis.call('HSET', sizes, k, n)
  used = used + c
  payload = payload + n
end
redis.call('HSET', stats, 'bytes', used, 'payload', payload, 'clock', clock)
if unlink ~= '' then
  for _, v in ipairs(victims) do
    redis.call('UNLINK', unlink .. v)
  end
end
return victims
"""
)

#: KEYS: order, sizes, stats. ARGV: prefix length, then keys. Drops the keys from the
#: bookkeeping; returns how many were in it.
FORGET = (
    _CHARGE
    + """
local order, sizes, stats = KEYS[1], KEYS[2], KEYS[3]
local used, payload = totals(order, sizes, stats, math.huge)
local removed = 0
for i = 2, #ARGV do
  local k = ARGV[i]
  local old = redis.call('HGET', sizes, k)
  if old then
    local on = count_of(old) or 0
    redis.call('HDEL', sizes, k)
    redis.call('ZREM', order, k)
    removed = removed + 1
    used = used - charge(k, on)
    payload = payload - on
  end
end
if removed > 0 then
  if used < 0 or payload < 0 or payload > used then
    used, payload = recount(sizes)
  end
  redis.call('HSET', stats, 'bytes', used, 'payload', payload)
end
return removed
"""
)

#: KEYS: order, sizes, stats. ARGV: prefix length. Makes the sorted set hold exactly the
#: keys of the sizes hash (new ones as the newest writes) and recomputes the totals.
REBUILD = (
    _CHARGE
    + """
local order, sizes, stats = KEYS[1], KEYS[2], KEYS[3]
local _, _, clock = totals(order, sizes, stats, math.huge)
local flat = redis.call('HGETALL', sizes)
local have, used, payload = {}, 0, 0
for i = 1, #flat, 2 do
  local k, n = flat[i], count_of(flat[i + 1]) or 0
  have[k] = true
  used = used + charge(k, n)
  payload = payload + n
  if not redis.call('ZSCORE', order, k) then
    clock = clock + 1
    redis.call('ZADD', order, clock, k)
  end
end
for _, k in ipairs(redis.call('ZRANGE', order, 0, -1)) do
  if not have[k] then
    redis.call('ZREM', order, k)
  end
end
redis.call('HSET', stats, 'bytes', used, 'payload', payload, 'clock', clock)
return #flat / 2
"""
)
