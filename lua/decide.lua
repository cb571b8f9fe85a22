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
-- allowed_m, tat_m}: tat_i is the bucket's TAT before this decision (0 when
-- the key was absent); the caller derives remaining tokens, waits and delays
-- from it with the Go code.
--
-- Redis work is what costs: each key is read once per call and written at
-- most once, at the end, with what the call's last request left in it (a
-- bucket shared by the requests of a call, such as a global limit, costs
-- one GET and one SET per call, not per request). On Redis 7 and later,
-- whose SET takes NX and GET together, the first read of a key also
-- creates it charged as this request would charge a full bucket: the
-- common case (a missing key, a request admitted) costs one command. When
-- that guess is wrong (the request was denied by another bucket), the end
-- of the call puts the key back as it was, still inside the same atomic
-- script.

if redis.replicate_commands then redis.replicate_commands() end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
-- redis.REDIS_VERSION_NUM and SET ... NX GET both came with Redis 7.0.
local setnxget = redis.REDIS_VERSION_NUM ~= nil

-- The keys this call touched, in order: slot[key] is a key's index in
-- touched, cur and held: its TAT as the requests so far left it (0: absent,
-- a full bucket), and what Redis holds now.
local slot, touched, cur, held, n = {}, {}, {}, {}, 0

local out = {now}
local stored, next, allowed, at = {}, {}, {}, {}
local k, a = 0, 1 -- the request's first KEYS and ARGV, less one; its m

while a <= #ARGV do
  local m = tonumber(ARGV[a])
  a = a + 1
  local admitted = 1
  for i = 1, m do
    local key = KEYS[k + i]
    local interval, burst, cost, wait = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    local j = slot[key]
    local tat
    if j then
      tat = cur[j]
    else
      n = n + 1
      j = n
      touched[j], slot[key] = key, j
      if setnxget and cost <= burst then
        -- A full bucket admits any cost up to burst.
        local span = cost * interval
        local old = redis.call('SET', key, string.format('%.0f', now + span), 'PX', math.ceil(span / 1000), 'NX', 'GET')
        if old then
          tat = tonumber(old) or 0
          held[j] = tat
        else
          tat = 0
          held[j] = now + span
        end
      else
        tat = tonumber(redis.call('GET', key)) or 0
        held[j] = tat
      end
      cur[j] = tat
    end
    at[i] = j
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
      cur[at[i]] = next[i]
    end
    out[#out + 1] = allowed[i]
    out[#out + 1] = stored[i]
  end
  k = k + m
end

for j = 1, n do
  local tat = cur[j]
  if tat ~= held[j] then
    if tat > now then
      -- Expire once the bucket is full again: a missing key is a full bucket.
      redis.call('SET', touched[j], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000))
    else
      redis.call('DEL', touched[j]) -- a guess undone: the key was absent
    end
  end
end
return out
