"""The engine: requests in, ``StepOutput`` events out, one forward pass per ``step()``.

A step is: schedule (which requests advance, by how many tokens) -> run the model over the flattened batch ->
sample a token for every request that caught up with its known tokens -> detokenize and check stop conditions.
Calls are not thread-safe; the worker makes them all from one thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from worker.engine.beam_search import BeamSearch, beam_request_id
from worker.engine.block_pool import BlockPool
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import IncrementalDetokenizer, direct_decoder
from worker.engine.draw import NOT_FINITE, Draw, checked, draw_tokens
from worker.engine.grammar import GrammarCompiler
from worker.engine.kv_cache import num_blocks_needed
from worker.engine.model_runner import ModelRunner
from worker.engine.outputs import EngineStats, FinishReason, Logprob, RequestOutput, StepOutput
from worker.engine.overlap import PendingStep, can_overlap, fed_tokens, launch_draw
from worker.engine.request import Request, validate_request
from worker.engine.sampler import Sampler, SamplerOutput, make_generator, prepare_sampling_batch
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import ScheduledChunk, Scheduler
from worker.engine.spec_decode import SpeculativeDecoder, make_speculative_decoder
from worker.models import resolve_model

log = logging.getLogger(__name__)
SEED_MODULUS = 2**63  # choice i of a seeded group draws with seed + i, wrapped into the allowed seed range


def eos_token_ids_of(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids as ``generate`` sees them: the generation config's, else the model config's, else the tokenizer's."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


class Engine:
    """Continuous batching over a paged KV cache; greedy output equals transformers ``generate`` token for token."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        folder = resolve_model(config.model)
        self.runner = ModelRunner(config, folder)
        self.plan = self.runner.plan
        self._tokenizer = AutoTokenizer.from_pretrained(folder)
        self._decoder = direct_decoder(self._tokenizer)  # what detokenizers decode with
        self.eos_token_ids = eos_token_ids_of(self.runner.model, self._tokenizer)
        self.block_pool = BlockPool(self.plan.num_kv_blocks, enable_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_pool, self.plan.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.sampler = Sampler()
        self.spec: SpeculativeDecoder | None = make_speculative_decoder(
            config, self.runner, self.sampler, self._tokenizer, self.eos_token_ids)
        self.grammar = GrammarCompiler(self._tokenizer, self.runner.shape.vocab_size, self.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self.beams = BeamSearch(self.scheduler, self.block_pool, self._requests, self._detokenize, self._scrub)
        self._arrivals = itertools.count()
        self._generate_ids = itertools.count()
        self._pending: PendingStep | None = None  # a launched step whose tokens are not read back (overlap.py)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Token ids the model accepts: [0, vocab_size)."""
        return self.runner.shape.vocab_size

    @property
    def max_model_len(self) -> int:
        """Prompt + output limit: the model's positions, the configured cap and the KV pool, whichever is least."""
        return self.plan.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0) -> None:
        """Queue a request. Output is clipped to the context: it ends with "length" at ``max_model_len`` tokens.

        Raises ValueError (naming the field and its allowed range) for bad input, changing nothing.
        """
        validate_request(request_id, prompt_token_ids, params, priority, self.runner.shape.vocab_size,
                         self.max_model_len)
        if request_id in self._requests or request_id in self.beams:
            raise ValueError(f"request_id must be unique among unfinished requests, got duplicate {request_id!r}")
        if params.is_beam_search:
            self._add_beam_group([request_id], list(prompt_token_ids), params, priority)
            return
        request = self._make_request(request_id, list(prompt_token_ids), params, priority, next(self._arrivals))
        self._requests[request_id] = request
        self.scheduler.add(request)

    def _make_request(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int,
                      arrival: int) -> Request:
        return Request(
            request_id=request_id, prompt_token_ids=prompt, params=params, priority=priority,
            arrival=arrival, max_tokens=min(params.max_tokens, self.max_model_len - len(prompt)),
            generator=make_generator(params.seed, self.runner.device),
            detokenizer=IncrementalDetokenizer(self._decoder, prompt, params.stop),
            grammar=self.grammar.start(params.grammar) if params.grammar is not None else None,
        )

    def add_request_group(self, request_ids: Sequence[str], prompt_token_ids: list[int], params: SamplingParams,
                          priority: int = 0) -> None:
        """Queue ``len(request_ids)`` requests for one prompt (a job's ``n`` choices), all or none.

        The prompt is prefilled once: the others start from the first one's KV blocks (shared, copy-on-write for
        the last partial block) as soon as its prompt is computed. With a ``seed``, request ``i`` draws with seed
        ``seed + i``, so the choices differ yet each is reproducible. Raises ValueError as ``add_request`` does.
        """
        ids = list(request_ids)
        if not 1 <= len(ids) <= self.config.max_num_seqs:
            raise ValueError(f"request_ids must hold 1 to max_num_seqs ({self.config.max_num_seqs}) ids, "
                             f"got {len(ids)}")
        if len(set(ids)) != len(ids) or any(rid in self._requests or rid in self.beams for rid in ids):
            raise ValueError(f"request_ids must be unique among unfinished requests, got {ids!r:.200}")
        validate_request(ids[0], prompt_token_ids, params, priority, self.runner.shape.vocab_size,
                         self.max_model_len)
        if not all(isinstance(rid, str) and rid for rid in ids):
            raise ValueError(f"request_ids must be non-empty strings, got {ids!r:.200}")
        prompt = list(prompt_token_ids)
        if params.is_beam_search:
            self._add_beam_group(ids, prompt, params, priority)
            return
        requests = [self._make_request(rid, prompt, params if params.seed is None else
                                       dataclasses.replace(params, seed=(params.seed + i) % SEED_MODULUS), priority,
                                       next(self._arrivals))
                    for i, rid in enumerate(ids)]
        for request in requests:
            self._requests[request.request_id] = request
        if len(requests) == 1:
            self.scheduler.add(requests[0])
        else:
            self.scheduler.add_group(requests[0], requests[1:])

    def _add_beam_group(self, output_ids: list[str], prompt: list[int], params: SamplingParams, priority: int
                        ) -> None:
        """Queue a beam search of ``params.beam_width`` beams returning the best ``len(output_ids)`` (worker.engine.
        beam_search). Raises ValueError, naming the field, where beam search cannot run as asked."""
        width = params.beam_width
        if width > self.config.max_num_seqs:
            raise ValueError(f"beam_width must be at most max_num_seqs ({self.config.max_num_seqs}), got {width}")
        if len(output_ids) > width:
            raise ValueError(f"n (returned beams) must be at most beam_width ({width}), got {len(output_ids)}")
        if self.spec is not None:
            raise ValueError("beam_width must be 1 on an engine with speculative decoding, got "
                             f"{width} (beams run on the target model only)")
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt))
        # Even with no sharing at all (after a preemption each beam recomputes alone) the group must fit the pool.
        needed = width * num_blocks_needed(len(prompt) + max_tokens, self.plan.block_size)
        if needed > self.plan.num_kv_blocks:
            raise ValueError(f"beam_width {width} times prompt + max_tokens needs {needed} KV blocks, more than the "
                             f"engine's {self.plan.num_kv_blocks}: lower beam_width or max_tokens")
        beam_ids = [beam_request_id(output_ids[0], i) for i in range(width)]
        if any(rid in self._requests for rid in beam_ids):
            raise ValueError(f"request_ids must be unique among unfinished requests, got {output_ids[0]!r}")
        beams = [self._make_request(rid, prompt, params, priority, next(self._arrivals)) for rid in beam_ids]
        self.beams.add(output_ids, beams, self.eos_token_ids)

    def _detokenize(self, prompt: list[int], token_ids: list[int]) -> str:
        detokenizer = IncrementalDetokenizer(self._decoder, prompt, ())
        return detokenizer.push(token_ids).text_delta + detokenizer.flush()

    def step(self) -> list[StepOutput]:
        """Advance every scheduled request by one forward pass; returns what happened (empty when idle).

        A request whose logits or sampling fail ends alone with finish reason "error" (``worker.engine.draw``);
        only a failure of the forward pass itself, which no single request can be blamed for, raises. With async
        scheduling (``overlap.py``) a decode step returns the previous step's tokens, its own still on the device.
        """
        pending, self._pending = self._pending, None
        graphs = self.runner.graphs
        if (self.runner.async_scheduling and graphs is not None and self.spec is None and not self.beams.num_groups
                and can_overlap(self.scheduler, graphs.buckets[-1])):
            return self._overlapped_step(pending)
        return self._settle_pending(pending) + self._step_in_turn()

    def _overlapped_step(self, pending: PendingStep | None) -> list[StepOutput]:
        """Launch the next step behind ``pending`` (``can_overlap``), then settle ``pending``."""
        output = self.scheduler.schedule()
        if output.is_empty:  # every running request ends with the pending step's tokens
            return self._settle_pending(pending)
        logits = self.runner.execute(output, fed_tokens(output.chunks, pending))  # [B, V]
        self.scheduler.cache_computed_blocks(output, self._requests)
        requests = [self._requests[c.request_id] for c in output.chunks]
        try:
            self._pending = launch_draw(requests, logits, self._sample)
        except Exception as exc:  # the sampler raised: draw again in turn, where a faulty request fails alone
            log.warning("drawing on the device raised %r; drawing this step in turn", exc)
            events = self._settle_pending(pending)
            draws = draw_tokens(requests, output.chunks, logits, self._draw)
            return events + [self._settle(r, d) for r, d in zip(requests, draws, strict=True)]
        return self._settle_pending(pending)

    def _settle_pending(self, pending: PendingStep | None) -> list[StepOutput]:
        """Read back a pending step's tokens and settle them; rows of requests that ended meanwhile are dropped."""
        if pending is None:
            return []
        token_ids, finite = pending.readback.wait()
        events = []
        for request, counted, token_id, ok in zip(pending.requests, pending.goes_on, token_ids, finite, strict=True):
            request.num_pending_tokens -= counted
            if not request.is_finished:
                draw = checked(Draw([token_id], [None]), self.vocab_size) if ok else Draw(error=NOT_FINITE)
                events.append(self._settle(request, draw))
        return events

    def _step_in_turn(self) -> list[StepOutput]:
        """Schedule, run, draw and settle one step."""
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)  # sets spec_token_ids of requests about to decode
            self.grammar.trim_proposals(self.scheduler.running)
        output = self.scheduler.schedule()
        if output.is_empty:
            return []
        logits = self.runner.execute(output)  # [num_sampled (+ speculative positions), V]
        self.scheduler.cache_computed_blocks(output, self._requests)
        chunks = [c for c in output.chunks if c.needs_logits]
        beam_events: list[StepOutput] = []
        if self.beams.num_groups:
            chunks, logits, beam_events = self.beams.take(chunks, logits)
        requests = [self._requests[c.request_id] for c in chunks]
        draws = draw_tokens(requests, chunks, logits, self._draw, defer_check=self.runner.device.type != "cpu"
                            ) if chunks else []
        events = [self._settle(r, d) for r, d in zip(requests, draws, strict=True)]
        events += beam_events
        if self.spec is not None:
            self.spec.forget(self.scheduler.running)
        return events

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished. For beam search:
        any of its output ids stops the whole search."""
        if request_id in self.beams:
            return self.beams.abort(request_id)
        if self.beams.is_beam(request_id):
            return False  # a beam's internal id: only the whole search can be stopped
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        request.finish_reason = "abort"
        self.scheduler.finish(request)
        if self.spec is not None:
            self.spec.forget(self.scheduler.running)
        return True

    def free_seats(self) -> int:
        """How many more requests the engine takes right now: its free seats, none without a free block."""
        if self.block_pool.num_free_blocks == 0:
            return 0
        return max(0, self.config.max_num_seqs - len(self._requests))

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=self.scheduler.num_waiting,
            num_total_blocks=self.block_pool.num_blocks, num_free_blocks=self.block_pool.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            num_draft_tokens=self.spec.num_draft_tokens if self.spec else 0,
            num_accepted_tokens=self.spec.num_accepted_tokens if self.spec else 0,
        )

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` (text or token ids) to completion and return their outputs in order.

        For offline use: it drives ``step()`` itself, so it refuses to run while ``add_request`` work is pending
        (those requests' events would be lost).
        """
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; drain add_request work with step() first")
        param_list = [params or SamplingParams()] * len(prompts) if not isinstance(params, Sequence) else params
        if len(param_list) != len(prompts):
            raise ValueError(f"params must be one SamplingParams or one per prompt ({len(prompts)}), "
                             f"got {len(param_list)}")
        requests: list[Request] = []
        try:
            for prompt, p in zip(prompts, param_list, strict=True):
                if p.is_beam_search:
                    raise ValueError("params: generate() runs no beam search (beam_width > 1); use "
                                     "add_request_group() and step(), whose outputs carry every beam")
                token_ids = self._tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                request_id = f"generate-{next(self._generate_ids)}"
                self.add_request(request_id, token_ids, p)
                requests.append(self._requests[request_id])
        except ValueError:
            for request in requests:
                self.abort(request.request_id)
            raise
        while self.has_unfinished():
            self.step()
        return [RequestOutput(request_id=r.request_id, prompt_token_ids=tuple(r.prompt_token_ids),
                              token_ids=tuple(r.output_token_ids), text=r.text,
                              finish_reason=r.finish_reason or "abort", logprobs=tuple(r.logprobs),
                              num_cached_tokens=r.num_cached_tokens) for r in requests]

    def _draw(self, requests: Sequence[Request], chunks: Sequence[ScheduledChunk], logits: torch.Tensor
              ) -> list[Draw]:
        """Sample one token per request; with speculation, verify each request's speculative tokens instead
        (requests without any sample as usual) and keep the accepted ones. Grammars mask the logits first."""
        logits = self.grammar.mask(requests, chunks, logits)
        if self.spec is not None:
            return [Draw(v.token_ids, v.logprobs, v.num_draft_tokens, v.num_accepted_tokens)
                    for v in self.spec.verify(requests, chunks, logits)]
        result = self._sample(requests, logits)
        return [Draw([t], [lp]) for t, lp in zip(result.token_ids.tolist(), result.logprobs, strict=True)]

    def _sample(self, requests: Sequence[Request], logits: torch.Tensor) -> SamplerOutput:
        """One token per request (``logits`` [B, V], masked already), each by its own parameters, on the device."""
        batch = prepare_sampling_batch(
            [r.params for r in requests], [r.prompt_token_ids for r in requests],
            [r.output_token_ids for r in requests], [r.generator for r in requests],
            self.eos_token_ids, self.runner.device)
        return self.sampler(logits, batch)

    def _settle(self, request: Request, draw: Draw) -> StepOutput:
        """Append a request's drawn tokens (rolling back rejected speculative K/V), or end it with its error."""
        if draw.error is not None:
            return self._fail(request, draw.error)
        try:
            event = self._append_tokens(request, draw.token_ids, draw.logprobs, draw.num_draft_tokens,
                                        draw.num_accepted_tokens)
        except Exception as exc:  # e.g. the detokenizer on a token it cannot decode: this request's fault alone
            log.warning("request %s failed after sampling: %r", request.request_id, exc)
            return self._fail(request, f"detokenizing failed: {type(exc).__name__}: {exc}"[:500])
        if self.spec is not None:
            self.spec.record(event.num_draft_tokens, event.num_accepted_tokens)
            if not request.is_finished:
                self.scheduler.accept_speculation(request, draw.num_accepted_tokens)
        return event

    def _fail(self, request: Request, error: str) -> StepOutput:
        """End one request with finish reason "error"; its blocks are scrubbed and freed, and the rest of the batch
        goes on."""
        log.warning("request %s failed: %s", request.request_id, error)
        request.finish_reason = "error"
        self._requests.pop(request.request_id, None)
        block_ids = list(request.block_ids)
        self.scheduler.finish(request)
        self._scrub(block_ids)
        return StepOutput(request_id=request.request_id, new_token_ids=(), text_delta="", finished=True,
                          finish_reason="error", num_prompt_tokens=request.num_prompt_tokens,
                          num_output_tokens=request.num_output_tokens, num_cached_tokens=request.num_cached_tokens,
                          error=error)

    def _scrub(self, block_ids: Sequence[int]) -> None:
        """After a failed request's blocks are freed: zero those nobody holds any more, and drop them from the
        prefix cache. Its K/V may be NaN, and a later owner's padded attention reads the slots it has not written
        yet (0 x NaN is NaN). Blocks still held keep their content: computed before it went wrong, or every
        holder fails alike."""
        freed = [b for b in dict.fromkeys(block_ids) if self.block_pool.ref_count(b) == 0]
        self.block_pool.forget(freed)
        self.runner.kv_cache.zero_blocks(freed)

    def _append_tokens(self, request: Request, token_ids: list[int], logprobs: list[Logprob | None],
                       num_draft_tokens: int = 0, num_accepted_tokens: int = 0) -> StepOutput:
        """Record sampled tokens in order, detokenizing each; the first one that ends the request (a stop token,
        a stop string, ``max_tokens``) drops the rest. ``num_accepted_tokens`` counts the speculative ones kept."""
        reason: FinishReason | None = None
        text_delta = ""
        num_appended = 0
        for token_id, logprob in zip(token_ids, logprobs, strict=True):
            request.output_token_ids.append(token_id)
            if logprob is not None:
                request.logprobs.append(logprob)
            num_appended += 1
            grammar_done = request.grammar is not None and request.grammar.advance(token_id)
            if self._is_stop_token(request, token_id):
                reason = "stop"  # a stop token ends the request without adding its text (as vLLM does)
                break
            update = request.detokenizer.push([token_id])
            text_delta += update.text_delta
            if update.stop_hit or grammar_done:
                reason = "stop"
            elif request.num_output_tokens >= request.max_tokens:
                reason = "length"
            if reason is not None:
                break
        if reason is not None:
            if not request.detokenizer.stop_hit:
                text_delta += request.detokenizer.flush()
            request.text = request.detokenizer.text
            request.finish_reason = reason
            del self._requests[request.request_id]
            self.scheduler.finish(request)
        appended_logprobs = tuple(lp for lp in logprobs[:num_appended] if lp is not None)
        return StepOutput(
            request_id=request.request_id, new_token_ids=tuple(token_ids[:num_appended]), text_delta=text_delta,
            finished=reason is not None, finish_reason=reason, num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens, num_cached_tokens=request.num_cached_tokens,
            logprobs=appended_logprobs, num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=min(num_accepted_tokens, num_appended),
        )

    def _is_stop_token(self, request: Request, token_id: int) -> bool:
        """EOS (unless ignored) or a stop token id, once ``min_tokens`` outputs came before it."""
        params = request.params
        if request.num_output_tokens <= params.min_tokens:
            return False
        return token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids)
