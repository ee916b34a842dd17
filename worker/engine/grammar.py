"""Constrained decoding: the logits of every request with a grammar are masked to the tokens it allows.

A request's grammar (``SamplingParams.grammar``: a JSON schema, any JSON object, a regex or a Lark grammar, see
``shared.grammar``) becomes an llguidance matcher when the request is added; it lives on the request
(``Request.grammar``) and consumes every token appended to the output (``GrammarState.advance``), so it always
stands exactly after the request's known tokens. Hence nothing special for the rest of the engine:

- preemption by recompute keeps the output tokens, and the matcher with them (only K/V is recomputed);
- prefix caching shares prompt K/V only, which the matcher never sees;
- speculative decoding: before scheduling, each proposal is cut to its longest prefix the grammar accepts
  (``trim_proposals``); the logit row of draft position j is masked with the state after draft tokens 0..j-1
  (llguidance advances through the draft and rolls back), so verification only ever keeps allowed tokens.

One step's masks are computed together by llguidance's thread pool (the GIL released) into an int32 bitmask
``[R, ceil(V/32)]`` on the CPU, moved to the logits' device and applied with one ``masked_fill``. Masking
happens before the sampler, so penalties, temperature, top-k/p, greedy and logprobs all see the constrained
distribution (logprobs are those of the masked logits).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import torch

from shared.grammar import GrammarSpec, llguidance_grammar
from worker.engine.request import Request
from worker.engine.scheduler import ScheduledChunk

MAX_CACHED_GRAMMARS = 64  # compiled matchers kept for reuse (n choices, repeated schemas); each is copied per request


class GrammarState:
    """One request's matcher, standing right after its known output tokens."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def advance(self, token_id: int) -> bool:
        """Consume one output token; True once the grammar is complete (it accepts nothing more)."""
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"grammar: token {token_id} is not allowed here: {self.matcher.get_error()}"[:500])
        return self.matcher.is_stopped()

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the grammar would accept from here (state unchanged)."""
        return self.matcher.validate_tokens(list(token_ids)) if token_ids else 0


def _byte_bits(device: torch.device | str) -> torch.Tensor:
    """[256, 8] bool: bit k of byte value b, for unpacking bitmasks one byte at a time."""
    values = torch.arange(256, dtype=torch.int32, device=device)
    return ((values[:, None] >> torch.arange(8, dtype=torch.int32, device=device)) & 1).bool()


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int, byte_bits: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """``bitmask`` [R, ceil(V/32)] int32 -> [R, V] bool, True where the token is allowed.

    Token 32w + i is bit i of word w; on a little-endian int32 that is bit i % 8 of byte 4w + i // 8, so bit k
    of byte j is token 8j + k, and one table lookup per byte unpacks the mask (cheaper on CPU than shifting every
    word 32 ways).
    """
    table = byte_bits if byte_bits is not None else _byte_bits(bitmask.device)
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [R, 4W]
    bits = table.index_select(0, as_bytes.flatten().long())  # [R * 4W, 8]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` [R, V] with every token whose bit is 0 in ``bitmask`` set to -inf (for tests and
    one-off use; the engine masks in place)."""
    return logits.masked_fill(~unpack_token_bitmask(bitmask, logits.shape[1]), float("-inf"))


class GrammarCompiler:
    """Builds matchers for one tokenizer and masks a step's logits; owned by the engine."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~1 s for a 50k vocabulary)
        self._executor = llguidance.LLExecutor()
        self._compiled: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._byte_bits: torch.Tensor | None = None  # the unpacking table, on the logits' device

    def start(self, spec: GrammarSpec) -> GrammarState:
        """A fresh matcher for ``spec``; ValueError naming ``grammar`` when it does not compile."""
        template = self._compiled.get(spec)
        if template is None:
            matcher = llguidance.LLMatcher(self._llg_tokenizer(), llguidance_grammar(spec.kind, spec.value),
                                           log_level=0)
            if matcher.is_error():
                raise ValueError(f"grammar ({spec.kind}) is invalid: {matcher.get_error()}"[:1000])
            template = self._compiled[spec] = matcher
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(spec)
        return GrammarState(template.deep_copy())

    def trim_proposals(self, requests: Sequence[Request]) -> None:
        """Cut each constrained request's speculative tokens to the prefix its grammar accepts."""
        for request in requests:
            if request.grammar is not None and request.spec_token_ids:
                del request.spec_token_ids[request.grammar.num_valid(request.spec_token_ids):]

    @torch.inference_mode()  # the model's logits are inference tensors, updated in place here
    def mask(self, requests: Sequence[Request], chunks: Sequence[ScheduledChunk], logits: torch.Tensor
             ) -> torch.Tensor:
        """``logits`` [sum(1 + num_spec_tokens), V] in chunk order, with constrained requests' rows masked.

        Raises ValueError when a grammar allows no token at all (the request cannot go on).
        """
        rows: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        first = 0
        for request, chunk in zip(requests, chunks, strict=True):
            if request.grammar is not None:
                draft = list(chunk.token_ids[len(chunk.token_ids) - chunk.num_spec_tokens:])
                rows.append((request.grammar.matcher, first, draft))
            first += 1 + chunk.num_spec_tokens
        if not rows:
            return logits
        row_ids = [row + j for _, row, draft in rows for j in range(len(draft) + 1)]
        bitmask = torch.full((int(logits.shape[0]), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        one_mask_bytes = bitmask.shape[1] * 4
        if any(draft for _, _, draft in rows):
            self._executor.unsafe_compute_mask_ptr_with_draft_token(rows, bitmask.data_ptr(), one_mask_bytes,
                                                                    bitmask.shape[0])
        else:
            self._executor.unsafe_compute_mask_ptr([(m, row) for m, row, _ in rows], bitmask.data_ptr(),
                                                   one_mask_bytes, bitmask.shape[0])
        index = torch.tensor(row_ids, dtype=torch.long)
        selected = bitmask[index]  # [R, W]
        if bool((selected == 0).all(dim=1).any()):
            errors = {m.get_error() for m, _, _ in rows if m.is_error()}
            raise ValueError(f"grammar: no token is allowed next{': ' + '; '.join(errors) if errors else ''}"[:500])
        if self._byte_bits is None or self._byte_bits.device != logits.device:
            self._byte_bits = _byte_bits(logits.device)
        allowed = unpack_token_bitmask(selected.to(logits.device, non_blocking=True), logits.shape[1],
                                       self._byte_bits)  # [R, V]
        # In place: a fresh [B, V] tensor per step would be page-faulted in afresh on CPU (see sampler.py).
        if len(row_ids) == logits.shape[0]:
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            device_index = index.to(logits.device)
            logits[device_index] = logits[device_index].masked_fill(~allowed, float("-inf"))
        return logits

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self._eos_token_ids or None)
        return self._tokenizer
