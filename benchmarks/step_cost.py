"""Step cost: one stream and 32 streams through the engine, for several dtype/quantisation settings.

    .venv/bin/python benchmarks/step_cost.py [--systems fp32,bf16,int8,int4] [--rounds 2] [--checkout PATH]

- one stream: a 64-token prompt, 128 new tokens, greedy (ignore EOS); tok/s counts the new tokens over the whole
  request (prefill included), as a client sees it;
- 32 streams: the first 32 requests of offline_throughput.py's mixed workload (16-256 prompt tokens, 8-256 new
  tokens), all submitted at once; output tok/s.
Systems run interleaved, round after round, so that load from other jobs on a shared machine hits them alike.
``--steps N`` measures instead the steady decode step itself, by default at batch 1 and at batch 32 (``--batches``;
64-token prompts), alternating single steps between the systems N times: the median ms/step of each is immune to load
drifting between whole runs (on a shared machine whole runs of the same system differed by 2-3x).
Each line names the compute plan the system got (dtype, quantisation, which forward) and the process CPU time
per step beside the wall time. ``--checkout`` imports the engine from another checkout (e.g. the main branch)
to measure "before" in a second process alternating with this one; ``int8`` there is the old dynamic-activation
option.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = {
    "default": {"quantization": "auto"},  # what a worker runs unconfigured (the worker's settings default to auto)
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "bf16_int4": {"dtype": "bfloat16", "quantization": "int4"},  # the two activation dtypes, whatever the CPU
    "fp32_int4": {"dtype": "float32", "quantization": "int4"},
    "fp16": {"quantization": "fp16"},  # float16 weights (fbgemm), float32 activations: x86 CPUs without fast bf16
    "decoder": {"quantization": "none"},  # the own decoder with the weights in the picked dtype, unquantised
    "sdpa": {"quantization": "auto", "attention_backend": "sdpa"},  # the default, decode K/V gathered for SDPA
    "torch_ops": {"quantization": "auto"},  # the default with the decoder's small steps as torch ops (see below)
    "torch_int4": {"quantization": "auto"},  # the default with torch's int4 kernel wherever int4 runs (see below)
    "layer_loop": {"quantization": "auto"},  # the default with every step's layers in Python (see below)
}
# Systems that differ from their config after the engine is built: ``torch_ops`` runs the norms, RoPE,
# SiLU-and-multiply and the K/V writes as torch ops instead of tokenspool's C++ operators (what a worker without a
# compiler runs, its LM head aside), to measure what the operators save; ``layer_loop`` runs the decoder's layers
# from Python in every step, not as one C++ call where the step allows it (``decode_layers.py``).


def _torch_ops(engine) -> None:
    from worker.engine.pointwise import make_pointwise

    decoder = engine.runner.decoder
    decoder.ops = make_pointwise("eager", decoder.eps, decoder.embed.device)
    decoder.stack = None
    engine.runner.kv_cache.fused_write = False


def _layer_loop(engine) -> None:
    engine.runner.decoder.stack = None


ADJUST = {"torch_ops": _torch_ops, "layer_loop": _layer_loop}


@contextlib.contextmanager
def _torch_int4():
    """While the engine is built: int4 layers on torch's kernel, where the plan would pick tokenspool's (AVX2)."""
    from worker.engine import config

    own = config.own_int4_kernel
    config.own_int4_kernel = lambda flags, kernels, dtype: False
    try:
        yield
    finally:
        config.own_int4_kernel = own


# ``torch_int4`` is built with tokenspool's int4 operator ruled out (``config.own_int4_kernel``), to measure it.
BUILD = {"torch_int4": _torch_int4}


def one_stream(engine, sampling_params) -> float:
    params = sampling_params(max_tokens=128, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    out = engine.generate([list(range(1000, 1064))], params)[0]
    assert len(out.token_ids) == 128
    return 128 / (time.perf_counter() - start)


def many_streams(engine, sampling_params, reqs) -> float:
    params = [sampling_params(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs]
    start = time.perf_counter()
    outs = engine.generate([r.prompt for r in reqs], params)
    assert [len(o.token_ids) for o in outs] == [r.max_tokens for r in reqs]
    return sum(r.max_tokens for r in reqs) / (time.perf_counter() - start)


def interleaved_steps(engines: dict, sampling_params, batch: int, steps: int) -> dict[str, tuple[float, float]]:
    """Median (wall, process CPU) seconds per decode step of each engine at ``batch`` running requests, steps
    alternating. With one thread the CPU time is the step's own work, without the waits for a core that a
    shared machine adds to the wall time."""
    params = sampling_params(max_tokens=2_000, temperature=0.0, ignore_eos=True)
    for name, engine in engines.items():
        for i in range(batch):
            engine.add_request(f"{name}-{batch}-{i}", [1000 + i + j for j in range(64)], params)
        for _ in range(3):  # the prefills, and one decode step to settle
            engine.step()
    times: dict[str, list[float]] = {name: [] for name in engines}
    cpu_times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            engine.step()
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - cpu_start)
    for name, engine in engines.items():
        for i in range(batch):
            engine.abort(f"{name}-{batch}-{i}")
    return {name: (statistics.median(times[name]), statistics.median(cpu_times[name])) for name in engines}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="default,fp32,bf16,int8,int4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkout", type=Path, default=HERE.parent, help="the repository whose engine to run")
    parser.add_argument("--label", default="", help="a prefix for the system names in the output")
    parser.add_argument("--steps", type=int, default=0, help="measure N interleaved decode steps instead")
    parser.add_argument("--batches", default="1,32", help="running requests for --steps, comma-separated")
    parser.add_argument("--avx2", action="store_true", help="an AVX2-only CPU's kernels (benchmarks/avx2.py)")
    parser.add_argument("--without-bf16", action="store_true",
                        help="as on an AVX-512 CPU without fast bf16 (benchmarks/without_bf16.py)")
    args = parser.parse_args()
    sys.path.insert(0, str(args.checkout.resolve()))
    sys.path.insert(1, str(HERE))
    from machine import read_cpu_info  # noqa: E402  # after the path is set
    from offline_throughput import make_workload  # noqa: E402

    label = ""
    if args.avx2:
        from avx2 import LABEL, emulate_avx2  # noqa: E402

        emulate_avx2()
        label += LABEL
    if args.without_bf16:
        from without_bf16 import LABEL, emulate_without_bf16  # noqa: E402

        emulate_without_bf16()
        label += LABEL

    from worker.engine import Engine, EngineConfig, SamplingParams
    from worker.models import resolve_model

    cpu = read_cpu_info().describe() + label
    path = str(resolve_model("smollm2"))
    reqs = make_workload("mixed", 49152)[:32]
    engines = {}
    for name in args.systems.split(","):
        with BUILD.get(name, contextlib.nullcontext)():
            engines[name] = Engine(EngineConfig(model=path, num_threads=args.threads, max_num_seqs=32,
                                                num_kv_blocks=1100, **SYSTEMS[name]))
    for name, engine in engines.items():
        ADJUST.get(name, lambda _: None)(engine)
    for engine in engines.values():  # warm-up: first-call allocations and kernel selection
        engine.generate([list(range(1000, 1016))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    if args.steps:
        for batch in (int(b) for b in args.batches.split(",")):
            medians = interleaved_steps(engines, SamplingParams, batch, args.steps)
            for name, (seconds, cpu_seconds) in medians.items():
                compute = getattr(engines[name].runner, "compute", None)  # absent in checkouts before issue 15
                print(json.dumps({"system": args.label + name, "batch": batch, "ms_per_step": round(seconds * 1e3, 1),
                                  "cpu_ms_per_step": round(cpu_seconds * 1e3, 1), "tok_s": round(batch / seconds, 1),
                                  "dtype": str(engines[name].runner.plan.dtype).removeprefix("torch."),
                                  "quantization": compute and compute.quantization,
                                  "forward": compute and ("decoder" if compute.own_decoder else "transformers"),
                                  "load": round(os.getloadavg()[0], 1), "threads": args.threads,
                                  "cpu": cpu}), flush=True)
        return 0
    results: dict[str, dict[str, list[float]]] = {n: {"one": [], "many": []} for n in engines}
    for round_index in range(args.rounds):
        for name, engine in engines.items():
            one = one_stream(engine, SamplingParams)
            many = many_streams(engine, SamplingParams, reqs)
            results[name]["one"].append(one)
            results[name]["many"].append(many)
            print(json.dumps({"system": args.label + name, "round": round_index, "one_stream_tok_s": round(one, 1),
                              "streams_32_tok_s": round(many, 1), "load": round(os.getloadavg()[0], 1),
                              "checkout": str(args.checkout), "threads": args.threads, "cpu": cpu}),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
