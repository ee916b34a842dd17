-- expire: finalise `expired` the queued jobs of one model whose start-by time passed (lib.lua
-- `expire_overdue`); claim.lua does the same first thing, this covers a model no worker claims from.
-- KEYS[1] model queue, KEYS[2] in-flight set, KEYS[3] the model's deadlines; ARGV[1] ctx JSON, ARGV[2] limit.
-- Returns how many jobs expired.
local ctx = cjson.decode(ARGV[1])
local model = string.sub(KEYS[1], #ctx.queue_prefix + 1, #KEYS[1] - #ctx.queue_suffix)
return expire_overdue(ctx, KEYS[2], model, tonumber(ARGV[2]))
