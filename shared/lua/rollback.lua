-- rollback: undo the jobs of a batch that was refused part-way (POST /v1/jobs/batch is all or none). Each job
-- is cancelled as by cancel.lua, and its idempotency key is deleted in the same step, so a retry with the
-- same keys creates the batch afresh instead of answering with the cancelled jobs. A key that already names
-- another job is left alone.
-- KEYS[1] in-flight set, KEYS[2..n] the jobs' records; ARGV[1] ctx JSON, ARGV[2] the error the cancelled jobs
-- record, ARGV[3..n+1] the job ids (in KEYS order).
-- Returns the number of jobs that existed.
local ctx = cjson.decode(ARGV[1])
local found = 0
for i = 2, #KEYS do
  local jk, id = KEYS[i], ARGV[i + 1]
  local idem = redis.call('HGET', jk, 'idem')
  if idem then
    if redis.call('GET', idem) == id then redis.call('DEL', idem) end
    redis.call('HDEL', jk, 'idem')
  end
  if cancel_job(ctx, KEYS[1], id, ARGV[2]) then found = found + 1 end
end
return found
