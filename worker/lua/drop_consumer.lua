-- drop_consumer.lua: forget a consumer that is gone, only while it is still
-- gone, in one atomic step: its heartbeat row always, its group membership
-- only while it holds nothing.
--
-- Keys touched (one queue's hash tag, so one Cluster slot):
--   KEYS[1]  <prefix>:{q}:requests        stream  XPENDING, XGROUP DELCONSUMER
--   KEYS[2]  <prefix>:{q}:worker:<name>   string  EXISTS (the consumer's liveness key)
--   KEYS[3]  <prefix>:{q}:workers         hash    HDEL <name> (its heartbeat row)
--
-- ARGV[1] group   ARGV[2] consumer name
--
-- Every removal of a consumer goes through here. Why a script: XGROUP
-- DELCONSUMER throws away pending entries, and a presumed-dead worker may read
-- some between a peer's check and its DELCONSUMER. A heartbeat row whose
-- liveness key expired is stale, so it goes even while entries are pending.
-- Returns 1 when the consumer was removed from the group, 0 otherwise.

if redis.call("EXISTS", KEYS[2]) == 1 then
  return 0
end
redis.call("HDEL", KEYS[3], ARGV[2])
local pending = redis.pcall("XPENDING", KEYS[1], ARGV[1], "-", "+", 1, ARGV[2])
if type(pending) ~= "table" or pending.err or #pending > 0 then
  return 0  -- entries still pending (or no group, nothing to remove)
end
return redis.call("XGROUP", "DELCONSUMER", KEYS[1], ARGV[1], ARGV[2]) > 0 and 1 or 0
