"""The served app's OpenAPI document: every route's responses declared, errors and streams included.

FastAPI derives request schemas from `cluster.serving.protocol`, strict ones: unknown fields are refused
(`additionalProperties: false`), and a field the server refuses (`cluster.serving.fields`) is declared only at
its neutral values, so every body the server accepts is one the document declares. What FastAPI cannot know is
declared here: the bodies of successful answers (`Completion`, `ChatCompletion`, ...), the SSE stream a
`stream: true` request gets instead, every error status a route can answer with (all OpenAI's `{"error": {...}}`), and
what only the running config knows: the one served model id, the arms the `x-specserve-arm` header may force,
and, with API keys, the bearer scheme on each route that needs one. The document is what a client generator or a
fuzzer (schemathesis, in the tests and `specserve bench --section reliability`) reads, so a response that does
not match it is a bug of the server or of this page.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.serving.ab import ARM_HEADER


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


class Usage(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative: dict[str, Any] | None = Field(
        None, description="arm, rounds, acceptance, γ, regret (ASD), and timing_s: seconds per hop of the request "
        "(tokenize, ingress_to_unit, queue, prefill, first_token, plan, draft, score, verify, decode, detokenize_sse, "
        "end; null where the engine does not expose a hop)")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobBody(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Each output token's logprob under the target (the raw distribution) and the top ones at its position."""

    content: list[TokenLogprobBody] | None
    refusal: list[TokenLogprobBody] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class CompletionChunk(BaseModel):
    """One SSE event of a streamed completion (the usage-only last chunk has no choices)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


StreamChunk = CompletionChunk | ChatCompletionChunk | ErrorResponse  # an SSE event's data, but the last "[DONE]"
STREAM_DONE = "[DONE]"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class Export(BaseModel):
    """`GET /v1/specserve/export` (schema specserve.export/v1; rows as `telemetry.request_row` writes them)."""

    model_config = ConfigDict(populate_by_name=True)

    schema_: Literal["specserve.export/v1"] = Field(alias="schema")
    service: str
    generated_s: float
    arms: list[str]
    requests: list[dict[str, Any]]
    audits: list[dict[str, Any]]
    dropped: dict[str, int]
    deployments: list[dict[str, Any]] = Field(default_factory=list)  # each change of the arms or their weights


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    meaning = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model",
               408: "Past serving.request_timeout_s", 413: "Body over serving.max_body_bytes",
               503: "Queue full, or the decoder unit failed or went away: retry after Retry-After"}
    return {s: {"model": ErrorResponse, "description": meaning[s]} for s in statuses}


SSE = {"text/event-stream": {"schema": {  # Open API 3.1: the schema of each event
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "JSON: a CompletionChunk or ChatCompletionChunk, or "
                            "an ErrorResponse once the stream has begun; the last event is `[DONE]`"}}}}}
GENERATE = {200: {"content": SSE, "description": "The completion, or its SSE stream when `stream` is true"},
            **_errors(400, 401, 404, 408, 413, 503)}
MODELS = _errors(401)
METRICS = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text"},
           **_errors(401)}
EXPORT = _errors(401)
PROTECTABLE = {"/metrics": "protect_metrics", "/v1/specserve/export": "protect_export"}
OPEN = {"/healthz"}
REQUEST_SCHEMAS = ("CompletionRequest", "ChatCompletionRequest")


def specserve_openapi(document: dict[str, Any], *, served_name: str, arms: list[str], max_tokens_limit: int,
                      auth: bool, protect_metrics: bool, protect_export: bool) -> dict[str, Any]:
    """FastAPI's `document` completed with what the running config knows (see the module docstring)."""
    protect = {"protect_metrics": protect_metrics, "protect_export": protect_export}
    schemas = document.get("components", {}).get("schemas", {})
    for name in REQUEST_SCHEMAS:
        properties = schemas.get(name, {}).get("properties", {})
        if "model" in properties:  # the one model this server serves (any other gets a 404)
            properties["model"] = {**properties["model"], "enum": [served_name]}
        for field in ("max_tokens", "max_completion_tokens"):
            for branch in properties.get(field, {}).get("anyOf", []):
                if branch.get("type") == "integer":
                    branch.update(minimum=1, maximum=max_tokens_limit)
    names = "|".join(re.escape(arm) for arm in arms)  # an arm's name, or blank for none (ArmRouter.assign)
    header = {"name": ARM_HEADER, "in": "header", "required": False,
              "schema": {"type": "string", "pattern": f"^\\s*(?:{names})?\\s*$", "examples": arms},
              "description": "Force the A/B arm of this request (blank: routed as if absent)."}
    for path, item in document.get("paths", {}).items():
        for method, operation in item.items():
            operation.get("responses", {}).pop("422", None)  # validation errors are answered 400
            if method == "post":
                operation.setdefault("parameters", []).append(header)
            if auth and path not in OPEN and protect.get(PROTECTABLE.get(path, ""), True):
                operation["security"] = [{"bearer": []}]
    for model in (CompletionChunk, ChatCompletionChunk, ErrorResponse):  # what the SSE events' data refers to
        definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(definition.pop("$defs", {}))
        schemas[model.__name__] = definition
    if auth:
        document.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
            "type": "http", "scheme": "bearer", "description": "An API key: `Authorization: Bearer <key>`."}
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    return document
