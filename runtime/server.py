"""OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the continuous-batching engine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (``stream: true`` -> SSE ending in
``data: [DONE]``), GET /v1/models, /health, /metrics (Prometheus text). The engine steps in a
background thread (:class:`runtime.engine.EngineLoop`). Each completion request is one async
generator of its outputs (:meth:`_Server.request_outputs`, over ``EngineLoop.generate``, vLLM's
api_server design): the handler iterates it, a client that disconnects cancels the iteration,
and the generator's one ``try/finally`` ends the request however it ends (the engine request
aborted, its KV blocks freed, its admission slot released).

What protects the server (docs/serving.md, "Failure behaviour"):

* every request body is read in full by :class:`_BodyLimit` before the app sees it: at most
  ``max_request_bytes`` (Content-Length checked up front, chunked bodies counted) -> 413, and
  within ``request_timeout`` seconds -> 408, while the event loop keeps serving others;
* prompts longer than ``max_prompt_chars`` are refused before tokenizing (400); tokenizing and
  the chat template run in a worker thread, never on the event loop;
* admission control: at most ``max_num_seqs + max_queue`` requests in flight, the rest get 429
  with ``Retry-After``; an unknown ``model`` gets 404;
* a request the engine fails gets 500 (or, once its SSE stream has started, an error event and
  the end of the stream); the engine goes on. /health is 503 only once the engine loop died;
* with an API key, every path but /health needs ``Authorization: Bearer <key>`` (401), and
  ``allowed_hosts`` limits the Host header (400), both before a body is read;
* below HTTP, :mod:`runtime.http_guard`: a deadline for request headers, a connection cap that
  keeps /health reachable under a flood of slow clients, the open-file limit raised at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import json
import logging
import re
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import uvicorn
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
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from quantpipe.core.io import MANIFEST_NAME, read_manifest
from quantpipe.runtime.config import DEFAULTS, KV_DTYPE_NAMES
from quantpipe.runtime.engine import (
    EngineConfig,
    EngineLoop,
    LLMEngine,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from quantpipe.runtime.fp_head import HEAD_DTYPES
from quantpipe.runtime.http_guard import (
    ACCEPT_BATCH,
    ConnectionGuard,
    ConnectionLimits,
    accept_error_handler,
    connection_cap,
    open_fds,
    raise_fd_limit,
    widen_listen_queue,
)
from quantpipe.runtime.openai_protocol import (
    UNSUPPORTED,
    ChatCompletionResponse,
    ChatRequest,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthStatus,
    ModelList,
    generation_responses,
    tighten_openapi,
)

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = DEFAULTS.max_request_bytes  # request body bytes; more -> 413
    max_prompt_chars: int = DEFAULTS.max_prompt_chars  # prompt (chat: all messages); more -> 400
    request_timeout: float = DEFAULTS.request_timeout  # seconds for a body to arrive; then 408

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be >= 1 KiB, got {self.max_request_bytes}")
        if self.max_prompt_chars < 1:
            raise ValueError(f"--max-prompt-chars must be >= 1, got {self.max_prompt_chars}")
        if not 0 < self.request_timeout <= 3600:
            raise ValueError(f"--request-timeout must be in (0, 3600] seconds, got "
                             f"{self.request_timeout}")


@dataclass(frozen=True)
class ServeSpec:
    model_dir: Path  # FP16 export or quantpipe quantized folder
    host: str = DEFAULTS.host  # loopback by default; anything else exposes the server
    port: int = DEFAULTS.port
    max_num_seqs: int = DEFAULTS.max_num_seqs  # running batch size
    max_queue: int = DEFAULTS.max_queue  # accepted requests beyond the running batch; then 429
    kv_cache_memory: int | None = None  # KV pool bytes; None -> kv_memory_fraction of free
    block_size: int = DEFAULTS.block_size  # tokens per KV block
    max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens  # tokens per engine step
    enable_prefix_caching: bool = DEFAULTS.enable_prefix_caching
    device: str = "cpu"
    head_dtype: str = DEFAULTS.serve_head_dtype  # CPU: embedding table / output head precision
    kv_dtype: str = DEFAULTS.kv_dtype  # KV cache elements: the activation dtype, or "bf16"
    max_request_bytes: int = DEFAULTS.max_request_bytes  # RequestLimits.max_request_bytes
    max_prompt_chars: int = DEFAULTS.max_prompt_chars  # RequestLimits.max_prompt_chars
    request_timeout: float = DEFAULTS.request_timeout  # RequestLimits.request_timeout
    max_connections: int = DEFAULTS.max_connections  # ConnectionLimits.max_connections
    header_timeout: float = DEFAULTS.header_timeout  # ConnectionLimits.header_timeout
    # every endpoint but /health needs "Authorization: Bearer <api_key>"; None: no key
    api_key: str | None = field(default=None, repr=False)
    allowed_hosts: tuple[str, ...] = ()  # Host header values served ("*.x.com" ok); () -> any
    verify: bool = True  # False (--no-verify): skip a quantized folder's hashes and values

    def __post_init__(self) -> None:
        # Everything here is cheap and runs before the model loads (minutes for a big one).
        self._check_options()
        self.engine_config()  # EngineConfig's own checks
        self.request_limits()
        self.connection_limits()
        check_access(self.api_key, self.allowed_hosts)
        check_model_dir(Path(self.model_dir))

    def _check_options(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"--block-size must be in 1..1024 tokens, got {self.block_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be "
                             f">= --max-num-seqs ({self.max_num_seqs})")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")
        if self.head_dtype not in HEAD_DTYPES:
            raise ValueError(f"--head-dtype {self.head_dtype!r}: use one of {HEAD_DTYPES}")
        if self.kv_dtype not in KV_DTYPE_NAMES:
            raise ValueError(f"--kv-dtype {self.kv_dtype!r}: use one of {sorted(KV_DTYPE_NAMES)}")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"--device {self.device!r}: use cpu, cuda or cuda:N")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_memory=self.kv_cache_memory,
            enable_prefix_caching=self.enable_prefix_caching, kv_dtype=self.kv_dtype,
        )

    def request_limits(self) -> RequestLimits:
        return RequestLimits(self.max_request_bytes, self.max_prompt_chars, self.request_timeout)

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(self.max_connections, self.header_timeout)


def check_access(api_key: str | None, allowed_hosts: tuple[str, ...]) -> None:
    if api_key is not None and not re.fullmatch(r"[\x21-\x7e]+", api_key):
        raise ValueError("--api-key / QUANTPIPE_API_KEY must be printable ASCII without spaces "
                         "(it travels in an HTTP header); e.g. openssl rand -hex 32")
    for pattern in allowed_hosts:
        if not pattern or "*" in pattern[1:] or (pattern[0] == "*" and pattern[:2] != "*."):
            raise ValueError(f"--allowed-host {pattern!r}: write a host name such as "
                             "api.example.com, *.example.com or 127.0.0.1")


def check_model_dir(folder: Path) -> None:
    """Cheap checks that ``folder`` can be served (reads config.json and the manifest only)."""
    remedy = "pass a model folder written by export-fp16 or export"
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{folder} has no config.json; {remedy}")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{cfg_path} is not valid JSON ({exc}); {remedy}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ValueError(f"{cfg_path} has no model_type; {remedy}")
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "quantpipe"):
        raise ValueError(f"{folder} uses quant_method {method!r}; the engine serves FP16 folders "
                         "and quantpipe-native quantized folders")
    if method == "quantpipe" or (folder / MANIFEST_NAME).is_file():
        try:
            read_manifest(folder)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{folder / MANIFEST_NAME} is not valid JSON ({exc}); re-run the "
                             "stage that wrote the folder") from None
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"{folder} has no *.safetensors weights (quantpipe loads only "
                         f"safetensors); {remedy}")
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"{folder} has no tokenizer (tokenizer.json); {remedy}")


_ERROR_TYPES = {429: "rate_limit_exceeded", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """An error answer with the OpenAI body; raised by checks, turned into a response."""

    def __init__(self, status: int, message: str, code: int | str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers

    def response(self) -> JSONResponse:
        kind = _ERROR_TYPES.get(self.status, "invalid_request_error")
        body = {"message": self.message, "type": kind, "param": None,
                "code": self.status if self.code is None else self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return ApiError(status, message, headers=headers).response()


def _sampling(req: CompletionRequest | ChatRequest, default_max: int) -> SamplingParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens or default_max
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=req.top_k, seed=req.seed, stop=stop, ignore_eos=req.ignore_eos,
                          logprobs=_logprobs_asked(req))


def _logprobs_asked(req: CompletionRequest | ChatRequest) -> int | None:
    """Alternatives per token the response reports; None: no logprobs (OpenAI's fields)."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise ValueError("top_logprobs needs logprobs: true")
    return (req.top_logprobs or 0) if req.logprobs else None


def _max_tokens_given(req: CompletionRequest | ChatRequest) -> bool:
    return req.max_tokens is not None or getattr(req, "max_completion_tokens", None) is not None


def _prompt_chars(req: CompletionRequest | ChatRequest) -> int:
    if isinstance(req, ChatRequest):
        return sum(len(m.role) + len(m.content) for m in req.messages)
    if isinstance(req.prompt, str):
        return len(req.prompt)
    return len(req.prompt[0]) if isinstance(req.prompt[0], str) else 0


def _checked_text(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the prompt is not valid Unicode (an unpaired surrogate such as "
                         "\\ud800); send UTF-8 text") from None
    return text


def _encode_prompt(tok, prompt: str) -> list[int]:
    """Runs in the tokenizer thread."""
    return tok.encode(_checked_text(prompt))


def _encode_chat(tok, messages: list[dict[str, str]]) -> list[int]:
    """Runs in the tokenizer thread; a template that refuses the messages is the caller's 400."""
    import jinja2

    for m in messages:
        _checked_text(m["role"] + m["content"])
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the model's chat template rejected the messages: {exc}") from None
    return tok.encode(text, add_special_tokens=False)


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


class _Server:
    """What the handlers share: the engine and its loop, the tokenizer thread, the metrics."""

    def __init__(self, engine: LLMEngine, model_name: str, max_queue: int,
                 limits: RequestLimits) -> None:
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.capacity = engine.config.max_num_seqs + max_queue
        self.in_flight = 0  # admitted requests whose generator has not ended
        self.metrics = _Metrics()
        self.loop: EngineLoop | None = None
        # The engine thread decodes with engine.tokenizer; a Rust tokenizer object may refuse
        # concurrent use ("Already borrowed"), so the HTTP side encodes with its own copy, in
        # one worker thread (off the event loop, never two encodes at once).
        self.tok = copy.deepcopy(engine.tokenizer)
        self.tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantpipe-tokenize")

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        el = EngineLoop(self.engine)
        el.start()
        self.loop = el
        yield
        el.stop()
        self.tok_pool.shutdown(wait=False, cancel_futures=True)

    async def respond(self, request: Request, req: CompletionRequest | ChatRequest,
                      chat: bool) -> Response:
        """Both endpoints, streamed or not: iterate the request's outputs into a response,
        cancelled when the client disconnects first."""
        head = _Head(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()),
                     self.model_name, chat)
        outputs = self.request_outputs(req, chat, head.rid)
        answer = _stream(outputs, head) if req.stream else _complete(outputs, head)
        return await _until_disconnected(request, answer)

    async def request_outputs(self, req: CompletionRequest | ChatRequest, chat: bool,
                              rid: str) -> AsyncGenerator[RequestOutput, None]:
        """One request from admission to its last output (``finished`` set).

        Raises ApiError before the first output when the request is refused (404, 400, 429,
        503). However the request ends (finished, failed, or the consumer stopped early because
        the client left), the ``finally`` closes the engine's generator, which aborts an
        unfinished request and so frees its KV blocks, and releases the admission slot.
        """
        params = self.admissible(req, chat)
        self.in_flight += 1  # no await since the capacity check: admission is race-free
        outputs: AsyncGenerator[RequestOutput, None] | None = None
        finished = False
        try:
            prompt_ids = await self.prompt_ids(req)
            params = self.fitted(req, prompt_ids, params)
            assert self.loop is not None
            timing = _Timing(self.metrics)
            outputs = self.loop.generate(rid, prompt_ids, params)
            async for out in outputs:
                finished = out.finished
                timing.observe(out)
                yield out
        finally:
            if outputs is not None:
                await outputs.aclose()  # aborts the request unless it finished
                if not finished:
                    self.metrics.requests.labels("disconnected").inc()
            self.in_flight -= 1

    def admissible(self, req: CompletionRequest | ChatRequest, chat: bool) -> SamplingParams:
        """The checks that need neither a slot nor the tokenizer (raise ApiError)."""
        if req.model is not None and req.model != self.model_name:
            raise ApiError(404, f"The model `{req.model}` does not exist", "model_not_found")
        default_max = DEFAULTS.chat_max_tokens if chat else DEFAULTS.completion_max_tokens
        try:
            params = _sampling(req, default_max)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        n_chars, limit = _prompt_chars(req), self.limits.max_prompt_chars
        if n_chars > limit:
            raise ApiError(400, f"the prompt has {n_chars:,} characters; this server takes at "
                                f"most {limit:,} (--max-prompt-chars)")
        if chat and not getattr(self.tok, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        assert self.loop is not None, "the app's lifespan starts the engine loop"
        if self.loop.error is not None:
            raise ApiError(503, f"engine stopped: {self.loop.error}; restart the server")
        if self.in_flight >= self.capacity:
            self.metrics.requests.labels("rejected").inc()
            raise ApiError(429, f"server busy: {self.capacity} requests in flight; retry "
                                "shortly", headers={"Retry-After": "1"})
        return params

    async def prompt_ids(self, req: CompletionRequest | ChatRequest) -> list[int]:
        if isinstance(req, ChatRequest):
            job = (_encode_chat, self.tok, [m.model_dump() for m in req.messages])
        elif isinstance(req.prompt, str) or isinstance(req.prompt[0], str):
            text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
            job = (_encode_prompt, self.tok, text)
        else:
            return list(req.prompt)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.tok_pool, *job)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    def fitted(self, req: CompletionRequest | ChatRequest, prompt_ids: list[int],
               params: SamplingParams) -> SamplingParams:
        """``params`` checked against the model and the KV pool; a default max_tokens is cut
        to the room the prompt leaves."""
        if not _max_tokens_given(req):
            room = self.engine.max_model_len - len(prompt_ids)
            params = replace(params, max_tokens=max(1, min(params.max_tokens, room)))
        try:
            self.engine.validate(prompt_ids, params)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        return params

    def model_list(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "owned_by": "quantpipe",
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.runner.decoder.embed_tokens.num_embeddings,
        }]}

    def health(self) -> Response:
        el = self.loop
        if el is None or el.error is not None:
            return _error(503, f"engine not running: {el.error if el else 'starting'}")
        return JSONResponse({"status": "ok"})

    def prometheus(self) -> Response:
        assert self.loop is not None
        s, m = self.loop.stats, self.metrics
        m.queue.set(s["num_waiting"])
        m.running.set(s["num_running"])
        m.in_flight.set(self.in_flight)
        m.kv_used.set(s["kv_blocks_used"])
        m.kv_total.set(s["kv_blocks_total"])
        m.hit_rate.set(s["prefix_cache_hit_rate"])
        m.preemptions.set(s["num_preemptions"])
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)


def build_app(engine: LLMEngine, model_name: str, max_queue: int = DEFAULTS.max_queue,
              limits: RequestLimits | None = None, api_key: str | None = None,
              allowed_hosts: tuple[str, ...] = ()) -> FastAPI:
    """The FastAPI app; the engine loop starts and stops with the app's lifespan.

    Middleware, outermost first: the Host check (``allowed_hosts``), the API key, the body
    limits; so a request with a wrong host or key is answered before its body is read.
    """
    limits = limits or RequestLimits()
    check_access(api_key, allowed_hosts)
    srv = _Server(engine, model_name, max_queue, limits)
    app = FastAPI(title="quantpipe", lifespan=srv.lifespan)
    app.add_middleware(_BodyLimit, limits=limits)  # add_middleware: the last added is outermost
    if api_key is not None:
        app.add_middleware(_ApiKey, key=api_key)
    if allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts),
                           www_redirect=False)
    _add_error_handlers(app)
    tighten_openapi(app, model_name, engine.max_model_len,
                    engine.runner.decoder.embed_tokens.num_embeddings, limits.max_prompt_chars,
                    api_key=api_key is not None)

    @app.post("/v1/completions", responses=generation_responses(CompletionResponse))
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await srv.respond(request, req, chat=False)

    @app.post("/v1/chat/completions", responses=generation_responses(ChatCompletionResponse))
    async def chat_completions(req: ChatRequest, request: Request) -> Response:
        return await srv.respond(request, req, chat=True)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        return srv.model_list()

    @app.get("/health", response_model=HealthStatus,
             responses={503: {"model": ErrorResponse, "description": "engine loop stopped"}})
    async def health() -> Response:
        return srv.health()

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {
                 "schema": {"type": "string"}}}, "description": "Prometheus text format"}})
    async def prom() -> Response:
        return srv.prometheus()

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error the app answers has the OpenAI body ``{"error": {...}}``."""

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _server_error(_req: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=exc)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


def _validation_message(errors) -> str:
    """``field: what was wrong`` per field; the alternatives of a union joined by "or"."""
    by_field: dict[str, list[str]] = {}
    for e in errors:
        # loc: ("body", field, ...); pydantic adds union member tags such as "constrained-str"
        path = [str(x) for x in e["loc"][1:] if isinstance(x, int) or str(x).isidentifier()]
        msg = e["msg"]
        if path and path[0] in UNSUPPORTED:  # the field as a whole, whatever part was wrong
            path, msg = path[:1], (f"not supported by this server; omit it (or send "
                                   f"{UNSUPPORTED[path[0]]})")
        msgs = by_field.setdefault(".".join(path) or "body", [])
        if msg not in msgs:
            msgs.append(msg)
    return "; ".join(f"{field}: {' or '.join(msgs)}" for field, msgs in by_field.items())


class _Timing:
    """TTFT / TPOT histograms and the outcome counter for one request."""

    def __init__(self, metrics: _Metrics) -> None:
        self.metrics = metrics
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.n = 0

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if self.first is None and out.new_token_ids:
            self.first = now
            self.metrics.ttft.observe(now - self.t0)
        self.n += len(out.new_token_ids)
        if out.finished:
            self.metrics.requests.labels(out.finish_reason or "unknown").inc()
            if self.first is not None and self.n > 1:
                self.metrics.tpot.observe((now - self.first) / (self.n - 1))


@dataclass(frozen=True)
class _Head:
    rid: str
    created: int
    model_name: str
    chat: bool


def _generation_failed(out: RequestOutput) -> ApiError:
    return ApiError(500, f"generation failed: {out.error}; the request was not completed "
                         "(the server goes on; retry or report the server log)")


async def _until_disconnected(request: Request,
                              answer: Coroutine[Any, Any, Response]) -> Response:
    """Await ``answer`` unless the client disconnects first (vLLM's ``with_cancellation``).

    A disconnect cancels ``answer``; the CancelledError reaches the request's outputs generator,
    whose ``finally`` aborts the request. A streamed answer returns once its first output is
    there; from then on the SSE response watches the connection itself.
    """
    task = asyncio.ensure_future(answer)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done():  # it finished first (a done task is never cancelled above)
        return task.result()
    await asyncio.gather(task, return_exceptions=True)  # let its cleanup finish
    return Response(status_code=499)  # client closed the connection; nobody reads this


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body was read already: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _complete(outputs: AsyncGenerator[RequestOutput, None], head: _Head) -> Response:
    """Collect a whole completion; 500 if the engine failed it."""
    text: list[str] = []
    logprobs: list[TokenLogprob] | None = None
    last: RequestOutput | None = None
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            text.append(out.new_text)
            if out.logprobs is not None:
                logprobs = (logprobs or []) + list(out.logprobs)
            last = out
    assert last is not None and last.finished, "a request's last output is finished"
    if last.finish_reason == "error":
        raise _generation_failed(last)
    usage = _usage(last)
    usage["prompt_tokens_details"] = {"cached_tokens": last.cached_prompt_tokens}
    body_text = "".join(text)
    lp_body = _LogprobsBody(head.chat).body(logprobs)
    if head.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": body_text},
                  "logprobs": lp_body, "finish_reason": last.finish_reason}
    else:
        choice = {"index": 0, "text": body_text, "logprobs": lp_body,
                  "finish_reason": last.finish_reason}
    return JSONResponse({
        "id": head.rid, "object": "chat.completion" if head.chat else "text_completion",
        "created": head.created, "model": head.model_name, "choices": [choice], "usage": usage,
    })


async def _stream(outputs: AsyncGenerator[RequestOutput, None], head: _Head) -> Response:
    """SSE response, started once the first output is there: a request that fails before
    its first token gets a plain 500, like a non-streamed one."""
    first = await anext(outputs)
    if first.finish_reason == "error":
        await outputs.aclose()
        raise _generation_failed(first)
    return _SSEResponse(_sse(first, outputs, head), outputs)


class _SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes the request's outputs when it ends.

    Starlette cancels a stream whose client left; if that lands while an event is being sent,
    the outputs generator is not running and only this ``aclose`` reaches its ``finally``.
    """

    def __init__(self, content: AsyncIterator[str],
                 outputs: AsyncGenerator[RequestOutput, None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._outputs = outputs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._outputs.aclose()


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


async def _sse(first: RequestOutput, rest: AsyncGenerator[RequestOutput, None],
               head: _Head) -> AsyncIterator[str]:
    """One SSE event per output, the last with finish_reason and usage, then [DONE]; a
    failure is one error event and the end of the stream (no [DONE]: it did not complete)."""
    out = first
    logprobs = _LogprobsBody(head.chat)  # completions' text_offset goes on across chunks
    while True:
        if out.finish_reason == "error":
            err = _generation_failed(out)
            body = {"message": err.message, "type": "server_error", "param": None, "code": 500}
            yield f"data: {json.dumps({'error': body}, ensure_ascii=False)}\n\n"
            return
        event = _chunk(out, head, out is first, logprobs)
        yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        if out.finished:
            break
        out = await anext(rest)
    yield "data: [DONE]\n\n"


def _chunk(out: RequestOutput, head: _Head, is_first: bool,
           logprobs: _LogprobsBody) -> dict[str, Any]:
    """One streamed chunk: the non-streamed body's shape with a delta."""
    reason = out.finish_reason if out.finished else None
    lp_body = logprobs.body(None if out.logprobs is None else list(out.logprobs))
    if head.chat:
        delta: dict[str, str] = {"content": out.new_text}
        if is_first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "logprobs": lp_body, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": out.new_text, "logprobs": lp_body, "finish_reason": reason}
    event: dict[str, Any] = {
        "id": head.rid, "object": "chat.completion.chunk" if head.chat else "text_completion",
        "created": head.created, "model": head.model_name, "choices": [choice],
    }
    if out.finished:
        event["usage"] = _usage(out)
    return event


# --- logprobs: OpenAI's shapes -------------------------------------------------------------------
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI and vLLM report this instead


def _token_text(token: bytes) -> str:
    """A token's text; one holding part of a UTF-8 character shows its bytes as \\xNN."""
    return token.decode("utf-8", errors="backslashreplace")


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class _LogprobsBody:
    """``choice.logprobs`` for the tokens of one or more outputs, as OpenAI writes it.

    Completions: ``{tokens, token_logprobs, top_logprobs: [{token: logprob}] (the sampled
    token and the ``logprobs`` most likely), text_offset}``, the offsets going on across the
    chunks of a stream. Chat: ``{content: [{token, logprob, bytes, top_logprobs: [{token,
    logprob, bytes}]}], refusal: null}``.
    """

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.offset = 0  # characters of the token texts so far (completions' text_offset)

    def body(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": [{**_chat_logprob(e.token, e.logprob), "top_logprobs": [
                _chat_logprob(tok, lp) for tok, lp in e.top]} for e in entries], "refusal": None}
        tokens = [_token_text(e.token) for e in entries]
        top = []
        for e, text in zip(entries, tokens):
            alternatives = {_token_text(tok): _lp(lp) for tok, lp in e.top}
            alternatives.setdefault(text, _lp(e.logprob))
            top.append(alternatives)
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [_lp(e.logprob) for e in entries],
                "top_logprobs": top, "text_offset": offsets}


def _chat_logprob(token: bytes, logprob: float) -> dict[str, Any]:
    return {"token": _token_text(token), "logprob": _lp(logprob), "bytes": list(token)}


# --- access: the API key -------------------------------------------------------------------------
OPEN_PATHS = ("/health",)  # answered without the API key (load balancers' health checks)


class _ApiKey:
    """ASGI middleware: every path but ``OPEN_PATHS`` needs ``Authorization: Bearer <key>``.

    A missing or wrong key gets 401 with OpenAI's body (code ``invalid_api_key``). The key is
    compared with ``hmac.compare_digest``, whose time does not depend on where they differ.
    """

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        scheme, _, token = (given or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            await self.app(scope, receive, send)
            return
        msg = ("no API key: send the header 'Authorization: Bearer <key>' with the key the "
               "server was started with (--api-key / QUANTPIPE_API_KEY)" if given is None else
               "incorrect API key provided in the Authorization header")
        err = ApiError(401, msg, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await err.response()(scope, receive, send)


# --- request bodies: size and time limits ------------------------------------------------------
class _BodyTooLarge(Exception):
    pass


async def _read_body(receive, max_bytes: int) -> bytes | None:
    """The whole body (None if the client hung up); raises _BodyTooLarge past ``max_bytes``."""
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise _BodyTooLarge(size)
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts)


class _BodyLimit:
    """ASGI middleware: reads each request body in full before the app runs.

    A declared Content-Length over the limit is refused before reading anything; a chunked
    body is counted as it arrives; a body that has not arrived within ``request_timeout``
    seconds (a stalled or slow client) gets 408. Waiting is asynchronous, so other requests
    (/health included) are served meanwhile. A 408 closes the connection. A 413 does not:
    uvicorn then discards the rest of the body as it arrives, whereas closing a socket with
    unread data sends a TCP reset that can destroy the 413 before the client reads it.
    """

    def __init__(self, app, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lim = self.limits
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > lim.max_request_bytes:
            await _error(413, _too_large_message(int(declared), lim))(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(_read_body(receive, lim.max_request_bytes),
                                          lim.request_timeout)
        except asyncio.TimeoutError:
            msg = (f"the request body did not arrive within {lim.request_timeout:g} s "
                   "(--request-timeout); send the whole body at once")
            await _error(408, msg, {"Connection": "close"})(scope, receive, send)
            return
        except _BodyTooLarge as exc:
            msg = _too_large_message(exc.args[0], lim, counted=True)
            await _error(413, msg)(scope, receive, send)
            return
        if body is None:
            return  # the client left before sending its body; there is no one to answer
        await self.app(scope, _replay(body, receive), send)


def _too_large_message(size: int, lim: RequestLimits, counted: bool = False) -> str:
    what = f"more than {lim.max_request_bytes:,}" if counted else f"{size:,}"
    return (f"request body is {what} bytes; this server takes at most "
            f"{lim.max_request_bytes:,} (--max-request-bytes): shorten the prompt")


def _replay(body: bytes, receive):
    """A receive() that hands out ``body`` once, then the connection's own events."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# --- the command ---------------------------------------------------------------------------------
def _check_listen(host: str, port: int) -> None:
    """Fail in a second, not after the model load, when the address cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} does not resolve ({exc}); use 127.0.0.1") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind(addr)
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another "
                             "--port or stop the process using it") from None


def serve(spec: ServeSpec, on_listening: Callable[[str], None] | None = None) -> None:
    """Check the address, load the model, build the app and run uvicorn until interrupted.

    ``on_listening(url)`` is called once the socket listens (every check passed).
    """
    import torch

    from quantpipe.runtime.engine import load_model_for_serving

    _warn_exposure(spec)
    _check_listen(spec.host, spec.port)
    if spec.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {spec.device}: no CUDA device is visible; use --device cpu")
    fd_limit, _ = raise_fd_limit()
    model, tok = load_model_for_serving(spec.model_dir, spec.device, head_dtype=spec.head_dtype,
                                        verify=spec.verify)
    engine = LLMEngine(model, tok, spec.engine_config())
    app = build_app(engine, Path(spec.model_dir).name, spec.max_queue, spec.request_limits(),
                    spec.api_key, spec.allowed_hosts)
    cap = connection_cap(spec.max_connections, fd_limit, open_fds())
    guard = ConnectionGuard(replace(spec.connection_limits(), max_connections=cap))
    config = uvicorn.Config(app, host=spec.host, port=spec.port, log_level="warning",
                            http=guard.protocol_class(), backlog=ACCEPT_BATCH)
    _ListeningServer(config, on_listening, guard).run()


def _warn_exposure(spec: ServeSpec) -> None:
    if spec.host in LOOPBACK_HOSTS:
        return
    if spec.api_key is None:
        log.warning("binding to %s exposes the server beyond this machine to anyone, with no "
                    "API key: set QUANTPIPE_API_KEY (or --api-key)", spec.host)
    else:
        log.warning("binding to %s exposes the server beyond this machine (API key required)",
                    spec.host)


class _ListeningServer(uvicorn.Server):
    """uvicorn's Server that calls ``on_listening(url)`` once its socket listens, with
    asyncio's traceback per failed accept() summarised (http_guard.accept_error_handler), and
    the summaries not yet logged logged at shutdown."""

    def __init__(self, config: uvicorn.Config, on_listening: Callable[[str], None] | None,
                 guard: ConnectionGuard) -> None:
        super().__init__(config)
        self.on_listening, self.guard = on_listening, guard
        self.accept_errors: Callable | None = None

    async def startup(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        self.accept_errors = accept_error_handler(loop)
        loop.set_exception_handler(self.accept_errors)
        await super().startup(sockets)
        if self.started:
            widen_listen_queue([s for server in self.servers for s in server.sockets])
        if self.started and self.on_listening is not None:
            host = self.config.host
            host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
            self.on_listening(f"http://{host}:{self.config.port}/v1")

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        self.guard.flush()
        if self.accept_errors is not None:
            self.accept_errors.flush()
