-- Bucket operations on Redis server time: one or more requests per call
-- (the concurrent requests of one Caddy instance are coalesced), each
-- decided atomically, in order. The same algorithm as bucket.go (rebase,
-- decideBuckets, adjust); keep the two in step.
--
-- KEYS   the buckets of every request, request after request; then every
--        other key the call touches, once each: the override of each
--        overridable bucket (<bucket>:override) and the learned usage of
--        each bucket that learns (<bucket>:usage). The script names those
--        from the bucket's key and reads them from no index: they are
--        declared so that a server that refuses a script touching a key
--        its call did not declare (Dragonfly, by default) runs it
--        (wire.go, touchedKeys: the names, on the Go side).
-- ARGV   first the format buckets are written in (1 or 2, see format.go);
--        then the call's numbers in one string, little-endian doubles
--        (exact: every value stays below 2^53), read by one struct.unpack:
--        Redis's handling of an argument costs more than the Lua that
--        reads it (measured: some 1.7 µs a request of 7 numbers); then the
--        call's strings (leases' members, events channels), each given
--        among the numbers by its ARGV index. The numbers are, per request:
--        its bucket count, then per bucket six values (a kind of bucket may
--        take more after them, see width):
--          op        4 * code + 2 * overridable + shadow; codes: 1 take,
--                    2 check, 3 adjust, 4 inspect, 5 reset; for concurrency
--                    slots 6 acquire, 7 release, 8 renew, 9 count, 10 free,
--                    11 restore; 12 and up for quotas (see bucketOp in
--                    bucket.go); overridable: an operator's override of the
--                    limit may be stored for the bucket (read it)
--          interval  µs per token under the current config (slots: the
--                    lease)
--          burst     capacity in tokens (slots: how many)
--          slack     µs a TAT may run beyond a full refill (reserved turns,
--                    debt)
--          amount    take, check: the cost; adjust: the delta, tokens charged (> 0)
--                    or given back (< 0); slots: the lease's member (a
--                    string); free: the µs a lease must have left to be kept
--          wait      take: µs ahead a slot may be reserved (policy `wait`);
--                    adjust: for a give-back (amount < 0), the Redis µs at
--                    which the last token given back is due (0: any): only
--                    those still due go back; negative for a hot key's
--                    block, given back only while the TAT is its own end
--                    (bucket.go, givenBack);
--                    slots: the channel of events between instances (a
--                    string)
--        a quota bucket (codes 12 take, 13 check, 14 adjust, 15 inspect,
--        16 reset: the rate verbs) takes ten values instead: op, quota (N),
--        slack (units a settle may charge beyond N), amount (the cost, or
--        adjust's units: > 0 charged, < 0 given back), the start and end of
--        the period an adjust's charge belongs to (0 0: the current one),
--        then four bounds b0 < b1 < b2 < b3 in µs: the script picks the
--        period [b[i], b[i+1]) that holds Redis's clock (quota.go)
--        an overridable bucket takes two more after those of its code:
--          the policy's wait (µs) and debt rule, which give an override's
--          limit its slack (see override.go, limitFor)
--        a rate bucket whose key learns its usage (op + 128, see
--        learned_usage.go) takes two more after those: the class of its
--        reservation (a take's, or the settled request's), then, for an
--        adjust (a settle), what it used beyond its reservation to
--        remember (0: within it); a take is raised by a high percentile of
--        what its class used beyond, at most burst; a reset forgets them
--
-- A bucket is its theoretical arrival time (TAT) in µs and the interval
-- that TAT was written under, stored in one of the formats of format.go
-- (read in all of them; written in the call's). It holds
-- (now + burst * interval - tat) / interval tokens, at most burst; taking
-- cost tokens moves tat forward cost * interval; a tat in the past, or a
-- missing key, is a full bucket. A bucket is read against the limit of the
-- request (rebase): the tokens it owes are kept across a change of limit,
-- at most what the current limit lets it owe. Every value stays below 2^53,
-- so Lua's doubles compute exactly what Go's integers do.
--
-- Concurrency slots are another kind of key: a sorted set of leases, each
-- member's score the Redis time its lease expires. Expired leases (of an
-- instance that died) are removed, and counted, whenever the key is read;
-- a lease is renewed while its request runs (renew extends a lease still
-- held; restore puts back one Redis lost, in a flush or a failover); free
-- drops the leases not renewed lately (stale: their holders vanished) and
-- keeps those of running requests; the key itself outlives its leases by a
-- lease, so that expired ones are found and counted. Slots are read and
-- written at once, not at the end of the call.
--
-- A quota bucket is a string "q:<start>:<end>:<used>": the period's bounds
-- in µs and the units used in it; a count of another period reads as 0
-- used (the period is over: usage starts again from 0). A take fits iff
-- cost <= quota - used. Its key expires a second after its period ends. A rate bucket or concurrency slots under its key (an earlier config
-- gave the name to another kind of policy) are replaced, and a rate bucket's
-- read replaces a quota's count.
--
-- Returns {now, then per request: status, then per bucket: allowed, tat,
-- expired}:
--   status   1 admitted (or, for adjust, inspect and reset, applied),
--            0 denied, -1 a bucket holds a value of another Redis type
--            (WRONGTYPE), -2 a bucket holds a string that is not a bucket,
--            -3 Redis's clock is outside a quota bucket's bounds: a request
--            with a bad key is neither admitted nor charged, and the other
--            requests of the call are decided as usual
--   allowed  1 when this bucket alone would admit the request; for a bad
--            key, its status (-1, -2 or -3)
--   tat      the bucket's TAT before this request, rebased (0: absent); the
--            caller derives tokens, waits and delays from it with bucket.go;
--            slots: the leases held before this request (free: after it)
--   expired  slots: the expired leases removed (free: and the stale ones)
--   quotas: allowed (or -3), the units used before this request in the
--            period Redis picked, and that period's start (µs)
-- and, for an overridable bucket, the interval, burst and slack it was
-- decided under: an operator's override of its limit, when one of its kind
-- is stored beside it (<prefix><policy>:{<hash>}:override, in its slot), or
-- the limit sent (a quota's: 0, its N and its slack); then, for a bucket
-- that learns, what its key raised a take by, or (other ops) the most it
-- raises one (<prefix><policy>:{<hash>}:usage, in its slot).
--
-- Redis work is what costs: each key is read once per call and written at
-- most once, at the end, with what the call's last request left in it. On
-- Redis 7 and later (SET takes NX and GET together) the first read of a
-- key by a take also creates it as that take would charge a full bucket:
-- the common case, a missing key and an admitted request, costs one
-- command; when that guess is wrong, the end of the call puts the key back.

if redis.replicate_commands then redis.replicate_commands() end

-- What the script costs Redis is mostly the Lua it runs: the common path
-- (a rate take, no override) is written inline, with locals for the
-- library functions it calls, and makes no table that only quotas, slots
-- or overrides use (those are made when a call first needs them). The
-- functions below take what they need as arguments and return what they
-- find: a function that refers to the script's locals (upvalues) costs
-- every call that defines it, used or not (measured: some 0.9 µs per
-- request of a call of 8).

-- code_of is an interval's v2 code, or false.
local function code_of(interval)
  if interval < 1000 then return 9 + interval end
  local m, e = interval, 0
  while m >= 1000 and m % 10 == 0 do
    m, e = m / 10, e + 1
  end
  if m < 1000 and 1009 + (e - 1) * 900 + m - 100 <= 9222 then
    return 1009 + (e - 1) * 900 + m - 100
  end
  return false
end

-- interval_of is the interval a v2 code stands for, or nil.
local function interval_of(c)
  if not c or c < 10 or c > 9222 or c ~= math.floor(c) then return nil end
  local i = c - 10
  if i < 999 then return i + 1 end
  i = i - 999
  return (i % 900 + 100) * 10 ^ (math.floor(i / 900) + 1)
end

-- encode is a bucket's value: v2 when v2 (the interval's code, or false)
-- can state it, v1 otherwise.
local function encode(tat, interval, v2)
  local off = tat - 1700000000000000 -- EPOCH; 15 digits below
  if v2 and off >= 0 and off < 1000000000000000 then
    return string.format('%d%015d', v2, off)
  end
  return string.format('%d:%d', tat, interval)
end

-- decode reads a value in any format: its TAT and interval, or nil.
local function decode(value, interval)
  local sep = string.find(value, ':', 1, true)
  if sep then
    return tonumber(string.sub(value, 1, sep - 1)), tonumber(string.sub(value, sep + 1))
  end
  local n = #value
  if n <= 16 then
    return tonumber(value), interval -- v0: written before intervals were stored
  end
  if n > 19 then return nil end
  local off = tonumber(string.sub(value, -15))
  if not off or off < 0 or off ~= math.floor(off) then return nil end
  return 1700000000000000 + off, interval_of(tonumber(string.sub(value, 1, n - 15)))
end

-- stored reads the value Redis held for a rate bucket's key (the first
-- read of the call found one): its TAT and interval, or nil and what is in
-- the way: WRONGTYPE (-1) or CORRUPT (-2), or 0 for a value to replace.
local function stored(key, value, interval)
  if type(value) == 'table' then -- an error reply
    if not string.find(value.err or '', 'WRONGTYPE', 1, true) then
      if redis.REDIS_VERSION_NUM then error(value) end
      error(value.err, 0) -- Redis 6.2 cannot raise an error reply: its text
    end
    if redis.call('TYPE', key).ok == 'zset' then
      -- A concurrency policy's slots, left by an earlier config that gave
      -- this name to another kind of policy: replaced.
      return nil, 0
    end
    return nil, -1
  end
  if string.sub(value, 1, 2) == 'q:' then
    -- A quota's count, left by an earlier config that gave this name to a
    -- quota policy: replaced.
    return nil, 0
  end
  local tat, stored_interval = decode(value, interval)
  if not tat or not stored_interval or stored_interval <= 0 or tat ~= math.floor(tat) then
    return nil, -2
  end
  return tat, stored_interval
end

-- The call's clock, and what it may use.

local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
-- redis.REDIS_VERSION_NUM and SET ... NX GET both came with Redis 7.0.
local set_get = redis.REDIS_VERSION_NUM ~= nil
-- The formats of format.go: v1 "<tat>:<interval>"; v2 one integer, the
-- interval's code then the TAT's offset from EPOCH (formatEpoch,
-- 1700000000000000) in 15 digits; v0 (read only) "<tat>".
local compact = tonumber(ARGV[1]) == 2

-- A lone take: a call of one request of one rate take, neither
-- overridable nor learning (shadow or not), is the call an instance makes
-- at one request at a time, nothing to coalesce it with. The lines below
-- decide it before the script makes what a call of many buckets, or of
-- other kinds, needs (the main loop's tables, the functions of overrides,
-- learned usage, quotas and slots): they cost Redis more than the take
-- itself (measured: a quarter of such a call's time in the script). They
-- decide, reply and write exactly what the main loop would (the same
-- rebase, decision and write: keep the two in step); a full bucket, the
-- common case, costs TIME and one SET ... NX GET.
if #KEYS == 1 and #ARGV[2] == 56 then -- one bucket, 7 numbers: a count of 1 and 6 values
  local count, op, interval, burst, slack, amount, wait = struct.unpack('<ddddddd', ARGV[2])
  if count == 1 and (op == 4 or op == 5) then -- 4 * TAKE (+ 1: shadow)
    local key = KEYS[1]
    local value
    if set_get and amount <= burst then
      -- A full bucket admits any cost up to burst: charged at once.
      local span = amount * interval
      value = redis.pcall('SET', key, encode(now + span, interval, compact and code_of(interval)),
        'PX', math.ceil(span / 1000), 'NX', 'GET')
      if not value then return {now, 1, 1, 0} end
    else
      value = redis.pcall('GET', key)
    end
    -- What the key holds: its TAT (0: none) and interval, or another
    -- kind's value to replace; a bad key fails the request alone.
    local held, written, replace = 0, interval, false
    if value then
      local tat, w = stored(key, value, interval)
      if tat then
        held, written = tat, w
      elseif w == 0 then
        replace = true
      else
        return {now, w, w, 0}
      end
    end
    -- Rebase, and decide (the main loop's rate decide).
    local tau, tat = interval * burst, held
    if tat > now then
      local ahead = tat - now
      if written ~= interval then ahead = math.ceil(ahead * interval / written) end -- rounded up, as bucket.go
      tat = now + math.min(ahead, tau + slack)
    end
    local before, status, allowed = tat, 1, 1
    if tat < now then tat = now end
    if amount > burst or tat + amount * interval - now > tau + wait then
      allowed = 0
      if op == 4 then status = 0 end -- unless shadow
    end
    -- Write what changed (the main loop's rate write): an admitted take's
    -- TAT, or a replaced value gone.
    local next, next_interval = held, written
    if allowed == 1 then next, next_interval = tat + amount * interval, interval end
    if replace or next ~= held or (next > now and next_interval ~= written) then
      if next > now then
        redis.call('SET', key, encode(next, next_interval, compact and code_of(next_interval)),
          'PX', math.ceil((next - now) / 1000))
      elseif held ~= 0 or replace then
        redis.call('DEL', key)
      end
    end
    if math.type then before = math.tointeger(before) or before end -- Lua 5.3+: as the main loop's reply
    return {now, status, allowed, before}
  end
end

-- Overrides (override.go): "o1 r <interval> <burst>" for a rate bucket,
-- "o1 c 0 <slots>" for slots, "o1 q 0 <N>" for a quota, in the key beside
-- the bucket's, read once per call. A value that is not an override is
-- ignored: the limit sent stands. The release before this one never sets
-- the overridable bit.
local function override_of(overrides, key)
  local o = overrides[key]
  if o ~= nil then return o end
  o = false
  local v = redis.pcall('GET', key .. ':override')
  if type(v) == 'string' then
    local kind, a, b = string.match(v, '^o1 ([rcq]) (%d+) (%d+)$')
    if kind and #a <= 16 and #b <= 16 then -- below 2^53: exact
      local interval, burst = tonumber(a), tonumber(b)
      if kind == 'r' and interval >= 1 and burst >= 1 and interval * burst <= 2 ^ 51 then -- MAX_SPAN
        o = {kind = kind, interval = interval, burst = burst}
      elseif kind ~= 'r' and burst >= 1 and burst < 2 ^ 53 then
        o = {kind = kind, interval = 0, burst = burst}
      end
    end
  end
  overrides[key] = o
  return o
end

-- overridden is the limit a bucket is decided under: its override's, with
-- the slack the policy's rule gives it, or the one sent (limitFor).
local function overridden(o, code, interval, burst, slack, wait_us, debt)
  if not o or code >= 12 then return interval, burst, slack end -- QUOTA
  if code >= 6 then -- ACQUIRE
    if o.kind == 'c' then return interval, o.burst, slack end
    return interval, burst, slack
  end
  if o.kind ~= 'r' then return interval, burst, slack end
  local tokens = debt
  if debt < 0 then tokens = -debt * o.burst end
  return o.interval, o.burst, math.min(wait_us + tokens * o.interval, 2 ^ 51 - o.interval * o.burst) -- MAX_SPAN
end

-- quota_overridden is the N and slack a quota bucket is decided under: a
-- quota override's N, with the units beyond it the policy's debt rule
-- gives a settle, or the ones sent (quotaLimitFor).
local function quota_overridden(o, limit, slack, debt)
  if not o or o.kind ~= 'q' then return limit, slack end
  local units = debt
  if debt < 0 then units = -debt * o.burst end
  return o.burst, math.min(units, 2 ^ 53 - o.burst)
end

-- Learned usage (learned_usage.go): the key's last settles, newest first,
-- at most LEARNED of them, each the class of its reservation and what it
-- used beyond it (0: within it), "l2 <class>:<excess> ...", in the key
-- beside the bucket's, read once per call. The release before this one
-- wrote "l1 <usage> ...": the largest is a floor a take is raised to, until
-- the next settle writes l2. A value that is neither reads as none.
local function learned_of(learned, key, most)
  local l = learned[key]
  if l then return l end
  l = {classes = {}, excess = {}, floor = 0, held = false, dirty = false}
  local v = redis.pcall('GET', key .. ':usage')
  if type(v) == 'string' then
    l.held = true
    if string.match(v, '^l1[ %d]*$') then
      for n in string.gmatch(string.sub(v, 3), '%d+') do
        if #n > 16 then -- at or above 2^53: not one written
          l.floor = 0
          break
        end
        if tonumber(n) > l.floor then l.floor = tonumber(n) end
      end
    elseif string.match(v, '^l2[ %d:]*$') then
      for c, e in string.gmatch(string.sub(v, 3), '(%d+):(%d+)') do
        if #c > 2 or tonumber(c) > 63 or #e > 16 then -- not one written
          l.classes, l.excess = {}, {}
          break
        end
        if #l.classes < most then
          l.classes[#l.classes + 1], l.excess[#l.excess + 1] = tonumber(c), tonumber(e)
        end
      end
    end
  end
  learned[key] = l
  return l
end

-- learned_most is the largest a take is raised to or by: the largest
-- excess remembered, or the floor; 0 for none.
local function learned_most(l)
  local m = l.floor
  for j = 1, #l.excess do
    if l.excess[j] > m then m = l.excess[j] end
  end
  return m
end

-- learned_raise is what a take of class reserving cost is raised by: of
-- its class's records, the largest excess while there are fewer than five,
-- the second largest from five on; or up to the floor when that is more.
local function learned_raise(l, class, cost)
  local e = {}
  for j = 1, #l.classes do
    if l.classes[j] == class then e[#e + 1] = l.excess[j] end
  end
  local r = 0
  if #e > 0 then
    table.sort(e)
    r = e[#e - (#e - #e % 5) / 5]
  end
  if l.floor > cost + r then r = l.floor - cost end
  return r
end

-- numbers unpacks the call's numbers: at most 1000 a struct.unpack (each
-- takes a slot of Lua's stack, which holds some 8000).
local function numbers(blob)
  local n = #blob / 8
  if n <= 1000 then
    return {struct.unpack('<' .. string.rep('d', n), blob)}, n -- and the end's position, unused
  end
  local all, got, pos = {}, 0, 1
  while got < n do
    local k = math.min(n - got, 1000)
    local chunk = {struct.unpack('<' .. string.rep('d', k), blob, pos)}
    for j = 1, k do all[got + j] = chunk[j] end
    got, pos = got + k, chunk[k + 1]
  end
  return all, n
end

local tonumber, floor, ceil, min, max = tonumber, math.floor, math.ceil, math.min, math.max
local rcall, pcall_ = redis.call, redis.pcall

local TAKE, CHECK, ADJUST, RESET = 1, 2, 3, 5
local LEARNED, LEARNED_TTL = 8, 86400000 -- learnRecords, learnTTL (ms)
local ACQUIRE, RELEASE, RENEW, FREE, RESTORE = 6, 7, 8, 10, 11
local QUOTA = 12 -- the first quota code
local WRONGTYPE, CORRUPT, CLOCK = -1, -2, -3

-- Each kind of bucket in one place: a rate bucket (codes below ACQUIRE), a
-- quota (QUOTA and above), concurrency slots (between). The main loop
-- dispatches each bucket of a request to its kind's decide, then, once the
-- request's status is known, to its kind's apply, which writes the
-- bucket's part of the reply; and at the end of the call to its kind's
-- write. A quota's and slots' functions, their readers included, are made
-- by quota_kind and slots_kind when a call first has a bucket of their
-- kind, so that a call without one makes none of them; they name the
-- codes above by their numbers and the library by its tables, and keep
-- what the call knows of its keys in C (a quota's, below). A rate
-- bucket's, the common path, are written inline in the main loop, each
-- under its own heading: as functions they cost Redis some 0.5 µs a
-- request more (measured side by side: a quarter more for a take).

-- Quota buckets.

-- quota_kind makes a quota's functions, with the call's first quota bucket
-- (a function the script defines is made anew by every call that runs the
-- definition, used or not).
local function quota_kind()
  -- quota_read reads a quota key: whether Redis holds a value for it, the
  -- period and units used it holds (0 0 0: none), and what is in the way:
  -- WRONGTYPE (-1) or CORRUPT (-2), or nil.
  local function quota_read(key)
    local value = redis.pcall('GET', key)
    if not value then
      return false, 0, 0, 0
    end
    if type(value) == 'table' then -- an error reply
      if not string.find(value.err or '', 'WRONGTYPE', 1, true) then
        if redis.REDIS_VERSION_NUM then error(value) end
        error(value.err, 0) -- Redis 6.2 cannot raise an error reply: its text
      end
      if redis.call('TYPE', key).ok == 'zset' then
        return true, 0, 0, 0 -- a concurrency policy's slots: replaced
      end
      return false, 0, 0, 0, -1
    end
    local s, e, used = string.match(value, '^q:(%d+):(%d+):(%d+)$')
    if s then
      return true, tonumber(s), tonumber(e), tonumber(used)
    elseif not decode(value, 1) then -- not a rate bucket either (which is replaced)
      return true, 0, 0, 0, -2
    end
    return true, 0, 0, 0
  end

  -- quota_decide decides a quota bucket's part of a request (its numbers
  -- from A[a]; limit and slack: the N and the units beyond it it is decided
  -- under; touched: the keys the call touched so far): the request's status,
  -- the keys touched, and the bucket's index, the units used before it and
  -- after it (next), whether it alone would admit (or CORRUPT, CLOCK), and the
  -- period Redis picked.
  local function quota_decide(C, key, op, code, limit, slack, A, a, status, touched)
    local verb, amount, now = code - 11, A[a + 3], C.now -- verb: code - QUOTA + TAKE
    local bucket = C.index_of[key]
    if not bucket then
      touched = touched + 1
      bucket = touched
      C.index_of[key], C.key_at[bucket] = bucket, key
      C.tat_now[bucket], C.interval_now[bucket], C.tat_stored[bucket], C.interval_stored[bucket] = 0, 0, 0, 0
      C.quota[bucket] = true
      C.q_held[bucket], C.q_start[bucket], C.q_end[bucket], C.q_used[bucket], C.bad[bucket] = quota_read(key)
    end
    local before, next, allowed, s, e = 0, 0, 1, nil, nil
    -- The period holding Redis's clock.
    for j = a + 6, a + 8 do
      local lo, hi = A[j], A[j + 1]
      if lo <= now and now < hi then
        s, e = lo, hi
        break
      end
    end
    if C.bad[bucket] then
      status = C.bad[bucket]
    elseif not C.quota[bucket] then
      allowed, status = -2, -2 -- CORRUPT: a rate bucket's key earlier in this call
    elseif not s then
      allowed, status = -3, -3 -- CLOCK
    else
      local used = 0
      if C.q_start[bucket] == s and C.q_end[bucket] == e then used = C.q_used[bucket] end
      before, next = used, used
      if verb == 1 or verb == 2 then -- TAKE, CHECK
        if amount > limit - used then
          allowed = 0
          if status == 1 and op % 2 == 0 then status = 0 end -- unless shadow
        end
        next = used + amount
      elseif verb == 3 then -- ADJUST
        local of = A[a + 4]
        if of == 0 or (of == s and A[a + 5] == e) then
          -- Within the period the charge belongs to: never below 0 used,
          -- never beyond quota + slack by a charge.
          local charged = used + amount
          if amount > 0 then charged = math.min(charged, math.max(used, limit + slack)) end
          next = math.max(charged, 0)
        end
      end
      return status, touched, bucket, before, next, allowed, s, e
    end
    return status, touched, bucket, before, next, allowed, 0, 0
  end

  -- quota_apply applies a quota bucket's part of a request whose status is
  -- known, and writes the bucket's part of the reply from out[n].
  local function quota_apply(C, code, status, bucket, allowed, before, next, s, e, out, n)
    if status >= 0 then
      local verb = code - 11 -- code - QUOTA + TAKE
      if verb == 1 and status == 1 and allowed == 1 or verb == 3 then -- TAKE admitted, or ADJUST
        C.q_start[bucket], C.q_end[bucket], C.q_used[bucket], C.q_dirty[bucket] = s, e, next, true
      elseif verb == 5 then -- RESET
        C.q_start[bucket], C.q_end[bucket], C.q_used[bucket], C.q_dirty[bucket] = 0, 0, 0, true
      end
    end
    out[n + 1], out[n + 2], out[n + 3] = C.bad[bucket] or allowed, before, s
    return n + 3
  end

  -- quota_write writes a quota bucket once the call is done, if it changed.
  local function quota_write(C, bucket)
    if not C.bad[bucket] and C.q_dirty[bucket] then
      if C.q_used[bucket] > 0 then
        -- Expire a second after the period: a count of a past one is 0.
        redis.call('SET', C.key_at[bucket], string.format('q:%d:%d:%d', C.q_start[bucket], C.q_end[bucket], C.q_used[bucket]),
          'PX', math.ceil((C.q_end[bucket] - C.now) / 1000) + 1000)
      elseif C.q_held[bucket] then
        redis.call('DEL', C.key_at[bucket])
      end
    end
  end

  return quota_decide, quota_apply, quota_write
end

-- Concurrency slots: read and written at once, not at the end of the call.

-- slots_kind makes slots' functions, with the call's first slots bucket.
local function slots_kind()
  -- slots reads a concurrency key: it removes the expired leases and
  -- returns the leases held and how many expired, or nil for a key of
  -- another type (a rate bucket left by an earlier config that gave the name
  -- to another kind of policy is replaced).
  local function slots(key, now)
    local expired = redis.pcall('ZREMRANGEBYSCORE', key, '-inf', now)
    if type(expired) == 'table' then
      if not string.find(expired.err or '', 'WRONGTYPE', 1, true) then
        -- An ACL without the command, not a key of another type.
        if redis.REDIS_VERSION_NUM then error(expired) end
        error(expired.err, 0) -- Redis 6.2 cannot raise an error reply: its text
      end
      if redis.call('TYPE', key).ok ~= 'string' then
        return nil
      end
      redis.call('DEL', key)
      expired = 0
    end
    return redis.call('ZCARD', key), expired
  end

  -- slots_decide decides a slots key's part of a request: the request's
  -- status, and the leases held before it, the expired ones removed, and
  -- whether it alone would admit (or WRONGTYPE).
  local function slots_decide(key, op, code, burst, status, now)
    local leases, gone = slots(key, now)
    if not leases then
      return -1, 0, 0, -1 -- WRONGTYPE
    end
    local allowed = 1
    if code == 6 and leases >= burst then -- ACQUIRE
      allowed = 0
      if status == 1 and op % 2 == 0 then status = 0 end -- unless shadow
    end
    return status, leases, gone, allowed
  end

  -- slots_apply applies a slots key's part of a request whose status is
  -- known (its numbers from A[a]; burst: the slots it was decided under),
  -- and writes its part of the reply from out[n].
  local function slots_apply(key, code, status, interval, burst, allowed, before, expired, A, a, out, n, now)
    if status >= 0 then
      local member = ARGV[A[a + 4]] -- free: nil (its amount is µs)
      local rcall = redis.call
      if code == 6 and status == 1 and allowed == 1 then -- ACQUIRE, admitted
        rcall('ZADD', key, now + interval, member)
        rcall('PEXPIRE', key, math.ceil(2 * interval / 1000))
      elseif code == 8 then -- RENEW
        allowed = rcall('ZADD', key, 'XX', 'CH', now + interval, member)
        if allowed == 1 then rcall('PEXPIRE', key, math.ceil(2 * interval / 1000)) end
      elseif code == 7 then -- RELEASE
        -- A slot freed from a full set: waiters on every instance may try.
        if rcall('ZREM', key, member) == 1 and before >= burst then
          rcall('PUBLISH', ARGV[A[a + 5]], 'freed ' .. key)
        end
      elseif code == 11 then -- RESTORE
        rcall('ZADD', key, now + interval, member)
        rcall('PEXPIRE', key, math.ceil(2 * interval / 1000))
      elseif code == 10 then -- FREE
        local stale = rcall('ZREMRANGEBYSCORE', key, '-inf', now + A[a + 4])
        before, expired = before - stale, expired + stale
        if stale > 0 then
          rcall('PUBLISH', ARGV[A[a + 5]], 'freed ' .. key)
        end
      end
    end
    out[n + 1], out[n + 2], out[n + 3] = allowed, before, expired
    return n + 3
  end

  return slots_decide, slots_apply
end

-- The call.

-- The keys this call touched, by index in the order first touched.
local index_of = {}                         -- key -> index
local key_at = {}                           -- index -> key
local tat_now, interval_now = {}, {}        -- as the requests so far left it
local tat_stored, interval_stored = {}, {}  -- what Redis holds now
local bad = {}                              -- index -> WRONGTYPE or CORRUPT
local replace = {}                          -- index -> the key held another kind's value
local touched = 0
-- C is what the call knows of its keys, for the quota functions (made with
-- the call's first quota bucket): the tables above, and of quota buckets,
-- by the same index, the period and units used as the requests so far left
-- them, whether Redis holds a value for the key, and whether the call
-- changed it. quota is C.quota: whether a key is a quota's.
local C, quota
-- A quota's and slots' functions (quota_kind, slots_kind), made with the
-- call's first bucket of their kind.
local quota_decide, quota_apply, quota_write, slots_decide, slots_apply
local coded, coded_as = nil, false -- the last interval encoded, and its v2 code (or false)
-- Overrides read, by bucket key: {kind, interval, burst}, or false (made
-- with the call's first overridable bucket).
local overrides
-- Learned usage read, by bucket key: {records, held, dirty} (made with the
-- call's first bucket that learns).
local learned

local out, n_out = {now}, 1
local A, n_args = numbers(ARGV[2])
local first_key, arg = 0, 1 -- the request's first KEYS index less one; its first number's index in A
-- Per bucket of the request: its op, first number's index in A, code and
-- interval; its kind's verdict (whether it alone would admit), and what
-- its kind's apply needs: at (rate, quota: the bucket's index), before
-- (rate: its TAT before, rebased; quota: the units used; slots: the leases
-- held) and next (rate: the TAT a take or adjust leaves it with; quota:
-- the units used it leaves; as in decideBuckets).
local ops, argat, codes, intervals, allowed, at, before, next = {}, {}, {}, {}, {}, {}, {}, {}
-- Made when a call first needs them: the expired leases removed (slots);
-- the start and end of the period picked (quotas); the burst and slack it
-- is decided under (slots, overridable buckets); the index of its learned
-- number and the usage its key had learned (buckets that learn).
local expired, starts, ends, bursts, slacks, lws, lvals

while arg <= n_args do
  local count = A[arg]
  arg = arg + 1
  local status = 1
  for i = 1, count do
    local key = KEYS[first_key + i]
    local op = A[arg]
    local learn = op >= 128
    if learn then op = op - 128 end
    local code = (op - op % 4) / 4 -- not math.floor: arithmetic is no call
    local interval, burst = A[arg + 1], A[arg + 2]
    local slack -- read where it counts
    local width = 6 -- the numbers of this bucket
    if code >= QUOTA then width = 10 end
    if op % 4 >= 2 then -- overridable
      if not bursts then bursts, slacks = {}, {} end
      if not overrides then overrides = {} end
      interval, burst, slack = overridden(override_of(overrides, key), code, interval, burst, A[arg + 3],
        A[arg + width], A[arg + width + 1])
      bursts[i], slacks[i] = burst, slack
      width = width + 2
    end
    if learn then
      if not lws then lws, lvals, learned = {}, {}, {} end
      local l = learned_of(learned, key, LEARNED)
      lws[i] = arg + width -- the class, then what a settle remembers
      if code == TAKE then
        lvals[i] = learned_raise(l, A[arg + width], A[arg + 4])
      else
        lvals[i] = learned_most(l) -- what inspect shows
      end
      width = width + 2
    elseif lws then
      lws[i] = nil
    end
    ops[i], argat[i], codes[i], intervals[i] = op, arg, code, interval
    if code < ACQUIRE then
      -- A rate bucket's decide.
      allowed[i] = 1
      local amount = A[arg + 4]
      if learn and code == TAKE and amount <= burst then
        amount = min(amount + lvals[i], burst) -- what like requests of the key recently used beyond theirs
      end
      local bucket = index_of[key]
      if not bucket then
        -- The call's first read of the key.
        touched = touched + 1
        bucket = touched
        index_of[key], key_at[bucket] = bucket, key
        tat_now[bucket], interval_now[bucket], tat_stored[bucket], interval_stored[bucket] = 0, interval, 0, interval
        local value
        if set_get and code == TAKE and amount <= burst then
          -- A full bucket admits any cost up to burst.
          local span = amount * interval
          if compact and interval ~= coded then coded, coded_as = interval, code_of(interval) end
          value = pcall_('SET', key, encode(now + span, interval, compact and coded_as), 'PX', ceil(span / 1000), 'NX', 'GET')
          if not value then tat_stored[bucket] = now + span end
        else
          value = pcall_('GET', key)
        end
        if value then
          local tat, written = stored(key, value, interval) -- written: its interval, or what is in the way
          if tat then
            tat_now[bucket], interval_now[bucket], tat_stored[bucket], interval_stored[bucket] = tat, written, tat, written
          elseif written == 0 then
            replace[bucket] = true
          else
            bad[bucket] = written
          end
        end
      end
      at[i] = bucket
      if bad[bucket] then
        status = bad[bucket]
      elseif quota and quota[bucket] then
        status = CORRUPT -- a quota's key earlier in this call
      end
      -- Rebase: the tokens owed, at the current interval, at most what the
      -- current limit lets a bucket owe.
      local tat = tat_now[bucket]
      local tau = interval * burst
      if tat > now then
        local ahead = tat - now
        if interval_now[bucket] ~= interval then
          ahead = ceil(ahead * interval / interval_now[bucket]) -- rounded up, as bucket.go
        end
        slack = slack or A[arg + 3]
        tat = now + min(ahead, tau + slack)
      end
      before[i] = tat
      if tat < now then tat = now end
      if code == TAKE or code == CHECK then
        local wait = 0
        if code == TAKE then wait = A[arg + 5] end
        if amount > burst or tat + amount * interval - now > tau + wait then
          allowed[i] = 0
          if status == 1 and op % 2 == 0 then status = 0 end -- unless shadow
        end
        next[i] = tat + amount * interval
      elseif code == ADJUST then
        local delta = amount -- tokens charged (> 0) or given back (< 0): Go's bucketRequest.delta
        local due = A[arg + 5] -- a give-back's last token is due then (0: any): only those still due go back
        if delta < 0 and due ~= 0 then
          if due < 0 then -- a hot key's block: only while its tokens end the line
            due = -due
            if tat ~= due then delta = 0 end
          end
          local left = 0
          if due > now then left = ceil((due - now) / interval) end
          if -delta > left then delta = -left end
        end
        slack = slack or A[arg + 3]
        next[i] = min(tat + delta * interval, now + tau + slack)
        if next[i] <= now then next[i] = 0 end -- never beyond a full bucket
      end
    elseif code >= QUOTA then
      if not starts then starts, ends = {}, {} end
      local limit, q_slack = A[arg + 1], A[arg + 2]
      if op % 4 >= 2 then -- overridable: its debt rule follows the 10 values of a quota bucket and the wait
        limit, q_slack = quota_overridden(override_of(overrides, key), limit, q_slack, A[arg + 11])
        intervals[i], bursts[i], slacks[i] = 0, limit, q_slack
      end
      if not C then
        quota_decide, quota_apply, quota_write = quota_kind()
        C = {now = now, index_of = index_of, key_at = key_at, tat_now = tat_now, interval_now = interval_now,
          tat_stored = tat_stored, interval_stored = interval_stored, bad = bad,
          quota = {}, q_start = {}, q_end = {}, q_used = {}, q_held = {}, q_dirty = {}}
        quota = C.quota
      end
      status, touched, at[i], before[i], next[i], allowed[i], starts[i], ends[i] = quota_decide(C, key, op, code, limit, q_slack, A, arg, status, touched)
    else
      if not bursts then bursts, slacks = {}, {} end
      bursts[i] = burst
      if not expired then expired, slots_decide, slots_apply = {}, slots_kind() end
      status, before[i], expired[i], allowed[i] = slots_decide(key, op, code, burst, status, now)
    end
    arg = arg + width
  end
  n_out = n_out + 1
  out[n_out] = status
  for i = 1, count do
    local code = codes[i]
    if code < ACQUIRE then
      -- A rate bucket's apply.
      local bucket = at[i]
      if status >= 0 then
        if code == TAKE and status == 1 and allowed[i] == 1 or code == ADJUST then
          tat_now[bucket], interval_now[bucket] = next[i], intervals[i]
        elseif code == RESET then
          tat_now[bucket] = 0
        end
        if lws and lws[i] and (code == ADJUST or code == RESET) then
          local l, class, u = learned[KEYS[first_key + i]], A[lws[i]], A[lws[i] + 1]
          if code == RESET then
            l.classes, l.excess, l.floor, l.dirty = {}, {}, 0, true
          elseif u > 0 or learned_most(l) > 0 then -- else nothing to remember or to forget
            table.insert(l.classes, 1, class)
            table.insert(l.excess, 1, u)
            l.classes[LEARNED + 1], l.excess[LEARNED + 1], l.floor, l.dirty = nil, nil, 0, true
            if learned_most(l) == 0 then l.classes, l.excess = {}, {} end -- all within their reservations: forgotten
          end
        end
      end
      out[n_out + 1], out[n_out + 2] = bad[bucket] or allowed[i], before[i]
      n_out = n_out + 2
    elseif code >= QUOTA then
      n_out = quota_apply(C, code, status, at[i], allowed[i], before[i], next[i], starts[i], ends[i], out, n_out)
    else
      n_out = slots_apply(KEYS[first_key + i], code, status, intervals[i], bursts[i], allowed[i], before[i], expired[i], A, argat[i], out, n_out, now)
    end
    if ops[i] % 4 >= 2 then -- overridable: the limit it was decided under
      out[n_out + 1], out[n_out + 2], out[n_out + 3] = intervals[i], bursts[i], slacks[i]
      n_out = n_out + 3
    end
    if lws and lws[i] then -- learns: what its key had learned
      n_out = n_out + 1
      out[n_out] = lvals[i]
    end
  end
  first_key = first_key + count
end

for bucket = 1, touched do
  if quota and quota[bucket] then
    quota_write(C, bucket)
  elseif not bad[bucket] then
    -- A rate bucket's write, if it changed.
    local tat = tat_now[bucket]
    if replace[bucket] or tat ~= tat_stored[bucket] or (tat > now and interval_now[bucket] ~= interval_stored[bucket]) then
      if tat > now then
        -- Expire once the bucket is full again: a missing key is a full bucket.
        local interval = interval_now[bucket]
        if compact and interval ~= coded then coded, coded_as = interval, code_of(interval) end
        rcall('SET', key_at[bucket], encode(tat, interval, compact and coded_as), 'PX', ceil((tat - now) / 1000))
      elseif tat_stored[bucket] ~= 0 or replace[bucket] then
        rcall('DEL', key_at[bucket])
      end
    end
  end
end
if learned then
  for key, l in pairs(learned) do
    if l.dirty then
      if #l.excess > 0 and learned_most(l) > 0 then
        local parts = {}
        for j = 1, #l.excess do parts[j] = string.format('%d:%d', l.classes[j], l.excess[j]) end
        rcall('SET', key .. ':usage', 'l2 ' .. table.concat(parts, ' '), 'PX', LEARNED_TTL)
      elseif l.held then
        rcall('DEL', key .. ':usage')
      end
    end
  end
end
-- Lua 5.3 and later (Dragonfly runs 5.4, Redis and Valkey 5.1) tell
-- integers from floats, and a server replies a float as a double where
-- Redis replies every number as an integer: the reply's numbers are all
-- integers (below 2^53), so they are sent as such.
if math.type then
  for i = 1, n_out do out[i] = math.tointeger(out[i]) or out[i] end
end
return out
