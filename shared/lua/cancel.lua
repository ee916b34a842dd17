-- cancel: a queued job is removed and finalised now; a running job gets the durable cancel flag, is added to
-- its worker's cancel set and announced on the worker's control channel (the worker aborts and completes it).
-- KEYS[1] job record ts:job:{<tag>}:<id>, KEYS[2] its shard's in-flight set ts:inflight:{<tag>}, KEYS[3] its
-- shard's config hash ts:config:{<tag>}; ARGV[1] job id.
-- Needs nothing of the service's settings from its caller: another backend EVALs lib.lua + this file.
-- Returns the record (HGETALL list), empty when the job does not exist.
local ctx = load_config(KEYS[3])
if not ctx then return redis.error_reply(config_missing(KEYS[3])) end
if KEYS[1] ~= job_key(ctx, ARGV[1]) then
  return redis.error_reply('ERR KEYS[1] must be ' .. job_key(ctx, ARGV[1]))
end
if not cancel_job(ctx, KEYS[2], ARGV[1]) then return {} end
return redis.call('HGETALL', KEYS[1])
