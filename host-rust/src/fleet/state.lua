-- Levee fleet shared state: read, or compare-and-set on a version, in one step; no lock.
-- The bytes are the policy core's (docs/fleet.md, policy-core/src/fleet/wire.rs): this script
-- never looks inside them.
--
-- KEYS[1]  the key's state entry, a hash: v = version, d = the core's bytes
-- ARGV[1]  the version the caller read ("" to only read)
-- ARGV[2]  the bytes to write
-- ARGV[3]  time to live, ms (the policy's fleet ttl: a key no process publishes expires)
-- Returns {1, new version, store ms} when written, else {0, version, store ms, bytes}
-- (what the store holds, so that the caller merges again without another read).
local time = redis.call('TIME')
local wall = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local cur = redis.call('HMGET', KEYS[1], 'v', 'd')
local version = tonumber(cur[1]) or 0
if ARGV[1] ~= '' and tonumber(ARGV[1]) == version then
  redis.call('HSET', KEYS[1], 'v', version + 1, 'd', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
  return {1, version + 1, wall}
end
return {0, version, wall, cur[2] or ''}
