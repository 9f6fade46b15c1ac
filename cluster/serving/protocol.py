"""The OpenAI-compatible wire format: request models, their validation, response bodies and errors.

Terms:
- **prompt ids**: the token ids the target sees (a completion's prompt, or the chat template applied to the
  messages). The context limit applies to prompt ids + max_tokens.
- **stop strings**: text-level stops, applied as tokens are detokenized (`cluster.serving.text`).

Every client mistake raises `APIError` (status 4xx) and renders as OpenAI's body
`{"error": {"message", "type", "param", "code"}}`; pydantic's errors map to the same body with `param` naming
the offending field. Nothing here imports Ray or torch.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cluster.serving.fields import (UNKNOWN, UNSUPPORTED, ChatFieldsNotHonoured, RefusedCompletionFields,
                                    RefusedMessageFields, RefusedSamplingFields, StrictRequest, declare,
                                    unsupported)

MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64
MAX_TEMPERATURE = 2.0  # OpenAI's range; far larger values overflow float32 in the sampler
SAMPLING_EPS = 1e-5  # temperatures below this decode greedily (as vLLM does): 1/T would overflow the logits
INT32_MAX, INT64_MIN, INT64_MAX = 2**31 - 1, -(2**63), 2**63 - 1


class APIError(Exception):
    """A request the server refuses; rendered as an OpenAI error body with HTTP `status`."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The 400 for pydantic/FastAPI validation errors: the first error's field becomes `param`.

    FastAPI locations start with "body" (or "query", "header"); that prefix is dropped, and list indices are
    kept (`messages.0.content`). A body that is not valid JSON maps to param None, code "invalid_json".
    """
    if not errors:
        return APIError("invalid request", code="invalid_request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "header")]
    if first.get("type") == "json_invalid":
        return APIError(f"request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    # pydantic reports union members as extra location parts ("str", "list[str]"); keep the field path only.
    loc = [part for part in loc if not _is_type_name(part)]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    if param:
        message = f"{param}: {message}"
    extra = len(errors) - 1
    if extra:
        message += f" (and {extra} more error{'s' if extra > 1 else ''})"
    kind = first.get("type")
    if kind == "extra_forbidden":
        message = f"{param}: unknown parameter (neither in OpenAI's schema nor a specserve extension)"
    code = {"missing": "missing_required_parameter", "extra_forbidden": UNKNOWN, UNSUPPORTED: UNSUPPORTED}.get(
        kind, "invalid_value")
    return APIError(message, param=param, code=code)


def _is_type_name(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "list[str]", "list[int]", "none") or part.startswith(
        ("list[", "function-", "constrained-")
    )


# ---------------------------------------------------------------------------------------------------------
# Requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = Field(False, description="Send a final chunk carrying `usage` (with `speculative`).")
    include_obfuscation: bool | None = Field(None, description="Ignored: chunks are sent without padding.")


class _SamplingFields(StrictRequest, RefusedSamplingFields):
    """Parameters shared by /v1/completions and /v1/chat/completions."""

    model: str = Field(min_length=1, description="The served model id (`GET /v1/models`).")
    max_tokens: int | None = Field(None, description="Most tokens to generate; None uses the server default.")
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, json_schema_extra=declare(or_null=True),
                               description=f"0 (or below {SAMPLING_EPS}) is greedy; > 0 samples; at most 2.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, in (0, 1].",
                         json_schema_extra=declare(or_null=True))
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX,
                              description="Extension: keep the k most likely tokens; 0 or -1 = off.")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX,
                             description="Seed of the request's random generator (sampling).")
    stop: str | list[str] | None = Field(
        None, description="Up to 4 strings; output ends before the first one.",
        json_schema_extra=declare(anyOf=[{"type": "string", "minLength": 1},
                                         {"type": "array", "items": {"type": "string", "minLength": 1},
                                          "maxItems": MAX_STOP_STRINGS}, {"type": "null"}]),
    )
    n: int = Field(1, description="Choices per request; only 1 is supported yet.",
                   json_schema_extra=declare(minimum=1, maximum=1, or_null=True))
    user: str | None = Field(None, max_length=256, description="End-user id; makes the A/B arm sticky.")
    stream: bool = Field(False, description="Stream server-sent events.", json_schema_extra=declare(or_null=True))
    stream_options: StreamOptions | None = None
    speculate: bool = Field(True, description="Extension: False decodes with the target alone (γ = 0).")
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS,
                                             description="Extension (vLLM's): token ids that end the output, "
                                             "which stops before them.")
    ignore_eos: bool | None = Field(None, description="Extension (vLLM's): go on past the model's end tokens.")

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise unsupported("only n = 1 is supported yet")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str] | None:
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else list(stop)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops or None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def top_k_or_none(self) -> int | None:
        return self.top_k if self.top_k is not None and self.top_k > 0 else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self, defaults: Any = None, vocab_size: int | None = None) -> dict[str, Any]:
        """`temperature`, `top_p` and `top_k` (None = off) as the sampler takes them. Each is the request's own
        value, else the operator's default (`serving.defaults`, a `cluster.config.SamplingDefaults`; None there
        keeps the OpenAI default), else the OpenAI default (temperature 1, top_p 1, no top_k). Then: a
        temperature below SAMPLING_EPS decodes greedily (1/T would overflow the logits), top_p is at least
        SAMPLING_EPS (smaller keeps the top token all the same, and would round to 0 in float32), and a top_k at
        or above `vocab_size` is off."""
        sent = self.model_fields_set

        def pick(name: str, own: Any) -> Any:
            default = getattr(defaults, name, None)
            return own if name in sent or default is None else default

        temperature, top_p, top_k = (pick("temperature", self.temperature), pick("top_p", self.top_p),
                                     pick("top_k", self.top_k_or_none))
        if vocab_size is not None and top_k is not None and top_k >= vocab_size:
            top_k = None
        return {"temperature": temperature if temperature >= SAMPLING_EPS else 0.0,
                "top_p": max(top_p, SAMPLING_EPS), "top_k": top_k}

    def stop_rules(self, vocab_size: int) -> dict[str, Any]:
        """`stop_token_ids` (each below `vocab_size`, else a 400 naming the field) and `ignore_eos`."""
        stop_ids = tuple(self.stop_token_ids or ())
        if any(not 0 <= i < vocab_size for i in stop_ids):
            raise APIError(f"stop_token_ids: every id must be in [0, {vocab_size}), got {list(stop_ids)}",
                           param="stop_token_ids", code="invalid_value")
        return {"stop_token_ids": stop_ids, "ignore_eos": bool(self.ignore_eos)}


class CompletionRequest(_SamplingFields, RefusedCompletionFields):
    """POST /v1/completions. `prompt` is text or token ids, alone or as a one-element list."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="The prompt (one per request): text or token ids, alone or as a list of one.",
        json_schema_extra=declare(anyOf=[
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
            {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
             "minItems": 1, "maxItems": 1},
        ]),
    )
    echo: bool = Field(False, description="Not supported yet; must be false.",
                       json_schema_extra=declare(const=False, or_null=True))

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str] | list[int] | list[list[int]]) -> str | list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) != 1:
                raise unsupported("only one prompt per request is supported yet")
            prompt = prompt[0]
        if isinstance(prompt, str) and not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and any(t < 0 for t in prompt):
            raise ValueError("prompt token ids must be >= 0")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise unsupported("echo is not supported yet")
        return echo


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = Field(None, description="Ignored: a cache hint.")


class ChatMessage(RefusedMessageFields):
    """One message. `name` and `tool_call_id` reach the chat template as sent (it decides what they mean)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields, ChatFieldsNotHonoured):
    """POST /v1/chat/completions. The prompt is the tokenizer's chat template applied to `messages`."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, description="Newer name of max_tokens.")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as the plain dicts a tokenizer's chat template expects ("developer" acts as "system")."""
        out = []
        for message in self.messages:
            role = "system" if message.role == "developer" else message.role
            entry = {"role": role, "content": message.text()}
            entry.update({k: v for k in ("name", "tool_call_id") if (v := getattr(message, k)) is not None})
            out.append(entry)
        if all(not m["content"] for m in out):
            raise APIError("messages: every message is empty", param="messages", code="empty_prompt")
        return out


def resolve_max_tokens(
    requested: int | None, *, prompt_len: int, default: int, limit: int, max_seq_len: int
) -> int:
    """Tokens to generate for a prompt of `prompt_len` ids, or APIError.

    An explicit `requested` must lie in [1, limit] and fit the context: prompt_len + requested <= max_seq_len.
    An omitted one is `default`, shortened to the room the context leaves.
    """
    if prompt_len <= 0:
        raise APIError("prompt must not be empty", param="prompt", code="empty_prompt")
    room = max_seq_len - prompt_len
    if room < 1:
        raise APIError(
            f"prompt is {prompt_len} tokens; the context limit is {max_seq_len} tokens including at least one "
            "generated token",
            param="prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        return min(default, limit, room)
    if requested < 1:
        raise APIError(f"max_tokens must be >= 1, got {requested}", param="max_tokens", code="invalid_value")
    if requested > limit:
        raise APIError(
            f"max_tokens must be <= {limit}, got {requested}", param="max_tokens", code="invalid_value"
        )
    if requested > room:
        raise APIError(
            f"prompt ({prompt_len} tokens) + max_tokens ({requested}) exceeds the context limit of "
            f"{max_seq_len} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


# ---------------------------------------------------------------------------------------------------------
# Responses


def usage_body(prompt_tokens: int, completion_tokens: int, speculative: dict | None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if speculative is not None:
        usage["speculative"] = speculative
    return usage


def completion_body(
    request_id: str, model: str, text: str, finish_reason: str | None, usage: dict | None, *, chat: bool,
    created: int | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion."""
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def chunk_body(
    request_id: str, model: str, created: int, *, chat: bool, text: str | None = None, role: bool = False,
    finish_reason: str | None = None, usage: dict | None = None, no_choices: bool = False,
) -> dict[str, Any]:
    """One streamed chunk. `role` opens a chat stream; `no_choices` is the final usage-only chunk."""
    if no_choices:
        choices: list[dict] = []
    elif chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    body = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def models_body(served_name: str, owned_by: str = "specserve", created: int | None = None) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": served_name, "object": "model", "created": created or 0, "owned_by": owned_by}],
    }
