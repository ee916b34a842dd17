-- renew: extend the leases of a worker's running jobs.
-- KEYS[1] in-flight set; ARGV[1] ctx JSON, ARGV[2] worker id, then pairs job id, fence.
-- Returns the ids whose lease is lost (fence moved on, job finished or reassigned): abort those.
local ctx = cjson.decode(ARGV[1])
local deadline = fmt(now() + ctx.lease_ttl_s)
local lost = {}
for i = 3, #ARGV, 2 do
  local id, fence = ARGV[i], ARGV[i + 1]
  local status, held, wid = unpack(redis.call('HMGET', job_key(ctx, id), 'status', 'fence', 'worker_id'))
  if status == 'running' and held == fence and wid == ARGV[2] then
    redis.call('ZADD', KEYS[1], 'XX', deadline, id)
  else
    lost[#lost + 1] = id
  end
end
return lost
