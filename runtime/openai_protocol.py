"""The OpenAI API's request and response bodies as the server takes and answers them, and the
OpenAPI schema the server publishes (vLLM keeps the same split: ``entrypoints/openai/protocol``).

Request bodies are strict (a string "16" or ``true`` is not a number, as in the OpenAI API) and
carry vLLM's ``top_k`` / ``ignore_eos`` extensions. The response models only describe the bodies
for the schema; the server builds the same dicts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from quantpipe.runtime.engine.sampling import SEED_MAX, SEED_MIN


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


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None  # must name the served model (GET /v1/models) when given
    max_tokens: _int(ge=1) | None = None
    temperature: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: _int(ge=-1) = -1
    seed: _int(ge=SEED_MIN, le=SEED_MAX) | None = None
    stop: NonEmpty | list[NonEmpty] | None = None
    stream: bool = False
    ignore_eos: bool = False
    n: _int(ge=1, le=1) = 1


class CompletionRequest(GenerationRequest):
    # A string, one string in a list (batches are not supported), or token ids.
    prompt: (NonEmpty | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)])


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)
    role: str = Field(min_length=1)
    content: str


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: _int(ge=1) | None = None


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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
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


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
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
        400: {**err, "description": "invalid request (schema, limits, prompt + max_tokens)"},
        404: {**err, "description": "unknown model (code model_not_found)"},
        408: {**err, "description": "the request body did not arrive within --request-timeout"},
        413: {**err, "description": "request body over --max-request-bytes"},
        429: {**err, "description": "max_num_seqs + max_queue requests in flight; Retry-After"},
        500: {**err, "description": "the engine failed this request (others are unaffected)"},
        503: {**err, "description": "the engine loop stopped; restart the server"},
    }


def tighten_openapi(app: FastAPI, model_name: str, max_model_len: int, vocab: int,
                    max_prompt_chars: int) -> None:
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
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _drop_422(schema: dict[str, Any]) -> None:
    for name in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(name, None)
    for path in schema["paths"].values():
        for op in path.values():
            op["responses"].pop("422", None)


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
