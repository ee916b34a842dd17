"""The launcher: the `tokenspool` CLI, `tokenspool up` (a supervisor of Redis, the API and the workers) and the
embedded redis-server. Nothing here is part of the queue protocol; api/ and worker/ run without it."""
