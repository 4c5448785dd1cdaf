-- Move dead letters back onto their queue's request stream: all of them or none.
--
-- Keys touched (both carry the queue's hash tag, so one Cluster slot):
--   KEYS[1]  <prefix>:{q}:dead       stream   XRANGE id id, then XDEL
--   KEYS[2]  <prefix>:{q}:requests   stream   XLEN, then XADD (never trimmed)
--
-- ARGV[1]   max_len: the queue's maximum length; 0 means no limit
-- ARGV[2]   drop_deadline: "1" leaves the request's deadline_ms field out
-- ARGV[3..] dead-stream entry ids, complete ("<ms>-<seq>"; the caller checks)
--
-- A dead letter's fields are the original request's fields plus the worker's
-- dead_* fields (dead_error_code, dead_error, dead_worker, dead_deliveries,
-- dead_at_ms, dead_source_id); every field whose name starts with "dead_" is
-- left out, so the request goes back exactly as its producer wrote it.
--
-- A letter with a dead_truncated field had fields cut by the worker to fit
-- its byte cap: it is not the request as written, so it is left where it is.
--
-- Returns, per id in order: the new request stream id; false when the dead
-- stream has no such entry; or, for a letter skipped and left in place,
-- {"truncated", <dead_truncated value>} or {"empty", ""} (no request fields
-- at all: nothing to put back). When XLEN + movable > max_len it moves nothing
-- and answers the error "QUEUEFULL <xlen> <max_len> <movable>", as the enqueue
-- script does (the same check, shared/lua/queue_full.lua).
--
-- Why a script: the XADD and the XDEL must happen together, or a crash in
-- between would lose the letter or run the request twice.
-- At maxmemory (noeviction) Redis refuses the first XADD with OOM, before
-- anything was written (it denies a script memory only at its first write
-- that grows memory), and the error reaches the caller: nothing moves.
-- Every write after the first goes through, so it is all or nothing.
--
-- Each tokenq:include line is replaced, when tokenq.shared.lua_scripts loads this
-- file, by that fragment of shared/lua/: the queue's length check (shared
-- with enqueue.lua) and the dead_ prefix rule (shared with publish.lua).

-- tokenq:include queue_full.lua
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
for i = 3, #ARGV do
  local entries = redis.call("XRANGE", dead, ARGV[i], ARGV[i])
  if #entries == 1 then
    local fields = entries[1][2]
    local own = 0
    for j = 1, #fields, 2 do
      if fields[j] == DEAD_TRUNCATED then
        skip[i] = {"truncated", fields[j + 1]}
      elseif not is_dead_field(fields[j]) then
        own = own + 1
      end
    end
    if skip[i] == nil and own == 0 then
      skip[i] = {"empty", ""}
    end
    if skip[i] == nil then
      found[i] = entries[1]
      count = count + 1
    end
  end
end

local full = queue_full(stream, max_len, count)
if full then
  return full
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
    for j = 1, #fields, 2 do
      local name = fields[j]
      local keep = not is_dead_field(name)
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
return ids
