"""Prometheus metrics of one worker process, in its own ``CollectorRegistry`` (names: docs/operations.md).

The runner calls a handful of ``on_*`` methods where jobs are claimed, produce their first token, finish, and
where the engine steps; everything else (histogram buckets, counter deltas from ``EngineStats``) lives here.
``serve(port)`` exposes the registry over HTTP (``--metrics-port``; 0 picks a free port).
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from shared.lifecycle_log import RECOVERIES
from shared.schemas import WorkerTotals
from worker.engine.outputs import EngineStats

# Latencies that include queueing: milliseconds on a GPU, up to minutes for a deep queue on a CPU.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
                     600.0)
# One token or one engine step: ~10 ms on a GPU, up to seconds for a long prefill on a CPU.
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# Job transitions a worker performs (label ``event`` of tokenspool_jobs_total).
JOB_EVENTS = ("completed", "failed", "cancelled", "retried", "dead_lettered", "expired")
# Our counter (attribute) fed by each cumulative EngineStats field.
ENGINE_COUNTERS = (("preemptions", "num_preemptions"), ("prefix_queries", "prefix_cache_queries"),
                   ("prefix_hits", "prefix_cache_hits"), ("draft_tokens", "num_draft_tokens"),
                   ("accepted_tokens", "num_accepted_tokens"))


class WorkerMetrics:
    """Job, latency, token and engine metrics of the worker serving ``model``.

    Thread-safe: the engine-step hooks run on the engine thread, the job hooks on the event loop.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self._engine_lock = threading.Lock()
        self._counted: dict[str, int] = {}  # EngineStats counter field -> value already counted
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=buckets, registry=r)

        def counter(name: str, doc: str) -> Counter:  # prometheus-client appends _total
            return Counter(name, doc, ["model"], registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model"], registry=r)

        self.jobs = Counter("tokenspool_jobs", "job transitions performed by this worker", ["model", "event"],
                            registry=r)
        self.queue_wait = hist("tokenspool_queue_wait_seconds", "submission to claim", LATENCY_BUCKETS_S)
        self.ttft = hist("tokenspool_time_to_first_token_seconds", "submission to the first token published",
                         LATENCY_BUCKETS_S)
        self.tpot = hist("tokenspool_time_per_output_token_seconds",
                         "(last token - first token) / (output tokens - 1), per finished sequence", STEP_BUCKETS_S)
        self.e2e = hist("tokenspool_e2e_latency_seconds", "submission to the job's completion", LATENCY_BUCKETS_S)
        self.prompt_tokens = counter("tokenspool_prompt_tokens", "prompt tokens of claimed jobs")
        self.generation_tokens = counter("tokenspool_generation_tokens", "tokens generated")
        self.running = gauge("tokenspool_running_requests", "sequences in the engine's running batch")
        self.waiting = gauge("tokenspool_waiting_requests", "sequences waiting or preempted in the engine")
        self.kv_cache_usage = gauge("tokenspool_kv_cache_usage_ratio", "fraction of KV cache blocks in use")
        self.prefix_queries = counter("tokenspool_prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("tokenspool_prefix_cache_hits", "prompt tokens found in the prefix cache")
        self.preemptions = counter("tokenspool_preemptions", "sequences preempted for lack of KV cache")
        self.draft_tokens = counter("tokenspool_spec_decode_draft_tokens", "tokens proposed by speculative decoding")
        self.accepted_tokens = counter("tokenspool_spec_decode_accepted_tokens",
                                       "speculative tokens accepted")
        self.batch_size = hist("tokenspool_batch_size", "sequences computed per engine step", BATCH_SIZE_BUCKETS)
        self.step_duration = hist("tokenspool_step_duration_seconds", "wall time of one engine step", STEP_BUCKETS_S)
        # Labelled children exist from the start, so a fresh worker exports zeros rather than nothing
        # (the "no live workers" alert tests for the absence of tokenspool_running_requests).
        for event in JOB_EVENTS:
            self.jobs.labels(model, event)
        for metric in (self.queue_wait, self.ttft, self.tpot, self.e2e, self.prompt_tokens, self.generation_tokens,
                       self.running, self.waiting, self.kv_cache_usage, self.prefix_queries, self.prefix_hits,
                       self.preemptions, self.draft_tokens, self.accepted_tokens, self.batch_size,
                       self.step_duration):
            metric.labels(model)

    def totals(self) -> WorkerTotals:
        """Tokens generated, first tokens and finished jobs so far with their latency sums (for the heartbeat)."""
        wanted = {"tokenspool_generation_tokens_total": "num_generated_tokens",
                  "tokenspool_time_to_first_token_seconds_count": "num_first_tokens",
                  "tokenspool_time_to_first_token_seconds_sum": "ttft_sum_s",
                  "tokenspool_e2e_latency_seconds_count": "num_finished_jobs",
                  "tokenspool_e2e_latency_seconds_sum": "e2e_sum_s"}
        values: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name in wanted and sample.labels.get("model") == self.model:
                    values[wanted[sample.name]] = sample.value
        return WorkerTotals(**{name: int(v) if name.startswith("num_") else v for name, v in values.items()})

    # --- serving ----------------------------------------------------------------------------------------

    def serve(self, port: int, addr: str = "0.0.0.0") -> WSGIServer:
        """Serve ``/metrics`` on ``port`` (0: a free one; read ``server.server_port``) in a daemon thread."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return server

    # --- job hooks (event loop) -------------------------------------------------------------------------

    def on_claimed(self, created_at: float | None, claimed_at: float, num_prompt_tokens: int) -> None:
        """A job entered the engine. ``created_at`` None (a submitter that did not stamp it): no wait time."""
        if created_at is not None:
            self.queue_wait.labels(self.model).observe(max(0.0, claimed_at - created_at))
        self.prompt_tokens.labels(self.model).inc(num_prompt_tokens)

    def on_first_token(self, created_at: float | None, at: float) -> None:
        if created_at is not None:
            self.ttft.labels(self.model).observe(max(0.0, at - created_at))

    def on_sequence_finished(self, num_output_tokens: int, first_token_at: float | None,
                             last_token_at: float | None) -> None:
        """Time per output token of one finished sequence (needs two tokens at least)."""
        if num_output_tokens > 1 and first_token_at is not None and last_token_at is not None:
            self.tpot.labels(self.model).observe((last_token_at - first_token_at) / (num_output_tokens - 1))

    def on_job_finished(self, event: str, created_at: float | None, at: float) -> None:
        """The worker completed the job (``completed``, ``cancelled`` or ``expired``): counts it and its
        end-to-end time."""
        self.on_job_event(event)
        if created_at is not None:
            self.e2e.labels(self.model).observe(max(0.0, at - created_at))

    def on_job_event(self, event: str) -> None:
        """Count one job transition (one of ``JOB_EVENTS``)."""
        if event not in JOB_EVENTS:
            raise ValueError(f"event must be one of {', '.join(JOB_EVENTS)}; got {event!r}")
        self.jobs.labels(self.model, event).inc()

    def on_requeue_status(self, status: str) -> None:
        """A release or reap left the job ``status`` (queued, failed = dead-lettered, or cancelled)."""
        self.on_job_event(RECOVERIES[status].jobs_total)

    # --- engine hooks (engine thread, or any thread) -----------------------------------------------------

    def on_step(self, duration_s: float, batch_size: int, num_new_tokens: int, stats: EngineStats) -> None:
        """One engine step: its time and batch, the tokens it generated, and the engine's state after it."""
        if batch_size:
            self.step_duration.labels(self.model).observe(duration_s)
            self.batch_size.labels(self.model).observe(batch_size)
        if num_new_tokens:
            self.generation_tokens.labels(self.model).inc(num_new_tokens)
        self.on_engine_stats(stats)

    def on_engine_stats(self, stats: EngineStats) -> None:
        """Gauges from ``stats``; the engine's cumulative counters advance ours by their change since last time."""
        self.running.labels(self.model).set(stats.num_running)
        self.waiting.labels(self.model).set(stats.num_waiting)
        self.kv_cache_usage.labels(self.model).set(stats.kv_cache_usage)
        # The engine's counters only grow; counting up to a high-water mark makes a stale snapshot (a heartbeat's,
        # overtaken by a step's) harmless.
        with self._engine_lock:
            for counter, name in ENGINE_COUNTERS:
                # getattr: speculative decoding's fields may not exist in every engine build yet.
                value = int(getattr(stats, name, 0))
                if value > self._counted.get(name, 0):
                    getattr(self, counter).labels(self.model).inc(value - self._counted.get(name, 0))
                    self._counted[name] = value
