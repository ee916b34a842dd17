"""Configuration: the one place that reads the environment.

Every setting has a ``TOKENSPOOL_*`` environment variable (the field name upper-cased) and a CLI flag of the
same name. Settings are frozen once built; the CLI builds them with ``Settings(**overrides)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.tenants import KeyPolicy, TenantPolicies


def default_data_dir() -> Path:
    """Where the embedded Redis keeps its AOF: ``~/.local/share/tokenspool``."""
    return Path.home() / ".local" / "share" / "tokenspool"


class Settings(BaseSettings):
    """All tokenspool settings. Sections: Redis, queue, API, worker/engine, logging."""

    model_config = SettingsConfigDict(env_prefix="TOKENSPOOL_", frozen=True, extra="ignore")

    # --- Redis ---------------------------------------------------------------------------------------
    redis_url: str | None = Field(None, description="Redis URL; unset = start an embedded redis-server; a Redis "
                                  "Cluster as redis+cluster://host:port[,host:port...] (rediss+cluster:// for TLS)")
    queue_shards: int = Field(1, ge=1, le=1024, description="queue shards every model's jobs spread over (each in "
                              "its own Cluster hash slot); every API and worker on one Redis must use the same")
    data_dir: Path = Field(default_factory=default_data_dir, description="embedded Redis data (AOF) directory")

    # --- queue protocol ------------------------------------------------------------------------------
    max_queue_length: int = Field(10_000, ge=1, description="queued jobs per model before submit returns 429")
    result_ttl_s: int = Field(86_400, ge=1, description="seconds a finished job's record and stream are kept")
    lease_ttl_s: float = Field(30.0, gt=0, description="seconds a claim lives without a heartbeat")
    heartbeat_interval_s: float = Field(5.0, gt=0, description="seconds between worker lease renewals")
    max_attempts: int = Field(3, ge=1, description="crashes of a job running alone before it is dead-lettered "
                              "(a first crash beside other jobs only isolates it)")
    stream_maxlen: int = Field(100_000, ge=100, description="max entries in one job's token replay log")

    # --- API -----------------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="accepted Bearer keys; empty = no auth"
    )
    max_body_bytes: int = Field(1_048_576, ge=1024, description="largest request body accepted")
    max_tokens_cap: int = Field(4096, ge=1, description="largest max_tokens a request may ask for")
    max_n: int = Field(8, ge=1, description="largest n (choices per request)")
    max_batch_size: int = Field(256, ge=1, description="most prompts in one POST /v1/jobs/batch")
    max_header_bytes: int = Field(65_536, ge=1024, description="largest request line + headers; more is 431")
    header_timeout_s: float = Field(10.0, gt=0, description="seconds a client has to send a request's headers "
                                    "(from connecting, or from the first byte on a kept-alive connection); then 408")
    tokenize_threads: int = Field(2, ge=1, description="prompts tokenized at once, off the event loop")
    redis_max_connections: int = Field(
        64, ge=4, description="API's Redis connections at most (a command waits for a free one); all open streams "
        "share one of them for their live events")

    # --- tenants: deadlines, rate limits, fair share (README "Sharing the fleet") ----------------------
    queue_timeout_s: float | None = Field(None, gt=0, description="default: a job must start within this many "
                                          "seconds or end expired; unset = wait forever")
    job_timeout_s: float | None = Field(None, gt=0, description="default: a job must end within this many seconds "
                                        "of submission (a running one stops with finish reason timeout)")
    rate_limit_rpm: int = Field(0, ge=0, description="default requests per minute per API key and model; 0 = off")
    rate_limit_tpm: int = Field(0, ge=0, description="default tokens (prompt + max_tokens) per minute per API "
                                "key and model; 0 = off")
    rate_limit_jobs: int = Field(0, ge=0, description="default queued + running jobs per API key and model; 0 = off")
    api_key_policies: dict[str, KeyPolicy] = Field(
        default_factory=dict, description='per API key: {"<key>": {"name", "rpm", "tpm", "max_jobs", "weight"}} '
        "(JSON); unset fields take the defaults above, weight 1")

    # --- files, batches, webhooks (docs: README "Batches and webhooks") ------------------------------------
    file_max_bytes: int = Field(50 * 1_048_576, ge=1024, description="largest file POST /v1/files accepts (kept "
                                "in Redis: size Redis's memory for it)")
    file_retention_s: int = Field(7 * 86_400, ge=60, description="seconds uploaded and batch output files live")
    batch_max_lines: int = Field(50_000, ge=1, description="most requests in one batch input file")
    batch_priority: int = Field(-100, ge=-1000, le=1000, description="priority of batch lines' jobs (interactive "
                                "requests default to 0 and run first)")
    batch_max_queued: int = Field(256, ge=1, description="jobs of one batch queued or running at once")
    batch_window_s: int = Field(86_400, ge=1, description="seconds a batch has to finish (its completion_window, "
                                "24h); unfinished lines then end batch_expired")
    batch_poll_s: float = Field(1.0, gt=0, description="seconds between a replica's rounds over active batches")
    webhook_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="operator webhook endpoints: every job and batch event goes to each")
    webhook_signing_key: str | None = Field(None, description="Standard Webhooks signing secret (whsec_<base64>)")
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="hosts a job's or batch's own webhook_url may name; empty = none")
    webhook_retry_s: float = Field(86_400.0, gt=0, description="seconds a delivery is retried before it is "
                                   "dead-lettered")
    webhook_timeout_s: float = Field(10.0, gt=0, description="seconds one delivery attempt may take")
    webhook_backoff_s: float = Field(1.0, gt=0, description="first retry delay; doubles each attempt, up to 10 min")

    # --- worker / engine -----------------------------------------------------------------------------
    model: str = Field("smollm2", description="built-in name, local HF folder or .gguf file")
    model_name: str | None = Field(None, description="name served to clients; default: the --model value")
    model_cache_dir: Path | None = Field(None, description="converted-model cache; default ~/.cache/tokenspool")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    dtype: str = Field("auto", description="auto (bf16 on CUDA, on CPUs with AMX and on AVX512-BF16 CPUs where "
                       "a startup probe finds bf16 matmuls 1.5x faster, else fp32; pin it for a fleet) | float32 "
                       "(transformers' exact forward) | bfloat16 | float16")
    max_num_seqs: int = Field(64, ge=1, description="requests decoded together")
    max_num_batched_tokens: int = Field(2048, ge=16, description="tokens computed in one engine step")
    block_size: int = Field(16, ge=1, description="tokens per KV cache block")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV blocks; unset = size from kv_cache_bytes")
    kv_cache_bytes: int | None = Field(None, ge=1, description="KV cache memory budget; unset = device default")
    enable_prefix_caching: bool = True
    speculative: str | None = Field(None, description="ngram | draft | unset")
    draft_model: str | None = None
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    speculative_max_batch: int = Field(8, ge=1, description="speculate only while at most this many requests run")
    quantization: str | None = Field("auto", description="auto (int4 on CPU where the weights came from 4-bit GGUF "
                                     "blocks, unless --dtype float32) | none | int8 | int4 (weight-only kernels for "
                                     "small batches) | fp16 (float16 weights, float32 activations; x86 CPUs)")
    kv_cache_dtype: str = Field("auto", pattern="^(auto|float32|bfloat16|float16)$",
                                description="auto (the compute dtype; float16 under float32 with quantised weights "
                                "on CPU) | float32 | bfloat16 | float16")
    attention_backend: str = Field("auto", pattern="^(auto|sdpa|kernel|flex)$",
                                   description="auto (flex on CUDA; on CPU the C++ decode kernel, built once with "
                                   "g++ and ninja, else sdpa) | sdpa (gathered K/V) | kernel | flex")
    async_scheduling: str = Field("auto", pattern="^(auto|on|off)$",
                                  description="schedule the next decode step while the GPU runs this one: auto (on "
                                  "where CUDA graphs replay decode steps) | on | off")
    num_threads: int | None = Field(None, ge=1, description="torch threads; unset = the cores this process may use")
    worker_id: str | None = Field(None, description="unique worker id; default host-pid-random")
    drain_timeout_s: float = Field(30.0, ge=0, description="seconds SIGTERM waits for running jobs")
    claim_poll_s: float = Field(0.5, gt=0, description="seconds between a worker's unprompted claims; new jobs "
                                "wake it at once, so this bounds only jobs pushed without a wake message")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="worker Prometheus port; unset = none")
    workers: int = Field(1, ge=0, description="workers started by `tokenspool up`")

    # --- logging -------------------------------------------------------------------------------------
    log_level: str = "INFO"
    log_prompts: bool = Field(False, description="include prompt and output text in logs")

    @field_validator("api_keys", "webhook_urls", "webhook_allowed_hosts", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        """Accept ``TOKENSPOOL_API_KEYS=key1,key2`` as well as a JSON list."""
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    def tenant_policies(self) -> TenantPolicies:
        """Each API key's policy by owner tag, with these settings' defaults (shared.tenants)."""
        default = KeyPolicy(rpm=self.rate_limit_rpm, tpm=self.rate_limit_tpm, max_jobs=self.rate_limit_jobs,
                            weight=1.0)
        return TenantPolicies(self.api_key_policies, default)

    @property
    def served_model_name(self) -> str:
        """The model name clients use in requests and that names the model's queue."""
        return self.model_name or self.model


def no_tokenizer_thread_pool() -> None:
    """Keep Hugging Face ``tokenizers`` from starting its own thread pool in this process (call at start-up).

    ``encode_batch`` (the API's off-loop token counting) otherwise spins up a pool of one thread per core that
    competes with the worker's torch threads and the event loop on small machines: with it, the queue-cost
    benchmark read +93-107 ms of added time to first token and 76-85% of the engine's throughput on 2 cores;
    without it, +18.7 ms and 90.3% (docs/performance.md). One prompt per call gains nothing from the pool.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
