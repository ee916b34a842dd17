"""The GPU check: the engine on random-weight SmolLM2-shaped and ~1B Llama-shaped models, against hardware bounds
and transformers' own continuous batching. One prepared script: ~3.5 minutes on an H200 for both shapes and every
check, most of it compiling and transformers' side (docs/performance.md, "GPU"):

    python benchmarks/gpu_check.py                       # cuda, bf16; JSON to $OUT/gpu_check.json if $OUT is set
    python benchmarks/gpu_check.py --device cpu --tiny   # tiny shapes on CPU in seconds: every code path, no numbers

Per shape: greedy parity with transformers ``generate`` in the same dtype; decode step time at batch
1/16/64/256 against the weight-bandwidth bound (parameter bytes / bandwidth, ~4.3 TB/s on an H200); prefill
tokens/s against the bf16 peak (~790 TFLOP/s); and the engine vs transformers' continuous batching at 64
concurrent requests. Targets (issue 15): the 1B shape's batch-1 decode within 2.5x of the bandwidth bound, and
>= 5x transformers' continuous batching at 64 concurrent. The report is written after every check, so a run cut
off by a lease's time limit still returns what it measured (``--deadline-s`` skips the checks that would start
too late; ``--fallback`` tries simpler engine settings when one fails to load).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.offline_throughput import (  # noqa: E402
    Req,
    decode_step_efficiency,
    model_flops_per_token,
    run_engine,
    run_hf_continuous,
)
from benchmarks.random_models import SHAPES, build_model, parameter_bytes, save_model_folder  # noqa: E402

H200_BANDWIDTH_TBS = 4.3  # measured HBM bandwidth
H200_BF16_TFLOPS = 790.0  # measured dense bf16 matmul rate
DECODE_TARGET = 2.5  # batch-1 decode step within this factor of the bandwidth bound
ANCHOR_TARGET = 5.0  # engine tokens/s over transformers' continuous batching at 64 concurrent
# fp32 must match token for token; in lower precision near-tied logits may flip a token, so we ask 75% agreement.
MIN_AGREEMENT = {torch.float32: 1.0}
LOW_PRECISION_AGREEMENT = 0.75
# Random weights give flat logits, so two implementations' roundings can flip a near-tied greedy token early (the
# 1B shape's 128,256 logits in bf16 are ~0.03 apart at their top). A divergence counts as a near tie when
# transformers itself rates its token at most this share of its top logit above the engine's token, at the
# point where they part; a wrong engine picks tokens transformers ranks far lower.
NEAR_TIE = {torch.float32: 1e-4}
LOW_PRECISION_NEAR_TIE = 0.02
DECODE_WARMUP_STEPS = 3
CHECK_NAMES = ("parity", "decode", "profile", "prefill", "concurrent")  # in the order they run


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def check_parity(engine, hf, vocab: int, num_prompts: int, max_tokens: int, seed: int = 0) -> dict:
    """Greedy tokens from the engine vs transformers ``generate`` on the same weights: mean fraction of the output
    before the first differing token, over prompts of random lengths."""
    from worker.engine import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 48))] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in engine.generate(prompts, [params] * num_prompts)]
    agreement, divergences = [], []
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt], device=hf.device)
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens)[0, len(prompt):].tolist()
        agreement.append(common_prefix(list(tokens), ref) / max_tokens)
        divergences.append(divergence(hf, prompt, ref, list(tokens)))
    required = MIN_AGREEMENT.get(hf.dtype, LOW_PRECISION_AGREEMENT)
    tie = NEAR_TIE.get(hf.dtype, LOW_PRECISION_NEAR_TIE)
    near_ties = all(d is None or d["relative_margin"] <= tie for d in divergences)
    mean = sum(agreement) / len(agreement)
    return {"agreement": mean, "per_prompt": agreement, "required": required, "divergences": divergences,
            "near_tie": tie, "all_near_ties": near_ties, "ok": mean >= required or near_ties}


def divergence(hf, prompt: list[int], ref: list[int], got: list[int]) -> dict | None:
    """Where the engine's greedy tokens first leave transformers' (None: nowhere), and how transformers' own logits
    there rate its token against the engine's: the margin, that margin as a share of the top logit, and the rank
    of the engine's token (0 = transformers' first choice)."""
    position = common_prefix(got, ref)
    if position == min(len(got), len(ref)):
        return None
    ids = torch.tensor([prompt + ref[:position]], device=hf.device)
    with torch.inference_mode():
        logits = hf(ids).logits[0, -1].float()
    margin = float(logits[ref[position]] - logits[got[position]])
    return {"position": position, "margin": margin, "relative_margin": margin / float(logits.abs().max()),
            "engine_token_rank": int((logits > logits[got[position]]).sum())}


def cuda_ms(fn: Callable[[], object], repeats: int = 10) -> float:
    """Mean GPU milliseconds of ``fn`` over ``repeats`` calls after three warm-ups (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def graph_replay_ms(engine, batch: int, repeats: int = 50) -> float | None:
    """GPU time of one replay of the CUDA graph that ran ``batch`` decodes (the forward alone: no scheduling,
    sampling or buffer filling); None where no graph was captured (CPU, graphs off)."""
    from worker.engine.cuda_graphs import pick_bucket

    graphs = engine.runner.graphs
    bucket = pick_bucket(batch, graphs.buckets) if graphs is not None else None
    graph = graphs.graph(bucket) if bucket is not None else None
    if graph is None:
        return None
    return cuda_ms(graph.replay, repeats)


def decode_vs_bandwidth(engine, hf, batches: list[int], bandwidth_tbs: float, peak_tflops: float) -> list[dict]:
    """Steady-state decode step time per batch size, and its multiple of the time to read the weights once; where
    the step ran from a CUDA graph, also the graph's replay alone (the rest of a step is host work). With async
    scheduling, the same steps are also timed in turn (``in_turn_step_ms``), the two ways alternating twice and
    the best of each kept, so that neither pays alone for a first use (a compile, a capture)."""
    bound = parameter_bytes(hf) / (bandwidth_tbs * 1e12)
    overlapped = engine.runner.async_scheduling
    rows = []
    for batch in batches:
        e, in_turn_ms = decode_timings(engine, hf, batch, peak_tflops) if overlapped else (
            decode_step_efficiency(engine, hf.config, batch, rate_gflops=peak_tflops * 1e3, steps=16,
                                   warmup_steps=DECODE_WARMUP_STEPS), None)
        replay = graph_replay_ms(engine, batch)
        rows.append({"batch": batch, "step_ms": e["step_seconds"] * 1e3, "bound_ms": bound * 1e3,
                     "x_bound": e["step_seconds"] / bound, "tokens_per_s": batch / e["step_seconds"],
                     "fraction_of_peak": e["fraction_of_matmul"], "replay_ms": replay,
                     "replay_x_bound": replay and replay / (bound * 1e3), "async_scheduling": overlapped,
                     "in_turn_step_ms": in_turn_ms})
    return rows


def decode_timings(engine, hf, batch: int, peak_tflops: float) -> tuple[dict, float]:
    """The best of two overlapped measurements (``decode_step_efficiency``'s result) and of two in turn (ms),
    alternating in turn first; the engine overlaps again afterwards."""
    readings: dict[bool, list[dict]] = {False: [], True: []}
    try:
        for overlap in (False, True, False, True):
            engine.runner.async_scheduling = overlap
            readings[overlap].append(decode_step_efficiency(engine, hf.config, batch, rate_gflops=peak_tflops * 1e3,
                                                            steps=16, warmup_steps=DECODE_WARMUP_STEPS))
    finally:
        engine.runner.async_scheduling = True
    best = {mode: min(found, key=lambda e: e["step_seconds"]) for mode, found in readings.items()}
    return best[True], best[False]["step_seconds"] * 1e3


def profile_decode(engine, hf, batch: int, steps: int = 8) -> dict:
    """The kernels (GPU) or ops (CPU) of ``steps`` steady decode steps at ``batch``, by self time: where a step's
    time goes, for the next round of work on the decode path."""
    from torch.profiler import ProfilerActivity, profile

    cuda = next(hf.parameters()).is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities)
    decode_step_efficiency(engine, hf.config, batch, rate_gflops=1.0, steps=steps, warmup_steps=DECODE_WARMUP_STEPS,
                           around=prof)
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    return {"batch": batch, "steps": steps, "table": averages.table(sort_by=sort, row_limit=25),
            "cpu_table": averages.table(sort_by="cpu_time_total", row_limit=40)}  # host time, waits included


def prefill_vs_peak(engine, hf, num_prompts: int, prompt_len: int, peak_tflops: float) -> dict:
    """Prompt tokens/s of long prompts with one output token each, and the FLOP rate as a share of the peak."""
    rng = random.Random(1)
    vocab = hf.config.vocab_size
    warmup, *reqs = (Req([rng.randrange(3, vocab) for _ in range(prompt_len)], 1) for _ in range(num_prompts + 1))
    run_engine(engine, [warmup])  # untimed: compiles attention for the chunk's shape
    seconds = run_engine(engine, reqs)
    tokens = num_prompts * prompt_len
    tflops = tokens * model_flops_per_token(hf.config, prompt_len // 2) / seconds / 1e12
    return {"prompts": num_prompts, "prompt_len": prompt_len, "tokens_per_s": tokens / seconds, "tflops": tflops,
            "fraction_of_peak": tflops / peak_tflops}


def transformers_cb_config(num_requests: int, tokens_per_request: int, max_batch_tokens: int):
    """KV room for every request at once and the engine's token budget per forward pass, so both sides get the
    same limits (and transformers skips sizing its cache from free memory). None where the installed transformers
    has no such config (older versions): it then sizes the cache itself."""
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:
        return None

    page = 256
    fields = inspect.signature(ContinuousBatchingConfig).parameters
    size = {"page_size": page} if "page_size" in fields else {"block_size": page}  # renamed after 5.17
    return ContinuousBatchingConfig(**size, num_blocks=num_requests * -(-tokens_per_request // page) + 8,
                                    max_batch_tokens=max_batch_tokens)


def concurrent_vs_transformers(engine, hf, num_requests: int, prompt_len: int, new_tokens: int,
                               max_batch_tokens: int) -> dict:
    """The engine and transformers' continuous batching on the same ``num_requests`` requests at once.

    A failure of transformers' side (its continuous batching is young and changes between versions) is recorded in
    the result, not raised: the rest of a timed GPU run is worth keeping."""
    rng = random.Random(2)
    vocab = hf.config.vocab_size
    # warm-up prompts of their own: the timed ones must not find their prefixes cached
    warmup, reqs = ([Req([rng.randrange(3, vocab) for _ in range(prompt_len)], new_tokens)
                     for _ in range(num_requests)] for _ in range(2))
    tokens = num_requests * new_tokens
    run_engine(engine, warmup)  # untimed: any shape new to this workload (a kernel compile, a graph capture)
    engine_tps = tokens / run_engine(engine, reqs)
    result = {"requests": num_requests, "prompt_len": prompt_len, "new_tokens": new_tokens,
              "engine_tps": engine_tps, "transformers_cb_tps": None, "ratio": None, "error": None}
    try:
        cb_config = transformers_cb_config(num_requests, prompt_len + new_tokens, max_batch_tokens)
        run_hf_continuous(hf, warmup, cb_config)  # untimed, as for the engine
        result["transformers_cb_tps"] = tokens / run_hf_continuous(hf, reqs, cb_config)
        result["ratio"] = engine_tps / result["transformers_cb_tps"]
    except Exception as exc:  # noqa: BLE001  # recorded in the JSON and printed
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"transformers continuous batching failed: {result['error']}", flush=True)
    return result


def failure(exc: BaseException) -> dict:
    """A failed step as the report records it (the run goes on: the rest of a timed GPU run is worth keeping)."""
    print(traceback.format_exc(), flush=True)
    return {"error": f"{type(exc).__name__}: {exc}"}


def engine_configurations(args: argparse.Namespace) -> list[dict[str, str]]:
    """The engine settings to try in order: the asked-for ones, then with ``--fallback`` the same without compiled
    pointwise steps, then also without graphs, then the plain path (sdpa, no graphs, torch ops)."""
    asked = {"attention_backend": args.attention, "cuda_graphs": args.cuda_graphs,
             "compile_pointwise": args.compile_pointwise, "async_scheduling": args.async_scheduling}
    tried = [asked]
    if args.fallback:
        tried += [{**asked, "compile_pointwise": "off"},
                  {**asked, "compile_pointwise": "off", "async_scheduling": "off"},
                  {**asked, "cuda_graphs": "off", "compile_pointwise": "off", "async_scheduling": "off"},
                  {"attention_backend": "sdpa", "cuda_graphs": "off", "compile_pointwise": "off",
                   "async_scheduling": "off"}]
    return [dict(t) for t in dict.fromkeys(tuple(t.items()) for t in tried)]


def load_engine(folder: str, args: argparse.Namespace, result: dict):
    """The engine on the first settings that load and run a warm-up request (which also compiles its first
    kernels); each one that fails is recorded in ``result["engine_errors"]``."""
    from worker.engine import Engine, EngineConfig

    for settings in engine_configurations(args):
        try:
            engine = Engine(EngineConfig(model=folder, device=args.device, dtype=args.dtype, max_num_seqs=256,
                                         max_num_batched_tokens=args.max_batched_tokens,
                                         max_model_len=args.max_model_len, kv_cache_bytes=args.kv_gib << 30,
                                         **settings))
            run_engine(engine, [Req(list(range(3, 35)), 8)])  # warm-up: allocations, kernel selection, compiles
            return engine
        except Exception as exc:  # noqa: BLE001  # recorded; the next settings are tried
            result.setdefault("engine_errors", []).append({**settings, **failure(exc)})
            gc.collect()
    return None


def check_shape(name: str, args: argparse.Namespace, result: dict, save: Callable[[], None]) -> None:
    """Build one random model, load it into the engine from a temporary folder, and run every check on it, filling
    ``result`` and calling ``save`` after each check; a check that fails or comes after ``args.deadline_s`` is
    recorded as such and the rest still run."""
    shape, tiny = SHAPES[name], name.endswith("-tiny")
    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    hf = build_model(shape, args.device, dtype)
    result.update({"shape": vars(shape), "parameter_bytes": parameter_bytes(hf), "seconds": {}})
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as folder:
        save_model_folder(hf, Path(folder))
        engine = load_engine(folder, args, result)
    result["seconds"]["setup"] = time.perf_counter() - start
    save()
    if engine is None:
        return
    decoder = engine.runner.decoder
    result.update({"attention_backend": engine.runner.attention_backend, "cuda_graphs": engine.runner.cuda_graphs,
                   "pointwise": decoder.ops.kind if decoder is not None else "transformers",
                   "async_scheduling": engine.runner.async_scheduling})
    checks = (
        ("parity", check_parity, (engine, hf, shape.vocab_size, 4, 16 if tiny else 32)),
        ("decode", decode_vs_bandwidth, (engine, hf, args.batches, args.bandwidth_tbs, args.peak_tflops)),
        *((("profile", profile_decode, (engine, hf, args.profile_batch)),) if args.profile_batch else ()),
        ("prefill", prefill_vs_peak, (engine, hf, 4 if tiny else 16, 64 if tiny else 2048, args.peak_tflops)),
        ("concurrent", concurrent_vs_transformers, (engine, hf, args.concurrent, 32 if tiny else 128,
                                                    16 if tiny else 128, args.max_batched_tokens)),
    )
    for key, check, check_args in checks:
        if key not in args.checks:
            continue
        if args.deadline_s is not None and time.perf_counter() - args.started > args.deadline_s:
            result[key] = {"skipped": f"past the {args.deadline_s:.0f} s deadline"}
            continue
        began = time.perf_counter()
        try:
            result[key] = check(*check_args)
        except Exception as exc:  # noqa: BLE001  # recorded in the JSON and printed
            result[key] = failure(exc)
        result["seconds"][key] = time.perf_counter() - began
        save()
    print(f"{name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in result["seconds"].items()), flush=True)
    del checks
    del engine, hf
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()


def targets(shapes: dict[str, dict]) -> dict[str, dict]:
    """The issue's targets, judged on the ~1B shape (its tiny stand-in in a --tiny run, where they mean nothing)."""
    one_b = shapes.get("llama-1b") or shapes.get("llama-1b-tiny")
    if one_b is None:
        return {}
    decode = one_b.get("decode")
    batch1 = next((d for d in decode if d["batch"] == 1), None) if isinstance(decode, list) else None
    ratio = one_b.get("concurrent", {}).get("ratio")
    return {
        "decode_batch1_x_bound": {"value": batch1 and batch1["x_bound"], "target": f"<= {DECODE_TARGET}",
                                  "met": bool(batch1 and batch1["x_bound"] <= DECODE_TARGET)},
        "concurrent_x_transformers_cb": {"value": ratio, "target": f">= {ANCHOR_TARGET}",
                                         "met": ratio is not None and ratio >= ANCHOR_TARGET},
    }


def unfinished(section: object) -> str | None:
    """Why a check has no numbers (it failed, was skipped or never ran), else None."""
    if not isinstance(section, dict):
        return None if section is not None else "not run"
    return section.get("error") or section.get("skipped")


def decode_cells(section: object, batches: list[int]) -> str:
    """One cell per batch: step ms (x bound), and the graph replay alone where one ran."""
    why = unfinished(section) if not isinstance(section, list) else None
    if why is not None or not isinstance(section, list):
        return " | ".join([f"{why}"] * len(batches))
    return " | ".join(f"{d['step_ms']:.2f} ({d['x_bound']:.1f}x)"
                      + (f"; in turn {d['in_turn_step_ms']:.2f}" if d.get("in_turn_step_ms") else "")
                      + (f"; graph {d['replay_ms']:.2f} ({d['replay_x_bound']:.1f}x)" if d.get("replay_ms") else "")
                      for d in section)


def parity_summary(parity: dict) -> str:
    """Agreement, and whether it passes on its own or because every divergence is a near tie."""
    if parity["agreement"] >= parity["required"]:
        return f"{parity['agreement']:.0%} (ok)"
    ties = sum(d is not None for d in parity.get("divergences", []))
    verdict = f"ok: {ties} near ties" if parity["ok"] else "FAIL"
    return f"{parity['agreement']:.0%} ({verdict})"


def shape_row(name: str, s: dict, batches: list[int]) -> str:
    """A shape's row: parity, decode per batch, prefill, concurrent; a failed or skipped check says so."""
    parity, prefill, concurrent = s.get("parity"), s.get("prefill"), s.get("concurrent")
    parity_cell = unfinished(parity) or parity_summary(parity)
    prefill_cell = unfinished(prefill) or f"{prefill['tokens_per_s']:.0f} ({prefill['fraction_of_peak']:.1%})"
    anchor = unfinished(concurrent) or (
        f"{concurrent['engine_tps']:.0f} / {concurrent['transformers_cb_tps']:.0f} = {concurrent['ratio']:.1f}x"
        if concurrent["ratio"] else f"{concurrent['engine_tps']:.0f} / failed")
    return f"| {name} | {parity_cell} | {decode_cells(s.get('decode'), batches)} | {prefill_cell} | {anchor} |"


def render_table(report: dict) -> str:
    """The per-shape numbers as a markdown table, for the console and docs/performance.md."""
    hardware = report.get("measured") or {}
    lines = [f"device: {report['device_name']} ({report['device']}, {report['dtype']}); torch {report['torch']}, "
             f"transformers {report['transformers']}; bounds: {report['bandwidth_tbs']} TB/s, "
             f"{report['peak_tflops']} TFLOP/s ({report.get('bounds_from', 'given')})"
             + (f" (measured in this run: {hardware['copy_tbs']:.2f} TB/s, {hardware['bf16_tflops']:.0f} TFLOP/s)"
                if hardware else ""),
             "engine: " + "; ".join(f"{n}: attention {s.get('attention_backend')}, cuda graphs {s.get('cuda_graphs')}"
                                    f", pointwise {s.get('pointwise')}, async scheduling {s.get('async_scheduling')}"
                                    for n, s in report["shapes"].items()), "",
             "| shape | parity | " + " | ".join(f"decode b{b} ms (x bound)" for b in report["batches"])
             + f" | prefill tok/s (of peak) | {report['concurrent']} concurrent: engine / transformers CB tok/s |",
             "|---|---|" + "---:|" * (len(report["batches"]) + 2)]
    lines += [shape_row(name, s, report["batches"]) for name, s in report["shapes"].items()]
    for name, s in report["shapes"].items():
        lines += [f"\n{name}: engine {e['attention_backend']}/{e['cuda_graphs']}/{e['compile_pointwise']} failed: "
                  f"{e['error']}"
                  for e in s.get("engine_errors", [])]
    for key, t in report["targets"].items():
        lines.append(f"\ntarget {key}: {t['value']} (want {t['target']}): {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines) + "\n"


def pick_bounds(bandwidth_tbs: float | None, peak_tflops: float | None, measured: dict | None
                ) -> tuple[float, float, str]:
    """The bandwidth and peak the targets are judged against, and where they came from: as given, else this
    GPU's own measured rates (an H100 is judged against an H100's memory, not an H200's), else an H200's."""
    if bandwidth_tbs is not None and peak_tflops is not None:
        return bandwidth_tbs, peak_tflops, "given"
    if measured is not None:
        return (bandwidth_tbs or round(measured["copy_tbs"], 2), peak_tflops or round(measured["bf16_tflops"]),
                "measured" if bandwidth_tbs is None and peak_tflops is None else "given and measured")
    return bandwidth_tbs or H200_BANDWIDTH_TBS, peak_tflops or H200_BF16_TFLOPS, "H200 constants"


def copy_tbs(device: str, nbytes: int = 1 << 32) -> float:
    """Device-to-device copy bandwidth, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / cuda_ms(lambda: dst.copy_(src)) / 1e9


def matmul_tflops(device: str, n: int = 8192) -> float:
    """Dense bf16 matrix product rate on random data."""
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    return 2 * n ** 3 / cuda_ms(lambda: a @ b) / 1e9


def measure_hardware(device: str) -> dict | None:
    """This GPU's copy bandwidth and bf16 matmul rate, beside the fixed bounds the targets use; None on CPU."""
    if not device.startswith("cuda"):
        return None
    measured = {"copy_tbs": copy_tbs(device), "bf16_tflops": matmul_tflops(device)}
    torch.cuda.empty_cache()
    return measured


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny stand-ins of both shapes (CPU tests)")
    parser.add_argument("--shapes", default=None, help="comma-separated, default: smollm2-135m,llama-1b")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--concurrent", type=int, default=64)
    parser.add_argument("--attention", default="auto", choices=("auto", "sdpa", "flex"),
                        help="EngineConfig.attention_backend (auto: flex on CUDA, sdpa on CPU)")
    parser.add_argument("--cuda-graphs", default="auto", choices=("auto", "off", "on", "padded"),
                        help="EngineConfig.cuda_graphs (auto: on with CUDA, flex and the own decoder)")
    parser.add_argument("--compile-pointwise", default="auto", choices=("auto", "off", "on"),
                        help="EngineConfig.compile_pointwise (auto: inductor-compiled norms, RoPE, SiLU on CUDA)")
    parser.add_argument("--async-scheduling", default="auto", choices=("auto", "off", "on"),
                        help="EngineConfig.async_scheduling (auto: on where CUDA graphs replay); where on, the decode "
                        "check also times the same steps in turn")
    parser.add_argument("--bandwidth-tbs", type=float, default=None,
                        help="the weight-bandwidth bound's TB/s (default: this GPU's copy rate, measured at the start; "
                        f"{H200_BANDWIDTH_TBS}, an H200's, on CPU)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the prefill peak's TFLOP/s (default: this GPU's bf16 matmul rate, measured at the start; "
                        f"{H200_BF16_TFLOPS:.0f}, an H200's, on CPU)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/gpu_check.json or "
                        "benchmarks/results/gpu_check.json)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="skip the checks that would start later than this (the report is written after each)")
    parser.add_argument("--checks", default=",".join(CHECK_NAMES),
                        help="which checks to run (profile only with --profile-batch)")
    parser.add_argument("--profile-batch", type=int, default=None,
                        help="also profile decode steps at this batch size (kernels by GPU time, in the report)")
    parser.add_argument("--fallback", action="store_true",
                        help="if the engine fails to load or warm up, try again with sdpa attention and no graphs")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device; use --device cpu --tiny for a CPU smoke run")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.shapes = (args.shapes or ("smollm2-tiny,llama-1b-tiny" if args.tiny else "smollm2-135m,llama-1b")).split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.checks = set(args.checks.split(","))
    if args.checks - set(CHECK_NAMES):
        parser.error(f"unknown checks {sorted(args.checks - set(CHECK_NAMES))}; known: {', '.join(CHECK_NAMES)}")
    args.max_batched_tokens, args.max_model_len = (512, 1024) if args.tiny else (8192, 4096)
    args.kv_gib = 16 if cuda else 1
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "results"
    args.out = args.out or out_dir / "gpu_check.json"
    return args


def main(argv: list[str] | None = None) -> int:
    import transformers

    args = parse_args(argv)
    args.started = time.perf_counter()
    cuda = args.device.startswith("cuda")
    shapes: dict[str, dict] = {}
    measured = measure_hardware(args.device)
    args.bandwidth_tbs, args.peak_tflops, bounds_from = pick_bounds(args.bandwidth_tbs, args.peak_tflops, measured)
    report = {"device": args.device, "device_name": torch.cuda.get_device_name(args.device) if cuda else "cpu",
              "dtype": args.dtype, "torch": torch.__version__, "transformers": transformers.__version__,
              "bandwidth_tbs": args.bandwidth_tbs, "peak_tflops": args.peak_tflops, "bounds_from": bounds_from,
              "batches": args.batches, "concurrent": args.concurrent, "measured": measured, "shapes": shapes,
              "complete": False}

    def save() -> None:
        report.update(targets=targets(shapes), seconds=time.perf_counter() - args.started)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    for name in args.shapes:
        shapes[name] = {}
        check_shape(name, args, shapes[name], save)
        print(f"{name}: done at {time.perf_counter() - args.started:.0f} s", flush=True)
    report["complete"] = True
    save()
    print(render_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
