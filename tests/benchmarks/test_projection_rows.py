"""benchmarks/projection_rows.py at one layer: every layout timed at every row count, and the quantised layouts
running their kernel however many rows a call has (which is what the crossing points are read from)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.projection_rows import LAYOUTS, SHAPES, build, main
from worker.engine.linear import GROUP_SIZE, half_packs


def test_every_layout_is_timed_at_every_row_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--rows", "1,9", "--layers", "1", "--passes", "1", "--threads", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    layouts = [n for n in LAYOUTS if n != "fp16" or half_packs(torch.device("cpu"))]
    assert [line["rows"] for line in lines] == [1, 9]
    for line in lines:
        assert all(line[name] > 0 for name in layouts)
        assert line["unit"] == f"ms per {len(SHAPES)} projections" and line["cpu"]


def test_quantised_layouts_take_the_kernel_beyond_the_engines_row_limits() -> None:
    layer = build(torch.bfloat16, "int4", layers=1)[0]
    x = torch.randn(64, layer.in_features).to(torch.bfloat16)  # more rows than any configured limit
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.codes, GROUP_SIZE, layer.scales)
    assert torch.equal(layer(x), kernel)
