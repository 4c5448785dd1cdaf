-- drop_consumer.lua: remove a dead consumer from the group, only while it is
-- still dead and holds nothing, in one atomic step.
--
-- Keys touched (one queue's hash tag, so one Cluster slot):
--   KEYS[1]  <prefix>:{q}:requests        stream  XPENDING, XGROUP DELCONSUMER
--   KEYS[2]  <prefix>:{q}:worker:<name>   string  EXISTS (the consumer's liveness key)
--
-- ARGV[1] group   ARGV[2] consumer name
--
-- Why a script: XGROUP DELCONSUMER throws away the consumer's pending
-- entries, which then stay in the stream and are never delivered or claimed
-- again. A worker presumed dead (stalled, not gone) can wake up and read new
-- entries between another worker's XINFO CONSUMERS and its DELCONSUMER;
-- checking and deleting in one script closes that window.
-- Returns 1 when the consumer was removed, 0 when it was left alone.

if redis.call("EXISTS", KEYS[2]) == 1 then
  return 0
end
if #redis.call("XPENDING", KEYS[1], ARGV[1], "-", "+", 1, ARGV[2]) > 0 then
  return 0
end
redis.call("XGROUP", "DELCONSUMER", KEYS[1], ARGV[1], ARGV[2])
return 1
