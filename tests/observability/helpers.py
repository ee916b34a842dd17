"""Helpers of the observability tests: scrape a Prometheus endpoint, read a worker's JSON log."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.worker.worker_process import WorkerProcess

MODEL = "tiny"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class ObservedWorker:
    process: WorkerProcess
    metrics_url: str

    @property
    def worker_id(self) -> str:
        return self.process.worker_id

    def scrape(self) -> Samples:
        return scrape(self.metrics_url)

    def log_lines(self) -> list[dict[str, Any]]:
        """Every line of the worker's output, parsed: each one must be a JSON object."""
        return [json.loads(line) for line in self.process.log_path.read_text().splitlines() if line.strip()]


def scrape(url: str) -> Samples:
    """``(sample name, labels) -> value`` of a Prometheus text exposition."""
    text = httpx.get(url, timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def exported_types(text: str) -> dict[str, str]:
    """``tokenspool_*`` metric name (counters with ``_total``, as the contract names them) -> type, from an
    exposition; prometheus-client's ``*_created`` timestamp series are left out."""
    return {(f.name + "_total" if f.type == "counter" else f.name): f.type
            for f in text_string_to_metric_families(text)
            if f.name.startswith("tokenspool_") and not f.name.endswith("_created")}
