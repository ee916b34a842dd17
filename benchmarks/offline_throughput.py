"""Offline throughput: naive static batching vs transformers' continuous batching vs the tokenspool engine.

One command, same machine, same model (SmolLM2, fp32 on CPU), same requests, same run:

    .venv/bin/python benchmarks/offline_throughput.py [--workloads mixed,shared_prefix,long] [--quick]

Prompts are random token ids and every request uses ``ignore_eos`` so output lengths are exact. Results go to
``benchmarks/results/offline_throughput.json`` and ``.md``; the README and docs/performance.md show the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Req:
    """One benchmark request: prompt token ids and an exact number of output tokens."""

    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class RunResult:
    system: str
    workload: str
    seconds: float
    prompt_tokens: int
    output_tokens: int
    load_before: float = 0.0  # 1-minute load average when the run started (other jobs share these cores)
    load_after: float = 0.0

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def make_workload(name: str, vocab: int, seed: int = 0, scale: float = 1.0) -> list[Req]:
    """The three workloads of the performance issue; ``scale`` < 1 shrinks request counts for a quick run."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    def count(n: int) -> int:
        return max(2, int(n * scale))

    if name == "mixed":
        return [Req(ids(rng.randint(16, 256)), rng.randint(8, 256)) for _ in range(count(64))]
    if name == "shared_prefix":
        system = ids(512)
        return [Req(system + ids(rng.randint(16, 64)), rng.randint(32, 128)) for _ in range(count(64))]
    if name == "long":
        return [Req(ids(rng.randint(1024, 2048)), rng.randint(16, 64)) for _ in range(count(16))]
    raise ValueError(f"workload must be mixed, shared_prefix or long, got {name!r}")


def default_threads() -> int:
    """The cores this process may use minus those other processes keep busy (1-minute load average), at least 1.

    On a shared machine a torch thread per core is a trap: when another process holds a core, torch's threads
    wait for each other at every op's barrier (measured: a batch-64 decode step 0.83 s with 1 thread, 4.2 s with
    2, at load ~3 on 2 cores; docs/performance.md).
    """
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, cores - round(os.getloadavg()[0])))


def matmul_rate_gflops(n: int = 2048, repeats: int = 10) -> float:
    """The machine's fp32 matrix-multiply rate (GFLOP/s) with torch's BLAS, the ceiling for any engine here."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def model_flops_per_token(config, context: int) -> float:
    """Forward FLOPs for one token at a given context: 2·(matmul params) + attention (QK and PV)."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    per_layer = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2 + 3 * h * inter
    attention = 2 * 2 * heads * head_dim * context
    return 2 * (layers * per_layer + h * config.vocab_size) + layers * attention


def workload_flops(config, reqs: list[Req]) -> float:
    """Useful FLOPs of a workload: every prompt and output token once, at its own mean context."""
    total = 0.0
    for r in reqs:
        n = len(r.prompt) + r.max_tokens
        total += n * model_flops_per_token(config, n // 2)
    return total


def run_naive(model, reqs: list[Req], pad_id: int, batch_size: int = 8) -> float:
    """transformers ``generate`` with left padding, fixed batches in arrival order, each to its longest output."""
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        longest = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - start


def run_hf_continuous(model, reqs: list[Req], cb_config=None) -> float:
    """transformers' built-in continuous batching, with each request's own ``max_new_tokens`` and no EOS.

    ``cb_config``: an optional ``transformers.ContinuousBatchingConfig`` (KV blocks, token budget); without one
    transformers sizes its cache from free memory, which on CPU costs ~20 s per run before the first token."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in reqs), eos_token_id=-1)
    extra = {} if cb_config is None else {"continuous_batching_config": cb_config}
    manager = model.init_continuous_batching(generation_config=config, **extra)
    manager.start()
    start = time.perf_counter()
    try:
        for i, r in enumerate(reqs):
            manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
        done = 0
        while done < len(reqs):
            result = manager.get_result(timeout=5)
            if result is not None and result.is_finished():
                done += 1
    finally:
        elapsed = time.perf_counter() - start
        manager.stop(block=True)
    return elapsed


def run_engine(engine, reqs: list[Req]) -> float:
    """The tokenspool engine's offline ``generate`` over the whole workload at once."""
    from worker.engine import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs]
    start = time.perf_counter()
    outs = engine.generate([r.prompt for r in reqs], params)
    elapsed = time.perf_counter() - start
    got = [len(o.token_ids) for o in outs]
    assert got == [r.max_tokens for r in reqs], "engine did not produce the exact output lengths"
    return elapsed


def decode_step_efficiency(engine, config, batch: int, rate_gflops: float, steps: int = 16,
                           warmup_steps: int = 0, around: AbstractContextManager | None = None) -> dict[str, float]:
    """Time steady-state decode steps at ``batch`` running requests; FLOPs achieved vs the matmul rate.
    ``warmup_steps`` untimed decode steps first (a CUDA graph's capture, a kernel's compilation for the shape);
    ``around``: entered around the timed steps (a profiler)."""
    from worker.engine import SamplingParams

    prompt_len = 64
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{i}", [5 + (i + j) % 1000 for j in range(prompt_len)], params)
    while sum(1 for _ in engine.step()) < batch:  # until every request has its first token (prefill done)
        pass
    for _ in range(warmup_steps):
        engine.step()
    with around or nullcontext():
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        seconds = (time.perf_counter() - start) / steps
    for i in range(batch):
        engine.abort(f"decode-{i}")
    flops = batch * model_flops_per_token(config, prompt_len + warmup_steps + steps)
    gflops = flops / seconds / 1e9
    return {"batch": batch, "step_seconds": seconds, "gflops": gflops, "fraction_of_matmul": gflops / rate_gflops}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workloads", default="mixed,shared_prefix,long")
    parser.add_argument("--systems", default="naive,hf_cb,engine,engine_no_prefix_cache,engine_no_cascade,engine_int8")
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests, for a smoke run")
    parser.add_argument("--scale", type=float, default=None, help="request-count scale (overrides --quick)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every system (default: the cores not already busy, at least 1)")
    parser.add_argument("--dtype", default=None, help="the engines' dtype (default: EngineConfig's pick for this "
                        "CPU; float32 is the exact path, whose decode attention gathers K/V)")
    parser.add_argument("--out", type=Path, default=RESULTS / "offline_throughput")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from worker.engine import Engine, EngineConfig
    from worker.engine.host_memory import keep_freed_memory_for_reuse
    from worker.models import resolve_model

    torch.manual_seed(0)
    # The engine applies these allocator settings when it is built; apply them first, so that every system in
    # this process (baselines included) runs with the same allocator.
    args.malloc_tuned = keep_freed_memory_for_reuse()
    args.threads = args.threads or default_threads()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = hf_model.config
    rate = matmul_rate_gflops()
    print(f"fp32 matmul rate: {rate:.1f} GFLOP/s on {torch.get_num_threads()} threads", flush=True)
    common = dict(model=str(path), num_threads=args.threads, dtype=args.dtype)
    engines: dict[str, Callable[[], object]] = {
        "engine": lambda: Engine(EngineConfig(**common, enable_prefix_caching=True)),
        "engine_no_prefix_cache": lambda: Engine(EngineConfig(**common, enable_prefix_caching=False)),
        "engine_no_cascade": lambda: Engine(EngineConfig(**common, cascade_attention="off")),
        "engine_int8": lambda: Engine(EngineConfig(**common, quantization="int8")),
    }
    systems = args.systems.split(",")
    results: list[RunResult] = []
    scale = args.scale if args.scale is not None else 0.25 if args.quick else 1.0
    args.scale = scale
    for workload in args.workloads.split(","):
        reqs = make_workload(workload, config.vocab_size, scale=scale)
        prompt_tokens = sum(len(r.prompt) for r in reqs)
        output_tokens = sum(r.max_tokens for r in reqs)
        for system in systems:
            if system in ("engine_no_prefix_cache", "engine_no_cascade") and workload != "shared_prefix":
                continue
            if system == "engine_int8" and workload != "mixed":
                continue
            load_before = os.getloadavg()[0]
            if system == "naive":
                seconds = run_naive(hf_model, reqs, pad_id=config.pad_token_id or 0)
            elif system == "hf_cb":
                seconds = run_hf_continuous(hf_model, reqs)
            else:
                seconds = run_engine(engines[system](), reqs)
            result = RunResult(system, workload, seconds, prompt_tokens, output_tokens, load_before,
                               os.getloadavg()[0])
            results.append(result)
            print(f"{workload:14s} {system:24s} {seconds:8.1f} s  {result.output_tps:8.1f} out tok/s  "
                  f"(load {load_before:.1f} -> {result.load_after:.1f})", flush=True)
    efficiency = []
    if "engine" in systems:
        engine = engines["engine"]()
        # The matmul rate again, next to the decode steps, so both see the same load.
        rate = (rate + matmul_rate_gflops()) / 2
        efficiency = [decode_step_efficiency(engine, config, b, rate) for b in (1, 16, 64)]
        for e in efficiency:
            print(f"decode batch {e['batch']:3d}: {e['step_seconds'] * 1e3:7.1f} ms/step, "
                  f"{e['fraction_of_matmul']:.0%} of matmul rate", flush=True)
    report = build_report(results, efficiency, rate, config, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    args.out.with_suffix(".md").write_text(render_markdown(report))
    print(render_markdown(report))
    return 0


def build_report(results, efficiency, rate, config, args) -> dict:
    """Everything measured, plus ratios of the engine against each baseline per workload."""
    by_key = {(r.system, r.workload): r for r in results}
    ratios = {}
    for (system, workload), r in by_key.items():
        if system != "engine":
            continue
        for base in ("naive", "hf_cb", "engine_no_prefix_cache", "engine_no_cascade"):
            if (base, workload) in by_key:
                ratios[f"{workload}: engine / {base}"] = r.output_tps / by_key[(base, workload)].output_tps
        if ("engine_int8", workload) in by_key:
            ratios[f"{workload}: engine_int8 / engine"] = by_key[("engine_int8", workload)].output_tps / r.output_tps
    rows = []
    for r in results:
        flops = workload_flops(config, make_workload(r.workload, config.vocab_size, scale=args.scale))
        rows.append({**asdict(r), "output_tps": r.output_tps, "total_tps": r.total_tps,
                     "gflops": flops / r.seconds / 1e9, "fraction_of_matmul": flops / r.seconds / 1e9 / rate})
    return {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "matmul_gflops": rate, "load_average": os.getloadavg()},
        "model": args.model, "quick": args.quick, "scale": args.scale, "malloc_tuned": args.malloc_tuned,
        "results": rows, "ratios": ratios,
        "decode_efficiency": efficiency,
    }


def render_markdown(report: dict) -> str:
    """The README/performance-doc table."""
    m = report["machine"]
    load = ", ".join(f"{x:.1f}" for x in m["load_average"])
    lines = [f"fp32 matmul rate: **{m['matmul_gflops']:.0f} GFLOP/s** ({m['threads']} threads, torch {m['torch']}); "
             f"request scale {report['scale']}; glibc thresholds raised for all systems: "
             f"{report.get('malloc_tuned', False)}; load average at the end {load}",
             "", "| workload | system | seconds | output tok/s | total tok/s | GFLOP/s | of matmul rate | load |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        lines.append(f"| {r['workload']} | {r['system']} | {r['seconds']:.1f} | {r['output_tps']:.1f} | "
                     f"{r['total_tps']:.1f} | {r['gflops']:.1f} | {r['fraction_of_matmul']:.0%} | "
                     f"{r['load_before']:.1f} |")
    lines += ["", "| ratio (output tok/s) | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f}x |" for k, v in report["ratios"].items()]
    if report["decode_efficiency"]:
        lines += ["", "| decode batch | step ms | GFLOP/s | of matmul rate |", "|---:|---:|---:|---:|"]
        for e in report["decode_efficiency"]:
            ms, share = e["step_seconds"] * 1e3, e["fraction_of_matmul"]
            lines.append(f"| {e['batch']} | {ms:.1f} | {e['gflops']:.1f} | {share:.0%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
