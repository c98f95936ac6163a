"""The runtime's defaults, written once: the engine, the server and their commands read them here.

``EngineConfig``, ``SchedulerLimits``, ``KVCacheSpec``, ``ServeSpec``, ``RequestLimits``,
``GenerateSpec``, ``MemoryPlanSpec``, ``BenchSpec`` and the click options of ``serve``,
``generate``, ``bench-serve`` and ``plan-memory`` take their default values from ``DEFAULTS``.
This module imports nothing heavy (no torch), so the CLI can read it to build its options.
"""

from __future__ import annotations

from dataclasses import dataclass

# KV cache element types the engine accepts (runtime.engine.engine.KV_DTYPES maps them to
# torch dtypes): "model" = the model's activation dtype, "bf16" = half of fp32's bytes.
KV_DTYPE_NAMES = ("model", "bf16")


@dataclass(frozen=True)
class RuntimeDefaults:
    # --- engine (EngineConfig, SchedulerLimits, KVCacheSpec) ----------------------------------
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 16  # sequences in the running batch
    max_num_batched_tokens: int = 2048  # tokens computed per step (prefill chunks + decodes)
    kv_dtype: str = "model"  # KV cache elements, one of KV_DTYPE_NAMES
    kv_memory_fraction: float = 0.5  # of free memory for the KV pool when no size is given
    enable_prefix_caching: bool = True  # reuse full KV blocks across requests
    # --- server (ServeSpec, RequestLimits, the request bodies) --------------------------------
    host: str = "127.0.0.1"  # loopback: other addresses expose the server
    port: int = 8000
    max_queue: int = 64  # accepted requests waiting beyond the running batch; then 429
    # CPU head precision when serving: int8 as for generate; the head runs on one row per
    # sequence of a step (at most max_num_seqs), where w8a8_mm is the fastest head measured
    # (docs/serving.md: 1.5 ms for 16 rows of SmolLM2's head vs bf16_mm's 6.5)
    serve_head_dtype: str = "int8"
    max_request_bytes: int = 2**20  # request body bytes; more -> 413
    max_prompt_chars: int = 2**18  # prompt characters (chat: all messages); more -> 400
    request_timeout: float = 30.0  # seconds for a request body to arrive in full; then 408
    header_timeout: float = 10.0  # seconds for a request's headers to arrive; then closed
    max_connections: int = 1000  # open client connections (lowered to fit the fd limit)
    completion_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    chat_max_tokens: int = 256  # /v1/chat/completions without max_tokens
    # --- generate (GenerateSpec) --------------------------------------------------------------
    # CPU head precision for one request (M = 1): int8 per 32 columns (llama.cpp's Q8_0), half
    # the bytes per token of fp16 at a KLD change too small to measure (docs/runtime.md);
    # fp16 where quantpipe's kernels are not usable
    generate_head_dtype: str = "int8"
    max_new_tokens: int = 64  # tokens generated after the prompt
    # --- plan-memory (MemoryPlanSpec) ---------------------------------------------------------
    plan_context: int = 8192  # tokens per sequence (prompt + output)
    plan_concurrency: int = 10  # sequences that must fit at once
    device_memory: int = 80 * 10**9  # bytes on the device
    utilization: float = 0.9  # fraction of device memory the server may use
    runtime_reserve: int = 2**30  # CUDA context, allocator slack, kernels' workspaces
    # --- bench-serve (BenchSpec) --------------------------------------------------------------
    bench_url: str = "http://127.0.0.1:8000"  # server base URL
    bench_concurrency: tuple[int, ...] = (1, 4, 16)  # in-flight request caps, one run each
    bench_prompt_len: int = 256  # prompt tokens per request
    bench_output_len: int = 128  # output tokens per request
    bench_duration: float = 60.0  # seconds of sending per run
    bench_repeats: int = 3  # runs per concurrency; medians reported
    bench_warmup_requests: int = 2  # per concurrency, excluded from metrics
    bench_max_requests: int = 10_000  # requests per run at most (a run also ends at its duration)
    ttft_slo: float = 2.0  # seconds, for goodput
    tpot_slo: float = 0.060  # seconds, for goodput

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "port",
                    "max_request_bytes", "max_prompt_chars", "max_connections",
                    "completion_max_tokens", "chat_max_tokens", "max_new_tokens", "plan_context",
                    "plan_concurrency", "device_memory", "bench_prompt_len", "bench_output_len",
                    "bench_repeats", "bench_max_requests")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"RuntimeDefaults.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("RuntimeDefaults.max_num_batched_tokens must be >= max_num_seqs")
        if self.kv_dtype not in KV_DTYPE_NAMES:
            raise ValueError(f"RuntimeDefaults.kv_dtype {self.kv_dtype!r}: use one of "
                             f"{KV_DTYPE_NAMES}")
        for name in ("kv_memory_fraction", "utilization"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"RuntimeDefaults.{name} must be in (0, 1]")


DEFAULTS = RuntimeDefaults()
