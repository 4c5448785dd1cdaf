-- peek_replies.lua: read, without removing, the first reply on each of a
-- caller's own reply keys.
--
-- Keys touched (a caller's own reply keys share the queue's hash tag, so one
-- Cluster slot):
--   KEYS[1..n]   <prefix>:{q}:reply:<request id>   list   LINDEX 0 (read only)
--
-- Returns n values, in KEYS order: the reply found on each key, or false
-- (nil to the caller) where none has landed yet.
--
-- Why read without removing: a reply popped (BLPOP, LPOP) is gone from Redis
-- the moment the server sends it, so one lost on its way to the caller (Redis
-- stopping, a connection dropped) would be lost for good. The producer reads
-- a reply here (or waits for one with BLMOVE key key, a rotation that removes
-- nothing), and deletes the key only once the reply is in its hands; a read
-- that never arrived is simply read again. Why a script: it reads every key
-- still missing in one round trip, where LINDEX would take one per key.
local found = {}
for i = 1, #KEYS do
  local reply = redis.call("LINDEX", KEYS[i], 0)
  if reply then
    found[i] = reply
  else
    found[i] = false
  end
end
return found
