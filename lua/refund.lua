-- Gives back tokens a decision charged, when a request whose policies span
-- several Redis Cluster slots was denied in another slot after this one
-- admitted it (see slots.go). The same bucket representation as decide.lua.
--
-- KEYS[i]   a bucket the decision charged
-- ARGV[i]   µs of TAT to give back: cost * interval
--
-- Tokens are interchangeable, so giving back after other requests charged
-- the bucket is the same as the refunded request never having been made.
-- A bucket that has refilled meanwhile is full: nothing to give back.

if redis.replicate_commands then redis.replicate_commands() end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

for i = 1, #KEYS do
  local tat = tonumber(redis.call('GET', KEYS[i]))
  if tat then
    tat = tat - tonumber(ARGV[i])
    if tat <= now then
      redis.call('DEL', KEYS[i])
    else
      redis.call('SET', KEYS[i], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000))
    end
  end
end
return #KEYS
