-- The comparison script for docs/performance.md: redis_rate's GCRA (go-redis/redis_rate),
-- written here from its published formula (shared/ANCHORS.md "Fleet-wide state"), not copied:
--   e = period / rate; tat = max(stored or now, now); new = tat + e * cost;
--   diff = now - (new - e * burst); remaining = floor(diff / e + 0.5);
--   admitted if remaining >= 0 (SET new EX ceil(new - now)), else retry after -diff.
-- Seconds as floating point, on Redis TIME. KEYS[1]; ARGV: burst, rate, period (s), cost.
local burst = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local period = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local e = period / rate
local t = redis.call('TIME')
local now = (tonumber(t[1]) - 1483228800) + tonumber(t[2]) / 1000000
local tat = tonumber(redis.call('GET', KEYS[1])) or now
tat = math.max(tat, now)
local new = tat + e * cost
local diff = now - (new - e * burst)
local remaining = math.floor(diff / e + 0.5)
if remaining < 0 then
  return {0, tostring(-diff)}
end
redis.call('SET', KEYS[1], tostring(new), 'EX', math.ceil(new - now))
return {1, remaining}
