-- A script that decides nothing, for make bench's scenario (z) only (a
-- Caddy built with -tags ratelimit_noop_script embeds it instead of
-- decide.lua): it takes a call's arguments as decide.lua does (the keys,
-- the format, the numbers in one string, read by one struct.unpack) and
-- replies in its shape, every bucket full (its TAT 0, no slot held, no unit
-- of a quota used) and every request admitted, without reading or writing
-- a key. What remains is the round trip's own cost, against which (b)
-- shows what a decision adds. It admits everything: never for production.

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])

-- The numbers, at most 1000 a struct.unpack, as decide.lua reads them.
local blob = ARGV[2]
local n = #blob / 8
local A, got, pos = {}, 0, 1
while got < n do
  local k = math.min(n - got, 1000)
  local chunk = {struct.unpack('<' .. string.rep('d', k), blob, pos)}
  for j = 1, k do A[got + j] = chunk[j] end
  got, pos = got + k, chunk[k + 1]
end

local QUOTA, ACQUIRE = 12, 6
local out, o, arg = {now}, 1, 1
while arg <= n do
  local count = A[arg]
  arg = arg + 1
  o = o + 1
  out[o] = 1 -- admitted
  for _ = 1, count do
    local op = A[arg]
    local code = (op - op % 4) / 4
    local overridable = op % 4 >= 2
    local width = 6
    if code >= QUOTA then
      width = 10
      local start = 0 -- the period holding Redis's clock, of the four bounds sent
      for j = arg + 6, arg + 8 do
        if A[j] <= now and now < A[j + 1] then start = A[j] end
      end
      out[o + 1], out[o + 2], out[o + 3] = 1, 0, start
      o = o + 3
    elseif code >= ACQUIRE then
      out[o + 1], out[o + 2], out[o + 3] = 1, 0, 0
      o = o + 3
    else
      out[o + 1], out[o + 2] = 1, 0
      o = o + 2
    end
    if overridable then -- the limit sent, as no override were stored
      if code >= QUOTA then
        out[o + 1], out[o + 2], out[o + 3] = 0, A[arg + 1], A[arg + 2]
      else
        out[o + 1], out[o + 2], out[o + 3] = A[arg + 1], A[arg + 2], A[arg + 3]
      end
      o = o + 3
      width = width + 2
    end
    arg = arg + width
  end
end
return out
