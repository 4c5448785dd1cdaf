-- enqueue.lua: append a batch of requests to a queue's stream, all or nothing, unless that
-- would push the stream past the queue's maximum length.
--
-- Keys touched (all share the queue's hash tag, so one Cluster slot):
--   KEYS[1]       <prefix>:{q}:requests      stream   XLEN, then XADD (never trimmed)
--   KEYS[2..n+1]  <prefix>:{q}:seen:<id>     string   one per entry, only when
--                                                     dedupe_ttl_ms > 0: GET, SET PX
--   or KEYS[2]    <prefix>:{q}:seen:call.<h> string   one for the whole call, only
--                                                     with dedupe call:<ms>: GET, SET PX
--   then, optionally, after the seen keys (else from KEYS[2]), in this order:
--                 <prefix>:{q:k}:retired     string   EXISTS: set on a retired shard
--                 <prefix>:{q}:tenants       set      SADD KEYS[1] when it is a tenant's
--                                                     stream, before the entries, so workers
--                                                     find and read it; when it was new, XADD
--                                                     (MAXLEN 64; best effort) to
--                                                     <prefix>:{q}:tenants:added, named from it
--   and, named from KEYS[1] (the same slot), <prefix>:{q}:pending hash HINCRBY: the new
--   entries' tokens, each also written into its entry as its first field, onto the sum and a
--   tenant stream's own field (pending_tokens.lua); and <prefix>:{q}:quotas hash HMGET: the
--   tenant's cap, then, only with one, its pending tokens (HMGET, or HGETALL for the default)
--
-- ARGV[1]   max_len: the queue's maximum length; 0 means no limit
-- ARGV[2]   n: how many entries follow
-- ARGV[3]   dedupe: how long what was enqueued is remembered, in ms: <ms> with a
--           seen key per entry, call:<ms> with one seen key for the call; 0 turns it off
-- ARGV[4..] for each entry: k, its number of fields (1 to 1,000), then k field/value pairs
--
-- Returns the n entry ids, in order (an entry seen before: the id its first enqueue got; an id
-- twice in one batch is added once). Only new entries count against the limit: when XLEN +
-- <new entries> > max_len it writes nothing and answers "QUEUEFULL <xlen> <max_len> <new
-- entries>" (a batch all seen before is never refused). On a retired shard new entries are
-- refused with "RETIRED ...". When they would take the tenant's pending tokens past its quota it
-- writes nothing and answers "OVERQUOTA <tenant> <held> <cap> <adding> <largest>".
--
-- Why (docs/decisions/0019, 0020, 0021, 0029): seen keys, read before the length check, make a
-- retry after a lost reply write nothing twice and not be refused; the retired marker keeps an
-- old shard count off a draining shard; one script makes check and writes atomic. Everything is
-- checked before the first write, and Redis refuses a script for memory only at its first write.
--
-- The blocks between tokenq:include and tokenq:end are the queue_full.lua and
-- pending_tokens.lua fragments themselves, which other scripts include; so this file is a
-- complete script (docs/PROTOCOL.md).

-- tokenq:include queue_full.lua (the fragment is written here)
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
-- tokenq:end queue_full.lua

-- tokenq:include pending_tokens.lua (the fragment is written here)
-- The queue's pending tokens (docs/PROTOCOL.md), kept in the step that adds or deletes
-- request entries. A script adding an entry writes its counted tokens into it, as the field
-- COUNTED (first), and adds them to the sum: field "tokens" of the hash named from the
-- stream's key, ":pending" for ":requests", and, on a tenant's stream, to its field
-- "tokens:<tenant>". A script deleting entries reads that field and takes the sum of what it
-- really deletes off both, once a call, never below 0: an entry written around the scripts
-- (a plain XADD) has no such field, so it is counted neither way.
local PENDING_TOTAL, COUNTED = "tokens", "counted"
-- pending_of(stream): the hash named from the stream's key (a tenant's stream counts in its
-- queue's) and, for a tenant's stream, its own field "tokens:<tenant>" (keys.pending_field),
-- kept with the sum in each step; nil for the default tenant, whose share is the rest.
local function pending_of(stream)
  local base = string.match(stream, "^(.*):requests$")
  if base then
    return base .. ":pending", nil
  end
  local queue, tenant = string.match(stream, "^(.*):requests:([^:]+)$")
  if queue then
    return queue .. ":pending", PENDING_TOTAL .. ":" .. tenant
  end
  return stream .. ":pending", nil
end
local function pending_key(stream)
  return (pending_of(stream))
end
-- count_of(text): a field value as a count: 0 unless 1 to 8 digits, at most 2^24 (what a
-- worker decodes as tokens).
local count_find = string.find  -- looked up once: count_of runs per entry
local function count_of(text)
  local value = #text <= 8 and count_find(text, "^%d+$") and tonumber(text)
  return value and value <= 16777216 and value or 0
end
-- tokens_of(list, first, last): the "tokens" value among the name/value pairs
-- list[first..last] as a count (absent: 0), and as the text COUNTED takes (its own text when
-- it counts, so no number is formatted). Looked for first where Client writes it, 4th.
local function tokens_of(list, first, last)
  if list[first + 6] == "tokens" and last - first >= 7 then
    local text = list[first + 7]  -- count_of, inline on this path
    local value = #text <= 8 and count_find(text, "^%d+$") and tonumber(text)
    if value and value <= 16777216 and value > 0 then
      return value, text
    end
    return 0, "0"
  end
  for j = first, last, 2 do
    if list[j] == "tokens" then
      local value = count_of(list[j + 1])
      return value, value > 0 and list[j + 1] or "0"
    end
  end
  return 0, "0"
end
-- counted_of(fields): an entry's COUNTED value as a count, read only as its first field,
-- where the scripts write it (anywhere else, or absent: 0).
local function counted_of(fields)
  return fields[1] == COUNTED and count_of(fields[2]) or 0
end
-- try(...): redis.pcall(...)'s reply; else nil and false when this user may not run it
-- (NOPERM: an ACL from before the command), or nil and the error.
local function try(...)
  local reply = redis.pcall(...)
  if type(reply) ~= "table" or not reply.err then
    return reply
  end
  local text = tostring(reply.err)
  if string.find(text, "NOPERM", 1, true) or string.find(text, "user executing", 1, true) then
    return nil, false
  end
  return nil, reply
end
-- uncountable(err): whether a HINCRBY failed for what the hash holds, not for Redis: a value
-- no count (written by hand), a sum past 2^63, a key that is no hash. The step goes on
-- uncounted rather than fail after its first write; readers skip such a value, and log it.
local function uncountable(err)
  local text = tostring(err)
  return string.find(text, "WRONGTYPE", 1, true) or string.find(text, "not an integer", 1, true)
    or string.find(text, "overflow", 1, true)
end
-- add_to(key, field, by): HINCRBY's new value; nil when uncountable (any other error fails).
local function add_to(key, field, by)
  local reply = redis.pcall("HINCRBY", key, field, by)
  if type(reply) == "table" and reply.err then
    if uncountable(reply.err) then
      return nil
    end
    error(reply)
  end
  return reply
end
-- pending_start(stream, adding): before an adding script's first write, `adding` entries.
-- true: counted (its entries get COUNTED, then pending_add); false: this user may not write
-- the hash (an ACL from before it), so the entries go uncounted, as a plain XADD's. Redis 7
-- asks the ACL, writing nothing; 6.2 adds 0 to the sum, as the first write: nil and the error
-- of a Redis refusing writes now. Adding none writes nothing (a batch all seen before).
local function pending_start(stream, adding)
  if adding == 0 then
    return true
  elseif redis.acl_check_cmd then
    return redis.acl_check_cmd("HINCRBY", pending_key(stream), PENDING_TOTAL, "0")
  end
  local done, failed = try("HINCRBY", pending_key(stream), PENDING_TOTAL, 0)
  if done or failed == false then
    return done ~= nil
  elseif uncountable(failed.err) then
    return true  -- counted in each entry; the sum, no count now, is left as it is
  end
  return nil, failed
end
-- pending_add(stream, sum): the added entries' COUNTED values, after pending_start.
local function pending_add(stream, sum)
  if sum > 0 then
    local key, field = pending_of(stream)
    add_to(key, PENDING_TOTAL, sum)
    if field then
      add_to(key, field, sum)
    end
  end
end
-- pending_release(stream, sum): entries whose COUNTED values total sum are being deleted:
-- off the sum and a tenant's field, each never below 0 (a forged COUNTED, docs/PROTOCOL.md;
-- entries counted before the tenant fields), the field dropped at 0.
local function pending_release(stream, sum)
  if sum > 0 then
    local key, field = pending_of(stream)
    local left = add_to(key, PENDING_TOTAL, -sum)
    if left and left < 0 then
      add_to(key, PENDING_TOTAL, -left)
    end
    local own = field and add_to(key, field, -sum)
    if own and own <= 0 then
      redis.call("HDEL", key, field)
    end
  end
end
-- tokenq:end pending_tokens.lua

local stream = KEYS[1]
local max_len = tonumber(ARGV[1])
local n = tonumber(ARGV[2])
local dedupe = ARGV[3] or ""
local per_call = string.sub(dedupe, 1, 5) == "call:"
local ttl_text = per_call and string.sub(dedupe, 6) or dedupe
local dedupe_ttl_ms = tonumber(ttl_text)
-- The TTL goes to SET PX as its digits: one Redis refuses (a fraction, 1e+15) would fail
-- the script after its first XADD.
if max_len == nil or n == nil or dedupe_ttl_ms == nil
    or max_len < 0 or n < 0 or dedupe_ttl_ms < 0 or (per_call and dedupe_ttl_ms == 0)
    or #ttl_text > 15 or not string.match(ttl_text, "^%d+$") then
  return redis.error_reply(
    "ERR tokenq enqueue: max_len, n and dedupe_ttl_ms must be non-negative integers "
    .. "(dedupe_ttl_ms: at most 15 digits, after call: at least 1)")
end
local per_entry = dedupe_ttl_ms > 0 and not per_call
-- How many seen keys follow the stream: one per entry, one for the call, or none.
local seen_keys = (per_call and 1) or (per_entry and n) or 0
-- After the seen keys: the retired marker, the tenants set (named by its suffix), or both.
local tenants = KEYS[#KEYS]
if #KEYS < seen_keys + 2 or string.sub(tenants, -8) ~= ":tenants" then
  tenants = nil
end
local extra = #KEYS - seen_keys - 1 - (tenants and 1 or 0)
if dedupe_ttl_ms > 0 and extra ~= 0 and extra ~= 1 then
  return redis.error_reply(per_call and "ERR tokenq enqueue: call: dedupe needs one seen key"
    or "ERR tokenq enqueue: dedupe needs one seen key per entry")
end

-- Check the arguments' shape before writing anything. An entry's fields go to XADD by
-- one unpack, and Lua's C stack takes about 8,000 values: more than MAX_FIELDS would
-- fail the script half way through the batch.
local MAX_FIELDS = 1000
local starts = {}
local pos = 4
for i = 1, n do
  local k = tonumber(ARGV[pos])
  if k == nil or k < 1 or k > MAX_FIELDS or pos + 2 * k > #ARGV then
    return redis.error_reply("ERR tokenq enqueue: malformed entry at argument " .. pos)
  end
  starts[i] = pos
  pos = pos + 1 + 2 * k
end
if pos ~= #ARGV + 1 then
  return redis.error_reply("ERR tokenq enqueue: " .. (#ARGV + 1 - pos) .. " stray arguments")
end

-- Which entries are new: not seen within dedupe_ttl_ms, nor earlier in this batch.
local ids = {}
local first_in_batch = {}
local same_as = {}
local fresh = n
if per_call then
  local held = redis.call("GET", KEYS[2])
  if held then
    for id in string.gmatch(held, "%S+") do
      ids[#ids + 1] = id
    end
    if #ids ~= n then
      return redis.error_reply("ERR tokenq enqueue: the call's seen key holds " .. #ids
        .. " ids for " .. n .. " entries")
    end
    return ids
  end
elseif per_entry then
  fresh = 0
  for i = 1, n do
    local key = KEYS[i + 1]
    local seen = redis.call("GET", key)
    if seen then
      ids[i] = seen
    elseif first_in_batch[key] then
      same_as[i] = first_in_batch[key]
    else
      first_in_batch[key] = i
      fresh = fresh + 1
    end
  end
end

local retired = extra == 1 and KEYS[seen_keys + 2] or nil
if fresh > 0 and retired and redis.call("EXISTS", retired) == 1 then
  return redis.error_reply("RETIRED this shard takes no new requests: read the queue's "
    .. "config and choose a shard again")
end

local full = queue_full(stream, max_len, fresh)
if full then
  return full
end

-- over_quota(): nil when the stream's tenant has no cap in the quotas hash (keys.quotas: its
-- own field, else "*"), or a user who may not read the hashes (uncapped, as a user who may not
-- keep the sum writes uncounted entries), or its pending tokens plus the new entries' stay
-- within its cap; else the error "OVERQUOTA <tenant> <held> <cap> <adding> <largest new
-- entry>", or one naming a cap that is not 0 to 15 digits. Reads nothing more without a cap.
local function over_quota()
  local key, field = pending_of(stream)
  local quotas = string.sub(key, 1, -9) .. ":quotas"
  local tenant = field and string.sub(field, #PENDING_TOTAL + 2) or "default"
  local caps, failed = try("HMGET", quotas, tenant, "*")
  if caps == nil or (caps[1] == false and caps[2] == false) then
    return failed or nil
  end
  local text = caps[1] or caps[2]
  local cap = #text <= 15 and string.match(text, "^%d+$") and tonumber(text)
  if not cap then
    return redis.error_reply("ERR tokenq enqueue: the quota for tenant " .. tenant .. " in "
      .. quotas .. " is '" .. string.sub(text, 1, 40) .. "', not a count of tokens "
      .. "(0 to 15 digits): fix it with tokenq quotas set or clear")
  end
  local adding, largest = 0, 0
  for i = 1, n do
    if ids[i] == nil and same_as[i] == nil then
      local at = starts[i]
      local value = tokens_of(ARGV, at + 1, at + 2 * tonumber(ARGV[at]))
      adding = adding + value
      largest = math.max(largest, value)
    end
  end
  if adding == 0 then
    return nil
  end
  local held, all = 0, nil
  if field then
    all, failed = try("HMGET", key, field)
  else  -- the default tenant's share: the sum less the tenants' fields (keys.pending_field)
    all, failed = try("HGETALL", key)
  end
  if all == nil then
    return failed or nil
  end
  if field then
    held = tonumber(all[1]) or 0
  else
    for j = 1, #all, 2 do
      local value = tonumber(all[j + 1]) or 0
      if all[j] == PENDING_TOTAL then
        held = held + value
      elseif string.sub(all[j], 1, #PENDING_TOTAL + 1) == PENDING_TOTAL .. ":" then
        held = held - value
      end
    end
    held = math.max(held, 0)
  end
  if held + adding <= cap then
    return nil
  end
  return redis.error_reply(string.format("OVERQUOTA %s %.0f %.0f %.0f %.0f", tenant, held, cap,
    adding, largest))
end

local over = fresh > 0 and over_quota()
if over then
  return over
end

local counting, refused = pending_start(stream, fresh)
if refused then
  return refused
end
-- A tenant's stream is registered before its entries are written: a user who may not SADD is
-- refused having written nothing (no worker reads a stream the set does not list).
local announce = tenants and fresh > 0 and redis.call("SADD", tenants, stream) == 1
local sum = 0
for i = 1, n do
  if same_as[i] ~= nil then
    ids[i] = ids[same_as[i]]
  elseif ids[i] == nil then
    -- The fields straight from ARGV: no table built per entry.
    local at = starts[i]
    local last = at + 2 * tonumber(ARGV[at])
    if counting then
      local value, text = tokens_of(ARGV, at + 1, last)
      sum = sum + value
      ids[i] = redis.call("XADD", stream, "*", COUNTED, text, unpack(ARGV, at + 1, last))
    else
      ids[i] = redis.call("XADD", stream, "*", unpack(ARGV, at + 1, last))
    end
    if per_entry then
      redis.call("SET", KEYS[i + 1], ids[i], "PX", ttl_text)
    end
  end
end
if announce then
  -- A stream new to the set: idle workers block on this, so they read it at once. Best effort:
  -- refused (an ACL from before it), workers find the stream at their next heartbeat.
  redis.pcall("XADD", tenants .. ":added", "MAXLEN", "64", "*", "stream", stream)
end
pending_add(stream, sum)
if per_call and n > 0 then
  redis.call("SET", KEYS[2], table.concat(ids, " "), "PX", ttl_text)
end
return ids
