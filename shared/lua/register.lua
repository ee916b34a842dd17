-- register: a worker's heartbeat: its WorkerInfo (expiring), its place in the workers set scored by Redis
-- time, and its model's card.
-- KEYS[1] workers set, KEYS[2] worker info key, KEYS[3] model cards hash;
-- ARGV[1] worker id, ARGV[2] WorkerInfo JSON, ARGV[3] info TTL seconds, ARGV[4] model name, ARGV[5] ModelCard JSON, or '' to keep the stored card (it is megabytes),
-- ARGV[6] (optional) seconds after which a worker whose heartbeats stopped leaves the workers set.
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], t[1] .. '.' .. string.format('%06d', tonumber(t[2])), ARGV[1])
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[3], ARGV[4], ARGV[5]) end
if ARGV[6] then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(t[1]) - tonumber(ARGV[6])) end
return 1
