-- publish.lua: answer a batch of requests, each exactly once, in one atomic step.
--
-- Keys touched (all share the queue's hash tag, so one Cluster slot; a custom
-- reply_to must carry the same tag under Cluster):
--   KEYS[1]     <prefix>:{q}:requests   stream  XPENDING (ownership), XRANGE, XACK, XDEL
--   KEYS[2]     <prefix>:{q}:dead       stream  XADD MAXLEN ~ (dead letters only)
--   KEYS[3..]   reply keys              list    RPUSH, and PEXPIRE at the first push to each
--
-- ARGV[1] group   ARGV[2] consumer   ARGV[3] reply_ttl_ms   ARGV[4] dead_max_len
-- ARGV[5] dead_max_letter_bytes (cap on the entry's own fields in a dead letter)
-- ARGV[6] n, then for each answer:
--   entry_id, reply (index into KEYS of its reply key; 0 = no reply; -1 = its
--   reply_to was refused before the script ran, see below), payload (msgpack
--   reply; with -1, why it was refused), k (dead-letter field pairs; 0 = not a
--   dead letter), then k field/value pairs
--
-- An answer is published only while its entry is still pending to this
-- consumer. If another worker claimed it (this one was presumed dead), or it
-- was already answered, the answer is dropped here: the owner answers, so the
-- caller sees exactly one reply.
--
-- A reply_to that refuses the reply (a key of another type, such as the
-- stream itself, or one the worker's ACL user may not write) must not fail
-- the script: the batch would be retried forever and the worker would never
-- answer anything again. Such an entry is acked and moved to the dead stream
-- with its original fields and dead_error_code bad_request; its caller named
-- a key that cannot be told. A key of another type fails RPUSH (caught with
-- pcall); a key outside the ACL makes Redis refuse the whole call before it
-- runs, so publish.py retries such a batch one answer at a time and passes
-- reply -1 for the answer whose key was refused.
--
-- The dead-letter write itself can fail only if someone made the dead key
-- something other than a stream (workers never write a producer-chosen key
-- there: reply_to is confined to the reply namespace before this runs). It
-- is made with pcall, so even then the answers are still settled; the
-- letters that could not be written are counted and the worker logs them.
--
-- Only a key that can never take the write is settled that way (WRONGTYPE,
-- NOPERM, CROSSSLOT: key_refuses, shared/lua/refusal.lua). When Redis
-- refuses writes right now (OOM at maxmemory with noeviction, READONLY,
-- MASTERDOWN, anything else), the script returns that error at once and
-- publish.py keeps the answers and retries the whole call: an answer is never
-- dropped, nor dead-lettered, because Redis was full. Nothing was written
-- when that happens for lack of memory, because Redis denies a script memory
-- only at its first write that grows memory; and what an earlier answer of
-- the call did write is safe to leave, since the retry skips answers whose
-- entries are no longer pending. For the same reason every argument is
-- checked before the first write (a TTL Redis would refuse in PEXPIRE would
-- otherwise leave a reply pushed, its entry pending and the reply without a
-- TTL), and the numbers go to Redis as the digits they came as (a Lua number
-- would be written 1e+15, which Redis refuses).
--
-- Returns {published, undeliverable, unwritten}: answers settled by this
-- call, how many of those were dead-lettered because their reply_to refused
-- the push, and how many dead letters the dead key refused.
--
-- A letter written here follows the same format and caps as one the worker
-- builds in Python (tokenq.shared.dead_letter): each tokenq:include line is
-- replaced, when tokenq.shared.lua_scripts loads this file, by that fragment of
-- shared/lua/, which holds the Lua side of the format (is_dead_field,
-- copy_capped, append_death).

-- tokenq:include dead_fields.lua
-- tokenq:include dead_letter.lua
-- tokenq:include refusal.lua

local stream, dead = KEYS[1], KEYS[2]
local group, consumer = ARGV[1], ARGV[2]
-- A count Redis takes as an integer: digits only, at most 15 of them (so
-- that now + ttl_ms cannot overflow PEXPIRE's bound either).
local function count(text, least)
  if type(text) ~= "string" or #text > 15 or not string.match(text, "^%d+$")
      or tonumber(text) < least then
    return nil
  end
  return tonumber(text)
end

local ttl_ms = ARGV[3]
local dead_max_len = ARGV[4]
local letter_bytes = count(ARGV[5], 0)
local n = count(ARGV[6], 0)
if count(ttl_ms, 1) == nil or count(dead_max_len, 0) == nil or letter_bytes == nil
    or n == nil then
  return redis.error_reply("ERR tokenq publish: reply_ttl_ms must be 1 to 15 digits; "
    .. "the dead stream's length and letter caps and n, 0 to 15 digits")
end
local unwritten = 0

-- nil when the letter was written or its key can never take it (counted in
-- unwritten); else the error of a Redis that refuses writes now.
local function write_letter(record)
  local added = redis.pcall(unpack(record))
  if type(added) == "table" and added.err then
    if not key_refuses(added.err) then
      return refusal_text(added.err)
    end
    unwritten = unwritten + 1
  end
  return nil
end

local function undeliverable_letter(entry_id, deliveries, why)
  local record = {"XADD", dead, "MAXLEN", "~", dead_max_len, "*"}
  local found = redis.call("XRANGE", stream, entry_id, entry_id)
  if #found == 1 then
    copy_capped(found[1][2], letter_bytes, record)
  end
  local now = redis.call("TIME")
  local at_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  append_death(record, "bad_request", why, consumer, deliveries, at_ms, entry_id)
  return write_letter(record)
end

-- The answered entries are acked and deleted together, one XACK and one XDEL
-- for the whole call rather than two commands per answer (issue 25: Redis CPU
-- per request). An answer settled earlier in the call is no longer pending
-- when a later one is checked, because the check goes through `settled` as
-- well as XPENDING, so an entry named twice is still answered once. Every
-- way out settles first: an error returned half way leaves what was pushed
-- acked, as it was when each answer acked itself, so the retry skips it.
local settled, settled_at = {}, {}
local function settle()
  for first = 1, #settled, 1000 do
    local ids = {unpack(settled, first, math.min(first + 999, #settled))}
    redis.call("XACK", stream, group, unpack(ids))
    redis.call("XDEL", stream, unpack(ids))
  end
  settled = {}
end
local function refuse(text)
  settle()
  return redis.error_reply(text)
end

-- Which answers are still this consumer's: one XPENDING over the range of
-- the call's entry ids rather than one per answer (issue 25). The range is
-- found by comparing canonical ids as digit strings, exactly (a Lua number
-- would round a sequence past 2^53); an entry the range may not have covered
-- (its id not canonical, or the reply cut at `limit` before reaching it) is
-- asked about alone, as every entry was before, so the shortcut can only
-- save work, never drop an answer.
local function canonical(digits)
  return digits == "0" or string.match(digits, "^[1-9]%d*$") ~= nil
end
local function parts(id)
  local ms, seq = string.match(id, "^(%d+)-(%d+)$")
  if ms and canonical(ms) and canonical(seq) then
    return ms, seq
  end
  return nil
end
local function digits_below(a, b)
  if #a ~= #b then
    return #a < #b
  end
  return a < b
end
local function below(a, b)  -- a, b: {ms, seq, id}
  if a[1] ~= b[1] then
    return digits_below(a[1], b[1])
  end
  return digits_below(a[2], b[2])
end

local ranged, low, high = {}, nil, nil
local pos = 7
for _ = 1, n do
  local entry_id = ARGV[pos]
  local k = tonumber(ARGV[pos + 3])
  if entry_id == nil or k == nil then
    break  -- malformed: the loop below stops at it as it always did
  end
  local ms, seq = parts(entry_id)
  if ms then
    local at = {ms, seq, entry_id}
    ranged[entry_id] = true
    if low == nil or below(at, low) then
      low = at
    end
    if high == nil or below(high, at) then
      high = at
    end
  end
  pos = pos + 4 + 2 * k
end
local owned, complete = {}, false
if low then
  local limit = 2 * n + 16
  local found = redis.call("XPENDING", stream, group, low[3], high[3], limit, consumer)
  for _, pending in ipairs(found) do
    owned[pending[1]] = pending[4]
  end
  complete = #found < limit
end
-- How many times this consumer's entry_id was delivered; nil when it is not pending to it.
local function deliveries_of(entry_id)
  if owned[entry_id] or (complete and ranged[entry_id]) then
    return owned[entry_id]
  end
  local mine = redis.call("XPENDING", stream, group, entry_id, entry_id, 1, consumer)
  return mine[1] and mine[1][4]
end

local published, undeliverable = 0, 0
local touched = {}
pos = 7
for _ = 1, n do
  local entry_id, reply, payload = ARGV[pos], tonumber(ARGV[pos + 1]), ARGV[pos + 2]
  local k = tonumber(ARGV[pos + 3])
  local deliveries = nil
  if not settled_at[entry_id] then
    deliveries = deliveries_of(entry_id)
  end
  if deliveries then
    settled_at[entry_id] = true
    if k > 0 then
      local record = {"XADD", dead, "MAXLEN", "~", dead_max_len, "*"}
      for j = pos + 4, pos + 3 + 2 * k do
        record[#record + 1] = ARGV[j]
      end
      local refused = write_letter(record)
      if refused then
        return refuse(refused)
      end
    end
    -- Why the answer reaches no one: the worker's reason (reply < 0), or the
    -- reply key refusing the push; nil once it is pushed (or none is wanted).
    local unanswered = nil
    if reply < 0 then
      unanswered = payload
    elseif reply > 0 then
      local pushed = redis.pcall("RPUSH", KEYS[reply], payload)
      if type(pushed) == "table" and pushed.err then
        if not key_refuses(pushed.err) then
          return refuse(refusal_text(pushed.err))
        end
        unanswered = "reply_to " .. KEYS[reply] .. " refused the reply: " .. tostring(pushed.err)
      elseif not touched[reply] then
        -- At the first push, not at the end: a reply key must never be left
        -- without a TTL, even if something later in this call fails.
        redis.call("PEXPIRE", KEYS[reply], ttl_ms)
        touched[reply] = true
      end
    end
    if unanswered then
      if k == 0 then
        local refused = undeliverable_letter(entry_id, deliveries, unanswered)
        if refused then
          return refuse(refused)
        end
      end
      undeliverable = undeliverable + 1
    end
    settled[#settled + 1] = entry_id
    published = published + 1
  end
  pos = pos + 4 + 2 * k
end
settle()
return {published, undeliverable, unwritten}
