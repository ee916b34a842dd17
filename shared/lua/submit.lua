-- submit: enqueue one job (self-contained: any backend may EVAL this file as shipped; see docs/protocol.md).
-- KEYS[1] job record    ts:job:{<id>}
-- KEYS[2] model queue   ts:queue:{<model>}
-- KEYS[3] queue counter ts:queue:{<model>}:seq
-- KEYS[4] (optional) idempotency key ts:idem:<owner or ->:<idempotency_key>, or '' for none
-- KEYS[5..7] (optional, together) the tenant's sub-queue ts:queue:{<model>}:tenant:<tenant>, the model's
--   tenants ts:queue:{<model>}:tenants and deadlines ts:queue:{<model>}:deadlines (fair share and queue
--   timeouts; a job submitted without them joins them when it reaches the head of the queue)
-- KEYS[8] (optional) the tenant's rate budget ts:queue:{<model>}:rate:<tenant>
-- ARGV[1] JobSubmission JSON (shared/schemas.py); ARGV[2] max queue length (optional, default 10000);
-- ARGV[3] (optional) the model's wake channel ts:queue:{<model>}:wake ('' for none): idle workers claim at once
-- when told, otherwise at their next poll; ARGV[4] (optional) the tenant's fair-share weight (default 1);
-- ARGV[5] (optional, with KEYS[8]) the tenant's limits {"rpm": n, "tpm": n, "jobs": n} (0 or absent = none)
-- Returns {'created'|'existing', <record as HGETALL list>, <rate>}, {'full', <queue length>} or
-- {'limited', <requests|tokens|jobs>, <retry after s>, <rate>}; <rate> is {} without KEYS[8], else
-- {rpm, requests remaining, s until requests reset, tpm, tokens remaining, s until tokens reset} (strings).
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

local function positive_or_nil(name)
  local v = sub[name]
  if v == nil or v == cjson.null then return nil end
  if type(v) ~= 'number' or v <= 0 then return false end
  return v
end
local queue_timeout, total_timeout = positive_or_nil('queue_timeout_s'), positive_or_nil('timeout_s')
if queue_timeout == false or total_timeout == false then
  return redis.error_reply('ERR queue_timeout_s and timeout_s must be positive numbers')
end

local tag_from, tag_to = string.find(KEYS[1], '{' .. sub.id .. '}', 1, true)
if not tag_from then
  return redis.error_reply('ERR KEYS[1] must be the record key of job ' .. sub.id)
end
local idem = KEYS[4] ~= nil and KEYS[4] ~= ''
if idem then
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
local clock = redis.call('TIME')
local t = tonumber(clock[1]) + tonumber(clock[2]) / 1000000

-- Tokens the job may use: the prompt (exact for token ids, else about 4 bytes a token) and n * max_tokens
-- (16, GenerationParams' default, when absent). Reserved against tokens per minute, and the fair-share charge
-- at its claim; both are corrected with the tokens used when it ends.
local function estimate_cost()
  local prompt = 0
  if type(sub.prompt_token_ids) == 'table' then
    prompt = #sub.prompt_token_ids
  else
    local bytes = type(sub.prompt) == 'string' and #sub.prompt or 0
    if type(sub.messages) == 'table' then
      for _, m in ipairs(sub.messages) do
        if type(m) == 'table' and type(m.content) == 'string' then bytes = bytes + #m.content + 16 end
      end
    end
    prompt = math.ceil(bytes / 4)
  end
  local params = type(sub.params) == 'table' and sub.params or {}
  local max_tokens = tonumber(params.max_tokens) or 16
  local n = tonumber(sub.n) or 1
  return prompt + n * max_tokens
end
local cost = estimate_cost()

-- Rate limits (GCRA): each request, and each token, moves the budget's theoretical arrival time `tat` on by
-- 60/limit s; a request passes while that stays within 60 s of now (a minute's budget, as a burst).
local rate, refusal, retry, never, charge = {}, nil, 0, false, nil
if KEYS[8] then
  local limits = (ARGV[5] and ARGV[5] ~= '') and cjson.decode(ARGV[5]) or {}
  local rpm, tpm, max_jobs = tonumber(limits.rpm) or 0, tonumber(limits.tpm) or 0, tonumber(limits.jobs) or 0
  local tat_r, tat_t, jobs = unpack(redis.call('HMGET', KEYS[8], 'tat_r', 'tat_t', 'jobs'))
  tat_r = math.max(tonumber(tat_r) or 0, t)
  tat_t = math.max(tonumber(tat_t) or 0, t)
  jobs = tonumber(jobs) or 0
  local function refuse(why, after)
    refusal = refusal or why
    retry = math.max(retry, after)
  end
  if max_jobs > 0 and jobs >= max_jobs then refuse('jobs', 1) end
  local next_r = rpm > 0 and tat_r + 60 / rpm or tat_r
  if next_r - t > 60 then refuse('requests', next_r - t - 60) end
  local next_t = tpm > 0 and tat_t + cost * 60 / tpm or tat_t
  if tpm > 0 and cost > tpm then refuse('tokens', 0); never = true elseif next_t - t > 60 then refuse('tokens', next_t - t - 60) end
  if refusal then next_r, next_t = tat_r, tat_t end
  -- (+1e-6: float rounding must not make 992 of 1000 tokens left read 991)
  local function left(limit, tat) return limit > 0 and math.floor((t + 60 - tat) * limit / 60 + 1e-6) or 0 end
  rate = {tostring(rpm), tostring(left(rpm, next_r)), string.format('%.3f', next_r - t),
          tostring(tpm), tostring(left(tpm, next_t)), string.format('%.3f', next_t - t)}
  charge = {next_r, next_t, tpm > 0 and 60 / tpm or 0}
  if never then retry = -1 end  -- more tokens than a minute's budget: no wait helps
end
if refusal then
  return {'limited', refusal, string.format('%.3f', retry), rate}
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
if type(created_at) ~= 'number' then created_at = t end
-- The owner is copied out of the submission so a read can check access without loading the submission
-- (megabytes of prompt): '' when the job has no owner.
local owner = sub.owner
if type(owner) ~= 'string' then owner = '' end
redis.call('HSET', KEYS[1], 'id', sub.id, 'model', sub.model, 'submission', ARGV[1], 'status', 'queued',
  'priority', priority, 'score', score, 'attempts', 0, 'fence', 0, 'seq', 0, 'owner', owner,
  'created_at', string.format('%.6f', created_at))
local tenant = owner ~= '' and owner or '-'
local weight = tonumber(ARGV[4] or '1') or 1
if weight <= 0 then weight = 1 end
redis.call('HSET', KEYS[1], 'tenant', tenant, 'weight', weight, 'cost', cost)
if idem then
  redis.call('SET', KEYS[4], sub.id)
  redis.call('HSET', KEYS[1], 'idem', KEYS[4])
end
-- Deadlines in Redis time: the job must start by `start_by` (the earlier of both timeouts) and end by `deadline`.
local start_by = math.min(queue_timeout and t + queue_timeout or math.huge, total_timeout and t + total_timeout or math.huge)
if total_timeout then redis.call('HSET', KEYS[1], 'deadline', string.format('%.6f', t + total_timeout)) end
if start_by < math.huge then redis.call('HSET', KEYS[1], 'start_by', string.format('%.6f', start_by)) end
if charge then
  redis.call('HSET', KEYS[8], 'tat_r', string.format('%.6f', charge[1]), 'tat_t', string.format('%.6f', charge[2]))
  redis.call('HINCRBY', KEYS[8], 'jobs', 1)
  redis.call('HSET', KEYS[1], 'rkey', KEYS[8], 'reserved', cost, 'tok_s', string.format('%.9f', charge[3]))
end
redis.call('ZADD', KEYS[2], score, sub.id)
if KEYS[7] then
  redis.call('ZADD', KEYS[5], score, sub.id)
  redis.call('ZADD', KEYS[6], weight, tenant)  -- the latest submission's weight is the tenant's
  if start_by < math.huge then redis.call('ZADD', KEYS[7], string.format('%.6f', start_by), sub.id) end
end
if ARGV[3] and ARGV[3] ~= '' then
  redis.call('PUBLISH', ARGV[3], sub.id)
end
return {'created', redis.call('HGETALL', KEYS[1]), rate}
