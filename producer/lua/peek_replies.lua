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
-- Why read without removing: a popped reply lost on its way (Redis stopping, a connection
-- dropped) would be lost for good; the producer deletes the key once the reply is in hand
-- (docs/RELIABILITY.md). Why a script: every key still missing in one round trip.
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
