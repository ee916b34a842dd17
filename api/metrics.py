"""Prometheus metrics of one API app, in its own ``CollectorRegistry``.

A per-app registry (not prometheus-client's global one) lets tests build many apps in one process and keeps
metric names from clashing with the worker's when both run in one process. The observability work extends
this class; routes only call its methods.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from api.fleet import FleetCollector
from shared.lifecycle_log import RECOVERIES
from shared.tenants import KeyPolicy, TenantPolicies

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)




class ApiMetrics:
    """Request counts and latency by route template, jobs submitted by model and endpoint, the job transitions
    this API performs (submissions, its reaper's recoveries), and the fleet's state read from Redis (``fleet``)."""

    def __init__(self, policies: TenantPolicies | None = None) -> None:
        self.registry = CollectorRegistry()
        self._policies = policies or TenantPolicies({}, default=KeyPolicy())
        self.requests = Counter(
            "tokenspool_api_requests", "HTTP requests answered", ["method", "route", "status"],
            registry=self.registry,
        )
        self.request_latency = Histogram(
            "tokenspool_api_request_duration_seconds", "time from request to the last byte of the response",
            ["method", "route"], buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.jobs_submitted = Counter(
            "tokenspool_api_jobs_submitted", "jobs enqueued by this API", ["model", "endpoint"],
            registry=self.registry,
        )
        self.jobs_rejected = Counter(
            "tokenspool_api_jobs_rejected", "submissions refused", ["reason"], registry=self.registry,
        )
        self.open_streams = Gauge(
            "tokenspool_api_open_streams", "SSE responses in progress", registry=self.registry,
        )
        self.jobs = Counter(
            "tokenspool_jobs", "job transitions performed by this API", ["model", "event"], registry=self.registry,
        )
        # Per API key, labelled by its configured name (or key-<hash prefix>): bounded by the keys configured,
        # and never the key itself.
        self.key_jobs_submitted = Counter(
            "tokenspool_api_key_jobs_submitted", "jobs enqueued by this API per API key", ["key", "model"],
            registry=self.registry,
        )
        self.key_rate_limited = Counter(
            "tokenspool_api_key_rate_limited", "submissions refused by a key's rate limit",
            ["key", "limit"], registry=self.registry,
        )
        self.fleet = FleetCollector()
        self.registry.register(self.fleet)

    def key_name(self, owner: str | None) -> str:
        """The metrics name of the API key whose owner tag is ``owner`` (shared.tenants)."""
        return self._policies.of(owner).name

    def job_submitted(self, model: str, endpoint: str, owner: str | None = None) -> None:
        self.jobs_submitted.labels(model, endpoint).inc()
        self.jobs.labels(model, "submitted").inc()
        self.key_jobs_submitted.labels(self.key_name(owner), model).inc()

    def rate_limited(self, owner: str | None, limit: str) -> None:
        """A key's rate limit (``requests``, ``tokens`` or ``jobs``) refused a submission."""
        self.jobs_rejected.labels("rate_limited").inc()
        self.key_rate_limited.labels(self.key_name(owner), limit).inc()

    def jobs_expired(self, model: str, count: int) -> None:
        """This API's reaper found ``count`` queued jobs past their start-by time and expired them."""
        self.jobs.labels(model, "expired").inc(count)

    def job_reaped(self, model: str, status: str) -> None:
        """The API's reaper took a job back from a dead worker and left it ``status``."""
        self.jobs.labels(model, RECOVERIES[status].jobs_total).inc()

    def observe_request(self, method: str, route: str, status: int, duration_s: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.request_latency.labels(method, route).observe(duration_s)

    def exposition(self) -> bytes:
        """The text exposition format for ``GET /metrics``."""
        return generate_latest(self.registry)
