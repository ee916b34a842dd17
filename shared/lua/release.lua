-- release: a worker gives a running job back (SIGTERM drain, lost engine) at its original priority.
-- KEYS[1] job record, KEYS[2] in-flight set, KEYS[3] dead-letter set; ARGV[1] ctx JSON, ARGV[2] job id,
-- ARGV[3] fence, ARGV[4] '1' to charge the attempt (then max_attempts applies), '0' not to.
-- Returns the job's new status (queued, failed = dead-lettered, or cancelled), or 0 when the fence is stale.
local ctx = cjson.decode(ARGV[1])
local status, fence, attempts = unpack(redis.call('HMGET', KEYS[1], 'status', 'fence', 'attempts'))
if status ~= 'running' or fence ~= ARGV[3] then return 0 end
attempts = tonumber(attempts)
if ARGV[4] ~= '1' then
  attempts = attempts - 1
end
return retry_or_give_up(ctx, KEYS[2], KEYS[3], ARGV[2], attempts, 'released by its worker')
