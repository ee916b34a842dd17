"""benchmarks/avx2.py: a benchmark process that asks for an AVX2-only CPU's kernels starts itself again with the
libraries' ISA limits, loads the operators' AVX2 build and plans as an AVX2-only CPU does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.avx2 import ENVIRONMENT
from worker.engine.decode_kernel import cpu_description

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from benchmarks.avx2 import emulate_avx2
emulate_avx2()
import torch
from worker.engine import EngineConfig, config, decode_kernel
plan = config.plan_compute(EngineConfig(quantization="auto"), torch.device("cpu"), torch.float32, None, True,
                           kernels=decode_kernel.loaded)
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(), "env": dict(os.environ),
                  "flags": sorted(config.cpu_flags()), "quantization": plan.quantization,
                  "operators": decode_kernel.loaded()}))
"""


@pytest.mark.slow
@pytest.mark.skipif("avx2" not in cpu_description(), reason="needs a CPU with AVX2")
def test_emulation_restarts_with_the_libraries_limits_and_plans_as_an_avx2_cpu(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT} | {
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    done = subprocess.run([sys.executable, str(script), str(ROOT)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["aten"] == "AVX2" and probe["operators"]
    assert all(probe["env"][key] == value for key, value in ENVIRONMENT.items())
    assert "avx2" in probe["flags"] and not any(f.startswith(("avx512", "amx")) for f in probe["flags"])
    assert probe["quantization"] == "q4_1"
