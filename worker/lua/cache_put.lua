-- cache_put.lua: write results to a queue's result cache and keep it within its
-- byte budget, in one atomic step.
--
-- Keys touched (one queue's hash tag, so one Cluster slot):
--   KEYS[1]  <prefix>:{q}:cache        hash    digest -> 8-byte written ms + reply
--   KEYS[2]  <prefix>:{q}:cache_index  zset    digest, scored by its written ms
--   KEYS[3]  <prefix>:{q}:cache_bytes  string  the bytes the entries are counted at
--   KEYS[3+j] <prefix>:{q}:cache_claim:<hex>  string  pair j's claim (cache_claim.lua),
--            deleted: its answer is cached, or will not be
--
-- ARGV[1] budget bytes, ARGV[2] TTL ms, ARGV[3] now (epoch ms), ARGV[4] bytes
-- counted per entry besides its digest (twice) and its value (a quarter more: the
-- allocator's rounding), for Redis's own structures,
-- ARGV[5] the share of maxmemory past which the cache only shrinks, then
-- digest, value pairs (none: only trim, as cache_trim does at maxmemory; an empty
-- value: its claim ends, nothing is cached).
--
-- Returns the bytes the cache is counted at afterwards.
--
-- Why it counts and evicts itself: the queue's Redis may run noeviction, where a
-- cache that grew unbounded would make Redis refuse queue writes. Entries past
-- their TTL go first, then the oldest, until the count is within the budget;
-- and while Redis's used memory is past the share of its maxmemory, nothing is
-- added and the cache gives back what Redis is over by (the rest is the queue's).

local budget, ttl, now, overhead, share =
  tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local used = tonumber(redis.call("GET", KEYS[3]) or "0")
local memory = redis.call("INFO", "memory")
local ceiling = tonumber(string.match(memory, "\nmaxmemory:(%d+)") or "0") * share
local over = tonumber(string.match(memory, "\nused_memory:(%d+)") or "0") - ceiling
local adding = ceiling == 0 or over <= 0
if not adding then
  budget = math.max(0, math.min(budget, used - over))
end

local function size_of(digest, length)
  return math.floor((5 * length + 3) / 4) + 2 * #digest + overhead
end

local function drop(digests)
  for _, digest in ipairs(digests) do
    used = used - size_of(digest, redis.call("HSTRLEN", KEYS[1], digest))
    redis.call("HDEL", KEYS[1], digest)
    redis.call("ZREM", KEYS[2], digest)
  end
end

drop(redis.call("ZRANGEBYSCORE", KEYS[2], "-inf", now - ttl, "LIMIT", 0, 256))
for i = 4, #KEYS do
  redis.call("DEL", KEYS[i])
end
for i = 6, adding and #ARGV - 1 or 0, 2 do
  local digest, value = ARGV[i], ARGV[i + 1]
  local size = size_of(digest, #value)
  if #value > 0 and size <= budget and redis.call("HSETNX", KEYS[1], digest, value) == 1 then
    redis.call("ZADD", KEYS[2], now, digest)
    used = used + size
  end
end
while used > budget do
  local oldest = redis.call("ZRANGE", KEYS[2], 0, 63)
  if #oldest == 0 then
    break
  end
  drop(oldest)
end
if redis.call("ZCARD", KEYS[2]) == 0 then
  used = 0  -- a count that drifted (entries removed by hand) starts again
  redis.call("DEL", KEYS[1])  -- a DEL each: an ACL grants each key in its own selector,
  redis.call("DEL", KEYS[3])  -- and one selector must allow a command whole (docs/SECURITY.md)
else
  redis.call("SET", KEYS[3], used)
end
return used
