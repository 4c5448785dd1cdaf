-- The dead-letter record built inside a script: the Lua twin of tokenq.shared.dead_letter
-- (capped_fields, encode_letter), after dead_fields.lua.
-- copy_capped(fields, letter_bytes, record): an entry's own fields (a flat name/value
-- array) appended to record within the caps, dead_truncated naming what was cut.
-- append_death(record, code, why, worker, deliveries, at_ms, source_id, stream): the dead_*
-- fields, dead_tenant last when stream is a named tenant's (<...>:requests:<tenant>).
local MAX_LETTER_FIELDS, MAX_TRUNCATED_NAMES, MAX_NAME_BYTES = 256, 16, 64

local function copy_capped(fields, letter_bytes, record)
  local room, kept, cut = letter_bytes, 0, {}
  for j = 1, #fields, 2 do
    local name, value = fields[j], fields[j + 1]
    if not is_dead_field(name) then
      if #name > room or kept >= MAX_LETTER_FIELDS then
        cut[#cut + 1] = string.sub(name, 1, MAX_NAME_BYTES)
      else
        room = room - #name
        if #value > room then
          cut[#cut + 1] = string.sub(name, 1, MAX_NAME_BYTES)
          value = string.sub(value, 1, room)
        end
        room = room - #value
        kept = kept + 1
        record[#record + 1] = name
        record[#record + 1] = value
      end
    end
  end
  if #cut > 0 then
    local names = table.concat(cut, ",", 1, math.min(#cut, MAX_TRUNCATED_NAMES))
    if #cut > MAX_TRUNCATED_NAMES then
      names = names .. ",+" .. (#cut - MAX_TRUNCATED_NAMES) .. " more"
    end
    record[#record + 1] = DEAD_TRUNCATED
    record[#record + 1] = names
  end
end

local function append_death(record, code, why, worker, deliveries, at_ms, source_id, stream)
  for _, v in ipairs({"dead_error_code", code, "dead_error", why, "dead_worker", worker,
                      "dead_deliveries", tostring(deliveries),
                      "dead_at_ms", string.format("%d", at_ms), "dead_source_id", source_id}) do
    record[#record + 1] = v
  end
  local tenant = string.match(stream, ":requests:([%w_.%-]+)$")
  if tenant then
    record[#record + 1] = "dead_tenant"
    record[#record + 1] = tenant
  end
end
