"""benchmarks/gpu_check.py on CPU with tiny shapes: every code path of the GPU script (random model folder, engine
load, parity, decode/prefill against bounds, transformers' continuous batching, report), plus its pure parts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check import (
    common_prefix,
    divergence,
    main,
    parity_summary,
    pick_bounds,
    render_table,
    targets,
    transformers_cb_config,
)
from benchmarks.random_models import SHAPES, build_model, parameter_bytes, save_model_folder, word_level_tokenizer


def test_common_prefix_counts_tokens_before_the_first_difference() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([5, 6], [5, 6]) == 2
    assert common_prefix([7], [8, 9]) == 0


def test_a_divergence_is_rated_by_transformers_own_logits() -> None:
    """The engine's token where it leaves transformers' greedy path: transformers' runner-up is a near tie (rank 1,
    a small margin), its last choice is not (the last rank, a margin of most of the top logit)."""
    model = build_model(SHAPES["smollm2-tiny"], "cpu", torch.float32)
    prompt = [5, 9, 13, 200]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                             do_sample=False, max_new_tokens=6, min_new_tokens=6)[0, 4:].tolist()
        ranked = model(torch.tensor([prompt + ref[:3]])).logits[0, -1].argsort(descending=True).tolist()
    assert divergence(model, prompt, ref, ref) is None
    runner_up = divergence(model, prompt, ref, ref[:3] + [ranked[1], 7, 7])
    last = divergence(model, prompt, ref, ref[:3] + [ranked[-1], 7, 7])
    assert runner_up is not None and last is not None
    assert (runner_up["position"], runner_up["engine_token_rank"]) == (3, 1) and runner_up["margin"] >= 0
    assert last["engine_token_rank"] == len(ranked) - 1 and last["relative_margin"] > runner_up["relative_margin"]


def test_parity_passes_on_agreement_or_when_every_divergence_is_a_near_tie() -> None:
    tie = {"position": 3, "relative_margin": 0.001}
    assert parity_summary({"agreement": 0.9, "required": 0.75, "ok": True}) == "90% (ok)"
    assert parity_summary({"agreement": 0.2, "required": 0.75, "ok": True, "divergences": [tie, None, tie]}) == (
        "20% (ok: 2 near ties)")
    assert parity_summary({"agreement": 0.2, "required": 0.75, "ok": False, "divergences": [tie]}) == "20% (FAIL)"


def test_word_level_tokenizer_round_trips_every_id() -> None:
    tok = word_level_tokenizer(50)
    assert len(tok) == 50 and (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.decode([10, 11, 49]) == "t10 t11 t49"
    assert tok("t3 t4")["input_ids"] == [3, 4]


def test_full_size_shapes_have_the_parameter_counts_they_are_named_for() -> None:
    with torch.device("meta"):
        smol, one_b = (build_model(SHAPES[n], "meta", torch.bfloat16) for n in ("smollm2-135m", "llama-1b"))
    assert parameter_bytes(smol) / 2 == pytest.approx(134.5e6, rel=0.01)  # tied embedding counted once
    assert parameter_bytes(one_b) / 2 == pytest.approx(1.236e9, rel=0.01)


def test_saved_random_model_folder_loads_in_the_engine_with_identical_weights(tmp_path: Path) -> None:
    from worker.engine import Engine, EngineConfig

    model = build_model(SHAPES["smollm2-tiny"], "cpu", torch.float32)
    engine = Engine(EngineConfig(model=str(save_model_folder(model, tmp_path)), device="cpu", dtype="float32",
                                 num_kv_blocks=16))
    loaded = dict(engine.runner.model.named_parameters())
    assert all(torch.equal(p, loaded[name]) for name, p in model.named_parameters())


def _report(x_bound: float, ratio: float | None) -> dict:
    return {"llama-1b": {"decode": [{"batch": 1, "x_bound": x_bound}, {"batch": 16, "x_bound": 9.0}],
                         "concurrent": {"ratio": ratio}}}


def test_targets_are_judged_on_the_1b_shape() -> None:
    met = targets(_report(2.4, 5.5))
    assert met["decode_batch1_x_bound"]["met"] and met["concurrent_x_transformers_cb"]["met"]
    missed = targets(_report(2.6, None))
    assert not missed["decode_batch1_x_bound"]["met"] and not missed["concurrent_x_transformers_cb"]["met"]
    assert targets({"smollm2-135m": {}}) == {}


def test_targets_are_missed_when_a_check_failed() -> None:
    failed = targets({"llama-1b": {"decode": {"error": "RuntimeError: boom"}, "concurrent": {"skipped": "deadline"}}})
    assert not failed["decode_batch1_x_bound"]["met"] and not failed["concurrent_x_transformers_cb"]["met"]


def test_targets_are_judged_against_the_gpus_own_measured_rates_unless_given() -> None:
    measured = {"copy_tbs": 3.214, "bf16_tflops": 701.6}  # an H100's
    assert pick_bounds(None, None, measured) == (3.21, 702, "measured")
    assert pick_bounds(4.3, None, measured) == (4.3, 702, "given and measured")
    assert pick_bounds(4.3, 790.0, measured) == (4.3, 790.0, "given")
    assert pick_bounds(None, None, None) == (4.3, 790.0, "H200 constants")  # CPU smoke runs


def test_transformers_cb_config_gives_both_sides_the_same_room() -> None:
    config = transformers_cb_config(num_requests=4, tokens_per_request=300, max_batch_tokens=512)
    assert config is not None  # the installed transformers has one
    page = getattr(config, "page_size", None) or config.block_size  # the field's name changed after 5.17
    assert (page, config.num_blocks, config.max_batch_tokens) == (256, 4 * 2 + 8, 512)


def test_a_deadline_skips_the_checks_and_still_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert main(["--device", "cpu", "--tiny", "--shapes", "smollm2-tiny", "--deadline-s", "0",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    shape = report["shapes"]["smollm2-tiny"]
    assert report["complete"] and shape["attention_backend"] == "sdpa"  # the engine loaded; no check ran
    assert all(shape[k] == {"skipped": "past the 0 s deadline"} for k in ("parity", "decode", "prefill", "concurrent"))
    assert "| smollm2-tiny | past the 0 s deadline |" in render_table(report)


def test_checks_can_be_chosen_and_unknown_ones_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert main(["--device", "cpu", "--tiny", "--shapes", "smollm2-tiny", "--checks", "decode", "--batches", "1",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    shape = report["shapes"]["smollm2-tiny"]
    assert [d["batch"] for d in shape["decode"]] == [1] and not {"parity", "prefill", "concurrent"} & set(shape)
    assert "| smollm2-tiny | not run |" in render_table(report)
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--tiny", "--checks", "decode,latency"])


def test_an_engine_that_fails_to_load_falls_back_to_the_plain_path(tmp_path: Path) -> None:
    """sdpa with CUDA graphs 'on' is refused by the engine's config; ``--fallback`` records why, then loads sdpa
    without graphs and runs the checks there (a decode profile among them)."""
    out = tmp_path / "gpu_check.json"
    assert main(["--device", "cpu", "--tiny", "--shapes", "smollm2-tiny", "--batches", "1", "--concurrent", "2",
                 "--attention", "sdpa", "--cuda-graphs", "on", "--fallback", "--profile-batch", "2",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    shape = report["shapes"]["smollm2-tiny"]
    tried = [(e["attention_backend"], e["cuda_graphs"], e["compile_pointwise"], e["async_scheduling"])
             for e in shape["engine_errors"]]
    # then without graphs: sdpa/off/off/off loads
    assert tried == [("sdpa", "on", "auto", "auto"), ("sdpa", "on", "off", "auto"), ("sdpa", "on", "off", "off")]
    assert all("cuda_graphs" in e["error"] for e in shape["engine_errors"])
    assert (shape["attention_backend"], shape["cuda_graphs"], shape["pointwise"]) == ("sdpa", "off", "transformers")
    assert shape["parity"]["ok"] and shape["decode"][0]["replay_ms"] is None  # no graph on CPU
    assert shape["profile"]["batch"] == 2 and "aten::" in shape["profile"]["table"]  # ops by CPU time
    assert "engine sdpa/on/auto failed" in render_table(report)
    no_fallback = tmp_path / "no_fallback.json"
    assert main(["--device", "cpu", "--tiny", "--shapes", "smollm2-tiny", "--attention", "sdpa", "--cuda-graphs",
                 "on", "--out", str(no_fallback)]) == 0
    shape = json.loads(no_fallback.read_text())["shapes"]["smollm2-tiny"]
    assert len(shape["engine_errors"]) == 1 and "parity" not in shape
    assert "| smollm2-tiny | not run |" in render_table(json.loads(no_fallback.read_text()))


def test_cuda_is_refused_with_a_hint_when_torch_sees_no_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit):
        main(["--device", "cuda"])


@pytest.mark.slow
def test_tiny_cpu_run_covers_every_check(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert main(["--device", "cpu", "--tiny", "--batches", "1,4", "--concurrent", "8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["shapes"]) == ["smollm2-tiny", "llama-1b-tiny"]
    for shape in report["shapes"].values():
        assert shape["parity"]["agreement"] == 1.0 and shape["parity"]["ok"]  # fp32: token for token
        assert (shape["attention_backend"], shape["cuda_graphs"]) == ("sdpa", "off")
        bound_ms = shape["parameter_bytes"] / 4.3e12 * 1e3
        assert [d["batch"] for d in shape["decode"]] == [1, 4]
        assert all(d["bound_ms"] == pytest.approx(bound_ms) and d["step_ms"] > bound_ms for d in shape["decode"])
        assert shape["prefill"]["prompts"] * shape["prefill"]["prompt_len"] == 4 * 64
        concurrent = shape["concurrent"]
        assert concurrent["error"] is None and concurrent["transformers_cb_tps"] > 0
        assert concurrent["ratio"] == pytest.approx(concurrent["engine_tps"] / concurrent["transformers_cb_tps"])
    assert set(report["targets"]) == {"decode_batch1_x_bound", "concurrent_x_transformers_cb"}
    table = render_table(report)
    assert "| smollm2-tiny | 100% (ok) |" in table and "8 concurrent" in table
    assert "smollm2-tiny: attention sdpa, cuda graphs off, pointwise transformers" in table  # CPU's auto, float32


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
def test_tiny_cpu_run_on_the_flex_backend(tmp_path: Path) -> None:
    """The CUDA configuration on CPU: flex attention (compiled by inductor), the static padded decode step and async
    scheduling, whose decode steps are also timed in turn; parity still token for token in fp32."""
    out = tmp_path / "gpu_check.json"
    assert main(["--device", "cpu", "--tiny", "--shapes", "smollm2-tiny", "--batches", "1,4", "--concurrent", "4",
                 "--attention", "flex", "--cuda-graphs", "padded", "--async-scheduling", "on", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    shape = report["shapes"]["smollm2-tiny"]
    assert (shape["attention_backend"], shape["cuda_graphs"], shape["async_scheduling"]) == ("flex", "padded", True)
    assert shape["parity"]["agreement"] == 1.0 and shape["concurrent"]["engine_tps"] > 0
    assert all(d["async_scheduling"] and d["in_turn_step_ms"] > 0 for d in shape["decode"])
    assert "async scheduling True" in render_table(report) and "; in turn " in render_table(report)
