-- queue_full(stream, max_len, adding): the queue's length limit, for every
-- script that adds entries to a request stream (KEYS: the stream, XLEN).
-- nil when `adding` more entries fit under max_len (0 means no limit);
-- otherwise the error "QUEUEFULL <xlen> <max_len> <adding>", which the
-- caller returns before writing anything (parsed by tokenq.shared.lua_scripts).
local function queue_full(stream, max_len, adding)
  if max_len == 0 or adding == 0 then
    return nil
  end
  local length = redis.call("XLEN", stream)
  if length + adding <= max_len then
    return nil
  end
  return redis.error_reply("QUEUEFULL " .. length .. " " .. max_len .. " " .. adding)
end
