"""The Kubernetes manifests in k8s/: valid against Kubernetes' own schema, and consistent with each other, with
``shared.config.Settings``, with the API's real routes and with the metrics contract in docs/operations.md.

Offline and fast: kubernetes-validate bundles the OpenAPI schemas of each Kubernetes release. KEDA's
ScaledObject is a CRD with no bundled schema, so its structure is checked here by hand.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from shared.config import Settings

# The Kubernetes release whose schema the manifests must satisfy (kubernetes-validate bundles it).
K8S_VERSION = "1.32"
ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "k8s"
OPERATIONS_DOC = ROOT / "docs" / "operations.md"
CRD_GROUPS = ("keda.sh/",)
# After the drain timeout the worker still hands unfinished jobs back to the queue and exits.
HAND_BACK_MARGIN_S = 10
TOKENSPOOL_IMAGE = re.compile(r"(^|/)tokenspool(:|$)")

Manifest = dict[str, Any]


def load_manifests() -> list[tuple[str, Manifest]]:
    """Every resource in k8s/ (file name, resource), kustomization.yaml excepted."""
    found = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((path.name, doc))
    return found


MANIFESTS = load_manifests()


def resource_id(item: tuple[str, Manifest]) -> str:
    file_name, doc = item
    return f"{file_name}:{doc['kind']}/{doc['metadata']['name']}"


def find(kind: str, name: str | None = None) -> Manifest:
    matches = [doc for _, doc in MANIFESTS if doc["kind"] == kind and name in (None, doc["metadata"]["name"])]
    assert len(matches) == 1, f"expected one {kind} {name or ''} in k8s/, found {len(matches)}"
    return matches[0]


def all_of(kind: str) -> list[Manifest]:
    return [doc for _, doc in MANIFESTS if doc["kind"] == kind]


def pod_spec(workload: Manifest) -> Manifest:
    return cast(Manifest, workload["spec"]["template"]["spec"])


def pod_labels(workload: Manifest) -> dict[str, str]:
    return cast(dict[str, str], workload["spec"]["template"]["metadata"]["labels"])


def container(workload: Manifest) -> Manifest:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: expected one container"
    return cast(Manifest, containers[0])


def tokenspool_containers() -> Iterator[tuple[str, Manifest]]:
    for kind in ("Deployment", "StatefulSet"):
        for workload in all_of(kind):
            for c in pod_spec(workload)["containers"]:
                if TOKENSPOOL_IMAGE.search(c["image"]):
                    yield workload["metadata"]["name"], c


def arg_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def port_number(c: Manifest, port: int | str) -> int:
    """A probe's port (number or name) as a number, asserting the container declares it."""
    declared = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    if isinstance(port, str):
        assert port in declared, f"container {c['name']}: probe port {port!r} is not one of {sorted(declared)}"
        return int(declared[port])
    assert port in declared.values(), f"container {c['name']}: probe port {port} is not declared"
    return port


def probes(c: Manifest) -> dict[str, Manifest]:
    return {kind: c[kind] for kind in ("startupProbe", "livenessProbe", "readinessProbe") if kind in c}


def prestop_sleep_s(c: Manifest) -> int:
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", f"{c['name']}: preStop {command} is not a plain sleep; update this budget check"
    return int(command[1])


def configmap() -> dict[str, str]:
    return cast(dict[str, str], find("ConfigMap", "tokenspool-config")["data"])


def secret_data(name: str) -> dict[str, str]:
    return cast(dict[str, str], find("Secret", name)["stringData"])


def settings_field(env_name: str) -> str | None:
    """The Settings field an environment variable sets, or None if it sets none."""
    if not env_name.startswith("TOKENSPOOL_"):
        return None
    field = env_name.removeprefix("TOKENSPOOL_").lower()
    return field if field in Settings.model_fields else None


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


# --- schema ---------------------------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    on_disk = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(on_disk)
    assert kustomization["namespace"] == find("Namespace")["metadata"]["name"]


@pytest.mark.parametrize("item", [m for m in MANIFESTS if not m[1]["apiVersion"].startswith(CRD_GROUPS)],
                         ids=resource_id)
def test_manifest_matches_the_kubernetes_schema(item: tuple[str, Manifest]) -> None:
    # strict: an unknown (misspelt) field is an error, not silently dropped as kubectl apply would.
    kubernetes_validate.validate(item[1], K8S_VERSION, strict=True)


def test_schema_check_rejects_a_misspelt_field() -> None:
    worker = yaml.safe_load((K8S_DIR / "worker.yaml").read_text())
    spec = pod_spec(worker)
    spec["terminationGracePeriodSecond"] = spec.pop("terminationGracePeriodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriodSecond"):
        kubernetes_validate.validate(worker, K8S_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_renders_every_resource_into_the_namespace() -> None:
    rendered = subprocess.run(["kubectl", "kustomize", str(K8S_DIR)], capture_output=True, text=True,
                              timeout=30, check=True).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    assert sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs) == sorted(
        f"{d['kind']}/{d['metadata']['name']}" for _, d in MANIFESTS)
    namespace = find("Namespace")["metadata"]["name"]
    assert all(d["metadata"].get("namespace") == namespace for d in docs if d["kind"] != "Namespace")


# --- KEDA ScaledObject (a CRD: checked structurally) ------------------------------------------------------------


def scaled_object() -> Manifest:
    return find("ScaledObject")


def test_scaledobject_structure() -> None:
    so = scaled_object()
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    known = {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod",
             "idleReplicaCount", "fallback", "advanced", "triggers", "initialCooldownPeriod"}
    assert set(spec) <= known, f"unknown ScaledObject fields: {set(spec) - known}"
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["pollingInterval"] > 0 and spec["cooldownPeriod"] > 0
    assert spec["triggers"], "a ScaledObject needs at least one trigger"
    for trigger in spec["triggers"]:
        assert isinstance(trigger["type"], str) and isinstance(trigger["metadata"], dict)
        assert all(isinstance(v, str) for v in trigger["metadata"].values()), "KEDA trigger metadata are strings"
    if "fallback" in spec:
        # KEDA only applies a fallback to AverageValue metrics.
        assert all(t.get("metricType", "AverageValue") == "AverageValue" for t in spec["triggers"])
        assert spec["fallback"]["failureThreshold"] > 0 and spec["fallback"]["replicas"] >= spec["minReplicaCount"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert set(behavior) <= {"scaleUp", "scaleDown"}


def test_keda_scales_the_worker_deployment() -> None:
    target = scaled_object()["spec"]["scaleTargetRef"]
    worker = find("Deployment", target["name"])
    assert target.get("kind", "Deployment") == "Deployment" and target.get("apiVersion", "apps/v1") == "apps/v1"
    assert any(c["resources"]["limits"].get("nvidia.com/gpu") for c in pod_spec(worker)["containers"])
    assert "replicas" not in worker["spec"], "KEDA owns the worker replica count; a fixed one would fight it"


def test_keda_trigger_reads_the_queue_depth_metric() -> None:
    (trigger,) = scaled_object()["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert urlsplit(meta["serverAddress"]).scheme in ("http", "https")
    assert "tokenspool_queue_depth" in meta["query"]
    assert f'model="{configmap()["TOKENSPOOL_MODEL"]}"' in meta["query"], "the query must select the served model"
    assert meta["ignoreNullValues"] == "false"


def test_keda_threshold_is_one_worker_of_backlog() -> None:
    threshold = float(scaled_object()["spec"]["triggers"][0]["metadata"]["threshold"])
    assert 0 < threshold <= int(configmap()["TOKENSPOOL_MAX_NUM_SEQS"])


def test_api_readiness_needs_a_live_worker_so_keda_keeps_one() -> None:
    api = container(find("Deployment", "tokenspool-api"))
    if api["readinessProbe"]["httpGet"]["path"] == "/readyz":
        # /readyz fails without a live worker: with zero workers no API pod is ready, nothing can be queued,
        # and the queue-depth trigger would never wake a worker.
        assert scaled_object()["spec"]["minReplicaCount"] >= 1


# --- workers ----------------------------------------------------------------------------------------------------


def test_worker_grace_period_covers_prestop_and_drain() -> None:
    worker = find("Deployment", "tokenspool-worker")
    drain_s = float(configmap()["TOKENSPOOL_DRAIN_TIMEOUT_S"])
    budget_s = prestop_sleep_s(container(worker)) + drain_s + HAND_BACK_MARGIN_S
    assert pod_spec(worker)["terminationGracePeriodSeconds"] >= budget_s > drain_s


def test_worker_requests_exactly_one_gpu() -> None:
    resources = container(find("Deployment", "tokenspool-worker"))["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"].get("nvidia.com/gpu", 1) == 1


def test_worker_probes_hit_its_metrics_port() -> None:
    worker = container(find("Deployment", "tokenspool-worker"))
    metrics_port = int(arg_value(worker["args"], "--metrics-port"))
    assert set(probes(worker)) == {"startupProbe", "livenessProbe", "readinessProbe"}
    for kind, probe in probes(worker).items():
        assert probe["httpGet"]["path"] == "/metrics", kind
        assert port_number(worker, probe["httpGet"]["port"]) == metrics_port, kind
    annotations = find("Deployment", "tokenspool-worker")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == metrics_port


# --- API --------------------------------------------------------------------------------------------------------


def test_api_probes_hit_real_routes_on_the_serving_port() -> None:
    from api.routes.health import router

    routes = {route.path for route in router.routes}  # type: ignore[attr-defined]
    deployment = find("Deployment", "tokenspool-api")
    api = container(deployment)
    serving_port = int(arg_value(api["args"], "--port"))
    assert set(probes(api)) >= {"livenessProbe", "readinessProbe"}
    for kind, probe in probes(api).items():
        assert probe["httpGet"]["path"] in routes, f"{kind} path is not an API route"
        assert port_number(api, probe["httpGet"]["port"]) == serving_port, kind
    # Liveness must not depend on Redis or workers (an outage there must not restart every API pod).
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz"
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in routes and int(annotations["prometheus.io/port"]) == serving_port


def test_hpa_scales_the_api_deployment() -> None:
    hpa = find("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    api = find("Deployment", target["name"])
    assert pod_labels(api)["app.kubernetes.io/component"] == "api"
    assert "replicas" not in api["spec"], "the HPA owns the API replica count; a fixed one would fight it"
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    # Utilization targets need CPU requests to be computed against.
    assert container(api)["resources"]["requests"]["cpu"]


def test_pdb_covers_exactly_the_api_pods() -> None:
    pdb = find("PodDisruptionBudget")
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert selects(selector, pod_labels(find("Deployment", "tokenspool-api")))
    others = [w for w in all_of("Deployment") + all_of("StatefulSet") if w["metadata"]["name"] != "tokenspool-api"]
    assert not any(selects(selector, pod_labels(w)) for w in others)
    # A minAvailable as large as the smallest replica count would block every node drain.
    assert pdb["spec"]["minAvailable"] < find("HorizontalPodAutoscaler")["spec"]["minReplicas"]


# --- services, Redis, configuration --------------------------------------------------------------------------


def test_workload_selectors_match_their_pod_templates() -> None:
    for workload in all_of("Deployment") + all_of("StatefulSet"):
        assert selects(workload["spec"]["selector"]["matchLabels"], pod_labels(workload)), workload["metadata"]["name"]


def test_every_service_reaches_a_declared_container_port() -> None:
    workloads = all_of("Deployment") + all_of("StatefulSet")
    for service in all_of("Service"):
        selector = service["spec"]["selector"]
        backends = [w for w in workloads if selects(selector, pod_labels(w))]
        assert len(backends) == 1, f"Service {service['metadata']['name']} selects {len(backends)} workloads"
        for port in service["spec"]["ports"]:
            port_number(container(backends[0]), port["targetPort"])


def test_redis_is_durable_and_never_evicts() -> None:
    redis = find("StatefulSet", "redis")
    args = container(redis)["args"]
    assert arg_value(args, "--appendonly") == "yes"
    assert arg_value(args, "--appendfsync") == "everysec"
    assert arg_value(args, "--maxmemory-policy") == "noeviction"
    assert arg_value(args, "--requirepass") == "$(REDIS_PASSWORD)"
    # The data directory is the persistent volume from the claim template.
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container(redis)["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == arg_value(args, "--dir")
    governing = find("Service", redis["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None"


def test_redis_url_points_at_the_redis_service_with_its_password() -> None:
    url = urlsplit(secret_data("tokenspool-secrets")["TOKENSPOOL_REDIS_URL"])
    service = find("Service", url.hostname)
    assert url.port in {p["port"] for p in service["spec"]["ports"]}
    assert url.password == secret_data("redis-auth")["REDIS_PASSWORD"]


def test_secrets_hold_only_placeholders() -> None:
    for secret in all_of("Secret"):
        for key, value in secret["stringData"].items():
            assert "CHANGE-ME" in value, f"Secret {secret['metadata']['name']}/{key} holds a non-placeholder value"
        assert "data" not in secret, "use stringData placeholders, never base64 data, in the repository"


def test_configmap_keys_are_settings_fields() -> None:
    unknown = [key for key in configmap() if settings_field(key) is None]
    assert not unknown, f"not Settings fields: {unknown}"


def test_tokenspool_containers_set_only_settings_fields() -> None:
    for workload, c in tokenspool_containers():
        names = [e["name"] for e in c.get("env", [])]
        for source in c.get("envFrom", []):
            if "configMapRef" in source:
                names += list(find("ConfigMap", source["configMapRef"]["name"])["data"])
            if "secretRef" in source:
                names += list(secret_data(source["secretRef"]["name"]))
        unknown = [name for name in names if settings_field(name) is None]
        assert not unknown, f"{workload}: not Settings fields: {unknown}"


def test_configuration_builds_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = container(find("Deployment", "tokenspool-worker"))
    env = {**configmap(), **secret_data("tokenspool-secrets"), **{e["name"]: e["value"] for e in worker["env"]}}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.drain_timeout_s == float(configmap()["TOKENSPOOL_DRAIN_TIMEOUT_S"])
    assert settings.device == "cuda"
    assert len(settings.api_keys) == 2 and all(settings.api_keys)
    # A lease must survive a missed heartbeat or two.
    assert settings.heartbeat_interval_s * 3 <= settings.lease_ttl_s


def test_pods_meet_the_restricted_pod_security_standard() -> None:
    assert find("Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for workload in all_of("Deployment") + all_of("StatefulSet"):
        name = workload["metadata"]["name"]
        security = pod_spec(workload)["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] > 0, name
        assert security["seccompProfile"]["type"] == "RuntimeDefault", name
        for c in pod_spec(workload)["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], name


def test_tokenspool_pods_run_as_the_images_user() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    image_uids = {int(uid) for uid in re.findall(r"^USER (\d+)", dockerfile, re.MULTILINE)}
    for workload in all_of("Deployment"):
        assert {pod_spec(workload)["securityContext"]["runAsUser"]} == image_uids, workload["metadata"]["name"]


# --- the metrics contract ----------------------------------------------------------------------------------


def contract_metrics() -> dict[str, str]:
    """Metric name -> type, from the contract table in docs/operations.md (rows like | `name` | counter | ...)."""
    rows = re.findall(r"^\| `(tokenspool_[a-z0-9_]+)`(?:\{[^}]*\})? \| (counter|gauge|histogram) \|",
                      OPERATIONS_DOC.read_text(), re.MULTILINE)
    return dict(rows)


def mentioned_metrics(text: str) -> set[str]:
    """Metric names used in PromQL or prose, with histogram series suffixes removed."""
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in re.findall(r"\btokenspool_[a-z0-9_]+", text)}


def test_metric_contract_names_are_prometheus_conventional() -> None:
    contract = contract_metrics()
    assert len(contract) >= 20
    for name, kind in contract.items():
        assert name.endswith("_total") == (kind == "counter"), f"{name}: only counters end in _total"
        if kind == "histogram":
            assert name.endswith(("_seconds", "_size")), f"{name}: histograms carry their unit"
        assert not name.endswith(("_bucket", "_sum", "_count")), name


def test_every_metric_the_manifests_and_doc_use_is_in_the_contract() -> None:
    contract = set(contract_metrics())
    used_by_manifests = mentioned_metrics("".join(p.read_text() for p in K8S_DIR.glob("*.yaml")))
    assert used_by_manifests and used_by_manifests <= contract, used_by_manifests - contract
    used_by_doc = mentioned_metrics(OPERATIONS_DOC.read_text())
    assert used_by_doc <= contract, f"docs/operations.md uses metrics outside its contract: {used_by_doc - contract}"
