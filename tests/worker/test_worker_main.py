"""worker.main: the worker's settings become the engine's config."""

from __future__ import annotations

from shared.config import Settings
from worker.main import engine_config


def test_engine_settings_reach_the_engine_config() -> None:
    config = engine_config(Settings(quantization="int4", compile_lone_decode=True, dtype="auto", num_threads=3))
    assert (config.quantization, config.compile_lone_decode, config.dtype, config.num_threads) == ("int4", True,
                                                                                                    None, 3)
    assert engine_config(Settings()).compile_lone_decode is False  # opt-in: it compiles for ~15 s at start-up
