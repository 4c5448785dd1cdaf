-- Move dead letters back onto their queue's request stream: all of them or none.
--
-- Keys touched (both carry the queue's hash tag, so one Cluster slot):
--   KEYS[1]  <prefix>:{q}:dead       stream   XRANGE id id, then XDEL
--   KEYS[2]  <prefix>:{q}:requests   stream   XLEN, then XADD (never trimmed)
--   and <prefix>:{q}:pending (named from KEYS[2]) hash HINCRBY: the requests' tokens, each
--   also written into its entry as its first field (pending_tokens.lua), onto the sum and, for
--   a tenant's stream, its field. Quotas do not refuse an operator's retry.
--
-- ARGV[1]   max_len: the queue's maximum length; 0 means no limit
-- ARGV[2]   drop_deadline: "1" leaves the request's deadline_ms field out
-- ARGV[3..] dead-stream entry ids, complete ("<ms>-<seq>"; the caller checks)
--
-- A letter goes back exactly as its producer wrote it: every dead_* field is left out, and
-- its old counted-tokens field, written again from its tokens.
-- A letter with dead_truncated (the worker cut fields to fit its byte cap) is left in place.
--
-- Returns, per id in order: the new request stream id; false when the dead stream has
-- no such entry; or, for a letter left in place, {"truncated", <dead_truncated value>}
-- or {"empty", ""} (no request fields). When XLEN + movable > max_len it moves nothing
-- and answers "QUEUEFULL <xlen> <max_len> <movable>", as enqueue.lua does.
--
-- Why a script: the XADD and the XDEL happen together, or a crash between them would
-- lose the letter or run the request twice. At maxmemory Redis refuses the first XADD
-- (OOM) before anything is written, and every later write goes through: all or nothing.
-- Each tokenq:include line is replaced by that fragment of shared/lua/ when loaded.

-- tokenq:include queue_full.lua
-- tokenq:include pending_tokens.lua
-- tokenq:include dead_fields.lua

local dead = KEYS[1]
local stream = KEYS[2]
local max_len = tonumber(ARGV[1])
if max_len == nil or max_len < 0 then
  return redis.error_reply("ERR tokenq dlq retry: max_len must be a non-negative integer")
end
local drop_deadline = ARGV[2] == "1"

local found = {}
local skip = {}
local count = 0
local tokens, sum = {}, 0
for i = 3, #ARGV do
  local entries = redis.call("XRANGE", dead, ARGV[i], ARGV[i])
  if #entries == 1 then
    local fields = entries[1][2]
    local own = 0
    for j = 1, #fields, 2 do
      if fields[j] == DEAD_TRUNCATED then
        skip[i] = {"truncated", fields[j + 1]}
      elseif not is_dead_field(fields[j]) and fields[j] ~= COUNTED then
        own = own + 1
      end
    end
    if skip[i] == nil and own == 0 then
      skip[i] = {"empty", ""}
    end
    if skip[i] == nil then
      found[i] = entries[1]
      count = count + 1
      local value, text = tokens_of(fields, 1, #fields)
      tokens[i] = text
      sum = sum + value
    end
  end
end

local full = queue_full(stream, max_len, count)
if full then
  return full
end

local counting, refused = pending_start(stream, count)
if refused then
  return refused
end
local ids = {}
for i = 3, #ARGV do
  local letter = found[i]
  if skip[i] ~= nil then
    ids[#ids + 1] = skip[i]
  elseif letter == nil then
    ids[#ids + 1] = false
  else
    local fields = letter[2]
    local entry = {"XADD", stream, "*"}
    if counting then
      entry[4], entry[5] = COUNTED, tokens[i]
    end
    for j = 1, #fields, 2 do
      local name = fields[j]
      local keep = not is_dead_field(name) and name ~= COUNTED
      if drop_deadline and name == "deadline_ms" then
        keep = false
      end
      if keep then
        entry[#entry + 1] = name
        entry[#entry + 1] = fields[j + 1]
      end
    end
    ids[#ids + 1] = redis.call(unpack(entry))
    redis.call("XDEL", dead, letter[1])
  end
end
if counting then
  pending_add(stream, sum)
end
return ids
