-- Helpers shared by the transition scripts. shared/scripts.py prepends this file to every script except
-- submit.lua (which stays self-contained so other backends can EVAL it as shipped).
-- `ctx` is one queue shard's key layout from shared/keys.py (`Keyspace.layout`) plus settings (shared/queue/base.py
-- script_config): the JSON object our workers pass as ARGV[1], or, for the scripts other backends call (cancel),
-- the shard's config hash ts:config:{<tag>}. Every key a script touches is in that shard's hash slot.

-- Redis server time in seconds: one clock for every lease and timestamp, whatever the clients' clocks say.
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Timestamps are stored as text with microseconds (Lua numbers returned to clients would be truncated).
local function fmt(x)
  return string.format('%.6f', x)
end

-- The ctx stored in the config hash (numbers as numbers), or nil when no API or worker has stored it yet.
local function load_config(key)
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return nil end
  local ctx = {}
  for i = 1, #flat, 2 do ctx[flat[i]] = tonumber(flat[i + 1]) or flat[i + 1] end
  return ctx
end

local function config_missing(key)
  return 'ERR ' .. key .. ' is missing: start the tokenspool API or a worker once on this Redis'
end

local function job_key(ctx, id) return ctx.job_prefix .. id .. ctx.job_suffix end
local function log_key(ctx, id) return ctx.job_prefix .. id .. ctx.log_suffix end
local function live_channel(ctx, id) return ctx.job_prefix .. id .. ctx.live_suffix end
local function queue_key(ctx, model) return ctx.queue_prefix .. model .. ctx.queue_suffix end
local function wake_channel(ctx, model) return ctx.queue_prefix .. model .. ctx.wake_suffix end
local function cancels_key(ctx, wid) return ctx.cancels_prefix .. wid end
local function tenants_key(ctx, model) return ctx.queue_prefix .. model .. ctx.tenants_suffix end
local function vtime_key(ctx, model) return ctx.queue_prefix .. model .. ctx.vtime_suffix end
local function tenant_queue_key(ctx, model, tenant) return ctx.queue_prefix .. model .. ctx.tenant_suffix .. tenant end
local function deadlines_key(ctx, model) return ctx.queue_prefix .. model .. ctx.deadlines_suffix end

-- The fair-share tenant of a job record: its `tenant` field (submit.lua), else its owner, else '-'.
local function tenant_of(jk)
  local tenant, owner = unpack(redis.call('HMGET', jk, 'tenant', 'owner'))
  if tenant and tenant ~= '' then return tenant end
  if owner and owner ~= '' then return owner end
  return '-'
end

-- Put a queued job (back) into its tenant's sub-queue, the tenant among the model's active ones, and its
-- start-by time (if any) into the model's deadlines.
local function enqueue_tenant(ctx, model, id, score)
  local jk = job_key(ctx, id)
  local tenant = tenant_of(jk)
  redis.call('ZADD', tenant_queue_key(ctx, model, tenant), score, id)
  redis.call('ZADD', tenants_key(ctx, model), 'NX', tonumber(redis.call('HGET', jk, 'weight') or '1') or 1, tenant)
  local start_by = redis.call('HGET', jk, 'start_by')
  if start_by then redis.call('ZADD', deadlines_key(ctx, model), start_by, id) end
  return tenant
end

-- Take a job out of the model's queue, its tenant's sub-queue (dropping the tenant from the active ones when
-- that empties) and the deadlines.
local function unqueue(ctx, model, id)
  local tenant = tenant_of(job_key(ctx, id))
  local tq = tenant_queue_key(ctx, model, tenant)
  redis.call('ZREM', queue_key(ctx, model), id)
  redis.call('ZREM', tq, id)
  redis.call('ZREM', deadlines_key(ctx, model), id)
  if redis.call('ZCARD', tq) == 0 then redis.call('ZREM', tenants_key(ctx, model), tenant) end
end

-- HINCRBYFLOAT by `delta`, skipped when it is not finite (Redis refuses inf and NaN, which would fail the script).
local function add_float(key, field, delta)
  if delta == delta and delta > -math.huge and delta < math.huge then redis.call('HINCRBYFLOAT', key, field, delta) end
end

-- A job's end settles what it was charged: its slot among the key's unfinished jobs, the tokens reserved
-- against tokens-per-minute beyond the `used` ones, and its tenant's virtual time beyond the tokens used.
-- `used` nil (a failed job) keeps the charges. Runs once: the fields that record the charges are removed.
local function settle(ctx, jk, used)
  local rkey, reserved, tok_s, model, tenant, cost, weight, charged = unpack(redis.call('HMGET', jk,
    'rkey', 'reserved', 'tok_s', 'model', 'tenant', 'cost', 'weight', 'charged'))
  if rkey then
    redis.call('HINCRBY', rkey, 'jobs', -1)
    if used and tonumber(tok_s or '0') > 0 then
      add_float(rkey, 'tat_t', -((tonumber(reserved) or 0) - used) * tonumber(tok_s))
    end
  end
  if used and charged == '1' and tenant and model then
    add_float(vtime_key(ctx, model), tenant, (used - (tonumber(cost) or 0)) / (tonumber(weight) or 1))
  end
  redis.call('HDEL', jk, 'rkey', 'charged')
end

-- Append event number `seq` of a job to its replay log and channel. `body` is a JSON object without "seq".
-- The stream entry id is "<seq>-0", so XREAD/XRANGE from "<last seen seq>-0" resumes a client exactly.
local function append_event(ctx, id, seq, body)
  local data = '{"seq":' .. seq .. ',' .. string.sub(body, 2)
  redis.call('XADD', log_key(ctx, id), 'MAXLEN', '~', ctx.stream_maxlen, seq .. '-0', 'seq', seq, 'data', data)
  -- A shard channel: on a cluster it stays on the node of the job's slot (SSUBSCRIBE), on one node it is plain.
  redis.call('SPUBLISH', live_channel(ctx, id), data)
end

-- Append one event to the job's replay log and channel, numbered by the job's seq counter, so seq grows
-- across attempts and no worker needs to know earlier attempts.
local function emit(ctx, id, body)
  local seq = redis.call('HINCRBY', job_key(ctx, id), 'seq', 1)
  append_event(ctx, id, seq, body)
  return seq
end

-- A running job's new events (publish.lua, and each job of publish_step.lua): `args[first..last]` are pairs of
-- attempt-local event number (1, 2, ... within this claim) and event JSON without "seq". Numbers this claim
-- already published (the record's `pub`) are skipped, so a retried call never duplicates an event; the job's seq
-- counter numbers the others. `tokens`: some are token events (the first sets `first_token_at`). One HMGET and
-- one HSET per job, whatever the number of events. Returns 1, or 0 when the fence is stale (the caller lost it).
local function publish_job(ctx, jk, id, fence, tokens, args, first, last)
  local status, held, pub, seq, first_token = unpack(redis.call('HMGET', jk, 'status', 'fence', 'pub', 'seq',
    'first_token_at'))
  if status ~= 'running' or held ~= fence then
    return 0
  end
  pub = tonumber(pub or '0')
  seq = tonumber(seq or '0')
  local newest = pub
  for i = first, last, 2 do
    local n = tonumber(args[i])
    if n > newest then
      seq = seq + 1
      append_event(ctx, id, seq, args[i + 1])
      newest = n
    end
  end
  if newest > pub then
    if tokens and not first_token then
      redis.call('HSET', jk, 'pub', newest, 'seq', seq, 'first_token_at', fmt(now()))
    else
      redis.call('HSET', jk, 'pub', newest, 'seq', seq)
    end
  end
  return 1
end

-- Terminal transition: status + fields, out of the in-flight set, a done marker in the log, and the result
-- TTL on every key of the job (record, log, idempotency key).
-- `used`: the tokens the job used (prompt + generated), or nil when unknown (see `settle`).
local function finish(ctx, inflight, id, status, fields, used)
  local jk = job_key(ctx, id)
  settle(ctx, jk, used)
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
  -- The queue timeout bounds the first start only; a restarted job must start before its total deadline.
  local deadline = redis.call('HGET', jk, 'deadline')
  if deadline then redis.call('HSET', jk, 'start_by', deadline) else redis.call('HDEL', jk, 'start_by') end
  redis.call('ZADD', queue_key(ctx, model), score, id)
  enqueue_tenant(ctx, model, id, score)
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
    unqueue(ctx, model, id)
    finish(ctx, inflight, id, 'cancelled', error and {'error', error} or {}, 0)
  elseif status == 'running' then
    redis.call('HSET', jk, 'cancel', 1)
    redis.call('SADD', cancels_key(ctx, wid), id)
    redis.call('PUBLISH', ctx.control_prefix .. wid, id)
  end
  return status
end

-- Expire up to `limit` queued jobs of `model` whose start-by time passed: out of the queues, finalised
-- `expired` with the reason in `error`, never given to a worker. Returns how many.
local function expire_overdue(ctx, inflight, model, limit)
  local dk = deadlines_key(ctx, model)
  local overdue = redis.call('ZRANGEBYSCORE', dk, '-inf', fmt(now()), 'LIMIT', 0, limit)
  local n = 0
  for _, id in ipairs(overdue) do
    local jk = job_key(ctx, id)
    if redis.pcall('HGET', jk, 'status') == 'queued' then
      local attempts = tonumber(redis.call('HGET', jk, 'attempts') or '0') or 0
      local why = attempts > 0 and 'not restarted before its total timeout' or 'not started within its deadline'
      unqueue(ctx, model, id)
      finish(ctx, inflight, id, 'expired', {'error', 'expired: ' .. why}, 0)
      n = n + 1
    else
      redis.call('ZREM', dk, id)
    end
  end
  return n
end
