-- publish.lua: answer a batch of requests, each exactly once, in one atomic step.
--
-- Keys (one hash tag, so one Cluster slot; a custom reply_to must carry it too):
--   KEYS[1]     <prefix>:{q}:requests   stream  XPENDING (ownership), XACK, XDEL; XRANGE
--                                               (a letter the worker could not write)
--   KEYS[2]     <prefix>:{q}:dead       stream  XADD MAXLEN ~ (dead letters only)
--   KEYS[3..]   reply keys              list    RPUSH (per key and 1,000 replies), PEXPIRE
--   and <prefix>:{q}:pending (named from KEYS[1]) hash HINCRBY: the settled entries'
--   counted tokens off the sum and, on a tenant's stream, off its field, dropped (HDEL) at 0
--   (pending_tokens.lua), once a call: each call is one stream's, so one tenant's
-- ARGV[1] group   ARGV[2] consumer   ARGV[3] reply_ttl_ms   ARGV[4] dead_max_len
-- ARGV[5] dead_max_letter_bytes   ARGV[6] n, then per answer: entry_id, reply (its
--   key's KEYS index; 0 = none; -1 = reply_to refused before the call, payload then
--   says why), payload (msgpack reply), counted (the entry's counted tokens as the worker
--   read them at delivery, 0 when it had none; not a count: 0), k (dead-letter field
--   pairs), k pairs
--
-- The counted values are the worker's (a trusted writer): no entry is read back for them.
-- Only the answers really settled (still pending to this consumer) take theirs off.
--
-- An answer is published only while its entry is still pending to this consumer
-- (one claimed by another worker, or answered, is dropped): exactly one reply.
-- A reply_to that can never take it (WRONGTYPE here; NOPERM or CROSSSLOT refuse the
-- call, and publish.py retries answer by answer with reply -1) is acked and
-- dead-lettered as bad_request; a dead key refusing its letter is counted. A Redis
-- refusing writes now (OOM, READONLY, MASTERDOWN: refusal.lua's key_refuses) ends
-- the call with its error after settling what was pushed, and publish.py retries.
-- Returns {published, undeliverable, unwritten}. Each tokenq:include line is
-- replaced by that fragment of shared/lua/ when the script is loaded.

-- tokenq:include dead_fields.lua
-- tokenq:include dead_letter.lua
-- tokenq:include refusal.lua
-- tokenq:include pending_tokens.lua

local stream, dead = KEYS[1], KEYS[2]
local group, consumer = ARGV[1], ARGV[2]
-- A count Redis takes as an integer: digits only, at most 15 of them (so
-- that now + ttl_ms cannot overflow PEXPIRE's bound either).
local function count(text, least)
  local digits = type(text) == "string" and #text <= 15 and string.match(text, "^%d+$")
  return digits and tonumber(text) >= least and tonumber(text) or nil
end

local ttl_ms, dead_max_len = ARGV[3], ARGV[4]
local letter_bytes = count(ARGV[5], 0)
local n = count(ARGV[6], 0)
if count(ttl_ms, 1) == nil or count(dead_max_len, 0) == nil or letter_bytes == nil
    or n == nil then
  return redis.error_reply("ERR tokenq publish: reply_ttl_ms must be 1 to 15 digits; "
    .. "the dead stream's length and letter caps and n, 0 to 15 digits")
end
local unwritten = 0
-- Before any write: a worker that may not keep the pending tokens (an ACL from before them)
-- is refused here, not after its replies are pushed (Redis 7; 6.2 checks each command).
local pending_hash, tenant_field = pending_of(stream)
if redis.acl_check_cmd
    and not (redis.acl_check_cmd("HINCRBY", pending_hash, PENDING_TOTAL, "0")
      and (tenant_field == nil or redis.acl_check_cmd("HDEL", pending_hash, tenant_field))) then
  return redis.error_reply("NOPERM tokenq publish: this user may not HINCRBY and HDEL "
    .. pending_hash .. " (docs/SECURITY.md)")
end

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
  append_death(record, "bad_request", why, consumer, deliveries, at_ms, entry_id, stream)
  return write_letter(record)
end

-- One XACK and one XDEL for the whole call. The ownership check also reads
-- `settled`, so an entry named twice is answered once; every way out settles
-- first, so a retry after an error skips what was pushed.
-- Most values one unpack hands a command: Lua's C stack takes about 8,000.
local SLICE = 1000
local settled, settled_at = {}, {}
local settled_sum = 0  -- the counted tokens of `settled`
local low, high = nil, nil  -- the call's lowest and highest entry id (below)
local function settle()
  pending_release(stream, settled_sum)
  settled_sum = 0
  for first = 1, #settled, SLICE do
    local ids = {unpack(settled, first, math.min(first + SLICE - 1, #settled))}
    redis.call("XACK", stream, group, unpack(ids))
    redis.call("XDEL", stream, unpack(ids))
  end
  settled = {}
end
local function refuse(text)
  settle()
  return redis.error_reply(text)
end

-- Which answers are still this consumer's: one XPENDING over the range of the
-- call's ids; an entry the range did not show is asked about alone, so the range
-- only saves work and can never drop an answer (odd ids, a cut reply).
local find, sub = string.find, string.sub
local low_ms, low_seq, high_ms, high_seq = 0, 0, 0, 0
local pos = 7
for _ = 1, n do
  local entry_id = ARGV[pos]
  local k = tonumber(ARGV[pos + 4])
  if entry_id == nil or k == nil then
    break  -- malformed: the loop below stops at it as it always did
  end
  local dash = find(entry_id, "-", 1, true)
  if dash then
    local ms, seq = tonumber(sub(entry_id, 1, dash - 1)), tonumber(sub(entry_id, dash + 1))
    if ms and seq then
      if low == nil or ms < low_ms or (ms == low_ms and seq < low_seq) then
        low, low_ms, low_seq = entry_id, ms, seq
      end
      if high == nil or ms > high_ms or (ms == high_ms and seq > high_seq) then
        high, high_ms, high_seq = entry_id, ms, seq
      end
    end
  end
  pos = pos + 5 + 2 * k
end
local owned = {}
if low then
  local found = redis.pcall("XPENDING", stream, group, low, high, 2 * n + 16, consumer)
  if found.err == nil then
    for _, pending in ipairs(found) do
      owned[pending[1]] = pending[4]
    end
  end
end
-- How many times this consumer's entry_id was delivered; nil when it is not pending to it.
local function deliveries_of(entry_id)
  local deliveries = owned[entry_id]
  if deliveries then
    return deliveries
  end
  local mine = redis.call("XPENDING", stream, group, entry_id, entry_id, 1, consumer)
  return mine[1] and mine[1][4]
end

local published, undeliverable = 0, 0

-- An answer no one can be told: dead-lettered unless it is a dead letter already.
-- nil, or the error of a Redis that refuses writes now.
local function unanswerable(entry_id, deliveries, k, why, counted)
  if k == 0 then
    local refused = undeliverable_letter(entry_id, deliveries, why)
    if refused then
      return refused
    end
  end
  undeliverable = undeliverable + 1
  settled[#settled + 1] = entry_id
  settled_sum = settled_sum + counted
  published = published + 1
  return nil
end

-- One RPUSH per reply key and up to SLICE payloads (a client's answers share a
-- key), in call order; an answer is settled only once its reply is pushed.
local replies, reply_order = {}, {}
local function push_all(reply, group)
  local key = KEYS[reply]
  for first = 1, #group, 5 * SLICE do  -- five slots an answer
    local last = math.min(first + 5 * SLICE - 1, #group)
    local payloads = {}
    for j = first + 2, last, 5 do
      payloads[#payloads + 1] = group[j]
    end
    local pushed = redis.pcall("RPUSH", key, unpack(payloads))
    local why = nil
    if type(pushed) == "table" and pushed.err then
      if not key_refuses(pushed.err) then
        return refusal_text(pushed.err)
      end
      why = "reply_to " .. key .. " refused the reply: " .. tostring(pushed.err)
    elseif first == 1 then
      -- With the push, not at the end: a reply key must never be left without
      -- a TTL, even if something later in this call fails.
      redis.call("PEXPIRE", key, ttl_ms)
    end
    for j = first, last, 5 do
      if why then
        local refused = unanswerable(group[j], group[j + 1], group[j + 3], why, group[j + 4])
        if refused then
          return refused
        end
      else
        settled[#settled + 1] = group[j]
        settled_sum = settled_sum + group[j + 4]
        published = published + 1
      end
    end
  end
  return nil
end

pos = 7
for _ = 1, n do
  local entry_id, reply, payload = ARGV[pos], tonumber(ARGV[pos + 1]), ARGV[pos + 2]
  local k = tonumber(ARGV[pos + 4])
  local deliveries = nil
  if not settled_at[entry_id] then
    deliveries = deliveries_of(entry_id)
  end
  if deliveries then
    settled_at[entry_id] = true
    local counted = ARGV[pos + 3]
    counted = (counted == "0" or counted == nil) and 0 or count_of(counted)
    if k > 0 then
      local record = {"XADD", dead, "MAXLEN", "~", dead_max_len, "*"}
      for j = pos + 5, pos + 4 + 2 * k do
        record[#record + 1] = ARGV[j]
      end
      local refused = write_letter(record)
      if refused then
        return refuse(refused)
      end
    end
    if reply > 0 then
      local group = replies[reply]
      if group == nil then
        group = {}
        replies[reply] = group
        reply_order[#reply_order + 1] = reply
      end
      -- Five slots an answer, flat: no table made per answer.
      group[#group + 1] = entry_id
      group[#group + 1] = deliveries
      group[#group + 1] = payload
      group[#group + 1] = k
      group[#group + 1] = counted
    elseif reply < 0 then  -- the worker's reason the reply reaches no one
      local refused = unanswerable(entry_id, deliveries, k, payload, counted)
      if refused then
        return refuse(refused)
      end
    else  -- no reply wanted
      settled[#settled + 1] = entry_id
      settled_sum = settled_sum + counted
      published = published + 1
    end
  end
  pos = pos + 5 + 2 * k
end
for _, reply in ipairs(reply_order) do
  local refused = push_all(reply, replies[reply])
  if refused then
    return refuse(refused)
  end
end
settle()
return {published, undeliverable, unwritten}
