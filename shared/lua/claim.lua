-- claim: move up to ARGV[3] jobs from the model's queue (best score first) to the in-flight set.
-- KEYS[1] model queue, KEYS[2] in-flight set; ARGV[1] ctx JSON, ARGV[2] worker id, ARGV[3] max jobs.
-- Each claim bumps the job's fence (so earlier holders' writes are rejected) and its attempt count.
-- Returns {{id, submission JSON, fence, attempt}, ...}.
local ctx = cjson.decode(ARGV[1])
local t = now()
local claimed = {}
local popped = redis.call('ZPOPMIN', KEYS[1], tonumber(ARGV[3]))
for i = 1, #popped, 2 do
  local id = popped[i]
  local jk = job_key(ctx, id)
  -- A queue entry without a queued record (deleted or pushed by hand) is dropped, not run.
  if redis.call('HGET', jk, 'status') == 'queued' then
    local fence = redis.call('HINCRBY', jk, 'fence', 1)
    local attempt = redis.call('HINCRBY', jk, 'attempts', 1)
    redis.call('HSET', jk, 'status', 'running', 'worker_id', ARGV[2], 'started_at', fmt(t), 'pub', 0)
    redis.call('HDEL', jk, 'first_token_at')
    redis.call('ZADD', KEYS[2], fmt(t + ctx.lease_ttl_s), id)
    claimed[#claimed + 1] = {id, redis.call('HGET', jk, 'submission') or '', fence, attempt}
  else
    redis.log(redis.LOG_WARNING, 'tokenspool claim: dropped queue entry without a queued job: ' .. id)
  end
end
return claimed
