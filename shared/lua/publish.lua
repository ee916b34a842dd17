-- publish: append a running job's new events to its replay log and channel.
-- KEYS[1] job record; ARGV[1] ctx JSON, ARGV[2] job id, ARGV[3] fence, ARGV[4] '1' if any are token events,
-- then pairs: attempt-local event number (1, 2, ... within this claim), event JSON without "seq".
-- Events whose local number was already published (a retried call) are skipped, so retries never duplicate.
-- Returns 1, or 0 when the fence is stale (the caller lost the job).
local ctx = cjson.decode(ARGV[1])
local id = ARGV[2]
local status, fence, pub = unpack(redis.call('HMGET', KEYS[1], 'status', 'fence', 'pub'))
if status ~= 'running' or fence ~= ARGV[3] then
  return 0
end
pub = tonumber(pub or '0')
local newest = pub
for i = 5, #ARGV, 2 do
  local n = tonumber(ARGV[i])
  if n > newest then
    emit(ctx, id, ARGV[i + 1])
    newest = n
  end
end
if newest > pub then
  redis.call('HSET', KEYS[1], 'pub', newest)
  if ARGV[4] == '1' and redis.call('HEXISTS', KEYS[1], 'first_token_at') == 0 then
    redis.call('HSET', KEYS[1], 'first_token_at', fmt(now()))
  end
end
return 1
