"""OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the continuous-batching engine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (``stream: true`` -> SSE ending in
``data: [DONE]``), GET /v1/models, /health, /metrics (Prometheus text). The engine steps in a
background thread (:class:`runtime.engine.EngineLoop`); each HTTP request owns an asyncio queue
that the engine thread fills through ``loop.call_soon_threadsafe``. Admission control: at most
``max_num_seqs + max_queue`` requests in flight, the rest get 429 with ``Retry-After``. A client
that disconnects has its sequence aborted, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client import Counter as PromCounter
from pydantic import BaseModel, ConfigDict, Field

from runtime.engine import EngineLoop, LLMEngine, RequestOutput, SamplingParams
from runtime.fp_head import HEAD_DTYPES

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServeSpec:
    model_dir: Path  # FP16 export or quantpipe quantized folder
    host: str = "127.0.0.1"  # loopback by default; anything else exposes the server
    port: int = 8000
    max_num_seqs: int = 16  # running batch size
    max_queue: int = 64  # accepted requests waiting beyond the running batch; then 429
    kv_cache_memory: int | None = None  # KV pool bytes; None -> half the free memory
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    device: str = "cpu"
    head_dtype: str = "bf16"  # CPU: embedding table / output head precision (runtime.fp_head)
    kv_dtype: str = "model"  # KV cache elements: the activation dtype, or "bf16" (half of fp32)

    def __post_init__(self) -> None:
        if self.head_dtype not in HEAD_DTYPES:
            raise ValueError(f"head dtype {self.head_dtype!r}: use one of {HEAD_DTYPES}")
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ValueError(f"{self.model_dir} has no config.json; pass a model folder written "
                             "by export-fp16 or export")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")


# --- request bodies (OpenAI fields + vLLM's top_k / ignore_eos extensions) --------------------
class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=1)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "rate_limit_exceeded" if status == 429 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status, headers=headers)


def _sampling(req: _Common, default_max: int) -> SamplingParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens or default_max
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=req.top_k, seed=req.seed, stop=stop, ignore_eos=req.ignore_eos)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("quantpipe_time_to_first_token_seconds", "Time to first token",
                              registry=r, buckets=(.01, .025, .05, .1, .25, .5, 1, 2, 5, 10, 30))
        self.tpot = Histogram("quantpipe_time_per_output_token_seconds",
                              "Mean time per output token after the first", registry=r,
                              buckets=(.005, .01, .02, .04, .06, .1, .2, .5, 1, 2))
        self.requests = PromCounter("quantpipe_requests", "Finished requests by outcome",
                                    ["outcome"], registry=r)
        self.queue = Gauge("quantpipe_queue_length", "Requests waiting for a batch slot",
                           registry=r)
        self.running = Gauge("quantpipe_running_sequences", "Sequences in the running batch",
                             registry=r)
        self.in_flight = Gauge("quantpipe_in_flight_requests", "Accepted, unfinished requests",
                               registry=r)
        self.kv_used = Gauge("quantpipe_kv_blocks_used", "KV blocks referenced", registry=r)
        self.kv_total = Gauge("quantpipe_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.hit_rate = Gauge("quantpipe_prefix_cache_hit_rate",
                              "Prompt tokens served from the prefix cache / prompt tokens",
                              registry=r)
        self.preemptions = Gauge("quantpipe_preemptions", "Sequences preempted so far",
                                 registry=r)


def build_app(engine: LLMEngine, model_name: str, max_queue: int) -> FastAPI:
    """The FastAPI app; the engine loop starts and stops with the app's lifespan."""
    loop_box: dict[str, EngineLoop] = {}
    metrics = _Metrics()
    # The engine thread decodes with engine.tokenizer; a Rust tokenizer object may refuse
    # concurrent use ("Already borrowed"), so the HTTP side encodes with its own copy.
    tok = copy.deepcopy(engine.tokenizer)
    capacity = engine.config.max_num_seqs + max_queue
    state = {"in_flight": 0}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        el = EngineLoop(engine)
        el.start()
        loop_box["loop"] = el
        app.state.engine_loop = el
        yield
        el.stop()

    app = FastAPI(title="quantpipe", lifespan=lifespan)
    app.state.in_flight = state

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_req: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}"
                 for e in exc.errors()]
        return _error(400, "; ".join(parts))

    async def _run(request: Request, prompt_ids: list[int], params: SamplingParams,
                   chat: bool, stream: bool) -> Response:
        el = loop_box["loop"]
        if el.error is not None:
            return _error(503, f"engine stopped: {el.error}")
        try:
            engine.validate(prompt_ids, params)
        except ValueError as exc:
            return _error(400, str(exc))
        if state["in_flight"] >= capacity:
            metrics.requests.labels("rejected").inc()
            return _error(429, f"server busy: {capacity} requests in flight; retry shortly",
                          headers={"Retry-After": "1"})
        state["in_flight"] += 1
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        aloop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        t0 = time.perf_counter()
        el.submit(rid, prompt_ids, params, lambda out: aloop.call_soon_threadsafe(q.put_nowait,
                                                                                  out))
        timing = {"first": None, "n": 0}

        def observe(out: RequestOutput) -> None:
            now = time.perf_counter()
            if timing["first"] is None and out.new_token_ids:
                timing["first"] = now
                metrics.ttft.observe(now - t0)
            timing["n"] += len(out.new_token_ids)
            if out.finished:
                metrics.requests.labels(out.finish_reason or "unknown").inc()
                if timing["first"] is not None and timing["n"] > 1:
                    metrics.tpot.observe((now - timing["first"]) / (timing["n"] - 1))

        created = int(time.time())
        if stream:
            done = {"finished": False, "cleaned": False}

            def cleanup() -> None:
                # Idempotent; runs when the response ends for any reason, also when the client
                # hung up before the body started (an unstarted generator has no finally).
                if done["cleaned"]:
                    return
                done["cleaned"] = True
                if not done["finished"]:
                    el.abort(rid)
                    metrics.requests.labels("disconnected").inc()
                state["in_flight"] -= 1

            return _SSEResponse(_sse(q, rid, created, model_name, chat, observe, done), cleanup)
        finished = False
        try:
            text, reason, out = [], None, None
            while True:
                try:
                    out = await asyncio.wait_for(q.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                observe(out)
                text.append(out.new_text)
                if out.finished:
                    finished, reason = True, out.finish_reason
                    break
        finally:
            if not finished:
                el.abort(rid)
                metrics.requests.labels("disconnected").inc()
            state["in_flight"] -= 1
        usage = {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                 "total_tokens": out.prompt_tokens + out.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": out.cached_prompt_tokens}}
        body_text = "".join(text)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": body_text},
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": body_text, "logprobs": None, "finish_reason": reason}
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model_name, "choices": [choice], "usage": usage,
        })

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        try:
            params = _sampling(req, default_max=16)
        except ValueError as exc:
            return _error(400, str(exc))
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str):
            if len(req.prompt) != 1:
                return _error(400, "prompt: send one prompt per request (batches of strings "
                                   "are not supported)")
            prompt_ids = tok.encode(req.prompt[0])
        elif isinstance(req.prompt, str):
            prompt_ids = tok.encode(req.prompt)
        else:
            prompt_ids = list(req.prompt)
        return await _run(request, prompt_ids, params, chat=False, stream=req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Response:
        try:
            params = _sampling(req, default_max=256)
        except ValueError as exc:
            return _error(400, str(exc))
        if not getattr(tok, "chat_template", None):
            return _error(400, "this model has no chat template; use /v1/completions")
        text = tok.apply_chat_template([m.model_dump() for m in req.messages],
                                       add_generation_prompt=True, tokenize=False)
        prompt_ids = tok.encode(text, add_special_tokens=False)
        return await _run(request, prompt_ids, params, chat=True, stream=req.stream)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "owned_by": "quantpipe",
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.runner.decoder.embed_tokens.num_embeddings,
        }]}

    @app.get("/health")
    async def health() -> Response:
        el = loop_box.get("loop")
        if el is None or el.error is not None:
            return _error(503, f"engine not running: {el.error if el else 'starting'}")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prom() -> Response:
        s = loop_box["loop"].stats
        metrics.queue.set(s["num_waiting"])
        metrics.running.set(s["num_running"])
        metrics.in_flight.set(state["in_flight"])
        metrics.kv_used.set(s["kv_blocks_used"])
        metrics.kv_total.set(s["kv_blocks_total"])
        metrics.hit_rate.set(s["prefix_cache_hit_rate"])
        metrics.preemptions.set(s["num_preemptions"])
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _SSEResponse(StreamingResponse):
    """A text/event-stream response that always runs ``cleanup`` when it ends."""

    def __init__(self, content: AsyncIterator[str], cleanup: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


async def _sse(q: asyncio.Queue, rid: str, created: int, model_name: str, chat: bool,
               observe: Callable[[RequestOutput], None], done: dict) -> AsyncIterator[str]:
    """One SSE event per generated token; the last carries finish_reason and usage."""
    first = True
    while True:
        out: RequestOutput = await q.get()
        observe(out)
        reason = out.finish_reason if out.finished else None
        if chat:
            delta: dict[str, str] = {"content": out.new_text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": out.new_text, "logprobs": None,
                      "finish_reason": reason}
        first = False
        event: dict[str, Any] = {
            "id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model_name, "choices": [choice],
        }
        if out.finished:
            done["finished"] = True  # the engine has released the sequence
            event["usage"] = {"prompt_tokens": out.prompt_tokens,
                              "completion_tokens": out.completion_tokens,
                              "total_tokens": out.prompt_tokens + out.completion_tokens}
        yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        if out.finished:
            break
    yield "data: [DONE]\n\n"


def serve(spec: ServeSpec) -> None:
    """Load the model, build the app and run uvicorn until interrupted."""
    import uvicorn

    from runtime.engine import EngineConfig, load_model_for_serving

    if spec.host not in LOOPBACK_HOSTS:
        log.warning("binding to %s exposes the server beyond this machine", spec.host)
    model, tok = load_model_for_serving(spec.model_dir, spec.device, head_dtype=spec.head_dtype)
    engine = LLMEngine(model, tok, EngineConfig(
        block_size=spec.block_size, max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens, kv_cache_memory=spec.kv_cache_memory,
        enable_prefix_caching=spec.enable_prefix_caching, kv_dtype=spec.kv_dtype,
    ))
    app = build_app(engine, Path(spec.model_dir).name, spec.max_queue)
    uvicorn.run(app, host=spec.host, port=spec.port, log_level="warning")
