"""The generation engine: continuous batching over a paged KV cache (no Redis, no HTTP in here)."""

from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.outputs import EngineStats, FinishReason, Logprob, RequestOutput, StepOutput
from worker.engine.sampling_params import SamplingParams

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StepOutput",
]
