"""Speculative decoding on SmolLM2 (fp32, CPU): n-gram prompt lookup and a truncated draft model vs plain decoding.

    .venv/bin/python benchmarks/speculative.py [--parts crossover,c1,c32,draft] [--quick] [--threads 1]

* ``crossover``: time of one forward step for B decoding requests with 1 token each vs 1 + k tokens each (the
  verification cost), B = 1..32; where the ratio exceeds the tokens a step can gain, speculation stops paying.
* ``c1``: concurrency 1, input-grounded prompts (rewrite code, quote/extract from a text, summarise a passage,
  SmolLM2 chat template), greedy: time per output token with ``ngram`` vs none; the text must be identical.
* ``c32``: 32 concurrent requests with the automatic policy (``speculative_max_batch``): throughput vs none.
* ``draft``: a draft made of SmolLM2's first layers + LM head (``write_truncated_draft``), concurrency 1.

The machine is shared and noisy: every measurement alternates the systems and keeps each one's best of
``--repeats`` runs. Results: ``benchmarks/results/speculative.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from worker.engine.scheduler import ScheduledChunk, SchedulerOutput  # noqa: E402
from worker.engine.spec_draft import write_truncated_draft  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals."""
    intervals = sorted(intervals, key=lambda x: x[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def count_words(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts
'''
CLASS = '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def peek(self):
        if not self.items:
            raise IndexError("peek from empty stack")
        return self.items[-1]

    def __len__(self):
        return len(self.items)
'''
PASSAGE = ("The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual reefs "
           "and 900 islands stretching for over 2,300 kilometres over an area of approximately 344,400 square "
           "kilometres. The reef is located in the Coral Sea, off the coast of Queensland, Australia. It can be "
           "seen from outer space and is the world's biggest single structure made by living organisms. This reef "
           "structure is composed of and built by billions of tiny organisms, known as coral polyps. It supports a "
           "wide diversity of life and was selected as a World Heritage Site in 1981. Climate change, pollution, "
           "crown-of-thorns starfish and fishing are the primary threats to the health of this reef system.")
LETTER = ("Dear Ms. Patel,\n\nThank you for your order #48213 placed on March 3. Your package containing two "
          "ceramic mugs and one teapot was shipped on March 5 via Parcel Express, tracking number PX-7781-2290. "
          "Delivery is expected on March 9 between 9 am and 5 pm. If you are not home, the courier will leave a "
          "notice and try again the next working day. For questions, call our support line at 555-0142.\n\n"
          "Kind regards,\nTom Becker, Customer Service")

PROMPTS = [
    "Rewrite the following Python code, renaming the function `merge_intervals` to `merge_ranges`. Output only "
    "the code.\n\n" + CODE,
    "Add type hints to every method of this class. Output only the code.\n\n" + CLASS,
    "Copy the following passage exactly, word for word.\n\n" + PASSAGE,
    "From the letter below, quote the sentence that gives the tracking number, then quote the sentence about "
    "delivery.\n\n" + LETTER,
    "Summarise this passage in three sentences, reusing its wording.\n\n" + PASSAGE,
    "Rewrite this code with all comments and docstrings removed. Output only the code.\n\n" + CODE,
]


def chat_ids(engine: Engine, prompt: str) -> list[int]:
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def engine_for(method: str | None, draft: str | None = None, max_batch: int | None = None,
               k: int = 4) -> Engine:
    extra = {"speculative_max_batch": max_batch} if max_batch is not None else {}
    return Engine(EngineConfig(model="smollm2", max_num_seqs=64, speculative_method=method, draft_model=draft,
                               num_speculative_tokens=k, enable_prefix_caching=False, **extra))


def timed_generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[tuple[int, ...]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def crossover(k: int, repeats: int, context: int = 256) -> list[dict]:
    """Step time for B requests decoding 1 token vs 1 + k tokens, on synthetic block tables."""
    engine = engine_for(None)
    runner, block_size = engine.runner, engine.plan.block_size
    blocks_per_seq = -(-(context + k + 1) // block_size)
    rows = []
    for batch in (1, 2, 4, 8, 12, 16, 24, 32):
        def step(num_new: int, batch: int = batch) -> float:
            chunks = tuple(ScheduledChunk(f"r{i}", tuple(range(100, 100 + num_new)), context,
                                          tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), True,
                                          num_spec_tokens=num_new - 1) for i in range(batch))
            start = time.perf_counter()
            runner.execute(SchedulerOutput(chunks))
            return time.perf_counter() - start
        plain, verify = [], []
        for _ in range(repeats):
            plain.append(step(1))
            verify.append(step(1 + k))
        row = {"batch": batch, "decode_ms": 1000 * min(plain), "verify_ms": 1000 * min(verify)}
        row["ratio"] = row["verify_ms"] / row["decode_ms"]
        rows.append(row)
        print(f"crossover B={batch}: decode {row['decode_ms']:.1f} ms, verify(k={k}) {row['verify_ms']:.1f} ms, "
              f"ratio {row['ratio']:.2f}", flush=True)
    return rows


def concurrency_one(repeats: int, max_tokens: int, k: int) -> dict:
    base, spec = engine_for(None), engine_for("ngram", k=k)
    prompts = [chat_ids(base, p) for p in PROMPTS]
    timed_generate(base, prompts[:1], 4), timed_generate(spec, prompts[:1], 4)  # warm-up
    per_prompt = []
    for i, ids in enumerate(prompts):
        best = {"none": float("inf"), "ngram": float("inf")}
        tokens: dict[str, tuple[int, ...]] = {}
        draft_before = (spec.stats().num_draft_tokens, spec.stats().num_accepted_tokens)
        for _ in range(repeats):
            for name, engine in (("none", base), ("ngram", spec)):
                seconds, outs = timed_generate(engine, [ids], max_tokens)
                best[name] = min(best[name], seconds)
                tokens[name] = outs[0]
        assert tokens["none"] == tokens["ngram"], f"prompt {i}: greedy text differs with ngram speculation"
        stats = spec.stats()
        drafted = (stats.num_draft_tokens - draft_before[0]) / repeats
        accepted = (stats.num_accepted_tokens - draft_before[1]) / repeats
        n = len(tokens["none"])
        per_prompt.append({"prompt": i, "output_tokens": n, "none_ms_per_token": 1000 * best["none"] / n,
                           "ngram_ms_per_token": 1000 * best["ngram"] / n,
                           "acceptance": accepted / drafted if drafted else 0.0})
        print(f"c1 prompt {i}: {n} tokens, none {per_prompt[-1]['none_ms_per_token']:.1f} ms/tok, ngram "
              f"{per_prompt[-1]['ngram_ms_per_token']:.1f} ms/tok, acceptance {per_prompt[-1]['acceptance']:.2f}",
              flush=True)
    total = sum(p["output_tokens"] for p in per_prompt)
    none_ms = sum(p["none_ms_per_token"] * p["output_tokens"] for p in per_prompt) / total
    ngram_ms = sum(p["ngram_ms_per_token"] * p["output_tokens"] for p in per_prompt) / total
    return {"prompts": per_prompt, "none_ms_per_token": none_ms, "ngram_ms_per_token": ngram_ms,
            "speedup": none_ms / ngram_ms, "identical_greedy_text": True}


def concurrency_32(repeats: int, max_tokens: int, k: int) -> dict:
    base, spec = engine_for(None), engine_for("ngram", k=k)
    prompts = [chat_ids(base, PROMPTS[i % len(PROMPTS)]) for i in range(32)]
    best = {"none": float("inf"), "ngram": float("inf")}
    outs: dict[str, list[tuple[int, ...]]] = {}
    for _ in range(repeats):
        for name, engine in (("none", base), ("ngram", spec)):
            seconds, outs[name] = timed_generate(engine, prompts, max_tokens)
            best[name] = min(best[name], seconds)
    num_tokens = sum(len(t) for t in outs["none"])
    assert outs["none"] == outs["ngram"], "greedy text differs at concurrency 32"
    result = {"output_tokens": num_tokens, "none_tok_per_s": num_tokens / best["none"],
              "ngram_tok_per_s": num_tokens / best["ngram"], "ratio": best["none"] / best["ngram"],
              "speculative_max_batch": spec.config.speculative_max_batch,
              "draft_tokens": spec.stats().num_draft_tokens, "accepted_tokens": spec.stats().num_accepted_tokens}
    print(f"c32: none {result['none_tok_per_s']:.1f} tok/s, ngram+policy {result['ngram_tok_per_s']:.1f} tok/s, "
          f"ratio {result['ratio']:.3f}", flush=True)
    return result


def draft_mode(repeats: int, max_tokens: int, k: int, layers: list[int]) -> list[dict]:
    base = engine_for(None)
    prompts = [chat_ids(base, p) for p in PROMPTS[:3]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for num_layers in layers:
            folder = write_truncated_draft("smollm2", Path(tmp) / f"draft-{num_layers}", num_layers)
            spec = engine_for("draft", str(folder), k=k)
            times = {"none": 0.0, "draft": 0.0}
            num_tokens = 0
            for ids in prompts:
                best = {"none": float("inf"), "draft": float("inf")}
                for _ in range(repeats):
                    for name, engine in (("none", base), ("draft", spec)):
                        seconds, outs = timed_generate(engine, [ids], max_tokens)
                        best[name] = min(best[name], seconds)
                        if name == "none":
                            expected = outs[0]
                        else:
                            assert outs[0] == expected, "greedy text differs with the draft model"
                times = {n: times[n] + best[n] for n in times}
                num_tokens += len(expected)
            stats = spec.stats()
            row = {"draft_layers": num_layers, "acceptance": stats.num_accepted_tokens / stats.num_draft_tokens,
                   "none_ms_per_token": 1000 * times["none"] / num_tokens,
                   "draft_ms_per_token": 1000 * times["draft"] / num_tokens}
            row["speedup"] = row["none_ms_per_token"] / row["draft_ms_per_token"]
            rows.append(row)
            print(f"draft {num_layers} layers: acceptance {row['acceptance']:.2f}, none "
                  f"{row['none_ms_per_token']:.1f} ms/tok, draft {row['draft_ms_per_token']:.1f} ms/tok", flush=True)
            del spec
    return rows


def write_markdown(results: dict) -> str:
    lines = ["# Speculative decoding (SmolLM2-135M, fp32, CPU)", "",
             f"{results['machine']}, torch threads {results['threads']}, k = {results['k']}", ""]
    if "crossover" in results:
        lines += ["## Verification cost vs batch size", "", "| batch | decode step ms | verify step (1+k tokens) ms |"
                  " ratio |", "|---:|---:|---:|---:|"]
        lines += [f"| {r['batch']} | {r['decode_ms']:.1f} | {r['verify_ms']:.1f} | {r['ratio']:.2f} |"
                  for r in results["crossover"]]
        lines.append("")
    if "c1" in results:
        c1 = results["c1"]
        lines += ["## Concurrency 1, n-gram prompt lookup (greedy, identical text)", "",
                  "| prompt | tokens | none ms/token | ngram ms/token | acceptance |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {p['prompt']} | {p['output_tokens']} | {p['none_ms_per_token']:.1f} | "
                  f"{p['ngram_ms_per_token']:.1f} | {p['acceptance']:.2f} |" for p in c1["prompts"]]
        lines += ["", f"Overall: {c1['none_ms_per_token']:.1f} -> {c1['ngram_ms_per_token']:.1f} ms/token, "
                  f"**{c1['speedup']:.2f}x** lower.", ""]
    if "c32" in results:
        c32 = results["c32"]
        lines += ["## Concurrency 32, automatic policy", "",
                  f"none {c32['none_tok_per_s']:.1f} tok/s, ngram with speculative_max_batch="
                  f"{c32['speculative_max_batch']}: {c32['ngram_tok_per_s']:.1f} tok/s, "
                  f"ratio **{c32['ratio']:.3f}**", ""]
    if "draft" in results:
        lines += ["## Draft model (SmolLM2's first layers + LM head), concurrency 1", "",
                  "| draft layers | acceptance | none ms/token | draft ms/token | speedup |",
                  "|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['draft_layers']} | {r['acceptance']:.2f} | {r['none_ms_per_token']:.1f} | "
                  f"{r['draft_ms_per_token']:.1f} | {r['speedup']:.2f} |" for r in results["draft"]]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="crossover,c1,c32,draft")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the box is shared)")
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats, max_tokens = (1, 64) if args.quick else (2, 192)
    parts = args.parts.split(",")
    results: dict = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "threads": args.threads,
                     "k": args.k}
    if "crossover" in parts:
        results["crossover"] = crossover(args.k, 3 if args.quick else 7)
    if "c1" in parts:
        results["c1"] = concurrency_one(repeats, max_tokens, args.k)
    if "c32" in parts:
        results["c32"] = concurrency_32(repeats, max_tokens // 2, args.k)
    if "draft" in parts:
        results["draft"] = draft_mode(repeats, max_tokens // 2, args.k, [4, 10])
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "speculative" if parts == ["crossover", "c1", "c32", "draft"] else "speculative-" + "-".join(parts)
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2))
    (RESULTS / f"{name}.md").write_text(write_markdown(results))
    print(write_markdown(results))


if __name__ == "__main__":
    main()
