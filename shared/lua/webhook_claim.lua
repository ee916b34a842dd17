-- webhook_claim: take up to ARGV[2] deliveries that are due, pushing each one's due time ARGV[1] seconds ahead
-- so no other replica sends it meanwhile (if this one dies, it is due again then). Self-contained.
-- KEYS[1] due set ts:webhooks:due. Returns the message ids taken.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.6f', now), 'LIMIT', 0, tonumber(ARGV[2]))
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], string.format('%.6f', now + tonumber(ARGV[1])), id)
end
return ids
