-- batch_result: record one batch line's result, once, and count it (self-contained; api/batches/store.py).
-- KEYS[1] batch hash ts:batch:{<id>}, KEYS[2] its results hash ts:batch:{<id>}:results
-- ARGV[1] line index, ARGV[2] the count it adds to ('completed' | 'failed'), ARGV[3] the output line JSON.
-- Returns 1 when recorded, 0 when the line already had a result (a second runner, a retry): no line completes
-- twice, and completed + failed always equals the number of results.
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[3]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
return 1
