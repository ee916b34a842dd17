-- publish_step: one engine step's new events for several running jobs in one call (publish.lua for each).
-- KEYS: each job's record, in order; ARGV[1] ctx JSON, then per job (in the order of KEYS): job id, fence,
-- '1' if any of its events are token events, the number k of its events, then k pairs as publish.lua takes them
-- (attempt-local event number, event JSON without "seq").
-- Every job is checked and published on its own, exactly as publish.lua does: a stale fence rejects that job
-- only (the others are still published), and event numbers a job already published are skipped (a retried call
-- duplicates nothing, even when it failed halfway through).
-- Returns one 1 (published) or 0 (stale fence) per job, in the order of KEYS.
-- On a single node any jobs may share a call. On a Redis Cluster a script's keys (and the job keys it derives
-- from the ids: log, live channel) must share one hash slot, so a step would become one call per slot
-- (shared/queue/worker.py `publish_groups` is where a step's jobs are grouped).
local ctx = cjson.decode(ARGV[1])
local replies = {}
local at = 2
for j = 1, #KEYS do
  local k = tonumber(ARGV[at + 3])
  replies[j] = publish_job(ctx, KEYS[j], ARGV[at], ARGV[at + 1], ARGV[at + 2] == '1', ARGV, at + 4, at + 3 + 2 * k)
  at = at + 4 + 2 * k
end
return replies
