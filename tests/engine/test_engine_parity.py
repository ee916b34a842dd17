"""Greedy engine output equals transformers ``generate`` token for token, under queueing, chunked prefill and
preemption (the hard paths: every request's K/V is split over chunks, evicted and recomputed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.helpers import drain, mixed_workload, reference_greedy
from worker.engine import Engine, EngineConfig


def check_parity(model_path: Path, config: EngineConfig, workload: list, min_preemptions: int = 1) -> None:
    engine = Engine(config)
    for i, (prompt, params, priority) in enumerate(workload):
        engine.add_request(f"r{i}", prompt, params, priority=priority)
    run = drain(engine)
    stats = engine.stats()
    assert stats.num_preemptions >= min_preemptions, "the pool was meant to be too small"
    assert run.max_waiting > 0, "max_num_seqs was meant to force queueing"
    assert any(len(p) > config.max_num_batched_tokens for p, _, _ in workload), "needs chunked prefill"
    assert stats.num_free_blocks == stats.num_total_blocks

    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for i, (prompt, params, _) in enumerate(workload):
        expected = reference_greedy(reference, prompt, params)
        assert run.token_ids[f"r{i}"] == expected, f"request r{i} (prompt {len(prompt)} tokens) differs"
        finish = run.finished[f"r{i}"].finish_reason
        assert finish == ("length" if len(expected) == params.max_tokens and expected[-1] != 2 else "stop")


def test_tiny_models_match_generate(tiny_model: Path) -> None:
    workload = mixed_workload(seed=3, num_requests=32, max_prompt=500, max_output=40, vocab=49152)
    config = EngineConfig(dtype="float32", model=str(tiny_model), block_size=16, num_kv_blocks=48, max_num_seqs=8,
                          max_num_batched_tokens=96)
    check_parity(tiny_model, config, workload)


@pytest.mark.slow
def test_smollm2_matches_generate(smollm2: Path) -> None:
    engine_vocab = 49152
    workload = mixed_workload(seed=5, num_requests=24, max_prompt=120, max_output=12, vocab=engine_vocab)
    config = EngineConfig(dtype="float32", model=str(smollm2), block_size=8, num_kv_blocks=48, max_num_seqs=12,
                          max_num_batched_tokens=64)
    check_parity(smollm2, config, workload)
