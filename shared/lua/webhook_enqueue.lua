-- webhook_enqueue: queue one webhook delivery unless a delivery with its message id exists (self-contained;
-- api/webhooks/outbox.py). Message ids are derived from the event and the endpoint, so an event queued twice
-- (a replica re-reading the job event stream after a restart) is delivered once.
-- KEYS[1] delivery hash ts:webhook:<message id>, KEYS[2] due set ts:webhooks:due
-- ARGV[1] message id, ARGV[2] url, ARGV[3] payload JSON, ARGV[4] event type. Returns 1 when queued, else 0.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'url', ARGV[2], 'payload', ARGV[3], 'type', ARGV[4], 'state', 'pending',
  'attempts', 0, 'first_at', string.format('%.6f', now))
redis.call('ZADD', KEYS[2], string.format('%.6f', now), ARGV[1])
return 1
