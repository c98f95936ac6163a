"""Continuous-batching serving engine over a paged KV cache (see docs/serving.md)."""

from quantpipe.runtime.engine.engine import (
    EngineConfig,
    EngineLoop,
    LLMEngine,
    RequestOutput,
    load_model_for_serving,
)
from quantpipe.runtime.engine.sampling import SamplingParams

__all__ = [
    "EngineConfig",
    "EngineLoop",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "load_model_for_serving",
]
