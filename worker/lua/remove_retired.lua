-- remove_retired.lua: remove a retired shard's lane once it is drained, in one
-- atomic step, keeping its retired marker.
--
-- Keys touched (one shard's hash tag, so one Cluster slot):
--   KEYS[1]  <prefix>:{q:k}:requests   stream  EXISTS, XLEN, XPENDING, then DEL
--   KEYS[2]  <prefix>:{q:k}:dead       stream  XLEN, then DEL
--   KEYS[3]  <prefix>:{q:k}:retired    string  EXISTS (never removed here)
--   KEYS[4]  <prefix>:{q:k}:workers    hash    DEL
--   KEYS[5]  <prefix>:{q:k}:config     hash    DEL
--   and, named from KEYS[1] (once its own stream is drained): <prefix>:{q:k}:tenants set
--   SMEMBERS (kept: a worker may only read it), each tenant stream it lists,
--   <prefix>:{q:k}:requests:<t>, XLEN, XPENDING, then DEL; <prefix>:{q:k}:pending hash DEL
--   (drained streams count 0)
--
-- ARGV[1] group
--
-- Returns "active" (no marker: the shard serves again, a worker grew the
-- count back), "gone" (no stream: removed already), "draining" (requests,
-- pending entries or dead letters remain, on its own stream or a tenant's) or "removed".
--
-- Why the marker decides and stays: enqueue.lua refuses a marked shard
-- atomically, so its streams only shrink and a producer with a stale shard count
-- is refused, never writing where nobody reads. Dead letters keep the lane for
-- `tokenq dlq`. Drained means every stream of the shard, its tenants' too: their
-- entries are counted in the one pending hash, which goes with the lane.

-- tokenq:include pending_tokens.lua
-- tokenq:include tenant_stream.lua

if redis.call("EXISTS", KEYS[3]) == 0 then
  return "active"
end

-- unanswered(stream): whether entries of it were read and not yet answered (none without
-- the group).
local function unanswered(stream)
  local pending = redis.pcall("XPENDING", stream, ARGV[1])
  return type(pending) == "table" and not pending.err and tonumber(pending[1]) > 0
end

local exists = redis.call("EXISTS", KEYS[1]) == 1
if exists and (redis.call("XLEN", KEYS[1]) > 0 or redis.call("XLEN", KEYS[2]) > 0
    or unanswered(KEYS[1])) then
  return "draining"
end
-- The tenant streams its tenants set lists: named <KEYS[1]>:<tenant> as keys.tenant_of reads
-- them (so in this slot). Other members, which a producer may add, and keys that are not
-- streams are left alone; a stream Redis refuses to read keeps the shard draining.
local head, drained = KEYS[1] .. ":", {}
local listed = (string.match(KEYS[1], "^(.*):requests$") or KEYS[1]) .. ":tenants"
for _, name in ipairs(redis.call("SMEMBERS", listed)) do
  if tenant_in(name, head) then
    local length = redis.pcall("XLEN", name)
    if type(length) == "table" and not string.find(length.err, "WRONGTYPE", 1, true) then
      return "draining"  -- refused (an ACL): it may hold entries, so nothing goes
    elseif type(length) == "number" then
      if length > 0 or unanswered(name) then
        return "draining"
      end
      drained[#drained + 1] = name
    end
  end
end
for _, stream in ipairs(drained) do
  redis.call("DEL", stream)
end
if not exists then
  return "gone"
end
-- A DEL per key: an ACL grants each kind of key in a selector of its own, and one command
-- must be allowed whole by one selector (docs/SECURITY.md).
for _, key in ipairs({KEYS[1], KEYS[2], KEYS[4], KEYS[5], pending_key(KEYS[1])}) do
  redis.call("DEL", key)
end
return "removed"
