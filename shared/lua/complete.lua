-- complete: write a running job's result together with its final status (succeeded; cancelled when the
-- worker aborted it on request; expired when it ran past its total timeout).
-- KEYS[1] job record, KEYS[2] in-flight set; ARGV[1] ctx JSON, ARGV[2] job id, ARGV[3] fence,
-- ARGV[4] status, ARGV[5] JobResult JSON, ARGV[6] (optional) tokens used, prompt + generated (settles the
-- job's rate-limit reservation and fair-share charge). Returns 1, or 0 when the fence is stale.
local ctx = cjson.decode(ARGV[1])
local status, fence = unpack(redis.call('HMGET', KEYS[1], 'status', 'fence'))
if fence ~= ARGV[3] then return 0 end
if status ~= 'running' then
  -- Same fence and already final: this is a retry of a call that succeeded.
  if status == 'succeeded' or status == 'cancelled' or status == 'expired' then return 1 end
  return 0
end
finish(ctx, KEYS[2], ARGV[2], ARGV[4], {'result', ARGV[5]}, tonumber(ARGV[6] or ''))
return 1
