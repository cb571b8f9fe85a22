-- Rate-limit decisions, each atomic, on Redis server time: one or more
-- requests, decided in order (concurrent requests of one Caddy instance are
-- coalesced into one call). The same algorithm as bucket.go (decideBuckets);
-- keep the two in step.
--
-- KEYS         the buckets of every request, request after request
-- ARGV         per request: m, its number of buckets, then per bucket:
--                interval  µs per token
--                burst     capacity in tokens
--                cost      of this request in tokens
--                wait      µs the request may be held for a slot (policy `wait`)
--                shadow    1 for a shadow policy (decided, never decisive)
--
-- A bucket is one number, its theoretical arrival time (TAT) in µs: it holds
-- (now + burst*interval - TAT) / interval tokens, at most burst. Charging a
-- request moves TAT forward cost*interval; a TAT up to `wait` beyond the
-- bucket's capacity is a slot reserved in the future. Every value stays
-- below 2^53, so Lua's doubles compute exactly what Go's integers do.
--
-- Returns {now, then per request: admitted, allowed_1, tat_1, ...,
-- allowed_m, tat_m}: tat_i is the stored TAT before this decision (0 when
-- the key was absent); the caller derives remaining tokens, waits and delays
-- from it with the Go code.

if redis.replicate_commands then redis.replicate_commands() end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local out = {now}
local stored, next, allowed = {}, {}, {}
local k, a = 0, 1 -- the request's first KEYS and ARGV, less one; its m

while a <= #ARGV do
  local m = tonumber(ARGV[a])
  a = a + 1
  local admitted = 1
  for i = 1, m do
    local interval, burst, cost, wait = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    local tat = tonumber(redis.call('GET', KEYS[k + i])) or 0
    stored[i] = tat
    -- A TAT in the past is a full bucket; one ahead of a clock that went
    -- backwards only makes the bucket stricter: state never moves backwards.
    if tat < now then tat = now end
    next[i] = tat + cost * interval
    if cost <= burst and next[i] - now <= burst * interval + wait then
      allowed[i] = 1
    else
      allowed[i] = 0
      if ARGV[a + 4] ~= '1' then admitted = 0 end
    end
    a = a + 5
  end
  out[#out + 1] = admitted
  for i = 1, m do
    if admitted == 1 and allowed[i] == 1 then
      -- Expire once the bucket is full again: a missing key is a full bucket.
      redis.call('SET', KEYS[k + i], string.format('%.0f', next[i]), 'PX', math.ceil((next[i] - now) / 1000))
    end
    out[#out + 1] = allowed[i]
    out[#out + 1] = stored[i]
  end
  k = k + m
end
return out
