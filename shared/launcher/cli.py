"""The ``tokenspool`` command: ``api``, ``worker``, ``up``, ``models``, ``bench`` and ``config``.

Every option of ``api``, ``worker`` and ``up`` is a :class:`~shared.config.Settings` field, generated from the
field itself: ``--max-num-seqs`` sets ``max_num_seqs``, whose environment variable is ``TOKENSPOOL_MAX_NUM_SEQS``
(fields in seconds also accept the flag without ``-s``: ``--drain-timeout``). A flag given on the command line
wins, then the environment variable, then the default: the CLI builds ``Settings(**flags_given)``.
Heavy modules (torch, the API app, the engine) are imported inside the command that runs them, so
``tokenspool --help`` and ``tokenspool api`` never import torch.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import ValidationError

from shared.config import Settings

_QUEUE = ("redis_url", "queue_shards", "max_queue_length", "result_ttl_s", "lease_ttl_s", "heartbeat_interval_s",
          "max_attempts", "stream_maxlen")
_API = ("host", "port", "api_keys", "max_body_bytes", "max_tokens_cap", "max_n", "max_batch_size",
        "max_header_bytes", "header_timeout_s", "tokenize_threads", "redis_max_connections")
_TENANTS = ("queue_timeout_s", "job_timeout_s", "rate_limit_rpm", "rate_limit_tpm", "rate_limit_jobs",
            "api_key_policies")
# Files, batches and webhooks (the API's fire-and-forget loops).
_BATCH = ("file_max_bytes", "file_retention_s", "batch_max_lines", "batch_priority", "batch_max_queued",
          "batch_window_s", "batch_poll_s", "webhook_urls", "webhook_signing_key", "webhook_allowed_hosts",
          "webhook_retry_s", "webhook_timeout_s", "webhook_backoff_s")
_MODEL = ("model", "model_name", "model_cache_dir")
_ENGINE = ("device", "dtype", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
           "kv_cache_bytes", "enable_prefix_caching", "speculative", "draft_model", "num_speculative_tokens",
           "speculative_max_batch", "quantization", "kv_cache_dtype", "attention_backend", "async_scheduling",
           "num_threads", "drain_timeout_s", "claim_poll_s", "metrics_port")
_LOG = ("log_level", "log_prompts")

# The Settings fields each command takes as flags. `up` passes its settings on to the processes it starts;
# it takes no --worker-id because each of its workers needs its own.
COMMAND_FIELDS: dict[str, tuple[str, ...]] = {
    "api": _QUEUE + _API + _TENANTS + _BATCH + _MODEL + _LOG,
    "worker": _QUEUE + _MODEL + _ENGINE + ("worker_id",) + _LOG,
    "up": ("data_dir", "workers") + _QUEUE + _API + _TENANTS + _BATCH + _MODEL + _ENGINE + _LOG,
    "models": ("model_cache_dir", "log_level"),
}

# Every bench is a script in benchmarks/ (`bench serve` is the load generator, benchmarks/loadgen.py).
BENCHMARKS = {"offline": "offline_throughput.py", "queue-cost": "serve.py", "speculative": "speculative.py",
              "api-relay": "api_relay.py", "serve": "loadgen.py", "llama-cpp": "llama_cpp.py",
              "gpu-check": "gpu_check.py", "step-cost": "step_cost.py", "redis-capacity": "redis_capacity.py"}
BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def env_var(field: str) -> str:
    """The environment variable of a Settings field."""
    return f"TOKENSPOOL_{field.upper()}"


def flags(field: str) -> list[str]:
    """The CLI flags of a Settings field: its name in kebab case, plus the name without ``-s`` for seconds."""
    main = "--" + field.replace("_", "-")
    return [main, main.removesuffix("-s")] if field.endswith("_s") else [main]


def _base_type(annotation: Any) -> Any:
    """``int | None`` -> ``int``; ``list[str]`` -> ``list``."""
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
    return get_origin(annotation) or annotation


def default_text(field: str) -> str:
    """The default of a Settings field as shown in help and the README table."""
    info = Settings.model_fields[field]
    if field == "data_dir":
        return "~/.local/share/tokenspool"
    if info.default_factory is not None:
        return "(none)"
    if info.default is None:
        return "unset"
    if isinstance(info.default, bool):
        return str(info.default).lower()
    return str(info.default)


def _add_setting(parser: argparse.ArgumentParser, field: str) -> None:
    info = Settings.model_fields[field]
    kind = _base_type(info.annotation)
    description = (info.description or field.replace("_", " ")).replace("%", "%%")
    help_text = f"{description} [{env_var(field)}; default {default_text(field)}]"
    common: dict[str, Any] = {"dest": field, "default": argparse.SUPPRESS, "help": help_text}
    if kind is bool:
        parser.add_argument(*flags(field), action=argparse.BooleanOptionalAction, **common)
        return
    if kind is dict:  # a JSON object, as its environment variable takes it
        parser.add_argument(*flags(field), metavar="JSON", type=json.loads, **common)
        return
    metavar = "SECONDS" if field.endswith("_s") else {int: "N", float: "X", Path: "PATH", list: "A,B"}.get(kind)
    # Values stay strings here: Settings validates them, with the field's range in the error message.
    parser.add_argument(*flags(field), metavar=metavar or "TEXT", **common)


def build_parser() -> argparse.ArgumentParser:
    """The ``tokenspool`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="tokenspool",
        description="Queue-backed LLM generation: an HTTP API and workers joined by Redis. "
        "Every option also reads its TOKENSPOOL_* environment variable.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    api = commands.add_parser("api", help="run the HTTP API (no model, no torch)")
    worker = commands.add_parser("worker", help="run one worker: load the model, claim jobs from Redis")
    up = commands.add_parser("up", help="run everything: embedded Redis, the API and N workers")
    for name, sub in (("api", api), ("worker", worker), ("up", up)):
        for field in COMMAND_FIELDS[name]:
            _add_setting(sub, field)

    models = commands.add_parser("models", help="list built-in models or prepare (convert) one")
    model_commands = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    model_commands.add_parser("list", help="built-in models and whether they are ready")
    prepare = model_commands.add_parser("prepare", help="convert a model once into the cache")
    prepare.add_argument("name", help="built-in name (smollm2), a Hugging Face folder or a .gguf file")
    for sub in (models, prepare):
        for field in COMMAND_FIELDS["models"]:
            _add_setting(sub, field)

    bench = commands.add_parser("bench", help="load-test a running API (serve) or run a script from benchmarks/")
    bench.add_argument("benchmark", choices=sorted(BENCHMARKS), nargs="?", default="offline")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the benchmark script")

    config = commands.add_parser("config", help="print the effective settings (show) or the settings table")
    config.add_argument("view", choices=("show", "table"), nargs="?", default="show")
    return parser


def build_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Settings:
    """``Settings`` from the flags given (others come from the environment), or exit 2 naming the bad value."""
    given = {field: value for field, value in vars(args).items() if field in Settings.model_fields}
    try:
        return Settings(**given)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else "?"
            source = flags(field)[0] if field in given else env_var(field)
            problems.append(f"{source}: {error['msg']} (got {error.get('input')!r})")
        parser.exit(2, f"tokenspool {args.command}: invalid settings\n  " + "\n  ".join(problems) + "\n")


def settings_table() -> str:
    """A Markdown table of every setting: env var, flag, default, commands, description (for the README)."""
    rows = ["| Environment variable | Flag | Default | Commands | Description |", "|---|---|---|---|---|"]
    for field, info in Settings.model_fields.items():
        commands = ", ".join(name for name, fields in COMMAND_FIELDS.items() if field in fields) or "-"
        description = (info.description or "").replace("|", "\\|")
        rows.append(f"| `{env_var(field)}` | `{flags(field)[0]}` | `{default_text(field)}` | {commands} "
                    f"| {description} |")
    return "\n".join(rows)


def _run_models(args: argparse.Namespace, settings: Settings) -> int:
    from worker.models import BUILTIN_MODELS, ModelNotFoundError, default_cache_dir, find_builtin_gguf, is_hf_folder

    if args.models_command == "list":
        cache = settings.model_cache_dir or default_cache_dir()
        for model in BUILTIN_MODELS:
            folder = cache / model.name
            try:
                gguf = find_builtin_gguf(model)
                status = f"ready: {folder}" if is_hf_folder(folder) else f"not converted yet (from {gguf})"
            except ModelNotFoundError as exc:
                status = f"not installed: {exc}"
            print(f"{model.name:<10} {model.description}\n{'':<10} {status}")
        return 0
    from worker.models import resolve_model

    try:
        print(resolve_model(args.name, settings.model_cache_dir))
    except ModelNotFoundError as exc:
        print(f"tokenspool models prepare: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    script = BENCHMARKS_DIR / BENCHMARKS[args.benchmark]
    if not script.is_file():
        print(f"tokenspool bench {args.benchmark}: {script} does not exist yet (it comes with the benchmark issue)",
              file=sys.stderr)
        return 1
    return subprocess.call([sys.executable, str(script), *args.args])


REDACTED = "***"


def redact_url(url: str) -> str:
    """``url`` with its password (in the user info or a ``password=`` query parameter) replaced by ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}:{REDACTED}@{host}"
    query = urlencode([(k, REDACTED if k.lower() == "password" else v)
                       for k, v in parse_qsl(parts.query, keep_blank_values=True)], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redacted_settings(settings: Settings) -> dict[str, Any]:
    """The settings as JSON-ready values with secrets masked: each API key, the Redis password."""
    values = settings.model_dump(mode="json")
    values["api_keys"] = [REDACTED for _ in settings.api_keys]
    values["api_key_policies"] = {f"{REDACTED} ({i})": policy.model_dump(mode="json")  # keyed by the secret
                                  for i, policy in enumerate(settings.api_key_policies.values())}
    if settings.webhook_signing_key is not None:
        values["webhook_signing_key"] = REDACTED
    if settings.redis_url is not None:
        values["redis_url"] = redact_url(settings.redis_url)
    return values


def _run_config(args: argparse.Namespace, settings: Settings) -> int:
    if args.view == "table":
        print(settings_table())
    else:
        print(json.dumps(redacted_settings(settings), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tokenspool`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return _run_bench(args)
    settings = build_settings(parser, args)
    if args.command == "config":
        return _run_config(args, settings)
    if args.command == "models":
        return _run_models(args, settings)

    from shared.logging_setup import configure_logging

    configure_logging(settings.log_level)
    if args.command == "api":
        from api.main import run_api

        run_api(settings)
        return 0
    if args.command == "worker":
        from worker.main import run_worker

        return run_worker(settings)
    from shared.launcher.up import run_up

    return run_up(settings)


if __name__ == "__main__":
    sys.exit(main())
