-- submit: enqueue one job (self-contained: any backend may EVAL this file as shipped; see docs/protocol.md).
-- KEYS[1] job record    ts:job:{<id>}
-- KEYS[2] model queue   ts:queue:{<model>}
-- KEYS[3] queue counter ts:queue:{<model>}:seq
-- KEYS[4] (optional) idempotency key ts:idem:<owner or ->:<idempotency_key>
-- ARGV[1] JobSubmission JSON (shared/schemas.py); ARGV[2] max queue length (optional, default 10000);
-- ARGV[3] (optional) the model's wake channel ts:queue:{<model>}:wake: idle workers claim at once when told,
-- otherwise at their next poll
-- ARGV[4], ARGV[5], ARGV[6] (optional, with ARGV[3]): the owner's recent-jobs index ts:owner:<owner or ->:jobs,
-- how many entries it keeps and its TTL in seconds; the new job joins it, scored by created_at
-- Returns {'created'|'existing', <record as HGETALL list>} or {'full', <queue length>}.
local ok, sub = pcall(cjson.decode, ARGV[1])
if not ok or type(sub) ~= 'table' then
  return redis.error_reply('ERR submission is not a JSON object')
end
if type(sub.id) ~= 'string' or type(sub.model) ~= 'string' then
  return redis.error_reply('ERR submission needs string fields id and model')
end
local priority = sub.priority
if priority == nil or priority == cjson.null then priority = 0 end
if type(priority) ~= 'number' or priority ~= math.floor(priority) or priority < -1000 or priority > 1000 then
  return redis.error_reply('ERR priority must be an integer in [-1000, 1000]')
end

local tag_from, tag_to = string.find(KEYS[1], '{' .. sub.id .. '}', 1, true)
if not tag_from then
  return redis.error_reply('ERR KEYS[1] must be the record key of job ' .. sub.id)
end
if KEYS[4] then
  local existing = redis.call('GET', KEYS[4])
  if existing then
    local ek = string.sub(KEYS[1], 1, tag_from) .. existing .. string.sub(KEYS[1], tag_to)
    if redis.call('EXISTS', ek) == 1 then
      return {'existing', redis.call('HGETALL', ek)}
    end
  end
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.error_reply('ERR job id ' .. sub.id .. ' already exists')
end
local depth = redis.call('ZCARD', KEYS[2])
if depth >= tonumber(ARGV[2] or '10000') then
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
-- The owner is copied out of the submission so a read can check access without loading the submission
-- (megabytes of prompt): '' when the job has no owner.
local owner = sub.owner
if type(owner) ~= 'string' then owner = '' end
redis.call('HSET', KEYS[1], 'id', sub.id, 'model', sub.model, 'submission', ARGV[1], 'status', 'queued',
  'priority', priority, 'score', score, 'attempts', 0, 'fence', 0, 'seq', 0, 'owner', owner,
  'created_at', string.format('%.6f', created_at))
if KEYS[4] then
  redis.call('SET', KEYS[4], sub.id)
  redis.call('HSET', KEYS[1], 'idem', KEYS[4])
end
redis.call('ZADD', KEYS[2], score, sub.id)
if ARGV[4] then
  redis.call('ZADD', ARGV[4], string.format('%.6f', created_at), sub.id)
  redis.call('ZREMRANGEBYRANK', ARGV[4], 0, -(tonumber(ARGV[5]) + 1))
  redis.call('EXPIRE', ARGV[4], tonumber(ARGV[6]))
end
if ARGV[3] then
  redis.call('PUBLISH', ARGV[3], sub.id)
end
return {'created', redis.call('HGETALL', KEYS[1])}
