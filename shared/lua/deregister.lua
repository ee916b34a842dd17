-- deregister: a worker leaves cleanly. KEYS[1] workers set, KEYS[2] worker info key; ARGV[1] worker id.
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return 1
