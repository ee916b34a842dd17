-- claim: hand up to ARGV[3] queued jobs of a model to a worker, moving them to the in-flight set.
-- One queue shard per call: KEYS[1] the model's queue in the shard, KEYS[2] the shard's in-flight set, KEYS[3] the
-- model's tenants, KEYS[4] the model's virtual times, KEYS[5] the model's deadlines (all in the shard);
-- ARGV[1] the shard's ctx JSON, ARGV[2] worker id, ARGV[3] max jobs,
-- ARGV[4] '1' when the worker holds no job at all (idle), else '0',
-- ARGV[5] (optional, '' for none) the lowest priority to hand out: the claim stops at a job of lower priority
-- (the worker saw a job of that priority at the head of another shard, and takes it from there first).
-- First, queued jobs whose start-by time passed are expired (lib.lua `expire_overdue`), never handed out.
-- Order: the best priority first; within it, fair share between tenants (start-time fair queuing by tokens):
-- the tenant with the least virtual time (its tokens charged / its weight, never behind the queue's virtual
-- time) gives its best-scored job, and is charged that job's estimated tokens / weight (corrected at its end,
-- lib.lua `settle`). A tenant's sub-queue is ts:queue:{<model>}:tenant:<tenant> (derived from ctx).
-- Each claim bumps the job's fence (so earlier holders' writes are rejected) and its attempt count.
-- An isolated job (one that was running when a worker crashed, see lib.lua `crashed`) is only handed to an idle
-- worker, alone (`alone` = 1: the worker takes nothing beside it until it ends). Until then it stays next in
-- line, and workers that are not idle claim nothing behind it, so they drain and one of them takes it.
-- Returns {number expired, {id, submission JSON, fence, attempt, alone, s left before its deadline or ''}, ...}.
local ctx = cjson.decode(ARGV[1])
local t = now()
local claimed = {}
local model = string.sub(KEYS[1], #ctx.queue_prefix + 1, #KEYS[1] - #ctx.queue_suffix)
local expired = expire_overdue(ctx, KEYS[2], model, 64)

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
  local deadline = tonumber(redis.call('HGET', jk, 'deadline') or '')
  claimed[#claimed + 1] = {id, redis.call('HGET', jk, 'submission') or '', fence, attempt, alone,
    deadline and string.format('%.3f', deadline - t) or ''}
end

local STRIDE = 4294967296  -- scores are -priority * 2^32 + seq: floor(score / 2^32) is -priority
local function band(score) return math.floor(tonumber(score) / STRIDE) end

-- The next job in line: {id, score, tenant, weight, start tag} of the fairest tenant among those whose best
-- job has the best priority in the queue, or nil when the queue is empty. A job submitted without the
-- fair-share keys joins its tenant's sub-queue when it reaches the head of the queue.
local function next_in_line()
  local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if #head == 0 then return nil end
  if redis.pcall('HGET', job_key(ctx, head[1]), 'status') ~= 'queued' then
    return {head[1], head[2], nil}
  end
  local head_tenant = tenant_of(job_key(ctx, head[1]))
  local head_tq = tenant_queue_key(ctx, model, head_tenant)
  if not redis.call('ZSCORE', head_tq, head[1]) then
    redis.call('ZADD', head_tq, head[2], head[1])
    redis.call('ZADD', KEYS[3], 'NX', tonumber(redis.call('HGET', job_key(ctx, head[1]), 'weight') or '1') or 1,
      head_tenant)
  end
  local best_band = band(head[2])
  local vnow = tonumber(redis.call('HGET', KEYS[4], '*') or '0') or 0
  local tenants = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
  local pick = nil
  for i = 1, #tenants, 2 do
    local tenant, weight = tenants[i], tonumber(tenants[i + 1])
    local top = redis.call('ZRANGE', tenant_queue_key(ctx, model, tenant), 0, 0, 'WITHSCORES')
    if #top == 0 then
      redis.call('ZREM', KEYS[3], tenant)
    elseif band(top[2]) == best_band then
      local start = math.max(tonumber(redis.call('HGET', KEYS[4], tenant) or '0') or 0, vnow)
      if not pick or start < pick[5] or (start == pick[5] and tonumber(top[2]) < tonumber(pick[2])) then
        pick = {top[1], top[2], tenant, weight > 0 and weight or 1, start}
      end
    end
  end
  return pick
end

-- Out of the queue, the tenant's sub-queue and the deadlines, the tenant inactive once its sub-queue is empty.
local function dequeue(id, tenant)
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZREM', KEYS[5], id)
  if tenant then
    local tq = tenant_queue_key(ctx, model, tenant)
    redis.call('ZREM', tq, id)
    if redis.call('ZCARD', tq) == 0 then redis.call('ZREM', KEYS[3], tenant) end
  end
end

-- Charge the tenant the job's estimated tokens / weight; the queue's virtual time moves to its start tag.
local function charge(jk, tenant, weight, start)
  local cost = tonumber(redis.call('HGET', jk, 'cost') or '1') or 1
  redis.call('HSET', KEYS[4], tenant, start + cost / weight, '*', start)
  redis.call('HSET', jk, 'tenant', tenant, 'weight', weight, 'cost', cost, 'charged', 1)
end

local idle = ARGV[4] == '1'
local lowest = tonumber(ARGV[5] or '')
for _ = 1, tonumber(ARGV[3]) do
  local pick = next_in_line()
  if not pick or (lowest and -band(pick[2]) < lowest) then break end
  local id, score, tenant = pick[1], pick[2], pick[3]
  local jk = job_key(ctx, id)
  -- pcall: a key of another type where the record belongs is an error reply, not a queued job.
  local status = redis.pcall('HGET', jk, 'status')
  if status == 'queued' and redis.call('HGET', jk, 'isolate') == '1' then
    if idle and #claimed == 0 then
      dequeue(id, tenant)
      charge(jk, tenant, pick[4], pick[5])
      take(id, jk, score, 1)
    end
    break
  end
  dequeue(id, tenant)
  -- A queue entry without a queued record (deleted or pushed by hand) is dropped, not run.
  if status == 'queued' then
    charge(jk, tenant, pick[4], pick[5])
    take(id, jk, score, 0)
  else
    redis.log(redis.LOG_WARNING, 'tokenspool claim: dropped queue entry without a queued job: ' .. id)
  end
end
local reply = {expired}
for _, job in ipairs(claimed) do reply[#reply + 1] = job end
return reply
