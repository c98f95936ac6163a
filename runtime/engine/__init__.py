"""Continuous-batching serving engine over a paged KV cache (see docs/serving.md).

``engine`` (LLMEngine: one step at a time), ``engine_loop`` (EngineLoop: the engine in a
background thread, with an async generator of outputs per request), ``loading`` (model folders
-> model and tokenizer), ``detokenize`` (text deltas, EOS and stop strings), ``scheduler``,
``kv_cache``, ``model_runner``, ``sampling``.
"""

from quantpipe.runtime.engine.engine import EngineConfig, LLMEngine, RequestOutput, TokenLogprob
from quantpipe.runtime.engine.engine_loop import EngineLoop
from quantpipe.runtime.engine.loading import load_model_for_serving
from quantpipe.runtime.engine.sampling import SamplingParams

__all__ = [
    "EngineConfig",
    "EngineLoop",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "load_model_for_serving",
]
