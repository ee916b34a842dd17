"""Speculative sampling is exact in distribution: chi-square tests against the target model's own distribution.

All draws are seeded, so these tests are deterministic; the thresholds only say "no detectable difference".
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.rejection_sampler import rejection_sample
from worker.engine.spec_draft import write_truncated_draft

VOCAB = 32
PROMPT = [(7 * i) % VOCAB for i in range(40)]  # every token occurs: n-gram lookup always finds a match
TEMPERATURE = 0.9


def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square, cells with expected count under 5 merged into one."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed, expected = counts[~small].double(), expected[~small]
    if small.any():
        observed = torch.cat([observed, counts[small].double().sum().reshape(1)])
        expected = torch.cat([expected, (probs.double()[small].sum() * counts.sum()).reshape(1)])
    expected = expected * observed.sum() / expected.sum()  # exact totals despite rounding in probs
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def test_rejection_sample_emits_the_target_distribution() -> None:
    generator = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(3, 8, generator=generator) * 2, dim=-1)  # p_1..p_3 (context-free here)
    draft = torch.softmax(torch.randn(2, 8, generator=generator) * 2, dim=-1)  # q_1, q_2: quite different
    first, second = torch.zeros(8), torch.zeros(8)
    num_second = 0
    for _ in range(20_000):
        proposal = [int(torch.multinomial(draft[j], 1, generator=generator)) for j in range(2)]
        emitted = rejection_sample(target, draft, proposal, generator)
        first[emitted[0]] += 1
        if len(emitted) > 1:  # the first was accepted, so the second is a draw from p_2 as well
            second[emitted[1]] += 1
            num_second += 1
    assert p_value(first, target[0]) > 1e-3
    assert p_value(second, target[1]) > 1e-3
    assert p_value(first, draft[0]) < 1e-6  # the test can tell p from q
    assert 0.2 * 20_000 < num_second < 0.9 * 20_000  # both acceptance and rejection happened often


@pytest.fixture(scope="module")
def exact_marginals(tiny_small_vocab: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution of the 1st and of the 2nd generated token (marginalised over the 1st)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_small_vocab, dtype=torch.float32).eval()
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([PROMPT])).logits[0, -1].double() / TEMPERATURE, -1)  # [V]
        contexts = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        second_given = torch.softmax(model(contexts).logits[:, -1].double() / TEMPERATURE, -1)  # [V, V]
    return first, first @ second_given


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_first_two_tokens_follow_the_target_distribution(tiny_small_vocab: Path, tmp_path: Path, method: str,
                                                          exact_marginals: tuple[torch.Tensor, torch.Tensor]) -> None:
    draft = write_truncated_draft(tiny_small_vocab, tmp_path / "draft", 1) if method == "draft" else None
    engine = Engine(EngineConfig(model=str(tiny_small_vocab), block_size=4, num_kv_blocks=2048, max_num_seqs=256,
                                 dtype="float32", max_num_batched_tokens=4096, speculative_method=method,
                                 draft_model=str(draft) if draft else None, num_speculative_tokens=3,
                                 speculative_max_batch=256, enable_prefix_caching=True))
    num = 3000
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=4, ignore_eos=True, seed=i) for i in range(num)]
    outs = engine.generate([PROMPT] * num, params)
    first = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=VOCAB)
    second = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=VOCAB)
    stats = engine.stats()
    assert stats.num_draft_tokens > num  # speculation really ran, and accepted tokens often enough
    assert stats.num_accepted_tokens > (0.3 * stats.num_draft_tokens if method == "draft" else 50)
    expected_first, expected_second = exact_marginals
    assert p_value(first, expected_first) > 1e-3
    assert p_value(second, expected_second) > 1e-3
    assert p_value(second, expected_first) < 1e-6  # the test can tell the two positions apart
