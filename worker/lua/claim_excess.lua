-- claim_excess.lua: take over, for refusal, the entries a request stream holds
-- beyond the queue's maximum length, in one atomic step.
--
-- Keys touched (one queue's hash tag, so one Cluster slot):
--   KEYS[1]  <prefix>:{q}:requests   stream  XLEN, XINFO GROUPS, XREVRANGE, XCLAIM FORCE, XDEL
--   and <prefix>:{q}:pending (named from KEYS[1]) hash HINCRBY: the taken entries' counted
--   tokens (their first field) off the sum and a tenant stream's field (HDEL at 0)
--
-- ARGV[1] group   ARGV[2] consumer   ARGV[3] max_len (at least 1)   ARGV[4] most to take
--
-- The newest XLEN - max_len entries were all written around enqueue.lua (which
-- appends only while the stream then holds at most max_len): a plain XADD, or
-- enqueue given a larger limit. Of those, the newest not yet delivered (at most
-- ARGV[4]) are made pending to this consumer (XCLAIM FORCE) and deleted (XDEL),
-- so none is handed out again; the worker answers each as a queue_full dead
-- letter through publish.lua. Returns the taken entries, newest first; nothing
-- within max_len or without the group.

local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local max_len, most = tonumber(ARGV[3]), tonumber(ARGV[4])
-- tokenq:include pending_tokens.lua

if max_len == nil or most == nil or max_len < 1 or most < 1 then
  return redis.error_reply("ERR tokenq claim_excess: max_len and the count must be at least 1")
end
local excess = redis.call("XLEN", stream) - max_len
if excess <= 0 then
  return {}
end
local delivered = nil
for _, row in ipairs(redis.call("XINFO", "GROUPS", stream)) do
  local name, last = nil, nil
  for i = 1, #row, 2 do
    if row[i] == "name" then
      name = row[i + 1]
    elseif row[i] == "last-delivered-id" then
      last = row[i + 1]
    end
  end
  if name == group then
    delivered = last
  end
end
if delivered == nil then
  return {}
end
local taken = redis.call("XREVRANGE", stream, "+", "(" .. delivered, "COUNT",
  math.min(excess, most))
if #taken == 0 then
  return {}
end
local claim, ids, sum = {"XCLAIM", stream, group, consumer, "0"}, {}, 0
for i, entry in ipairs(taken) do
  ids[i] = entry[1]
  claim[#claim + 1] = entry[1]
  sum = sum + counted_of(entry[2])
end
claim[#claim + 1] = "FORCE"
claim[#claim + 1] = "JUSTID"
pending_release(stream, sum)
redis.call(unpack(claim))
redis.call("XDEL", stream, unpack(ids))
return taken
