-- reap: recover jobs whose lease expired (their worker died or lost Redis for longer than the lease):
-- requeue with the attempt charged, or fail + dead-letter after max_attempts, or finalise a cancelled one.
-- Also prunes old dead-letter entries and workers whose heartbeats stopped long ago.
-- KEYS[1] in-flight set, KEYS[2] dead-letter set, KEYS[3] workers set; ARGV[1] ctx JSON, ARGV[2] limit.
-- Returns the number of jobs recovered.
local ctx = cjson.decode(ARGV[1])
local t = now()
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', fmt(t), 'LIMIT', 0, tonumber(ARGV[2]))
local n = 0
for _, id in ipairs(expired) do
  local status, attempts = unpack(redis.call('HMGET', job_key(ctx, id), 'status', 'attempts'))
  if status == 'running' then
    retry_or_give_up(ctx, KEYS[1], KEYS[2], id, tonumber(attempts), 'lease expired')
    n = n + 1
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', fmt(t - ctx.dead_keep_s))
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', fmt(t - ctx.dead_keep_s))
return n
