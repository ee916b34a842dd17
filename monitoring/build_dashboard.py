"""Build the Grafana dashboard of tokenspool (API and worker metrics) and its Kubernetes ConfigMap.

    .venv/bin/python monitoring/build_dashboard.py     # rewrites the two files below

The dashboard is written as data here (panels as title, unit and PromQL), and rendered to
``monitoring/grafana/dashboards/tokenspool.json`` (provisioned by docker-compose's ``monitoring`` profile) and to
``k8s/grafana-dashboard.yaml`` (a ConfigMap the Grafana sidecar of kube-prometheus-stack picks up by its
``grafana_dashboard`` label). tests/deploy/test_dashboards.py checks both are up to date and that every query
names a metric the API or a worker really exports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_JSON = ROOT / "monitoring" / "grafana" / "dashboards" / "tokenspool.json"
CONFIGMAP_YAML = ROOT / "k8s" / "grafana-dashboard.yaml"
UID = "tokenspool"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
MODEL = 'model=~"$model"'


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""
    kind: str = "timeseries"
    width: int = 8


def quantiles(metric: str, by: str = "") -> tuple[tuple[str, str], ...]:
    """p50, p95 and p99 of a histogram over the selected models."""
    labels = f"le{', ' + by if by else ''}"
    legend = f"{{{{{by}}}}} " if by else ""
    return tuple((f"histogram_quantile({q}, sum by ({labels}) (rate({metric}_bucket{{{MODEL}}}[{RATE}])))",
                  f"{legend}p{round(q * 100)}") for q in (0.5, 0.95, 0.99))


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Queue", (
        Panel("Queue depth by model and priority", "short",
              ((f"sum by (model, priority) (tokenspool_queue_depth{{{MODEL}}})", "{{model}} p{{priority}}"),),
              "jobs queued, not yet claimed (read from Redis by the API)"),
        Panel("Live workers", "short", ((f"tokenspool_live_workers{{{MODEL}}}", "{{model}}"),),
              "workers with a heartbeat within one lease TTL"),
        Panel("Queue wait", "s", quantiles("tokenspool_queue_wait_seconds"), "submission to claim"),
    )),
    ("Latency", (
        Panel("Time to first token", "s", quantiles("tokenspool_time_to_first_token_seconds"),
              "submission to the first token published (queue wait + prefill)"),
        Panel("Inter-token latency", "s", quantiles("tokenspool_time_per_output_token_seconds"),
              "time per output token of finished sequences"),
        Panel("End-to-end latency", "s", quantiles("tokenspool_e2e_latency_seconds"),
              "submission to the job's completion"),
    )),
    ("Throughput", (
        Panel("Tokens per second", "short", (
            (f"sum by (model) (rate(tokenspool_generation_tokens_total{{{MODEL}}}[{RATE}]))", "{{model}} generated"),
            (f"sum by (model) (rate(tokenspool_prompt_tokens_total{{{MODEL}}}[{RATE}]))", "{{model}} prompt"),
        )),
        Panel("Job transitions per second", "short",
              ((f"sum by (event) (rate(tokenspool_jobs_total{{{MODEL}}}[{RATE}]))", "{{event}}"),),
              "submitted (API), completed, failed, cancelled, retried, dead_lettered"),
        Panel("Batch size and step time", "short", (
            (f"histogram_quantile(0.5, sum by (le) (rate(tokenspool_batch_size_bucket{{{MODEL}}}[{RATE}])))",
             "batch p50"),
            (f"histogram_quantile(0.95, sum by (le) (rate(tokenspool_step_duration_seconds_bucket{{{MODEL}}}"
             f"[{RATE}]))) * 1000", "step p95 (ms)"),
        )),
    )),
    ("Engine", (
        Panel("KV cache usage per worker", "percentunit",
              ((f"tokenspool_worker_kv_cache_usage_ratio{{{MODEL}}}", "{{worker}}"),),
              "from each worker's heartbeat, as the API sees it"),
        Panel("Running and waiting sequences", "short", (
            (f"sum by (model) (tokenspool_running_requests{{{MODEL}}})", "{{model}} running"),
            (f"sum by (model) (tokenspool_waiting_requests{{{MODEL}}})", "{{model}} waiting"),
        )),
        Panel("Preemptions per second", "short",
              ((f"sum by (model) (rate(tokenspool_preemptions_total{{{MODEL}}}[{RATE}]))", "{{model}}"),),
              "sequences whose KV blocks were reclaimed for lack of cache"),
        Panel("Speculative decoding acceptance", "percentunit", (
            (f"sum by (model) (rate(tokenspool_spec_decode_accepted_tokens_total{{{MODEL}}}[{RATE}])) / "
             f"sum by (model) (rate(tokenspool_spec_decode_draft_tokens_total{{{MODEL}}}[{RATE}]))", "{{model}}"),
        ), "accepted / proposed draft tokens (empty without speculative decoding)"),
        Panel("Prefix cache hit rate", "percentunit", (
            (f"sum by (model) (rate(tokenspool_prefix_cache_hits_total{{{MODEL}}}[{RATE}])) / "
             f"sum by (model) (rate(tokenspool_prefix_cache_queries_total{{{MODEL}}}[{RATE}]))", "{{model}}"),
        )),
        Panel("KV cache usage (worker scrape)", "percentunit",
              ((f"tokenspool_kv_cache_usage_ratio{{{MODEL}}}", "{{instance}}"),)),
    )),
    ("Errors", (
        Panel("Failed and dead-lettered jobs per second", "short", (
            (f'sum by (event) (rate(tokenspool_jobs_total{{{MODEL}, event=~"failed|dead_lettered"}}[{RATE}]))',
             "{{event}}"),
        )),
        Panel("HTTP errors per second", "short", (
            (f'sum by (status) (rate(tokenspool_api_requests_total{{status=~"[45].."}}[{RATE}]))', "{{status}}"),
        )),
        Panel("Submissions refused per second", "short",
              ((f"sum by (reason) (rate(tokenspool_api_jobs_rejected_total[{RATE}]))", "{{reason}}"),)),
        Panel("Dead-letter set", "short", (("tokenspool_dead_letter_jobs", "jobs"),), kind="stat", width=4),
        Panel("Open SSE streams", "short", (("sum(tokenspool_api_open_streams)", "streams"),), kind="stat",
              width=4),
        Panel("API request latency p95 by route", "s", (
            (f"histogram_quantile(0.95, sum by (le, route) (rate(tokenspool_api_request_duration_seconds_bucket"
             f"[{RATE}])))", "{{route}}"),
        )),
    )),
)


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE, "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(panel.targets)],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in ROWS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y += 1
        x = 0
        for panel in row:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(panel_json(panel, len(panels) + 1, x, y))
            x += panel.width
        y += 8
    variables = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus",
         "current": {}, "hide": 0},
        {"name": "model", "type": "query", "label": "model", "datasource": DATASOURCE,
         "query": {"query": "label_values(tokenspool_queue_depth, model)", "refId": "model"},
         "definition": "label_values(tokenspool_queue_depth, model)", "refresh": 2, "includeAll": True,
         "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "hide": 0},
    ]
    return {
        "uid": UID, "title": "tokenspool", "description": "Queue, latency, throughput, engine and errors of "
        "tokenspool (API /metrics and worker --metrics-port)", "tags": ["tokenspool", "llm"],
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "timezone": "browser",
        "templating": {"list": variables}, "annotations": {"list": []}, "panels": panels,
    }


def dashboard_text() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def configmap_text() -> str:
    """The ConfigMap, written by hand as YAML text so the JSON inside stays byte-identical to the file."""
    body = "".join(f"    {line}\n" if line else "\n" for line in dashboard_text().splitlines())
    return ("# Generated by monitoring/build_dashboard.py from the same panels as monitoring/grafana/dashboards/"
            "tokenspool.json; do not edit.\n"
            "# The Grafana sidecar (kube-prometheus-stack, grafana helm chart: sidecar.dashboards.enabled) loads\n"
            "# every ConfigMap labelled grafana_dashboard=\"1\"; set sidecar.dashboards.searchNamespace to include\n"
            "# this namespace.\n"
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: tokenspool-grafana-dashboard\n"
            "  labels:\n    grafana_dashboard: \"1\"\n    app.kubernetes.io/name: tokenspool\n"
            "data:\n  tokenspool.json: |\n" + body)


def main() -> None:
    DASHBOARD_JSON.write_text(dashboard_text())
    CONFIGMAP_YAML.write_text(configmap_text())
    print(f"wrote {DASHBOARD_JSON.relative_to(ROOT)} and {CONFIGMAP_YAML.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
