-- reap: recover jobs whose lease expired (their worker died or lost Redis for longer than the lease):
-- requeue (the attempt charged if the job ran alone, else isolated: lib.lua `crashed`), or fail + dead-letter
-- after max_attempts, or finalise a cancelled one.
-- Also prunes old dead-letter entries. One queue shard per call.
-- KEYS[1] the shard's in-flight set, KEYS[2] its dead-letter set; ARGV[1] the shard's ctx JSON, ARGV[2] limit.
-- Returns {recovered, {id, model, worker id, new status}, ...}: `recovered` counts the expired entries looked
-- at (stale ones included), so the caller knows whether to call again; then one entry per job recovered,
-- its new status `queued`, `failed` (dead-lettered) or `cancelled`.
local ctx = cjson.decode(ARGV[1])
local t = now()
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', fmt(t), 'LIMIT', 0, tonumber(ARGV[2]))
local reply = {#expired}
for _, id in ipairs(expired) do
  local status, model, wid = unpack(redis.call('HMGET', job_key(ctx, id), 'status', 'model', 'worker_id'))
  if status == 'running' then
    local outcome = crashed(ctx, KEYS[1], KEYS[2], id, 'lease expired')
    reply[#reply + 1] = {id, model or '', wid or '', outcome}
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', fmt(t - ctx.dead_keep_s))
return reply
