-- remove_idle_tenants.lua: remove the tenant streams idle for a while, each with its place in
-- the tenants set and its pending field, in one atomic step: a tenant named once costs Redis
-- nothing once idle (docs/OPERATIONS.md, "Tenants").
--
-- Keys touched (one queue's hash tag, so one Cluster slot):
--   KEYS[1]    <prefix>:{q}:tenants           set     SISMEMBER, SREM
--   KEYS[2..]  <prefix>:{q}:requests:<t>      stream  XLEN, XINFO STREAM (EXISTS when it
--                                                     fails), XPENDING, then DEL
--   and, named from each stream: <prefix>:{q}:pending hash HDEL of its field tokens:<t>
--
-- ARGV[1] group
-- ARGV[2] idle_ms: a stream is idle when its last id (XINFO STREAM's last-generated-id) was
--         made at least this long before the server's TIME
--
-- Returns the streams removed: each one the set lists, named as a tenant's stream of the set's
-- queue, with no entry, none read and unanswered (the group's XPENDING), and idle. Others
-- (junk a producer put in the set, keys that are not streams) are left alone; a listed name
-- with no key is taken off the set.
--
-- Why atomic: enqueue.lua is a script too, so a tenant's enqueue lands before the check (the
-- stream is not empty: kept) or after the removal (its SADD answers 1 again: registered and
-- announced, and a worker makes the group again from id 0).

-- tokenq:include pending_tokens.lua
-- tokenq:include tenant_stream.lua

local head = string.sub(KEYS[1], 1, -#":tenants" - 1) .. ":requests:"
local idle_ms = tonumber(ARGV[2])
local time = redis.call("TIME")
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- idle(stream): an empty stream, none of it pending, last written idle_ms ago or more.
local function idle(stream)
  local length = redis.pcall("XLEN", stream)
  if type(length) ~= "number" or length > 0 then
    return false
  end
  local info = redis.pcall("XINFO", "STREAM", stream)
  if type(info) ~= "table" or info.err then
    return redis.call("EXISTS", stream) == 0  -- listed with no stream: nothing to keep
  end
  local last
  for i = 1, #info - 1, 2 do
    if info[i] == "last-generated-id" then
      last = tonumber(string.match(info[i + 1], "^(%d+)-"))
    end
  end
  if last == nil or now_ms - last < idle_ms then
    return false
  end
  local pending = redis.pcall("XPENDING", stream, ARGV[1])
  return not (type(pending) == "table" and not pending.err and tonumber(pending[1]) > 0)
end

local removed = {}
for i = 2, #KEYS do
  local stream = KEYS[i]
  if tenant_in(stream, head) and redis.call("SISMEMBER", KEYS[1], stream) == 1
      and idle(stream) then
    local key, field = pending_of(stream)
    -- A command per key: an ACL grants each kind of key in a selector of its own, and one
    -- command must be allowed whole by one selector (docs/SECURITY.md).
    redis.call("SREM", KEYS[1], stream)
    redis.call("DEL", stream)
    if field then
      redis.call("HDEL", key, field)
    end
    removed[#removed + 1] = stream
  end
end
return removed
