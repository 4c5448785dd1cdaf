-- tenant_in(stream, head): the tenant whose request stream ``stream`` is, named ``head`` (its
-- queue's request stream and ":") then the tenant, or nil when it is no tenant's: the Lua twin
-- of tokenq.shared.keys.tenant_of (1-64 letters, digits, '_', '.', '-'; never "default").
local function tenant_in(stream, head)
  local tenant = string.sub(stream, #head + 1)
  if string.sub(stream, 1, #head) == head and #tenant <= 64 and tenant ~= "default"
      and string.find(tenant, "^[A-Za-z0-9_.%-]+$") then
    return tenant
  end
  return nil
end
