"""Shared helpers for engine tests: drive an engine by hand and compute transformers' reference output."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from worker.engine import Engine, SamplingParams, StepOutput
from worker.engine.attention import PagedContext
from worker.engine.config import cpu_flags, own_int4_kernel
from worker.engine.decode_kernel import load_decode_kernel
from worker.engine.decoder import Decoder
from worker.engine.linear import half_packs
from worker.engine.model_runner import ModelRunner
from worker.engine.scheduler import ScheduledChunk


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Torch's intra-op thread count set to ``count`` inside, restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)

# float16 weights (``--quantization fp16``, float32 layers' dense copies) need fbgemm: torch's x86 builds
needs_fbgemm = pytest.mark.skipif(not half_packs(torch.device("cpu")), reason="no fbgemm (x86 builds of torch)")


def this_cpus_int4(dtype: torch.dtype) -> str:
    """What int4 layers computing in ``dtype`` run as here with the C++ operators built (loading them): ``"q4_1"``
    (tokenspool's operators) or ``"int4"`` (torch's kernel), by ``config.own_int4_kernel``."""
    return "q4_1" if own_int4_kernel(cpu_flags(), load_decode_kernel() is None, dtype) else "int4"


@dataclass
class Run:
    """Everything the engine emitted while draining."""

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    text: dict[str, str] = field(default_factory=dict)
    finished: dict[str, StepOutput] = field(default_factory=dict)
    max_waiting: int = 0
    num_steps: int = 0


    def record(self, events: list[StepOutput]) -> None:
        """Fold one step's events in, checking the event stream's own invariants."""
        for event in events:
            assert event.request_id not in self.finished, "events after finished"
            self.token_ids.setdefault(event.request_id, []).extend(event.new_token_ids)
            self.text[event.request_id] = self.text.get(event.request_id, "") + event.text_delta
            assert event.num_output_tokens == len(self.token_ids[event.request_id])
            if event.finished:
                self.finished[event.request_id] = event


def drain(engine: Engine, run: Run | None = None) -> Run:
    """Step until idle, recording every event."""
    run = run or Run()
    while engine.has_unfinished():
        run.record(engine.step())
        run.max_waiting = max(run.max_waiting, engine.stats().num_waiting)
        run.num_steps += 1
    return run


def reference_greedy(model: torch.nn.Module, prompt: list[int], params: SamplingParams) -> list[int]:
    """transformers ``generate`` on the prompt alone, greedy; includes the EOS token when it stops on one."""
    input_ids = torch.tensor([prompt])
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=params.max_tokens, min_new_tokens=params.min_tokens or None)
    return out[0, len(prompt):].tolist()


@dataclass(frozen=True)
class Case:
    prompt: list[int]
    width: int
    max_tokens: int
    length_penalty: float
    early_stopping: bool | str
    eos: int | None  # a token that ends a hypothesis (the model's EOS for transformers), or none at all
    min_tokens: int = 0


def pad_id(case: Case) -> int:
    """What transformers pads shorter beams with here (it takes EOS for a pad id of 0)."""
    return case.eos if case.eos is not None else 1


def reference_beams(model: torch.nn.Module, case: Case) -> list[tuple[list[int], float]]:
    """transformers' k beams (tokens after the prompt, shorter ones padded with ``pad_id``) and scores, best first."""
    input_ids = torch.tensor([case.prompt])
    pad = pad_id(case)
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         num_beams=case.width, num_return_sequences=case.width, max_new_tokens=case.max_tokens,
                         length_penalty=case.length_penalty, early_stopping=case.early_stopping,
                         eos_token_id=case.eos if case.eos is not None else [], pad_token_id=pad,
                         min_new_tokens=case.min_tokens or None,
                         return_dict_in_generate=True, output_scores=True)
    rows = out.sequences[:, len(case.prompt):].tolist()
    return list(zip(rows, out.sequences_scores.tolist(), strict=True))


def mixed_workload(seed: int, num_requests: int, max_prompt: int, max_output: int, vocab: int
                   ) -> list[tuple[list[int], SamplingParams, int]]:
    """Random token prompts of 1..max_prompt tokens (both ends included), greedy, mixed lengths and priorities.

    Half the requests force their full length with ``min_tokens`` (EOS masked, as ``min_new_tokens`` does), the
    rest may stop on EOS.
    """
    rng = random.Random(seed)
    lengths = [1, max_prompt] + [rng.randint(1, max_prompt) for _ in range(num_requests - 2)]
    workload = []
    for i, length in enumerate(lengths):
        max_tokens = rng.randint(1, max_output)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens if i % 2 else 0)
        workload.append(([rng.randrange(3, vocab) for _ in range(length)], params, rng.randint(0, 2)))
    return workload


def poison_token(engine: Engine, token_id: int) -> None:
    """Make ``token_id``'s embedding NaN, so any request whose prompt holds it gets NaN K/V and logits (whichever
    forward the engine runs: transformers' or its own decoder)."""
    runner = engine.runner
    with torch.no_grad():
        if runner.decoder is not None:
            runner.decoder.embed[token_id] = float("nan")
        else:
            runner.model.get_input_embeddings().weight[token_id] = float("nan")


def decoder_logits(decoder: Decoder, runner: ModelRunner, sequences: list[list[int]], prefill: int
                   ) -> list[torch.Tensor]:
    """Run ``sequences`` through ``decoder``: the first ``prefill`` tokens of each as one chunk (the requests side by
    side in one step), then one token per step. Returns each sequence's logits ``[len - prefill + 1, V]``."""
    tables = [tuple(range(i * 8, i * 8 + 8)) for i in range(len(sequences))]  # 8 blocks of 8 tokens each
    per_seq: list[list[torch.Tensor]] = [[] for _ in sequences]
    for position in range(prefill, max(len(s) for s in sequences) + 1):
        chunks = []
        for seq, table in zip(sequences, tables, strict=True):
            if position > len(seq):
                continue
            start = 0 if position == prefill else position - 1
            chunks.append(ScheduledChunk("r", tuple(seq[start:position]), start, table, needs_logits=True))
        input_ids, position_ids, metadata, logits_indices = runner.prepare_inputs(chunks)
        with torch.inference_mode():
            logits = decoder(input_ids[0], position_ids[0], PagedContext(runner.kv_cache, metadata), logits_indices)
        rows = iter(logits.float())
        for i, seq in enumerate(sequences):
            if position <= len(seq):
                per_seq[i].append(next(rows))
    return [torch.stack(rows) for rows in per_seq]
