-- One rate-limit decision for one request, atomically, on Redis server time.
-- The same algorithm as bucket.go (decideBuckets); keep the two in step.
--
-- KEYS[i]      the bucket of the i-th policy that matched the request
-- ARGV[5i-4]   interval: µs per token
-- ARGV[5i-3]   burst: capacity in tokens
-- ARGV[5i-2]   cost of this request in tokens
-- ARGV[5i-1]   wait: µs the request may be held for a slot (policy `wait`)
-- ARGV[5i]     1 for a shadow policy (decided, never decisive)
--
-- A bucket is one number, its theoretical arrival time (TAT) in µs: it holds
-- (now + burst*interval - TAT) / interval tokens, at most burst. Charging a
-- request moves TAT forward cost*interval; a TAT up to `wait` beyond the
-- bucket's capacity is a slot reserved in the future. Every value stays
-- below 2^53, so Lua's doubles compute exactly what Go's integers do.
--
-- Returns {admitted, now, allowed_1, tat_1, ..., allowed_n, tat_n}: tat_i is
-- the stored TAT before this decision (0 when the key was absent); the caller
-- derives remaining tokens, waits and delays from it with the Go code.

if redis.replicate_commands then redis.replicate_commands() end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local n = #KEYS
local admitted = 1
local out = {0, now}
local stored, next, allowed = {}, {}, {}

for i = 1, n do
  local a = 5 * i
  local interval, burst, cost, wait = tonumber(ARGV[a - 4]), tonumber(ARGV[a - 3]), tonumber(ARGV[a - 2]), tonumber(ARGV[a - 1])
  local tat = tonumber(redis.call('GET', KEYS[i])) or 0
  stored[i] = tat
  -- A TAT in the past is a full bucket; one ahead of a clock that went
  -- backwards only makes the bucket stricter: state never moves backwards.
  if tat < now then tat = now end
  next[i] = tat + cost * interval
  if cost <= burst and next[i] - now <= burst * interval + wait then
    allowed[i] = 1
  else
    allowed[i] = 0
    if ARGV[a] ~= '1' then admitted = 0 end
  end
end

for i = 1, n do
  if admitted == 1 and allowed[i] == 1 then
    -- Expire once the bucket is full again: a missing key is a full bucket.
    redis.call('SET', KEYS[i], string.format('%.0f', next[i]), 'PX', math.ceil((next[i] - now) / 1000))
  end
  out[2 * i + 1] = allowed[i]
  out[2 * i + 2] = stored[i]
end
out[1] = admitted
return out
