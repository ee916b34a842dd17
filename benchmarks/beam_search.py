"""Beam search on SmolLM2 (fp32, CPU): KV blocks of one width-8 search vs 8 independent copies, and the engine's
beam-search speed vs transformers' ``generate(num_beams=k)`` on the same prompts (issue 21).

    .venv/bin/python benchmarks/beam_search.py [--threads 1] [--max-tokens 24] [--repeats 1]

* blocks: the peak KV blocks in use while one width-8 search runs (beams share the prompt's and their common
  prefix's blocks, copy only the block they write), against 8 independent requests for the same prompt and length
  (prefix caching off: each holds its own copy), and against the arithmetic 8 x blocks(prompt + max_tokens).
* speed: one request at a time, widths 4 and 8, no EOS (every search runs to ``max_tokens``): wall time and
  beam tokens/s = width x max_tokens / time, for the engine and for ``generate``; the returned beams must be equal.

The machine is shared and noisy: the two systems alternate and each keeps its best of ``--repeats`` runs.
Results: ``benchmarks/results/beam_search.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import read_cpu_info  # noqa: E402
from worker.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from worker.engine.kv_cache import num_blocks_needed  # noqa: E402
from worker.models import resolve_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PROMPTS = [
    "Translate to French: The weather is lovely today, so we will walk along the river after lunch.",
    "Summarise in one sentence: The committee met on Tuesday to review the budget. After a long discussion "
    "about rising costs, it agreed to postpone the new library wing until next year and to fund repairs first.",
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
]
BLOCK_SIZE = 16


def make_engine(folder: Path, caching: bool, threads: int) -> Engine:
    return Engine(EngineConfig(model=str(folder), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=512,
                               max_num_seqs=16, enable_prefix_caching=caching, num_threads=threads))


def peak_blocks(engine: Engine) -> int:
    """Step the engine to idle; the most blocks in use at any step."""
    peak = 0
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        peak = max(peak, stats.num_total_blocks - stats.num_free_blocks)
    return peak


def measure_blocks(folder: Path, prompt: list[int], max_tokens: int, threads: int) -> dict:
    engine = make_engine(folder, caching=False, threads=threads)
    beam = SamplingParams(temperature=0.0, beam_width=8, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request_group([f"b#{i}" for i in range(8)], prompt, beam)
    beam_peak = peak_blocks(engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"copy{i}", prompt, greedy)
    copies_peak = peak_blocks(engine)
    return {"prompt_tokens": len(prompt), "max_tokens": max_tokens, "block_size": BLOCK_SIZE,
            "beam_width_8_peak_blocks": beam_peak, "eight_independent_requests_peak_blocks": copies_peak,
            "eight_copies_arithmetic": 8 * num_blocks_needed(len(prompt) + max_tokens, BLOCK_SIZE)}


def run_engine(engine: Engine, prompt: list[int], width: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"r#{i}" for i in range(width)]
    start = time.perf_counter()
    engine.add_request_group(ids, prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for event in engine.step():
            tokens[event.request_id] = list(event.new_token_ids)
    return time.perf_counter() - start, [tokens[i] for i in ids]


def run_generate(model: torch.nn.Module, prompt: list[int], width: int, max_tokens: int
                 ) -> tuple[float, list[list[int]]]:
    input_ids = torch.tensor([prompt])
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, num_beams=width,
                         num_return_sequences=width, max_new_tokens=max_tokens, eos_token_id=[], pad_token_id=1)
    return time.perf_counter() - start, out[:, len(prompt):].tolist()


def measure_speed(folder: Path, prompts: list[list[int]], max_tokens: int, repeats: int, threads: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = make_engine(folder, caching=True, threads=threads)
    rows = []
    for width in (4, 8):
        engine_s, generate_s, equal = 0.0, 0.0, True
        for prompt in prompts:
            best_engine, best_generate = float("inf"), float("inf")
            for _ in range(repeats):  # alternate the two systems; keep each one's best
                seconds, ours = run_engine(engine, prompt, width, max_tokens)
                best_engine = min(best_engine, seconds)
                with torch.inference_mode():
                    seconds, theirs = run_generate(model, prompt, width, max_tokens)
                best_generate = min(best_generate, seconds)
                equal = equal and ours == theirs
            engine_s += best_engine
            generate_s += best_generate
        num_tokens = width * max_tokens * len(prompts)
        rows.append({"width": width, "prompts": len(prompts), "max_tokens": max_tokens,
                     "engine_s": round(engine_s, 2), "generate_s": round(generate_s, 2),
                     "engine_beam_tokens_per_s": round(num_tokens / engine_s, 1),
                     "generate_beam_tokens_per_s": round(num_tokens / generate_s, 1), "beams_equal": equal})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_model("smollm2")
    engine = make_engine(folder, caching=False, threads=args.threads)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    del engine
    results = {"machine": read_cpu_info().describe(), "threads": args.threads, "shared_machine": True,
               "blocks": measure_blocks(folder, prompts[1], args.max_tokens, args.threads),
               "speed": measure_speed(folder, prompts, args.max_tokens, args.repeats, args.threads)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "beam_search.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
