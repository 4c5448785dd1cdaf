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
-- Returns {published, undeliverable, unwritten}: answers settled by this
-- call, how many of those were dead-lettered because their reply_to refused
-- the push, and how many dead letters the dead key refused.
--
-- A letter written here follows the same format and caps as one the worker
-- builds in Python (tokenq.shared.dead_letter): each tokenq:include line is
-- replaced, when tokenq.shared.lua loads this file, by that fragment of
-- shared/lua/, which holds the Lua side of the format (is_dead_field,
-- copy_capped, append_death).

-- tokenq:include dead_fields.lua
-- tokenq:include dead_letter.lua

local stream, dead = KEYS[1], KEYS[2]
local group, consumer = ARGV[1], ARGV[2]
local ttl_ms = tonumber(ARGV[3])
local dead_max_len = tonumber(ARGV[4])
local letter_bytes = tonumber(ARGV[5])
local n = tonumber(ARGV[6])
local unwritten = 0

local function write_letter(record)
  local added = redis.pcall(unpack(record))
  if type(added) == "table" and added.err then
    unwritten = unwritten + 1
  end
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
  write_letter(record)
end

local published, undeliverable = 0, 0
local touched = {}
local pos = 7
for _ = 1, n do
  local entry_id, reply, payload = ARGV[pos], tonumber(ARGV[pos + 1]), ARGV[pos + 2]
  local k = tonumber(ARGV[pos + 3])
  local mine = redis.call("XPENDING", stream, group, entry_id, entry_id, 1, consumer)
  if #mine == 1 then
    if k > 0 then
      local record = {"XADD", dead, "MAXLEN", "~", dead_max_len, "*"}
      for j = pos + 4, pos + 3 + 2 * k do
        record[#record + 1] = ARGV[j]
      end
      write_letter(record)
    end
    if reply < 0 then
      if k == 0 then
        undeliverable_letter(entry_id, mine[1][4], payload)
      end
      undeliverable = undeliverable + 1
    elseif reply > 0 then
      local pushed = redis.pcall("RPUSH", KEYS[reply], payload)
      if type(pushed) == "table" and pushed.err then
        if k == 0 then
          local why = "reply_to " .. KEYS[reply] .. " refused the reply: " .. tostring(pushed.err)
          undeliverable_letter(entry_id, mine[1][4], why)
        end
        undeliverable = undeliverable + 1
      elseif not touched[reply] then
        -- At the first push, not at the end: a reply key must never be left
        -- without a TTL, even if something later in this call fails.
        redis.call("PEXPIRE", KEYS[reply], ttl_ms)
        touched[reply] = true
      end
    end
    redis.call("XACK", stream, group, entry_id)
    redis.call("XDEL", stream, entry_id)
    published = published + 1
  end
  pos = pos + 4 + 2 * k
end
return {published, undeliverable, unwritten}
