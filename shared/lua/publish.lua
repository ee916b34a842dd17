-- publish: append a running job's new events to its replay log and channel.
-- KEYS[1] job record; ARGV[1] ctx JSON, ARGV[2] job id, ARGV[3] fence, ARGV[4] '1' if any are token events,
-- then pairs: attempt-local event number (1, 2, ... within this claim), event JSON without "seq".
-- Events whose local number was already published (a retried call) are skipped, so retries never duplicate.
-- Returns 1, or 0 when the fence is stale (the caller lost the job). A worker publishes a whole engine step's
-- jobs in one publish_step.lua call instead; this script is the one-job form (lib.lua `publish_job` is both).
local ctx = cjson.decode(ARGV[1])
return publish_job(ctx, KEYS[1], ARGV[2], ARGV[3], ARGV[4] == '1', ARGV, 5, #ARGV)
