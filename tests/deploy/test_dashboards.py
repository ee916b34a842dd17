"""The Grafana dashboard and its provisioning: every query names a series the API or a worker really exports (read
from their real metrics registries, rendered as /metrics renders them), the shipped files are what
monitoring/build_dashboard.py builds, and docker-compose's `monitoring` profile and k8s/ wire them up."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.fleet import FleetSnapshot
from api.metrics import ApiMetrics
from monitoring import build_dashboard
from shared.schemas import WorkerInfo
from worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
TARGET_LABELS = {"instance", "job"}  # added by Prometheus to every scraped series
METRIC = re.compile(r"\b(tokenspool_[a-z0-9_]+)(\{[^}]*\})?")
BY = re.compile(r"\bby\s*\(([^)]*)\)")


def exported(exposition: bytes) -> dict[str, set[str]]:
    """Series name -> label names, from a Prometheus text exposition (counters as ``*_total``, histograms as
    their ``_bucket``/``_sum``/``_count`` series)."""
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition.decode()):
        labels = {name for sample in family.samples for name in sample.labels} - {"le"}
        for suffix in SERIES_SUFFIXES.get(family.type, ("",)):
            series[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return series


@pytest.fixture(scope="module")
def exported_series() -> dict[str, set[str]]:
    """What the API's /metrics and a worker's --metrics-port export, with a live worker in the fleet view and one
    request of each kind the API counts (labelled series appear once used)."""
    api = ApiMetrics()
    now = time.time()
    api.fleet.update(FleetSnapshot({"m": {0: 1}}, (WorkerInfo(id="w", model="m", max_num_seqs=4, heartbeat_at=now,
                                                              started_at=now),), 0))
    api.observe_request("GET", "/v1/jobs/{job_id}", 200, 0.01)
    api.job_submitted("m", "jobs")
    api.jobs_rejected.labels("queue_full").inc()
    series = exported(api.exposition())
    for name, labels in exported(generate_latest(WorkerMetrics("m").registry)).items():
        series[name] = series.get(name, set()) | labels
    return series


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every templating query."""
    found = [(f"panel {p['title']!r}", t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    found += [(f"variable {v['name']}", v["definition"]) for v in dashboard["templating"]["list"]
              if v["type"] == "query"]
    return found


DASHBOARD = cast(dict[str, Any], json.loads(build_dashboard.DASHBOARD_JSON.read_text()))


def test_dashboard_covers_what_operators_watch() -> None:
    text = json.dumps(DASHBOARD)
    for metric in ("tokenspool_queue_depth", "tokenspool_time_to_first_token_seconds_bucket",
                   "tokenspool_time_per_output_token_seconds_bucket", "tokenspool_e2e_latency_seconds_bucket",
                   "tokenspool_generation_tokens_total", "tokenspool_worker_kv_cache_usage_ratio",
                   "tokenspool_preemptions_total", "tokenspool_spec_decode_accepted_tokens_total",
                   "tokenspool_api_requests_total", "tokenspool_jobs_total"):
        assert metric in text, f"the dashboard shows no {metric}"
    assert {"p50", "p95", "p99"} <= {t["legendFormat"] for p in DASHBOARD["panels"] for t in p.get("targets", [])}


@pytest.mark.parametrize(("where", "expr"), queries(DASHBOARD), ids=[w for w, _ in queries(DASHBOARD)])
def test_every_query_names_exported_series_and_labels(exported_series: dict[str, set[str]], where: str,
                                                      expr: str) -> None:
    used = METRIC.findall(expr)
    assert used, f"{where}: no tokenspool metric in {expr}"
    labels_of_expr: set[str] = set(TARGET_LABELS)
    for name, matchers in used:
        assert name in exported_series, f"{where}: {name} is not exported by the API or a worker"
        labels_of_expr |= exported_series[name]
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
            assert label in exported_series[name], f"{where}: {name} has no label {label!r}"
    for group in BY.findall(expr):
        for label in filter(None, (x.strip() for x in group.split(","))):
            assert label in labels_of_expr, f"{where}: 'by ({group})' names {label!r}, which no series here has"


def test_query_check_rejects_an_unknown_metric(exported_series: dict[str, set[str]]) -> None:
    assert "tokenspool_time_to_first_token_seconds_bucket" in exported_series
    assert "tokenspool_time_to_first_token_seconds" not in exported_series  # a histogram has no bare series
    assert "tokenspool_queue_depth_total" not in exported_series
    assert "model" in exported_series["tokenspool_queue_depth"]


def test_shipped_files_are_what_the_builder_writes() -> None:
    assert build_dashboard.DASHBOARD_JSON.read_text() == build_dashboard.dashboard_text(), \
        "run .venv/bin/python monitoring/build_dashboard.py"
    configmap = yaml.safe_load(build_dashboard.CONFIGMAP_YAML.read_text())
    assert build_dashboard.CONFIGMAP_YAML.read_text() == build_dashboard.configmap_text()
    assert configmap["kind"] == "ConfigMap" and configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"]["tokenspool.json"] == build_dashboard.dashboard_text()


def test_panels_have_unique_ids_and_fit_the_grid() -> None:
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for panel in DASHBOARD["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]


def test_compose_monitoring_profile_provisions_prometheus_and_the_dashboard() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
    grafana_mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    provider = yaml.safe_load((ROOT / "monitoring/grafana/provisioning/dashboards/tokenspool.yaml").read_text())
    dashboards_dir = provider["providers"][0]["options"]["path"]
    assert grafana_mounts["./monitoring/grafana/dashboards"] == dashboards_dir
    assert grafana_mounts["./monitoring/grafana/provisioning"] == "/etc/grafana/provisioning"
    datasource = yaml.safe_load((ROOT / "monitoring/grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_prometheus_scrapes_the_api_and_worker_ports_compose_serves() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    scrape = {job["job_name"]: job for job in yaml.safe_load((ROOT / "monitoring/prometheus.yml").read_text())
              ["scrape_configs"]}
    api_port = services["api"]["command"][services["api"]["command"].index("--port") + 1]
    assert scrape["tokenspool-api"]["static_configs"][0]["targets"] == [f"api:{api_port}"]
    worker_port = services["worker"]["command"][services["worker"]["command"].index("--metrics-port") + 1]
    dns = scrape["tokenspool-worker"]["dns_sd_configs"][0]
    assert str(dns["port"]) == worker_port and {"worker", "worker-gpu"} <= set(dns["names"])
