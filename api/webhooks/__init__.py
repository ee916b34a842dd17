"""Signed webhooks (Standard Webhooks): ``outbox`` queues events in Redis, ``delivery`` sends them at least once
with retries and dead-lettering, ``job_events`` turns the queue's job-event stream into job events."""
