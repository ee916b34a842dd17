"""Speculative sampling: keep a prefix of the proposed tokens so that output is distributed exactly as the target's.

Notation (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"): a proposer drew
``d_1..d_k`` with ``d_j ~ q_j``; one target forward pass over the last known token and ``d_1..d_k`` gives
``p_1..p_{k+1}``, where ``p_j`` is the target's (fully processed: penalties, temperature, top-k/p) distribution of
the j-th new token given the context and ``d_1..d_{j-1}``. For j = 1, 2, ...:

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
    at the first rejection emit one token from normalise(max(0, p_j - q_j)) and stop;
    if all k are accepted emit a bonus token from p_{k+1}.

Every step emits between 1 and k + 1 tokens, and each is distributed exactly as plain sampling from the target
would have produced it (the paper's Theorem 3.5).

Two cases make the rule simpler (``SpeculativeDecoder._verify_by_matching`` implements them):

* a *deterministic* proposal (n-gram lookup; q_j one-hot at d_j): accept with probability p_j(d_j); on rejection
  normalise(max(0, p_j - onehot(d_j))) is p_j conditioned on "not d_j". That is exactly what drawing
  ``t_j ~ p_j`` and accepting iff ``t_j == d_j`` does (when they differ, ``t_j`` is the resampled token). Drawing
  ``t_j`` with the request's ordinary sampler and its own generator also reproduces non-speculative seeded output.
* a *greedy* request (p_j one-hot at the target's argmax): accept iff d_j is that argmax, else emit the argmax,
  whatever q was. Greedy output is therefore identical to non-speculative greedy output, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from ``probs`` [V] (need not sum to one)."""
    return int(torch.multinomial(probs, 1, generator=generator))


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_token_ids: Sequence[int],
                     generator: torch.Generator | None) -> list[int]:
    """Leviathan et al.'s rule for a proposer with a real distribution (a draft model sampling from q).

    ``target_probs``: [k+1, V] p_1..p_{k+1}; ``draft_probs``: [k, V] q_1..q_k; ``draft_token_ids``: [k], d_j ~ q_j.
    Returns the emitted tokens (accepted draft prefix + one target token). All draws use ``generator``.
    """
    k = len(draft_token_ids)
    device = target_probs.device
    positions = torch.arange(k, device=device)
    drafts = torch.tensor(list(draft_token_ids), dtype=torch.long, device=device)
    p = target_probs[positions, drafts]  # [k] p_j(d_j)
    q = draft_probs[positions, drafts].clamp(min=torch.finfo(draft_probs.dtype).tiny)  # [k]; > 0: d_j was drawn
    accept_prob = (p / q).clamp(max=1.0)  # [k] min(1, p/q)
    uniform = torch.rand(k, generator=generator, device=device)  # [k] one coin per draft token
    rejected = (uniform >= accept_prob).nonzero()
    if rejected.numel() == 0:
        return list(draft_token_ids) + [_sample(target_probs[k], generator)]  # all accepted: the bonus token
    n = int(rejected[0, 0])  # first rejected draft token (0-based)
    residual = (target_probs[n] - draft_probs[n]).clamp(min=0.0)  # max(0, p - q), [V]
    if float(residual.sum()) <= 0.0:
        # p == q everywhere, so the rejection can only come from rounding in p/q: sample p itself.
        residual = target_probs[n]
    return list(draft_token_ids[:n]) + [_sample(residual, generator)]
