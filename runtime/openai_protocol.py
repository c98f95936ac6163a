"""The OpenAI API's request and response bodies as the server takes and answers them, and the
OpenAPI schema the server publishes (vLLM keeps the same split: ``entrypoints/openai/protocol``).

Request bodies are strict (a string "16" or ``true`` is not a number, as in the OpenAI API) and
carry vLLM's ``top_k`` / ``ignore_eos`` extensions. OpenAI fields the server does not implement
(``UNSUPPORTED``) are accepted only with the value that asks for nothing (``echo: false``,
``tools: []``, ...); any other value is a 400 naming the field, never silently ignored. The
response models only describe the bodies for the schema; the server builds the same dicts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from quantpipe.runtime.engine.sampling import MAX_LOGPROBS, SEED_MAX, SEED_MIN


# --- request bodies (OpenAI fields + vLLM's top_k / ignore_eos extensions) --------------------
# Strict: a string "16" or true is not a number here, as in the OpenAI API; but 16.0 is an
# integer in JSON Schema, so integral floats are taken as integers.
def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _int(**constraints: int) -> Any:
    # The constraints before the validator, or the schema shows pydantic's "ge" keywords.
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


NonEmpty = Annotated[str, Field(min_length=1)]
TokenId = _int(ge=0)
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions ``logprobs`` (OpenAI's limit)

# field -> the one value accepted (it asks for nothing); any other value gets 400
UNSUPPORTED: dict[str, str] = {
    "echo": "false", "best_of": "1", "suffix": "null", "logit_bias": "{}",
    "presence_penalty": "0", "frequency_penalty": "0", "response_format": '{"type": "text"}',
    "tools": "[]", "tool_choice": '"none"', "functions": "[]", "function_call": '"none"',
}
Zero = Annotated[float, Field(ge=0.0, le=0.0)]
Nothing = Annotated[list[Any], Field(max_length=0)]


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None  # must name the served model (GET /v1/models) when given
    max_tokens: _int(ge=1) | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: _int(ge=-1) = -1
    seed: _int(ge=SEED_MIN, le=SEED_MAX) | None = None
    stop: NonEmpty | list[NonEmpty] | None = None
    stream: bool = False
    ignore_eos: bool = False
    n: _int(ge=1, le=1) = 1
    # not implemented (UNSUPPORTED): only the value that asks for nothing
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = None
    presence_penalty: Zero | None = None
    frequency_penalty: Zero | None = None


class CompletionRequest(GenerationRequest):
    # A string, one string in a list (batches are not supported), or token ids.
    prompt: (NonEmpty | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)])
    # the sampled token's logprob and this many most likely tokens', per token
    logprobs: _int(ge=0, le=MAX_COMPLETION_LOGPROBS) | None = None
    echo: Literal[False] | None = None
    best_of: Literal[1] | None = None
    suffix: Literal[""] | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)
    role: str = Field(min_length=1)
    content: str


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: _int(ge=1) | None = None
    logprobs: bool | None = None  # true: each token's logprob in choice.logprobs.content
    top_logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = None  # needs logprobs: true
    response_format: TextFormat | None = None
    tools: Nothing | None = None
    tool_choice: Literal["none"] | None = None
    functions: Nothing | None = None
    function_call: Literal["none"] | None = None


# --- response bodies (for the OpenAPI schema; handlers build the same dicts) ------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # the sampled token and the ``logprobs`` most likely
    text_offset: list[int]  # where each token starts in the completion's text


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes (a token can hold part of a character)


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the ``top_logprobs`` most likely tokens


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    owned_by: str
    max_model_len: int
    vocab_size: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthStatus(BaseModel):
    status: Literal["ok"]


SSE_DOC = ("with stream: true, server-sent events: one `data: {chunk}` per token, the last with "
            "finish_reason and usage, then `data: [DONE]`; a failure after the stream started "
            "is one `data: {\"error\": {...}}` event, then the stream ends without [DONE]")

# OpenAPI 3.1: for text/event-stream, ``schema`` describes one event.
SSE_EVENT = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk (the non-streamed "
                                                            "body's shape with a delta), a JSON "
                                                            "error body, or [DONE]"},
                   "event": {"type": "string"}},
}


def generation_responses(ok: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    err = {"model": ErrorResponse}
    return {
        200: {"model": ok, "content": {"text/event-stream": {"schema": SSE_EVENT}},
              "description": "the completion; " + SSE_DOC},
        400: {**err, "description": "invalid request (schema, limits, prompt + max_tokens, a "
                                    "field this server does not implement)"},
        404: {**err, "description": "unknown model (code model_not_found)"},
        408: {**err, "description": "the request body did not arrive within --request-timeout"},
        413: {**err, "description": "request body over --max-request-bytes"},
        429: {**err, "description": "max_num_seqs + max_queue requests in flight; Retry-After"},
        500: {**err, "description": "the engine failed this request (others are unaffected)"},
        503: {**err, "description": "the engine loop stopped; restart the server"},
    }


def tighten_openapi(app: FastAPI, model_name: str, max_model_len: int, vocab: int,
                    max_prompt_chars: int, api_key: bool = False) -> None:
    """The served schema states this server's real limits (so a schema fuzzer aims well).

    The request models are shared by every app, so the per-model facts (the one accepted
    ``model``, the vocabulary, the length limits) are patched into the generated schema; the
    unused 422 response FastAPI adds is dropped (validation errors answer 400).
    """
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            _drop_422(schema)
            _state_limits(schema["components"]["schemas"], model_name, max_model_len, vocab,
                          max_prompt_chars)
            if api_key:
                _require_key(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _drop_422(schema: dict[str, Any]) -> None:
    for name in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(name, None)
    for path in schema["paths"].values():
        for op in path.values():
            op["responses"].pop("422", None)


def _require_key(schema: dict[str, Any]) -> None:
    """Every operation but /health takes a Bearer key and may answer 401."""
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, ops in schema["paths"].items():
        if path == "/health":
            continue
        for op in ops.values():
            op["security"] = [{"bearer": []}]
            op["responses"]["401"] = {
                "description": "no or a wrong API key (code invalid_api_key)",
                "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _state_limits(comps: dict[str, Any], model_name: str, max_model_len: int, vocab: int,
                  max_chars: int) -> None:
    for name in ("CompletionRequest", "ChatRequest"):
        props = comps[name]["properties"]
        props["model"] = {"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}],
                          "title": "Model"}
        for key in ("max_tokens", "max_completion_tokens"):
            if key in props:
                props[key]["anyOf"][0]["maximum"] = max_model_len - 1
    for alt in comps["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        if alt["type"] == "string":
            alt["maxLength"] = max_chars
        elif alt["items"]["type"] == "integer":
            alt["items"]["maximum"] = vocab - 1
            alt["maxItems"] = max_model_len - 1
    comps["ChatMessage"]["properties"]["content"]["maxLength"] = max_chars
