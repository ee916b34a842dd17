-- submit: enqueue one job (self-contained: any backend may EVAL this file as shipped; see docs/protocol.md).
-- KEYS[1] job record    ts:job:{<id>}
-- KEYS[2] model queue   ts:queue:{<model>}
-- KEYS[3] queue counter ts:queue:{<model>}:seq
-- KEYS[4] config        ts:config (the key layout and the queue cap, stored by the service's processes)
-- KEYS[5] idempotency key ts:idem:<owner or ->:<idempotency_key> exactly when the submission has an
--         idempotency_key; absent or '' otherwise
-- ARGV[1] JobSubmission JSON (shared/schemas.py). Nothing else: the queue cap and the wake channel come from the
-- config, so a caller cannot pass a wrong copy of the service's settings.
-- KEYS[6] (optional) the owner's recent-jobs index ts:owner:<owner or ->:jobs: the job joins it (scored by
--         created_at); it keeps the config's owner_jobs_keep newest and expires result_ttl_s after the last one
-- Returns {'created'|'existing', <record as HGETALL list>} or {'full', <queue length>}.
local cfg = redis.call('HGETALL', KEYS[4])
if #cfg == 0 then
  return redis.error_reply('ERR ' .. KEYS[4] .. ' is missing: start the tokenspool API or a worker once on this Redis')
end
local c = {}
for i = 1, #cfg, 2 do c[cfg[i]] = cfg[i + 1] end

local ok, sub = pcall(cjson.decode, ARGV[1])
if not ok or type(sub) ~= 'table' then
  return redis.error_reply('ERR submission is not a JSON object')
end
if type(sub.id) ~= 'string' or type(sub.model) ~= 'string' then
  return redis.error_reply('ERR submission needs string fields id and model')
end
if #sub.id < 8 or #sub.id > 64 or not string.match(sub.id, '^[%w_%-]+$') then
  return redis.error_reply('ERR id must be 8-64 characters of [A-Za-z0-9_-]')
end
local priority = sub.priority
if priority == nil or priority == cjson.null then priority = 0 end
if type(priority) ~= 'number' or priority ~= math.floor(priority) or priority < -1000 or priority > 1000 then
  return redis.error_reply('ERR priority must be an integer in [-1000, 1000]')
end
-- The owner is copied out of the submission so a read can check access without loading the submission
-- (megabytes of prompt): '' when the job has no owner.
local owner = sub.owner
if type(owner) ~= 'string' then owner = '' end

local function job_key(id) return c.job_prefix .. id .. c.job_suffix end
local expected = {job_key(sub.id), c.queue_prefix .. sub.model .. c.queue_suffix,
                  c.queue_prefix .. sub.model .. c.seq_suffix}
for i = 1, 3 do
  if KEYS[i] ~= expected[i] then
    return redis.error_reply('ERR KEYS[' .. i .. '] must be ' .. expected[i])
  end
end
local idem_key = sub.idempotency_key
local has_idem = KEYS[5] ~= nil and KEYS[5] ~= ''
if type(idem_key) == 'string' then
  local want = c.idem_prefix .. (owner ~= '' and owner or '-') .. ':' .. idem_key
  if KEYS[5] ~= want then return redis.error_reply('ERR KEYS[5] must be ' .. want) end
  local existing = redis.call('GET', KEYS[5])
  if existing and redis.call('EXISTS', job_key(existing)) == 1 then
    return {'existing', redis.call('HGETALL', job_key(existing))}
  end
elseif has_idem then
  return redis.error_reply('ERR KEYS[5] given but the submission has no idempotency_key')
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.error_reply('ERR job id ' .. sub.id .. ' already exists')
end
local depth = redis.call('ZCARD', KEYS[2])
if depth >= tonumber(c.max_queue_length) then
  return {'full', depth}
end

-- Higher priority first, FIFO within a priority: score = -priority * 2^32 + seq. |priority| <= 1000 and
-- seq < 2^32 keep every score an exact integer below 2^53, so doubles order them exactly.
local seq = redis.call('INCR', KEYS[3])
local score = string.format('%.0f', -priority * 4294967296 + seq)
local created_at = sub.created_at
if type(created_at) ~= 'number' then
  local t = redis.call('TIME')
  created_at = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
redis.call('HSET', KEYS[1], 'id', sub.id, 'model', sub.model, 'submission', ARGV[1], 'status', 'queued',
  'priority', priority, 'score', score, 'attempts', 0, 'fence', 0, 'seq', 0, 'owner', owner,
  'created_at', string.format('%.6f', created_at))
if has_idem then
  redis.call('SET', KEYS[5], sub.id)
  redis.call('HSET', KEYS[1], 'idem', KEYS[5])
end
redis.call('ZADD', KEYS[2], score, sub.id)
if KEYS[6] then
  redis.call('ZADD', KEYS[6], string.format('%.6f', created_at), sub.id)
  redis.call('ZREMRANGEBYRANK', KEYS[6], 0, -(tonumber(c.owner_jobs_keep) + 1))
  redis.call('EXPIRE', KEYS[6], tonumber(c.result_ttl_s))
end
-- Idle workers of the model listen here and claim at once (otherwise at their next poll).
redis.call('PUBLISH', c.queue_prefix .. sub.model .. c.wake_suffix, sub.id)
return {'created', redis.call('HGETALL', KEYS[1])}
