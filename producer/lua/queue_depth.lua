-- queue_depth.lua: how deep one lane of a queue is over every stream it has: its own and
-- each tenant's its tenants set lists (docs/PROTOCOL.md, "Tenants").
--
-- Keys touched (one lane's hash tag, so one Cluster slot):
--   KEYS[1]  <prefix>:{q}:requests     stream  XLEN; with "depth": EXISTS, XINFO GROUPS
--   and, named from KEYS[1]: <prefix>:{q}:tenants set SMEMBERS; each tenant stream it lists,
--   <prefix>:{q}:requests:<t>, the same (other members, which a producer may add, and keys
--   that are no stream are left alone; any other refusal, e.g. an ACL's, is the reply)
--
-- ARGV[1]  "length", or "depth"; ARGV[2] the consumer group (with "depth")
--
-- Returns {length}, or with "depth" {length, pending, lag, exact}: sums over the streams. A
-- stream without the group counts all its entries as lag; exact is 0 when Redis gave no lag
-- for a stream (before 7.0, or an entry deleted unread), whose lag is then length - pending.
--
-- Why a script: one round trip however many tenants a lane has; it costs a read per stream.

-- tokenq:include tenant_stream.lua

local depth = ARGV[1] == "depth"
local streams = {KEYS[1]}
local head = KEYS[1] .. ":"
local listed = (string.match(KEYS[1], "^(.*):requests$") or KEYS[1]) .. ":tenants"
for _, name in ipairs(redis.call("SMEMBERS", listed)) do
  if tenant_in(name, head) then
    streams[#streams + 1] = name
  end
end
local length, pending, lag, exact = 0, 0, 0, 1
for i, stream in ipairs(streams) do
  local n = i == 1 and redis.call("XLEN", stream) or redis.pcall("XLEN", stream)
  if type(n) == "table" and n.err and not string.find(n.err, "WRONGTYPE", 1, true) then
    return n  -- refused (an ACL): an error, never a sum that leaves the stream out
  end
  if type(n) == "number" then
    length = length + n
    local group = nil
    if depth and redis.call("EXISTS", stream) == 1 then
      for _, fields in ipairs(redis.call("XINFO", "GROUPS", stream)) do
        local found = {}
        for j = 1, #fields, 2 do
          found[fields[j]] = fields[j + 1]
        end
        if found["name"] == ARGV[2] then
          group = found
        end
      end
    end
    if group == nil then
      lag = lag + n
    else
      local held = tonumber(group["pending"]) or 0
      pending = pending + held
      if type(group["lag"]) == "number" then
        lag = lag + group["lag"]
      else
        lag, exact = lag + math.max(0, n - held), 0
      end
    end
  end
end
if depth then
  return {length, pending, lag, exact}
end
return {length}
