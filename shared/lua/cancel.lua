-- cancel: a queued job is removed and finalised now; a running job gets the durable cancel flag, is added to
-- its worker's cancel set and announced on the worker's control channel (the worker aborts and completes it).
-- KEYS[1] job record, KEYS[2] in-flight set; ARGV[1] ctx JSON, ARGV[2] job id.
-- Returns the record (HGETALL list), empty when the job does not exist.
local ctx = cjson.decode(ARGV[1])
if not cancel_job(ctx, KEYS[2], ARGV[2]) then return {} end
return redis.call('HGETALL', KEYS[1])
