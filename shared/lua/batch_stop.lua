-- batch_stop: stop a running batch (cancel, or its completion window ran out); self-contained.
-- KEYS[1] batch hash; ARGV[1] the error code its unfinished lines end with ('batch_cancelled' | 'batch_expired'),
-- ARGV[2] the new status ('' = keep it), ARGV[3] the timestamp field to set with it, ARGV[4] the time.
-- Only a validating or in_progress batch that is not stopping yet changes. Returns its status before, or false
-- when the batch does not exist.
local status, stop = unpack(redis.call('HMGET', KEYS[1], 'status', 'stop'))
if not status then return false end
if (status ~= 'in_progress' and status ~= 'validating') or stop then return status end
redis.call('HSET', KEYS[1], 'stop', ARGV[1])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'status', ARGV[2], ARGV[3], ARGV[4]) end
return status
