-- Levee fleet rate limit: GCRA on the store's clock (Redis TIME), with the policy core's
-- semantics (policy-core/src/fleet/gcra.rs is the reference; fleet/tests/gcra-cases.json the
-- cases this script must reproduce). One script call is one decision; no lock, no round trip
-- between reading and writing the TAT.
--
-- KEYS[1]  the key's rate entry, a hash: b = base (store seconds), t = TAT (ns since b)
-- ARGV[1]  emission interval T, ns (per / rate, from the core's fleet plan)
-- ARGV[2]  burst b
-- ARGV[3]  cost c (tokens wanted)
-- ARGV[4]  max-wait, ns
-- ARGV[5]  "1": take up to c tokens (a lease), "0": exactly c
-- ARGV[6]  (tests only) `now` in ns, instead of TIME; hosts never pass it
-- Returns {kind, granted, ns}: kind 0 admitted, 1 wait ns (tokens reserved), 2 rejected with
-- a retry-after hint of ns.
--
-- Times are exact integers in doubles: ns counted from a base second kept with the TAT and
-- moved forward once a day, so every value stays far below 2^53.
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local max_wait = tonumber(ARGV[4])
local upto = ARGV[5] == '1'
local stored = redis.call('HMGET', KEYS[1], 'b', 't')
local tat = tonumber(stored[2]) or 0
local base, now
if ARGV[6] then
  base = 0
  now = tonumber(ARGV[6])
else
  local time = redis.call('TIME')
  local secs = tonumber(time[1])
  base = tonumber(stored[1]) or secs
  if secs < base then
    -- The store's clock went back past the base: keep the base, count no time as passed.
    secs = base
    time[2] = 0
  end
  if secs - base > 86400 then
    local shift = secs - base
    base = secs
    tat = math.max(tat - shift * 1000000000, 0)
  end
  now = (secs - base) * 1000000000 + tonumber(time[2]) * 1000
end

local function floor_div(a, b)
  local q = math.floor(a / b)
  if q * b > a then
    q = q - 1
  elseif (q + 1) * b <= a then
    q = q + 1
  end
  return q
end

local t = math.max(tat, now)
local full = interval * burst
local kind, granted, ns, new
if upto and cost > 1 then
  local free = 0
  if now + full > t then
    free = floor_div(now + full - t, interval)
  end
  granted = math.min(free, cost)
  if granted >= 1 then
    kind, ns, new = 0, 0, t + interval * granted
  else
    cost = 1
  end
end
if kind == nil then
  new = t + interval * cost
  local allow_at = new - full
  if allow_at <= now then
    kind, granted, ns = 0, cost, 0
  elseif allow_at - now <= max_wait then
    kind, granted, ns = 1, cost, allow_at - now
  else
    kind, granted, ns, new = 2, 0, allow_at - now, nil
  end
end
if new then
  redis.call('HSET', KEYS[1], 'b', string.format('%.0f', base), 't', string.format('%.0f', new))
  if ARGV[6] then
    redis.call('PEXPIRE', KEYS[1], 60000)
  else
    redis.call('PEXPIRE', KEYS[1], math.floor((new - now) / 1000000) + 1)
  end
end
return {kind, granted, ns}
