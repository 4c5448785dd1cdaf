-- cache_claim.lua: look digests up in a queue's result cache and claim each one
-- not there for this worker, so the fleet computes identical requests once.
--
-- Keys touched (one queue's hash tag, so one Cluster slot):
--   KEYS[1]    <prefix>:{q}:cache                 hash    digest -> 8-byte written ms + reply
--   KEYS[1+i]  <prefix>:{q}:cache_claim:<hex i>   string  the worker computing digest i;
--                                                         PX the lease
--
-- ARGV[1] this worker's consumer name, ARGV[2] now (epoch ms), ARGV[3] the cache's
-- TTL ms, ARGV[4] the lease ms, ARGV[5] the share of maxmemory past which nothing
-- is claimed, ARGV[6] how many digests, from the first, to take over from whoever
-- holds them; then the digests, ARGV[6+i] named by KEYS[1+i].
--
-- Returns, per digest: its cached value when one is younger than the TTL; "" when
-- another worker holds it; else false (nil): this worker is to compute it, claimed
-- for it (unless Redis is past the share: then nothing is written).
-- A claim is deleted by cache_put.lua as its answer is written, or lapses.

local me, now, ttl, lease, share, take =
  ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]),
  tonumber(ARGV[6])
local room = nil

local function claiming()
  if room == nil then
    local memory = redis.call("INFO", "memory")
    local ceiling = tonumber(string.match(memory, "\nmaxmemory:(%d+)") or "0") * share
    room = ceiling == 0 or tonumber(string.match(memory, "\nused_memory:(%d+)") or "0") <= ceiling
  end
  return room
end

local out = {}
for i = 1, #KEYS - 1 do
  local value = redis.call("HGET", KEYS[1], ARGV[6 + i])
  local written = 0
  for k = 1, value and #value > 8 and 8 or 0 do
    written = written * 256 + string.byte(value, k)
  end
  local holder = written <= now - ttl and redis.call("GET", KEYS[1 + i])
  local left = holder and holder ~= me and i > take and redis.call("PTTL", KEYS[1 + i])
  if written > now - ttl then
    out[i] = value
  elseif left and left >= 0 and left <= lease then  -- else no worker's: no lease, or longer
    out[i] = ""
  else
    if claiming() then
      redis.call("SET", KEYS[1 + i], me, "PX", lease)
    end
    out[i] = false
  end
end
return out
