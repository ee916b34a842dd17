"""Beam search equals transformers ``generate(num_beams=k, num_return_sequences=k, do_sample=False, ...)``: the k
sequences, best first, and their scores, for widths 2-8, with and without EOS, with transformers' length_penalty and
early_stopping (True, False, "never"), while the beams share blocks with each other and run in one batch beside
ordinary requests that share their prompt's prefix (prefix caching, chunked prefill and preemption on)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.engine.helpers import Case, Run, pad_id, poison_token, reference_beams, reference_greedy
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.kv_cache import num_blocks_needed


def beam_params(case: Case) -> SamplingParams:
    """The engine's spelling of ``case``: its EOS as the only stop token (ignore_eos drops the model's own)."""
    return SamplingParams(temperature=0.0, beam_width=case.width, max_tokens=case.max_tokens,
                          length_penalty=case.length_penalty, early_stopping=case.early_stopping,
                          stop_token_ids=(case.eos,) if case.eos is not None else (), ignore_eos=True,
                          min_tokens=case.min_tokens)


def check_beams(run: Run, model: torch.nn.Module, name: str, case: Case) -> None:
    expected = reference_beams(model, case)
    for i, (ref_tokens, ref_score) in enumerate(expected):
        event = run.finished[f"{name}#{i}"]
        tokens = run.token_ids[f"{name}#{i}"]
        pad = pad_id(case)
        assert ref_tokens[:len(tokens)] == tokens and set(ref_tokens[len(tokens):]) <= {pad}, f"{name} beam {i}"
        assert event.beam_score == pytest.approx(ref_score, abs=1e-4), f"{name} beam {i} score"
        ends_on_eos = case.eos is not None and tokens[-1] == case.eos
        assert event.finish_reason == ("stop" if ends_on_eos else "length")


def likely_token(model: torch.nn.Module, prompt: list[int]) -> int:
    """A token the model ranks second after the prompt: as an EOS it ends some beams early but not all."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    return int(logits.topk(2).indices[1])


def run_mixed(engine: Engine, cases: dict[str, Case], others: dict[str, tuple[list[int], SamplingParams]]) -> Run:
    """Ordinary requests, then (one step later, so their prompt blocks are cached) every beam search beside them;
    checks that the blocks all end free."""
    for name, (prompt, params) in others.items():
        engine.add_request(name, prompt, params)
    run = Run()
    run.record(engine.step())
    for name, case in cases.items():
        engine.add_request_group([f"{name}#{i}" for i in range(case.width)], case.prompt, beam_params(case))
    while engine.has_unfinished():
        run.record(engine.step())
        run.num_steps += 1
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert all(engine.block_pool.ref_count(b) == 0 for b in range(stats.num_total_blocks))
    return run


def test_tiny_model_widths_2_to_8_match_generate(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    rng = random.Random(21)
    shared = [rng.randrange(3, 49152) for _ in range(20)]
    settings = [(1.0, False), (0.0, True), (2.0, "never"), (-1.0, False), (1.0, True), (0.5, "never"), (1.0, "never")]
    cases: dict[str, Case] = {}
    for width, (length_penalty, early_stopping) in zip(range(2, 9), settings, strict=True):
        for with_eos in (False, True):
            prompt = shared[:rng.randint(5, 20)] + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 6))]
            cases[f"w{width}{'e' if with_eos else ''}"] = Case(
                prompt, width, rng.randint(4, 9), length_penalty, early_stopping,
                likely_token(model, prompt) if with_eos else None)
    cases["w5m"] = dataclasses.replace(cases["w5e"], min_tokens=3)  # EOS held off for 3 tokens (min_new_tokens)
    others = {f"g{i}": (shared[:rng.randint(4, 20)] + [rng.randrange(3, 49152)],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) for i in range(6)}
    engine = Engine(EngineConfig(dtype="float32", model=str(tiny_llama), block_size=8, num_kv_blocks=40,
                                 max_num_seqs=64, max_num_batched_tokens=48, enable_prefix_caching=True))
    run = run_mixed(engine, cases, others)
    for name, case in cases.items():
        check_beams(run, model, name, case)
    assert engine.stats().num_preemptions > 0, "the pool was meant to be too small"
    assert any(run.finished[f"{n}#0"].finish_reason == "stop" for n in cases), "no hypothesis ended on EOS"
    for name, (prompt, params) in others.items():
        assert run.token_ids[name] == reference_greedy(model, prompt, params)


def test_beams_share_blocks_and_free_dropped_ones_at_once(tiny_llama: Path) -> None:
    """A width-8 search over a 64-token prompt holds the prompt's blocks once, not 8 times."""
    engine = Engine(EngineConfig(dtype="float32", model=str(tiny_llama), block_size=4, num_kv_blocks=256,
                                 max_num_seqs=8, max_num_batched_tokens=128))
    prompt = list(range(100, 164))
    engine.add_request_group([f"b#{i}" for i in range(8)], prompt,
                             SamplingParams(temperature=0.0, beam_width=8, max_tokens=12, ignore_eos=True))
    max_used = 0
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        max_used = max(max_used, stats.num_total_blocks - stats.num_free_blocks)
    # Prompt blocks once, plus per beam at most the blocks its 12 own tokens touch (one shared-then-copied block).
    assert max_used <= num_blocks_needed(64, 4) + 8 * (num_blocks_needed(12, 4) + 1)
    assert max_used < 8 * num_blocks_needed(64 + 12, 4) // 3
    assert engine.stats().num_free_blocks == 256


def test_abort_ends_the_whole_group_and_frees_its_blocks(tiny_llama: Path) -> None:
    engine = Engine(EngineConfig(dtype="float32", model=str(tiny_llama), block_size=4, num_kv_blocks=64,
                                 max_num_seqs=8))
    engine.add_request_group(["a#0", "a#1", "a#2"], list(range(5, 30)),
                             SamplingParams(temperature=0.0, beam_width=4, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        assert engine.step() == []  # beams report only when the search is over
    assert engine.stats().num_free_blocks < 64
    assert engine.abort("a#1") and not engine.abort("a#0") and not engine.abort("a#0/beam0")
    assert not engine.has_unfinished() and engine.stats().num_free_blocks == 64


def test_logprobs_of_each_beam_add_up_to_its_score(tiny_llama: Path) -> None:
    engine = Engine(EngineConfig(dtype="float32", model=str(tiny_llama), block_size=4, num_kv_blocks=64,
                                 max_num_seqs=8))
    engine.add_request_group(["p#0", "p#1", "p#2"], list(range(40, 52)), SamplingParams(
        temperature=0.0, beam_width=3, max_tokens=5, ignore_eos=True, logprobs=2, length_penalty=1.0))
    run = Run()
    while engine.has_unfinished():
        run.record(engine.step())
    for i in range(3):
        event = run.finished[f"p#{i}"]
        assert [lp.token_id for lp in event.logprobs] == run.token_ids[f"p#{i}"]
        assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.logprob - 1e-6 for lp in event.logprobs)
        assert event.beam_score == pytest.approx(sum(lp.logprob for lp in event.logprobs) / 5, abs=1e-4)


def test_a_beam_group_with_nan_logits_fails_alone(tiny_llama: Path) -> None:
    engine = Engine(EngineConfig(dtype="float32", model=str(tiny_llama), block_size=4, num_kv_blocks=64,
                                 max_num_seqs=8))
    poison_token(engine, 77)
    engine.add_request_group(["bad#0", "bad#1"], [5, 77, 6], SamplingParams(temperature=0.0, beam_width=3))
    engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    run = Run()
    while engine.has_unfinished():
        run.record(engine.step())
    assert [run.finished[f"bad#{i}"].finish_reason for i in range(2)] == ["error", "error"]
    assert "not finite" in (run.finished["bad#0"].error or "")
    assert run.finished["good"].finish_reason == "length" and len(run.token_ids["good"]) == 4
    assert engine.stats().num_free_blocks == 64


@pytest.mark.parametrize("fields, name", [
    ({"temperature": 0.7}, "temperature"), ({"top_p": 0.9}, "top_p"), ({"top_k": 5}, "top_k"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"), ({"stop": ("x",)}, "stop"), ({"logprobs": 6}, "logprobs"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
])
def test_beam_search_refuses_what_it_cannot_honour(fields: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{"temperature": 0.0, "beam_width": 4, **fields})


def test_engine_refuses_a_width_beyond_its_seats_or_pool(tiny_llama: Path) -> None:
    engine = Engine(EngineConfig(dtype="float32", model=str(tiny_llama), block_size=4, num_kv_blocks=16,
                                 max_num_seqs=4))
    with pytest.raises(ValueError, match="beam_width"):
        engine.add_request("x", [5, 6, 7], SamplingParams(temperature=0.0, beam_width=5))
    with pytest.raises(ValueError, match="beam_width"):
        engine.add_request("x", list(range(5, 40)), SamplingParams(temperature=0.0, beam_width=4, max_tokens=8))
    with pytest.raises(ValueError, match="n "):
        engine.add_request_group(["x#0", "x#1", "x#2"], [5, 6], SamplingParams(temperature=0.0, beam_width=2))
    assert not engine.has_unfinished()


@pytest.mark.slow
def test_smollm2_beams_and_scores_match_generate(smollm2: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    head = "The quick brown fox jumps over the lazy dog. "
    prompts = [tokenizer.encode(head + tail) for tail in ("The capital of France is", "Once upon a time,",
                                                          "def fibonacci(n):")]
    period = tokenizer.encode(".")[0]
    cases = {"fr": Case(prompts[0], 4, 10, 1.0, False, period),
             "tale": Case(prompts[1], 3, 8, 0.5, True, None),
             "code": Case(prompts[2], 2, 8, 1.0, "never", None)}
    others = {"plain": (tokenizer.encode(head + "A second request"),
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))}
    engine = Engine(EngineConfig(dtype="float32", model=str(smollm2), block_size=8, num_kv_blocks=128,
                                 max_num_seqs=16, max_num_batched_tokens=64, enable_prefix_caching=True))
    run = run_mixed(engine, cases, others)
    for name, case in cases.items():
        check_beams(run, model, name, case)
    assert any(run.finished[f"fr#{i}"].finish_reason == "stop" for i in range(4)), "no beam ended on its EOS"
    assert run.token_ids["plain"] == reference_greedy(model, *others["plain"])
    assert engine.stats().prefix_cache_hits > 0
