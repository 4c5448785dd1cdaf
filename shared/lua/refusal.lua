-- The Lua twin of tokenq.shared.redis_refusal: key_refuses(err) is true when the key can
-- never take this write (settle without it); any other error means Redis refuses writes now
-- (return it at once; the caller retries the whole call later).
-- refusal_text(err): the error's text as Redis 7 gives it, fit for redis.error_reply.
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
