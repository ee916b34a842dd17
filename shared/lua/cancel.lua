-- cancel: a queued job is removed and finalised now; a running job gets the durable cancel flag, is added to
-- its worker's cancel set and announced on the worker's control channel (the worker aborts and completes it).
-- KEYS[1] job record, KEYS[2] in-flight set; ARGV[1] ctx JSON, ARGV[2] job id.
-- Returns the record (HGETALL list), empty when the job does not exist.
local ctx = cjson.decode(ARGV[1])
local id = ARGV[2]
local status, model, wid = unpack(redis.call('HMGET', KEYS[1], 'status', 'model', 'worker_id'))
if not status then return {} end
if status == 'queued' then
  redis.call('ZREM', queue_key(ctx, model), id)
  finish(ctx, KEYS[2], id, 'cancelled', {})
elseif status == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', 1)
  redis.call('SADD', cancels_key(ctx, wid), id)
  redis.call('PUBLISH', ctx.control_prefix .. wid, id)
end
return redis.call('HGETALL', KEYS[1])
