-- fail: a running job cannot succeed (malformed, invalid for this model, engine error): fail it for good.
-- KEYS[1] job record, KEYS[2] in-flight set; ARGV[1] ctx JSON, ARGV[2] job id, ARGV[3] fence, ARGV[4] error.
-- Returns 1, or 0 when the fence is stale.
local ctx = cjson.decode(ARGV[1])
local status, fence = unpack(redis.call('HMGET', KEYS[1], 'status', 'fence'))
if fence ~= ARGV[3] then return 0 end
if status ~= 'running' then
  if status == 'failed' then return 1 end
  return 0
end
finish(ctx, KEYS[2], ARGV[2], 'failed', {'error', ARGV[4]})
return 1
