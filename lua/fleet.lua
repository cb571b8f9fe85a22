-- The fleet's records (fleet.go): each instance using this Redis database
-- says what it enforces, and reads who else is live.
--
-- KEYS[1]: the index, a hash: instance id -> "<expiry, ms of Redis time> <digest>"
-- KEYS[2]: the records, a hash: instance id -> its record (JSON)
-- Both keys share a Redis Cluster hash tag.
-- ARGV[1]: this instance's id, or '' to only read
-- ARGV[2]: the digest of its record
-- ARGV[3]: its record, or '' to leave the fleet
-- ARGV[4]: how long a record lives unless written again, in ms
-- ARGV[5]: '1' to return the records too
--
-- Writes (or removes) this instance's record, drops the records whose
-- instance stopped writing them, and returns Redis's time in ms, then, for
-- each live instance, its id, expiry, digest (and record).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[4])
if ARGV[1] ~= '' then
  if ARGV[3] == '' then
    redis.call('HDEL', KEYS[1], ARGV[1])
    redis.call('HDEL', KEYS[2], ARGV[1])
  else
    redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', now + ttl) .. ' ' .. ARGV[2])
    redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
  end
end
local index = redis.call('HGETALL', KEYS[1])
local out = {now}
for i = 1, #index, 2 do
  local id = index[i]
  local expiry, digest = string.match(index[i + 1], '^(%d+) (%S+)$')
  expiry = tonumber(expiry)
  if expiry and expiry > now then
    out[#out + 1] = id
    out[#out + 1] = expiry
    out[#out + 1] = digest
    if ARGV[5] == '1' then
      out[#out + 1] = redis.call('HGET', KEYS[2], id) or ''
    end
  else
    redis.call('HDEL', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
  end
end
if #out > 1 then
  -- The keys outlive the last live record by at most its TTL.
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return out
