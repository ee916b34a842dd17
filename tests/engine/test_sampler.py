"""Sampler behaviour: hand-computed penalties and filters, seeds, logprobs, and chi-square tests of the draws."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from worker.engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    compute_probs,
    greedy_tokens,
    make_generator,
    prepare_sampling_batch,
)
from worker.engine.sampling_params import SamplingParams

EOS = 2
PROMPT = [1, 5, 9, 13, 17]


def _batch(params: list[SamplingParams], prompts: list[list[int]] | None = None,
           outputs: list[list[int]] | None = None, eos: list[int] | None = None) -> SamplingBatch:
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    generators = [make_generator(p.seed, "cpu") for p in params]
    return prepare_sampling_batch(params, prompts, outputs, generators, eos if eos is not None else [EOS], "cpu")


def _support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def _chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square goodness of fit, via the regularised upper incomplete gamma function."""
    counts, expected_probs = counts.double(), expected_probs.double()
    expected = expected_probs * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


# --- greedy -------------------------------------------------------------------------------------------------


def test_greedy_is_argmax_even_in_a_mixed_batch() -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, seed=3),
              SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2), SamplingParams(),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_p=0.3)]
    out = Sampler()(logits, _batch(params))
    greedy_rows = [0, 2, 4]
    assert out.token_ids[greedy_rows].tolist() == logits[greedy_rows].argmax(dim=-1).tolist()
    assert out.token_ids.shape == (6,) and out.token_ids.dtype == torch.long


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_argmax_on_ties_nan_and_infinities(dtype: torch.dtype) -> None:
    inf, nan = float("inf"), float("nan")
    special = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 5.0], [-inf] * 4, [1.0, inf, inf, 0.0],
                            [0.0, nan, inf, 1.0]], dtype=dtype)
    ties = torch.randint(0, 3, (64, 4099), generator=torch.Generator().manual_seed(0)).to(dtype)  # many equal maxima
    for logits in (special, ties, ties[:, 1:]):  # the last one a strided view
        assert greedy_tokens(logits).tolist() == logits.argmax(dim=-1).tolist()


def test_greedy_matches_transformers_generate(tiny_small_vocab: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_small_vocab, dtype=torch.float32)
    expected = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                              pad_token_id=EOS)[0, len(PROMPT):].tolist()
    ids = list(PROMPT)
    params = SamplingParams(temperature=0.0, min_tokens=8)
    with torch.no_grad():
        for _ in range(8):
            logits = model(torch.tensor([ids])).logits[:, -1]  # [1, V]
            batch = prepare_sampling_batch([params], [PROMPT], [ids[len(PROMPT):]], [None], [EOS], "cpu")
            ids.append(int(Sampler()(logits, batch).token_ids[0]))
    assert ids[len(PROMPT):] == expected


# --- penalties, hand-computed -------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -0.5]])
    batch = _batch([SamplingParams(repetition_penalty=2.0)], prompts=[[0]], outputs=[[1, 1]])
    # token 0 (prompt, +): 2 / 2; token 1 (output, -): -1 * 2; tokens 2-4 unseen: unchanged.
    assert apply_penalties(logits, batch).tolist() == [[1.0, -2.0, 0.5, 3.0, -0.5]]


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    plain = Sampler()(logits, _batch([SamplingParams(temperature=0.0)], prompts=[[0]]))
    penalised = Sampler()(logits, _batch([SamplingParams(temperature=0.0, repetition_penalty=2.0)], prompts=[[0]]))
    assert (plain.token_ids.item(), penalised.token_ids.item()) == (0, 1)  # 3 / 2 = 1.5 < 2


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.5]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    batch = _batch([params], prompts=[[2, 2, 3]], outputs=[[0, 0, 0, 1]])
    # token 0: 1 - 3*0.5 - 0.25 = -0.75; token 1: 1 - 0.5 - 0.25 = 0.25; tokens 2, 3 only in the prompt.
    assert apply_penalties(logits, batch).tolist() == [[-0.75, 0.25, 1.0, 0.5]]


def test_repetition_penalty_applies_before_frequency_penalty() -> None:
    logits = torch.tensor([[2.0, 0.0]])
    batch = _batch([SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5)], outputs=[[0, 0]])
    assert apply_penalties(logits, batch).tolist() == [[0.0, 0.0]]  # 2 / 2 - 2 * 0.5 (not (2 - 1) / 2)


def test_penalties_are_per_row() -> None:
    logits = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    params = [SamplingParams(), SamplingParams(presence_penalty=1.5), SamplingParams(repetition_penalty=4.0)]
    batch = _batch(params, prompts=[[0], [0], [0]], outputs=[[1], [1], [1]])
    assert apply_penalties(logits, batch).tolist() == [[1.0, 1.0], [1.0, -0.5], [0.25, 0.25]]


def test_neutral_batch_builds_no_penalty_or_filter_tensors() -> None:
    batch = _batch([SamplingParams(), SamplingParams(temperature=0.0)], prompts=[[1, 2]] * 2, outputs=[[3]] * 2)
    assert batch.prompt_tokens is batch.output_tokens is batch.banned_tokens is None
    assert batch.top_k is batch.top_p is batch.min_p is None


# --- min_tokens ---------------------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]])  # EOS (2) is the favourite, then stop token 3
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    chosen = [Sampler()(logits, _batch([params], outputs=[[4] * n])).token_ids.item() for n in range(3)]
    assert chosen == [4, 4, 2]


def test_ignore_eos_leaves_eos_sampleable_during_min_tokens_but_masks_stop_token_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 6.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(3,), ignore_eos=True)
    assert Sampler()(logits, _batch([params], outputs=[[1]])).token_ids.item() == EOS


def test_min_tokens_masks_every_eos_id() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 6.0]])
    params = SamplingParams(temperature=0.0, min_tokens=1)
    assert Sampler()(logits, _batch([params], eos=[2, 3])).token_ids.item() == 1


# --- top-k, top-p, min-p: exact sets ------------------------------------------------------------------------


def test_filters_keep_exact_sets_and_renormalise() -> None:
    base = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log()
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.75), SamplingParams(top_p=0.5),
              SamplingParams(min_p=0.3), SamplingParams(min_p=0.5), SamplingParams(top_k=4, top_p=0.95),
              SamplingParams(top_k=-1), SamplingParams(top_k=100)]
    probs = compute_probs(base.expand(len(params), -1).clone(), _batch(params))
    supports = [_support(row) for row in probs]
    assert supports == [{0, 1}, {0, 1, 2}, {0, 1}, {0, 1, 2}, {0, 1}, {0, 1, 2, 3}, {0, 1, 2, 3, 4},
                        {0, 1, 2, 3, 4}]
    torch.testing.assert_close(probs[0, :2], torch.tensor([0.4, 0.3]) / 0.7)
    torch.testing.assert_close(probs[5, :4], torch.tensor([0.4, 0.3, 0.15, 0.1]) / 0.95)
    torch.testing.assert_close(probs[6], torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))


def test_top_k_alone_uses_per_row_k() -> None:
    logits = torch.arange(10.0).expand(3, -1).clone()  # token 9 is the most likely
    probs = compute_probs(logits, _batch([SamplingParams(top_k=1), SamplingParams(top_k=3), SamplingParams()]))
    assert [_support(row) for row in probs] == [{9}, {7, 8, 9}, set(range(10))]


def test_sampled_tokens_stay_inside_the_filtered_set() -> None:
    logits = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log().expand(2000, -1).clone()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = Sampler()(logits, _batch([SamplingParams(top_k=2)] * 2000))
    assert set(out.token_ids.tolist()) == {0, 1}


def test_compute_probs_is_one_hot_for_greedy_rows() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    probs = compute_probs(logits, _batch([SamplingParams(temperature=0.0), SamplingParams()]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(probs[1], logits[1].softmax(-1))


# --- seeds --------------------------------------------------------------------------------------------------


def _run_steps(params: list[SamplingParams], steps: list[torch.Tensor]) -> list[list[int]]:
    """Sample len(steps) tokens per row with persistent per-request generators; returns tokens per row."""
    generators = [make_generator(p.seed, "cpu") for p in params]
    tokens: list[list[int]] = [[] for _ in params]
    for logits in steps:
        batch = prepare_sampling_batch(params, [[] for _ in params], tokens, generators, [EOS], "cpu")
        for row, token in enumerate(Sampler()(logits[: len(params)], batch).token_ids.tolist()):
            tokens[row].append(token)
    return tokens


def test_same_seed_gives_same_tokens_whatever_the_batch() -> None:
    vocab = 500
    row_logits = [torch.randn(vocab, generator=torch.Generator().manual_seed(s)) for s in range(12)]
    seeded = SamplingParams(seed=1234, top_p=0.95)
    alone = _run_steps([seeded], [r.expand(1, -1) for r in row_logits])[0]
    others = [SamplingParams(), SamplingParams(seed=7), SamplingParams(temperature=0.0), SamplingParams(seed=99)]
    mixed = _run_steps(others[:3] + [seeded] + others[3:], [r.expand(5, -1) for r in row_logits])
    assert mixed[3] == alone
    assert mixed[1] != alone  # a different seed gives a different sequence
    assert _run_steps([SamplingParams(seed=1234, top_p=0.95)], [r.expand(1, -1) for r in row_logits])[0] == alone


# --- distribution: chi-square against transformers' next-token distribution ---------------------------------


@pytest.fixture(scope="module")
def next_token_logits(tiny_small_vocab: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_small_vocab, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0, -1]  # [V]


def _draw_counts(logits: torch.Tensor, params: SamplingParams, num_draws: int) -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(2024)
        batch = _batch([params] * num_draws)
        tokens = Sampler()(logits.expand(num_draws, -1).clone(), batch).token_ids
    return torch.bincount(tokens, minlength=logits.numel())


def test_temperature_one_draws_follow_the_model_distribution(next_token_logits: torch.Tensor) -> None:
    counts = _draw_counts(next_token_logits, SamplingParams(temperature=1.0), 100_000)
    expected = next_token_logits.double().softmax(-1)
    assert _chi_square_p_value(counts, expected) > 1e-3
    uniform = torch.full_like(expected, 1 / expected.numel())
    assert _chi_square_p_value(counts, uniform) < 1e-6  # the test can tell this model from uniform


def test_draws_follow_a_skewed_distribution() -> None:
    """The tiny model's distribution is nearly flat; a skewed one also catches a biased draw."""
    probs = torch.tensor([0.5, 0.2, 0.1, 0.08, 0.05, 0.04, 0.02, 0.01], dtype=torch.float64)
    counts = _draw_counts(probs.log().float(), SamplingParams(), 50_000)
    assert _chi_square_p_value(counts, probs) > 1e-3


def test_temperature_and_top_p_draws_follow_the_renormalised_distribution(next_token_logits: torch.Tensor) -> None:
    counts = _draw_counts(next_token_logits, SamplingParams(temperature=0.7, top_p=0.9), 100_000)
    probs = (next_token_logits.double() / 0.7).softmax(-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    kept = order[mass_before < 0.9]  # the smallest top set whose mass reaches 0.9
    expected = torch.zeros_like(probs)
    expected[kept] = probs[kept] / probs[kept].sum()
    assert (counts == 0).sum() > 0 and set(torch.nonzero(counts).flatten().tolist()) == set(kept.tolist())
    assert _chi_square_p_value(counts[kept], expected[kept]) > 1e-3
    at_temperature_one = next_token_logits.double()[kept].softmax(-1)
    assert _chi_square_p_value(counts[kept], at_temperature_one) < 1e-6  # temperature must matter


def test_seeded_rows_follow_the_model_distribution(next_token_logits: torch.Tensor) -> None:
    num_draws = 20_000
    params = [SamplingParams(seed=i) for i in range(num_draws)]
    tokens = Sampler()(next_token_logits.expand(num_draws, -1).clone(), _batch(params)).token_ids
    counts = torch.bincount(tokens, minlength=next_token_logits.numel())
    assert _chi_square_p_value(counts, next_token_logits.double().softmax(-1)) > 1e-3


# --- logprobs -----------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_sorted_top_n() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5, seed=1), SamplingParams(),
              SamplingParams(logprobs=0, temperature=0.0), SamplingParams(logprobs=2, top_k=3, seed=2)]
    out = Sampler()(logits, _batch(params, prompts=[[0, 1, 2]] * 4))
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for row in (0, 2, 3):
        record = out.logprobs[row]
        assert record is not None and record.token_id == out.token_ids[row].item()
        assert record.logprob == pytest.approx(expected[row, record.token_id].item(), abs=1e-6)
        n = params[row].logprobs or 0
        top_values, top_ids = expected[row].topk(n)
        assert [t for t, _ in record.top] == top_ids.tolist()
        assert [v for _, v in record.top] == pytest.approx(top_values.tolist(), abs=1e-6)
        assert [v for _, v in record.top] == sorted((v for _, v in record.top), reverse=True)
    assert out.logprobs[2] is not None and out.logprobs[2].top == ()
    assert math.isclose(out.logprobs[2].logprob, expected[2].max().item(), abs_tol=1e-6)


def test_logits_are_not_modified_in_place() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    before = logits.clone()
    Sampler()(logits, _batch([SamplingParams(repetition_penalty=2.0, top_k=1, min_tokens=1)], prompts=[[0, 1]]))
    assert torch.equal(logits, before)
