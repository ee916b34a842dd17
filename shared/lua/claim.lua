-- claim: move up to ARGV[3] jobs from the model's queue (best score first) to the in-flight set.
-- KEYS[1] model queue, KEYS[2] in-flight set; ARGV[1] ctx JSON, ARGV[2] worker id, ARGV[3] max jobs,
-- ARGV[4] '1' when the worker holds no job at all (idle), else '0'.
-- Each claim bumps the job's fence (so earlier holders' writes are rejected) and its attempt count.
-- An isolated job (one that was running when a worker crashed, see lib.lua `crashed`) is only handed to an idle
-- worker, alone (`alone` = 1: the worker takes nothing beside it until it ends). Until then it keeps its place
-- at the head of the queue, and workers that are not idle claim nothing behind it, so they drain and one of
-- them takes it: priority order holds.
-- Returns {{id, submission JSON, fence, attempt, alone}, ...}.
local ctx = cjson.decode(ARGV[1])
local t = now()
local claimed = {}
local model = string.sub(KEYS[1], #ctx.queue_prefix + 1, #KEYS[1] - #ctx.queue_suffix)

local function is_int(v) return v == false or string.match(v, '^%-?%d+$') ~= nil end

-- A record written by hand rather than by submit.lua may hold anything. The fields later scripts compute
-- with (counters, score, model) are made sane here, so a garbage record fails cleanly instead of making every
-- later script on it (publish, fail, reap) raise an error.
local function repair(jk, score)
  for _, field in ipairs({'fence', 'attempts', 'seq', 'crashes'}) do
    if not is_int(redis.call('HGET', jk, field)) then redis.call('HSET', jk, field, 0) end
  end
  if not is_int(redis.call('HGET', jk, 'score')) then redis.call('HSET', jk, 'score', score) end
  redis.call('HSET', jk, 'model', model)
end

local function take(id, jk, score, alone)
  repair(jk, string.format('%.0f', tonumber(score)))
  if #id < 8 or #id > 64 or not string.match(id, '^[%w_%-]+$') then
    finish(ctx, KEYS[2], id, 'failed', {'error', 'invalid job: id must be 8-64 characters of [A-Za-z0-9_-]'})
    return
  end
  local fence = redis.call('HINCRBY', jk, 'fence', 1)
  local attempt = redis.call('HINCRBY', jk, 'attempts', 1)
  redis.call('HSET', jk, 'status', 'running', 'worker_id', ARGV[2], 'started_at', fmt(t), 'pub', 0,
    'alone', alone)
  redis.call('HDEL', jk, 'first_token_at')
  redis.call('ZADD', KEYS[2], fmt(t + ctx.lease_ttl_s), id)
  claimed[#claimed + 1] = {id, redis.call('HGET', jk, 'submission') or '', fence, attempt, alone}
end

local idle = ARGV[4] == '1'
local head = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1, 'WITHSCORES')
for i = 1, #head, 2 do
  local id = head[i]
  local jk = job_key(ctx, id)
  -- pcall: a key of another type where the record belongs is an error reply, not a queued job.
  local status = redis.pcall('HGET', jk, 'status')
  if status == 'queued' and redis.call('HGET', jk, 'isolate') == '1' then
    if idle and #claimed == 0 then
      redis.call('ZREM', KEYS[1], id)
      take(id, jk, head[i + 1], 1)
    end
    break
  end
  redis.call('ZREM', KEYS[1], id)
  -- A queue entry without a queued record (deleted or pushed by hand) is dropped, not run.
  if status == 'queued' then
    take(id, jk, head[i + 1], 0)
  else
    redis.log(redis.LOG_WARNING, 'tokenspool claim: dropped queue entry without a queued job: ' .. id)
  end
end
return claimed
