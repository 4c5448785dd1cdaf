-- The Lua twin of tokenq.shared.redis_refusal: which errors a redis.pcall
-- hands back mean "this key can never take this write" (the key is of another
-- type, outside the ACL, in another slot: settle without it) and which mean
-- "Redis refuses writes right now" (OOM at maxmemory, READONLY, MASTERDOWN,
-- LOADING, BUSY, and anything not known: the script returns the error at
-- once, the caller keeps its work and retries the whole call later).
-- Redis refuses a script for lack of memory only at its first write that
-- grows memory, so a script that returns such an error at once has written
-- nothing when the error is OOM.
--
-- refusal_text(err): the error's text as Redis 7 gives it, fit for
-- redis.error_reply (Redis 6 hands back "@user_script: <line>: -OOM ...\r\n").
-- key_refuses(err): true for WRONGTYPE, NOPERM and CROSSSLOT.
local KEY_REFUSES = {WRONGTYPE = true, NOPERM = true, CROSSSLOT = true}
local function refusal_text(err)
  local text = tostring(err)
  text = string.gsub(text, "^@[%w_]+: %d+: ", "")  -- Redis 6 puts the script's line first
  text = string.gsub(text, "^%-", "")
  text = string.gsub(text, "[\r\n]+$", "")
  return text
end
local function key_refuses(err)
  local code = string.match(refusal_text(err), "^(%S+)")
  return code ~= nil and KEY_REFUSES[code] == true
end
