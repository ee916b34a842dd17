"""What a speculative proposer returns, and the interface every proposer (n-gram, draft model) implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from worker.engine.request import Request


@dataclass(frozen=True, eq=False)
class Proposal:
    """Proposed next tokens of one request; ``draft_probs`` [k, V] is the distribution each was drawn from, or
    None for a deterministic proposer (a one-hot q)."""

    token_ids: tuple[int, ...]
    draft_probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[Proposal]:
        """Up to ``max_tokens[i]`` tokens following all of ``requests[i]``'s known tokens."""
        ...

    def forget(self, keep_request_ids: set[str]) -> None:
        """Drop per-request state (draft KV blocks) of every other request."""
        ...
