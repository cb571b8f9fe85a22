-- One rate-limit decision for one request, atomically, on Redis server time.
-- The same algorithm as bucket.go (decideBuckets); keep the two in step.
--
-- KEYS[i]      the bucket of the i-th policy that matched the request
-- ARGV[4i-3]   interval: µs per token
-- ARGV[4i-2]   burst: capacity in tokens
-- ARGV[4i-1]   cost of this request in tokens
-- ARGV[4i]     "1" for a shadow policy (decided, never decisive)
--
-- A bucket is one number, its theoretical arrival time (TAT) in µs: it holds
-- (now + burst*interval - TAT) / interval tokens, at most burst. Every value
-- stays below 2^53, so Lua's doubles compute exactly what Go's integers do.
--
-- Returns {admitted, now, allowed_1, tat_1, ..., allowed_n, tat_n}: tat_i is
-- the stored TAT before this decision (0 when the key was absent); the caller
-- derives remaining tokens and waits from it with the Go code.

if redis.replicate_commands then redis.replicate_commands() end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local n = #KEYS
local admitted = 1
local out = {0, now}
local stored, base, allowed = {}, {}, {}

for i = 1, n do
  local a = 4 * i
  local interval, burst, cost = tonumber(ARGV[a - 3]), tonumber(ARGV[a - 2]), tonumber(ARGV[a - 1])
  local tat = tonumber(redis.call('GET', KEYS[i])) or 0
  stored[i] = tat
  -- A TAT in the past is a full bucket; one ahead of a clock that went
  -- backwards only makes the bucket stricter: state never moves backwards.
  if tat < now then tat = now end
  base[i] = tat
  if cost <= burst and tat + cost * interval - now <= burst * interval then
    allowed[i] = 1
  else
    allowed[i] = 0
    if ARGV[a] ~= '1' then admitted = 0 end
  end
end

for i = 1, n do
  if admitted == 1 and allowed[i] == 1 then
    local a = 4 * i
    local tat = base[i] + tonumber(ARGV[a - 1]) * tonumber(ARGV[a - 3])
    -- Expire once the bucket is full again: a missing key is a full bucket.
    redis.call('SET', KEYS[i], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000))
  end
  out[2 * i + 1] = allowed[i]
  out[2 * i + 2] = stored[i]
end
out[1] = admitted
return out
