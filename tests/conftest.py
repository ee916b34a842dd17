"""Shared fixtures: a private redis-server, a private Redis Cluster, tiny random-weight models and the real SmolLM2.

No in-memory Redis fakes and no mocks: queue and API tests talk to a real ``redis-server`` started here on a free port,
cluster tests to a real local cluster of ``redis-server`` nodes (3 masters, 1 replica each).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from shared.launcher.redis_cluster import LocalRedisCluster, cluster_support_problem
from shared.launcher.redis_server import RedisServer

SMOLLM2_VOCAB = 49152  # tiny models share SmolLM2's tokenizer, so text round-trips
SMALL_VOCAB = 32  # for distribution (chi-square) tests: every token's probability is non-negligible


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server (AOF on) for the whole run. Fault tests may stop/restart it; it keeps port and data."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The test Redis's URL, flushed before each test so tests never see each other's keys."""
    if not redis_server.running:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """One local Redis Cluster (3 masters, 1 replica each) for the whole run, started on first use (~2.3 s).

    Skipped where redis-server/redis-cli cannot make one (no redis-cli, or Redis older than 7). Fault tests may
    ``kill_master(i)``; ``redis_cluster_url`` revives killed nodes (as replicas) before the next test.
    """
    problem = cluster_support_problem()
    if problem is not None:
        pytest.skip(f"no local Redis Cluster here: {problem}")
    cluster = LocalRedisCluster(num_masters=3, replicas=1, data_dir=tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture()
def redis_cluster_url(redis_cluster: LocalRedisCluster) -> str:
    """The test cluster's ``redis+cluster://`` URL: whole again (killed nodes revived) and every master flushed."""
    redis_cluster.revive()
    redis_cluster.flushall()
    return redis_cluster.url


def _save_tiny(kind: str, out: Path, vocab_size: int = SMOLLM2_VOCAB) -> Path:
    """A tiny random-weight model of architecture ``kind`` with SmolLM2's real tokenizer.

    With ``vocab_size`` smaller than the tokenizer's, use token-id prompts only.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    if kind == "llama":
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=1024, **common)
    elif kind == "qwen2":
        config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=1024, **common)
    elif kind == "gpt2":
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **common)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    tokenizer.save_pretrained(out)
    return out


def smollm2_folder() -> Path:
    """The converted SmolLM2 folder (converted once into the user cache by ``make setup``)."""
    from worker.models import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each tiny architecture in turn."""
    return _save_tiny(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return smollm2_folder()


@pytest.fixture(scope="session")
def tiny_small_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a 32-token vocabulary, for chi-square tests of sampling distributions."""
    return _save_tiny("llama", tmp_path_factory.mktemp("tiny-small-vocab"), vocab_size=SMALL_VOCAB)
