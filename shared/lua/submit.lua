-- submit: enqueue one job (self-contained: any backend may EVAL this file as shipped; see docs/protocol.md).
-- Every key is in the job's queue shard, hash tag {<tag>} (ts:shards lists the tags; docs/protocol.md "Shards").
-- KEYS[1] job record    ts:job:{<tag>}:<id>
-- KEYS[2] model queue   ts:queue:{<tag>}:<model>
-- KEYS[3] queue counter ts:queue:{<tag>}:<model>:seq
-- KEYS[4] config        ts:config:{<tag>} (the shard's key layout, the queue cap and the result TTL, stored by the
--         service)
-- KEYS[5] idempotency key ts:idem:{<tag>}:<owner or ->:<idempotency_key> exactly when the submission has an
--         idempotency_key; absent otherwise. An optional key that is followed by given ones is absent when it is
--         '' (single node) or KEYS[1] again (any Redis, Cluster included)
-- KEYS[6..8] (optional, together) the tenant's sub-queue ts:queue:{<tag>}:<model>:tenant:<owner or ->, the
--         model's tenants ts:queue:{<tag>}:<model>:tenants and deadlines ts:queue:{<tag>}:<model>:deadlines (fair
--         share and queue timeouts; a job submitted without them joins them when it reaches the head of the queue)
-- KEYS[9] (optional) the owner's recent-jobs index ts:owner:{<tag>}:<owner or ->:jobs: the job joins it
--         (scored by created_at); it keeps the config's owner_jobs_keep newest and expires result_ttl_s later
-- KEYS[10] (optional) the tenant's rate budget ts:queue:{<tag>}:<model>:rate:<owner or ->
-- ARGV[1] JobSubmission JSON (shared/schemas.py); ARGV[2] (optional) the tenant's fair-share weight (default 1);
-- ARGV[3] (optional, with KEYS[10]) the tenant's limits {"rpm": n, "tpm": n, "jobs": n} (0 or absent = none).
-- The shard: the job id must map to it (CRC16(id) mod the number of shards); so must the tenant when KEYS[10] is
-- given (a tenant's rate budget is one key), else the idempotency scope "<owner or ->:<key>" when there is one.
-- Nothing of the service's settings: the queue cap and the wake channel come from the config.
-- Returns {'created'|'existing', <record as HGETALL list>, <rate>}, {'full', <queue length>} or
-- {'limited', <requests|tokens|jobs>, <retry after s>, <rate>}; <rate> is {} without KEYS[10], else
-- {rpm, requests remaining, s until requests reset, tpm, tokens remaining, s until tokens reset} (strings).
local cfg = redis.call('HGETALL', KEYS[4])
if #cfg == 0 then
  return redis.error_reply('ERR ' .. KEYS[4] .. ' is missing: start the tokenspool API or a worker once on this Redis')
end
local c = {}
for i = 1, #cfg, 2 do c[cfg[i]] = cfg[i + 1] end
-- An optional key is absent when missing, '' or KEYS[1] (a key in the job's slot: a Redis Cluster refuses '',
-- which hashes to slot 0, beside keys of another slot).
local function given(i) return KEYS[i] ~= nil and KEYS[i] ~= '' and KEYS[i] ~= KEYS[1] end

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
-- The owner is copied out of the submission so a read can check access without loading the submission
-- (megabytes of prompt): '' when the job has no owner.
local owner = sub.owner
if type(owner) ~= 'string' then owner = '' end

-- CRC16-XMODEM, the checksum Redis Cluster maps keys to slots with: CRC16(x) mod num_shards is x's shard.
local function crc16(s)
  local crc = 0
  for i = 1, #s do
    crc = bit.bxor(crc, bit.lshift(string.byte(s, i), 8))
    for _ = 1, 8 do
      if bit.band(crc, 0x8000) ~= 0 then crc = bit.bxor(bit.lshift(crc, 1), 0x1021) else crc = bit.lshift(crc, 1) end
      crc = bit.band(crc, 0xFFFF)
    end
  end
  return crc
end
local num_shards, shard = tonumber(c.num_shards) or 1, tonumber(c.shard) or 0
local function check_shard(what, routing_key)
  if crc16(routing_key) % num_shards ~= shard then
    return redis.error_reply('ERR ' .. what .. ' ' .. routing_key .. ' maps to shard ' .. (crc16(routing_key) % num_shards)
      .. ', not to shard ' .. shard .. ' of these keys (CRC16 mod ' .. num_shards .. '; docs/protocol.md "Shards")')
  end
end
local function job_key(id) return c.job_prefix .. id .. c.job_suffix end
local expected = {job_key(sub.id), c.queue_prefix .. sub.model .. c.queue_suffix,
                  c.queue_prefix .. sub.model .. c.seq_suffix}
for i = 1, 3 do
  if KEYS[i] ~= expected[i] then
    return redis.error_reply('ERR KEYS[' .. i .. '] must be ' .. expected[i])
  end
end
local idem_key = sub.idempotency_key
local tenant = owner ~= '' and owner or '-'
local wrong = check_shard('job id', sub.id)
if not wrong and given(10) then wrong = check_shard('tenant (it has rate limits)', tenant)
elseif not wrong and type(idem_key) == 'string' then wrong = check_shard('idempotency scope', tenant .. ':' .. idem_key) end
if wrong then return wrong end
if type(idem_key) == 'string' then
  local want = c.idem_prefix .. tenant .. ':' .. idem_key
  if KEYS[5] ~= want then return redis.error_reply('ERR KEYS[5] must be ' .. want) end
  local existing = redis.call('GET', KEYS[5])
  if existing and redis.call('EXISTS', job_key(existing)) == 1 then
    return {'existing', redis.call('HGETALL', job_key(existing))}
  end
elseif given(5) then
  return redis.error_reply('ERR KEYS[5] given but the submission has no idempotency_key')
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
  local cost = prompt + n * max_tokens
  -- Bounded (10M tokens, beyond any context): a hostile max_tokens or n (1e308, -1, NaN) must not make the
  -- tenant's charge at the claim infinite or NaN; HINCRBYFLOAT would refuse every later settlement.
  if cost ~= cost then return 0 end
  return math.min(math.max(cost, 0), 1e7)
end
local cost = estimate_cost()

-- Rate limits (GCRA): each request, and each token, moves the budget's theoretical arrival time `tat` on by
-- 60/limit s; a request passes while that stays within 60 s of now (a minute's budget, as a burst).
local rate, refusal, retry, never, charge = {}, nil, 0, false, nil
if given(10) then
  local limits = (ARGV[3] and ARGV[3] ~= '') and cjson.decode(ARGV[3]) or {}
  local rpm, tpm, max_jobs = tonumber(limits.rpm) or 0, tonumber(limits.tpm) or 0, tonumber(limits.jobs) or 0
  local tat_r, tat_t, jobs = unpack(redis.call('HMGET', KEYS[10], 'tat_r', 'tat_t', 'jobs'))
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
if depth >= tonumber(c.max_queue_length) then
  return {'full', depth}
end

-- Higher priority first, FIFO within a priority: score = -priority * 2^32 + seq. |priority| <= 1000 and
-- seq < 2^32 keep every score an exact integer below 2^53, so doubles order them exactly.
local seq = redis.call('INCR', KEYS[3])
local score = string.format('%.0f', -priority * 4294967296 + seq)
local created_at = sub.created_at
if type(created_at) ~= 'number' then created_at = t end
redis.call('HSET', KEYS[1], 'id', sub.id, 'model', sub.model, 'submission', ARGV[1], 'status', 'queued',
  'priority', priority, 'score', score, 'attempts', 0, 'fence', 0, 'seq', 0, 'owner', owner,
  'created_at', string.format('%.6f', created_at))
local weight = tonumber(ARGV[2] or '1') or 1
if weight <= 0 then weight = 1 end
redis.call('HSET', KEYS[1], 'tenant', tenant, 'weight', weight, 'cost', cost)
if given(5) then
  redis.call('SET', KEYS[5], sub.id)
  redis.call('HSET', KEYS[1], 'idem', KEYS[5])
end
-- Deadlines in Redis time: the job must start by `start_by` (the earlier of both timeouts) and end by `deadline`.
local start_by = math.min(queue_timeout and t + queue_timeout or math.huge, total_timeout and t + total_timeout or math.huge)
if total_timeout then redis.call('HSET', KEYS[1], 'deadline', string.format('%.6f', t + total_timeout)) end
if start_by < math.huge then redis.call('HSET', KEYS[1], 'start_by', string.format('%.6f', start_by)) end
if charge then
  redis.call('HSET', KEYS[10], 'tat_r', string.format('%.6f', charge[1]), 'tat_t', string.format('%.6f', charge[2]))
  redis.call('HINCRBY', KEYS[10], 'jobs', 1)
  redis.call('HSET', KEYS[1], 'rkey', KEYS[10], 'reserved', cost, 'tok_s', string.format('%.9f', charge[3]))
end
redis.call('ZADD', KEYS[2], score, sub.id)
if given(8) then
  redis.call('ZADD', KEYS[6], score, sub.id)
  redis.call('ZADD', KEYS[7], weight, tenant)  -- the latest submission's weight is the tenant's
  if start_by < math.huge then redis.call('ZADD', KEYS[8], string.format('%.6f', start_by), sub.id) end
end
if given(9) then
  redis.call('ZADD', KEYS[9], string.format('%.6f', created_at), sub.id)
  redis.call('ZREMRANGEBYRANK', KEYS[9], 0, -(tonumber(c.owner_jobs_keep) + 1))
  redis.call('EXPIRE', KEYS[9], tonumber(c.result_ttl_s))
end
-- Idle workers of the model listen here and claim at once (otherwise at their next poll).
redis.call('PUBLISH', c.queue_prefix .. sub.model .. c.wake_suffix, sub.id)
return {'created', redis.call('HGETALL', KEYS[1]), rate}
