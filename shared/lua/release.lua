-- release: a worker gives a running job back (SIGTERM drain, lost engine) at its original priority.
-- KEYS[1] job record, KEYS[2] in-flight set, KEYS[3] dead-letter set; ARGV[1] ctx JSON, ARGV[2] job id,
-- ARGV[3] fence, ARGV[4] '1' after a crash of its engine (lib.lua `crashed`: charged if it ran alone, else
-- isolated), '0' not to charge it (a drain).
-- Returns the job's new status (queued, failed = dead-lettered, or cancelled), or 0 when the fence is stale.
local ctx = cjson.decode(ARGV[1])
local status, fence, crashes = unpack(redis.call('HMGET', KEYS[1], 'status', 'fence', 'crashes'))
if status ~= 'running' or fence ~= ARGV[3] then return 0 end
if ARGV[4] == '1' then
  return crashed(ctx, KEYS[2], KEYS[3], ARGV[2], 'released by its worker')
end
return retry_or_give_up(ctx, KEYS[2], KEYS[3], ARGV[2], tonumber(crashes or '0') or 0, 'released by its worker')
