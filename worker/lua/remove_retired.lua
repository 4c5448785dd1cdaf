-- remove_retired.lua: remove a retired shard's lane once it is drained, in one
-- atomic step, keeping its retired marker.
--
-- Keys touched (one shard's hash tag, so one Cluster slot):
--   KEYS[1]  <prefix>:{q:k}:requests   stream  EXISTS, XLEN, XPENDING, then DEL
--   KEYS[2]  <prefix>:{q:k}:dead       stream  XLEN, then DEL
--   KEYS[3]  <prefix>:{q:k}:retired    string  EXISTS (never removed here)
--   KEYS[4]  <prefix>:{q:k}:workers    hash    DEL
--   KEYS[5]  <prefix>:{q:k}:config     hash    DEL
--   and <prefix>:{q:k}:pending (named from KEYS[1]) hash DEL (an empty stream counts 0)
--
-- ARGV[1] group
--
-- Returns "active" (no marker: the shard serves again, a worker grew the
-- count back), "gone" (no stream: removed already), "draining" (requests,
-- pending entries or dead letters remain) or "removed".
--
-- Why the marker decides and stays: enqueue.lua refuses a marked shard
-- atomically, so its stream only shrinks and a producer with a stale shard count
-- is refused, never writing where nobody reads. Dead letters keep the lane for
-- `tokenq dlq`.

-- tokenq:include pending_tokens.lua

if redis.call("EXISTS", KEYS[3]) == 0 then
  return "active"
end
if redis.call("EXISTS", KEYS[1]) == 0 then
  return "gone"
end
if redis.call("XLEN", KEYS[1]) > 0 or redis.call("XLEN", KEYS[2]) > 0 then
  return "draining"
end
local pending = redis.pcall("XPENDING", KEYS[1], ARGV[1])
if type(pending) == "table" and not pending.err and tonumber(pending[1]) > 0 then
  return "draining"
end
redis.call("DEL", KEYS[1], KEYS[2], KEYS[4], KEYS[5], pending_key(KEYS[1]))
return "removed"
