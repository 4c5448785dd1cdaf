-- is_dead_field(name): the one rule that tells a dead letter's own fields
-- (dead_error_code, dead_truncated, ...) from the request's: the "dead_"
-- prefix (tokenq.shared.dead_letter.is_dead_field is its Python twin).
local DEAD_TRUNCATED = "dead_truncated"
local function is_dead_field(name)
  return string.sub(name, 1, 5) == "dead_"
end
