"""Per-step cost of constrained decoding: ``GrammarCompiler.mask`` for a batch of requests under a JSON schema.

Run by hand: ``.venv/bin/python benchmarks/grammar_mask.py [--batch 1 64] [--steps 40]``. Each request follows a
valid JSON document token by token (as a model would), so the masks are computed at realistic parser states;
the number reported is the wall time of one step's masking (the llguidance masks for every row, the bitmask
moved and applied to ``[B, V]`` float32 logits), median and p90 over the steps. Results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoTokenizer

from shared.grammar import GrammarSpec, json_schema_text
from worker.engine.grammar import GrammarCompiler
from worker.engine.request import Request
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import ScheduledChunk
from worker.models import resolve_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
            "address": {"city": "London", "zip": "W1"}}


def run(batch: int, steps: int, compiler: GrammarCompiler, token_ids: list[int]) -> list[float]:
    spec = GrammarSpec("json_schema", json_schema_text(SCHEMA))
    params = SamplingParams(grammar=spec)
    requests = [Request(request_id=str(i), prompt_token_ids=[1], params=params, priority=0, arrival=i,
                        max_tokens=10_000, grammar=compiler.start(spec)) for i in range(batch)]
    chunks = [ScheduledChunk(str(i), (1,), 0, (), True) for i in range(batch)]
    logits = torch.randn(batch, compiler.vocab_size)
    times = []
    for step in range(min(steps, len(token_ids))):
        start = time.perf_counter()
        compiler.mask(requests, chunks, logits)
        times.append(time.perf_counter() - start)
        for request in requests:
            request.grammar.advance(token_ids[step])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    token_ids = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")))
    run(1, 3, compiler, token_ids)  # warm-up: builds the llguidance tokenizer
    for batch in args.batch:
        times = sorted(run(batch, args.steps, compiler, token_ids))
        p50, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
        print(f"batch {batch:3d}: mask per step median {p50 * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms "
              f"({len(times)} steps, vocab {compiler.vocab_size})")


if __name__ == "__main__":
    main()
