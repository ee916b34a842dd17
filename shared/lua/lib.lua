-- Helpers shared by the transition scripts. shared/scripts.py prepends this file to every script except
-- submit.lua (which stays self-contained so other backends can EVAL it as shipped).
-- `ctx` is the JSON object JobQueue passes as ARGV[1]: key layout from shared/keys.py plus settings.

-- Redis server time in seconds: one clock for every lease and timestamp, whatever the clients' clocks say.
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Timestamps are stored as text with microseconds (Lua numbers returned to clients would be truncated).
local function fmt(x)
  return string.format('%.6f', x)
end

local function job_key(ctx, id) return ctx.job_prefix .. id .. ctx.job_suffix end
local function log_key(ctx, id) return ctx.job_prefix .. id .. ctx.log_suffix end
local function live_channel(ctx, id) return ctx.job_prefix .. id .. ctx.live_suffix end
local function queue_key(ctx, model) return ctx.queue_prefix .. model .. ctx.queue_suffix end
local function wake_channel(ctx, model) return ctx.queue_prefix .. model .. ctx.wake_suffix end
local function cancels_key(ctx, wid) return ctx.worker_prefix .. wid .. ctx.cancels_suffix end

-- Append one event to the job's replay log and channel. `body` is a JSON object without "seq"; the job's
-- seq counter numbers it, so seq grows across attempts and no worker needs to know earlier attempts.
-- The stream entry id is "<seq>-0", so XREAD/XRANGE from "<last seen seq>-0" resumes a client exactly.
local function emit(ctx, id, body)
  local jk = job_key(ctx, id)
  local seq = redis.call('HINCRBY', jk, 'seq', 1)
  local data = '{"seq":' .. seq .. ',' .. string.sub(body, 2)
  redis.call('XADD', log_key(ctx, id), 'MAXLEN', '~', ctx.stream_maxlen, seq .. '-0', 'seq', seq, 'data', data)
  redis.call('PUBLISH', live_channel(ctx, id), data)
  return seq
end

-- Terminal transition: status + fields, out of the in-flight set, a done marker in the log, and the result
-- TTL on every key of the job (record, log, idempotency key).
local function finish(ctx, inflight, id, status, fields)
  local jk = job_key(ctx, id)
  redis.call('HSET', jk, 'status', status, 'finished_at', fmt(now()), unpack(fields))
  redis.call('ZREM', inflight, id)
  local wid = redis.call('HGET', jk, 'worker_id')
  if wid then redis.call('SREM', cancels_key(ctx, wid), id) end
  emit(ctx, id, '{"type":"done","status":"' .. status .. '"}')
  redis.call('EXPIRE', jk, ctx.result_ttl_s)
  redis.call('EXPIRE', log_key(ctx, id), ctx.result_ttl_s)
  local idem = redis.call('HGET', jk, 'idem')
  if idem then redis.call('EXPIRE', idem, ctx.result_ttl_s) end
  -- The job-event stream webhooks read (api/webhooks/job_events.py): one entry per terminal transition.
  if ctx.events_key then
    redis.call('XADD', ctx.events_key, 'MAXLEN', '~', ctx.events_maxlen, '*', 'job_id', id, 'status', status)
  end
end

-- Back to the queue at the job's original score (its priority and FIFO place), under a new fence so the
-- previous holder's late writes are rejected. A restart event tells clients to drop the partial text (it names
-- the attempt that comes next: `attempts` counts claims), and the log is trimmed to start at it: the failed
-- attempt's tokens are never replayed again.
local function requeue(ctx, inflight, id)
  local jk = job_key(ctx, id)
  local model, score, attempts = unpack(redis.call('HMGET', jk, 'model', 'score', 'attempts'))
  redis.call('HSET', jk, 'status', 'queued')
  redis.call('HDEL', jk, 'worker_id', 'started_at', 'first_token_at')
  redis.call('HINCRBY', jk, 'fence', 1)
  redis.call('ZREM', inflight, id)
  redis.call('ZADD', queue_key(ctx, model), score, id)
  redis.call('PUBLISH', wake_channel(ctx, model), id)
  local seq = emit(ctx, id, '{"type":"restart","attempt":' .. (tonumber(attempts) + 1) .. '}')
  redis.call('XTRIM', log_key(ctx, id), 'MINID', seq .. '-0')
end

-- Lease lost or released: cancel if asked, dead-letter once `crashes` (the crashes charged to the job) reach
-- max_attempts, otherwise requeue. Returns the new status.
local function retry_or_give_up(ctx, inflight, dead, id, crashes, why)
  local jk = job_key(ctx, id)
  if redis.call('HGET', jk, 'cancel') == '1' then
    finish(ctx, inflight, id, 'cancelled', {})
    return 'cancelled'
  end
  if crashes >= ctx.max_attempts then
    local err = 'job failed ' .. crashes .. ' times running alone (' .. why .. '); gave up after max_attempts='
      .. ctx.max_attempts
    finish(ctx, inflight, id, 'failed', {'error', err})
    redis.call('ZADD', dead, fmt(now()), id)
    return 'failed'
  end
  requeue(ctx, inflight, id)
  return 'queued'
end

-- A crash took the job down: its lease expired (the worker died or froze) or its worker's engine failed. Only a
-- job that ran alone can be blamed, so only then is the crash charged (`crashes`, against max_attempts). A job
-- that ran beside others is not charged but isolated: from now on it runs alone (claim.lua). A poison job thus
-- exhausts its attempts alone, while the innocent jobs of a batch it crashed lose nothing but a restart.
local function crashed(ctx, inflight, dead, id, why)
  local jk = job_key(ctx, id)
  local crashes = 0
  if redis.call('HGET', jk, 'alone') == '1' then
    crashes = redis.call('HINCRBY', jk, 'crashes', 1)
  else
    redis.call('HSET', jk, 'isolate', 1)
    crashes = tonumber(redis.call('HGET', jk, 'crashes') or '0') or 0
  end
  return retry_or_give_up(ctx, inflight, dead, id, crashes, why)
end

-- Cancel one job: a queued job is removed and finalised now (with `error` when given); a running job gets the
-- durable cancel flag, joins its worker's cancel set and is announced on the worker's control channel (the
-- worker aborts and completes it). Anything else is left as it is. Returns the job's status before, or nil.
local function cancel_job(ctx, inflight, id, error)
  local jk = job_key(ctx, id)
  local status, model, wid = unpack(redis.call('HMGET', jk, 'status', 'model', 'worker_id'))
  if not status then return nil end
  if status == 'queued' then
    redis.call('ZREM', queue_key(ctx, model), id)
    finish(ctx, inflight, id, 'cancelled', error and {'error', error} or {})
  elseif status == 'running' then
    redis.call('HSET', jk, 'cancel', 1)
    redis.call('SADD', cancels_key(ctx, wid), id)
    redis.call('PUBLISH', ctx.control_prefix .. wid, id)
  end
  return status
end
