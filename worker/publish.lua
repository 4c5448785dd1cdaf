-- publish.lua: answer a batch of requests, each exactly once, in one atomic step.
--
-- Keys touched (all share the queue's hash tag, so one Cluster slot; a custom
-- reply_to must carry the same tag under Cluster):
--   KEYS[1]     <prefix>:{q}:requests   stream  XPENDING (ownership), XACK, XDEL
--   KEYS[2]     <prefix>:{q}:dead       stream  XADD MAXLEN ~ (dead letters only)
--   KEYS[3..]   reply keys              list    RPUSH, then PEXPIRE once each
--
-- ARGV[1] group   ARGV[2] consumer   ARGV[3] reply_ttl_ms   ARGV[4] dead_max_len
-- ARGV[5] n, then for each answer:
--   entry_id, reply (index into KEYS of its reply key; 0 = no reply),
--   payload (msgpack reply), k (dead-letter field pairs; 0 = not a dead letter),
--   then k field/value pairs
--
-- An answer is published only while its entry is still pending to this
-- consumer. If another worker claimed it (this one was presumed dead), or it
-- was already answered, the answer is dropped here: the owner answers, so the
-- caller sees exactly one reply. Returns the number of answers published.

local stream, dead = KEYS[1], KEYS[2]
local group, consumer = ARGV[1], ARGV[2]
local ttl_ms = tonumber(ARGV[3])
local dead_max_len = tonumber(ARGV[4])
local n = tonumber(ARGV[5])

local published = 0
local touched = {}
local pos = 6
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
      redis.call(unpack(record))
    end
    if reply > 0 then
      redis.call("RPUSH", KEYS[reply], payload)
      touched[reply] = true
    end
    redis.call("XACK", stream, group, entry_id)
    redis.call("XDEL", stream, entry_id)
    published = published + 1
  end
  pos = pos + 4 + 2 * k
end
for reply, _ in pairs(touched) do
  redis.call("PEXPIRE", KEYS[reply], ttl_ms)
end
return published
