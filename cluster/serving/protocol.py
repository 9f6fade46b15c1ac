"""The OpenAI-compatible wire format: the request models and their validation.

Terms:
- **prompt ids**: the token ids the target sees (a completion's prompt, or the chat template applied to the
  messages). The context limit applies to prompt ids + max_tokens.
- **stop strings**: text-level stops, applied as tokens are detokenized (`cluster.serving.text`).

Every client mistake raises `APIError` (`cluster.serving.errors`): a 4xx whose body's `param` names the field.
The response bodies are `cluster.serving.bodies`'. Nothing here imports Ray.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from actors.requests import MAX_LOGPROBS, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, StructuredOutput
from cluster.serving.errors import APIError
from cluster.serving.fields import (UNSUPPORTED, ChatFieldsNotHonoured, RefusedCompletionFields,
                                    RefusedMessageFields, StrictRequest, declare, unsupported)

MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 128  # choices per request: n × prompts (OpenAI's n limit)
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request
MAX_TEMPERATURE = 2.0  # OpenAI's range; far larger values overflow float32 in the sampler
SAMPLING_EPS = 1e-5  # temperatures below this decode greedily (as vLLM does): 1/T would overflow the logits
INT32_MAX, INT64_MIN, INT64_MAX = 2**31 - 1, -(2**63), 2**63 - 1


# ---------------------------------------------------------------------------------------------------------
# Requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = Field(False, description="Send a final chunk carrying `usage` (with `speculative`).")
    include_obfuscation: bool | None = Field(None, description="Ignored: chunks are sent without padding.")


class _SamplingFields(StrictRequest):
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
    n: int = Field(1, ge=1, le=MAX_CHOICES, json_schema_extra=declare(or_null=True),
                   description=f"Choices per prompt (at most {MAX_CHOICES} choices per request); a seeded "
                   "request's choice j draws with seed + j.")
    user: str | None = Field(None, max_length=256, description="End-user id; makes the A/B arm sticky.")
    stream: bool = Field(False, description="Stream server-sent events.", json_schema_extra=declare(or_null=True))
    stream_options: StreamOptions | None = None
    speculate: bool = Field(True, description="Extension: False decodes with the target alone (γ = 0).")
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS,
                                             description="Extension (vLLM's): token ids that end the output, "
                                             "which stops before them.")
    ignore_eos: bool | None = Field(None, description="Extension (vLLM's): go on past the model's end tokens.")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Subtracted from a token's logit "
                                            "once per time it occurs in the output so far.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Subtracted from a token's logit "
                                           "once it occurs in the output so far.")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (a decimal string) -> a bias in [-100, 100] added to its logit; -100 bans it.",
        json_schema_extra=declare(anyOf=[{"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                                          "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                                          "maxProperties": MAX_LOGIT_BIAS}, {"type": "null"}]))
    repetition_penalty: float | None = Field(
        None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, description="Extension (vLLM's): a logit of a "
        "token in the prompt or output is divided by it if positive, multiplied by it if not; 1 is off.")
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX, description="Extension (vLLM's): no end token or "
                                   "stop token id before this many output tokens (stop strings still apply).")

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is None:
            return None
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries are allowed, got {len(bias)}")
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {value} for token {key}")
        return bias

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

    def logit_rules(self, vocab_size: int, max_tokens: int) -> dict[str, Any]:
        """The penalties, `logit_bias` (token ids below `vocab_size`) and `min_tokens` (at most `max_tokens`) as
        `actors.requests.SamplingParams` takes them; a 400 naming the field otherwise."""
        bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if any(t >= vocab_size for t in bias):
            raise APIError(f"logit_bias: token ids must be < {vocab_size}, got {sorted(t for t in bias if t >= vocab_size)}",
                           param="logit_bias", code="invalid_value")
        if (self.min_tokens or 0) > max_tokens:
            raise APIError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})",
                           param="min_tokens", code="invalid_value")
        return {"frequency_penalty": float(self.frequency_penalty or 0.0),
                "presence_penalty": float(self.presence_penalty or 0.0),
                "repetition_penalty": float(self.repetition_penalty or 1.0),
                "logit_bias": bias or None, "min_tokens": self.min_tokens or 0}


class CompletionRequest(_SamplingFields, RefusedCompletionFields):
    """POST /v1/completions. `prompt` is text or token ids, or a list of either: one choice per prompt (times n)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description=f"The prompt: text or token ids, or a list of up to {MAX_CHOICES} of either.",
        json_schema_extra=declare(anyOf=[
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_CHOICES},
            {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
             "minItems": 1, "maxItems": MAX_CHOICES},
        ]),
    )
    echo: bool = Field(False, description="Put the prompt's text in front of each choice's text.",
                       json_schema_extra=declare(or_null=True))
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Each output token's logprob and the "
                                 "top this-many tokens at its position (the raw target distribution).")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: str | list[str] | list[int] | list[list[int]]) -> str | list[str] | list[int] | list[list[int]]:
        many = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
        for one in prompt if many else [prompt]:
            if not one:
                raise ValueError("prompt must not be empty")
            if isinstance(one, list) and any(t < 0 for t in one):
                raise ValueError("prompt token ids must be >= 0")
        if many and len(prompt) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts are allowed, got {len(prompt)}")
        return prompt

    def check_choices(self) -> None:
        """Cross-field rules, as a 400 naming the field: n × prompts within MAX_CHOICES; no echo with logprobs
        (the prompt's logprobs are not computed)."""
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise APIError(f"n: {self.n} choices for each of {len(self.prompts)} prompts exceed {MAX_CHOICES} "
                           "choices per request", param="n", code="invalid_value")
        if self.echo and self.logprobs is not None:
            raise APIError("echo with logprobs needs the prompt's logprobs, which are not computed; send one or "
                           "the other", param="echo", code=UNSUPPORTED)

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, in order."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            return list(prompt)
        return [prompt]

    @property
    def top_logprobs_n(self) -> int | None:
        return self.logprobs


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


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$", description="The schema's name.")
    description: str | None = Field(None, description="What the output is for (not used for decoding).")
    schema_: dict[str, Any] = Field(alias="schema", description="A JSON Schema every output follows.")
    strict: bool | None = Field(None, description="Outputs always follow the schema exactly; false is refused.")

    @field_validator("strict")
    @classmethod
    def _always_strict(cls, strict: bool | None) -> bool | None:
        if strict is False:
            raise unsupported("outputs always follow the schema exactly; strict: false is not supported")
        return strict


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = Field(None, description="With type json_schema: the schema.")

    def structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.json_schema is None:
            raise APIError("response_format: type json_schema needs json_schema", param="response_format.json_schema",
                           code="missing_required_parameter")
        import json

        from jsonschema import SchemaError
        from jsonschema.validators import validator_for

        schema = self.json_schema.schema_
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as err:
            raise APIError(f"response_format.json_schema.schema is not a valid JSON Schema: {err.message}",
                           param="response_format.json_schema.schema", code="invalid_value") from None
        return StructuredOutput("json_schema", json.dumps(schema))


class ChatCompletionRequest(_SamplingFields, ChatFieldsNotHonoured):
    """POST /v1/chat/completions. The prompt is the tokenizer's chat template applied to `messages`."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, description="Newer name of max_tokens.")
    logprobs: bool | None = Field(None, description="Return each output token's logprob (the raw target "
                                  "distribution).")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="With logprobs: the top this-many "
                                     "tokens at each position too.")
    response_format: ResponseFormat | None = Field(None, description="text, json_object (any JSON object) or "
                                                   "json_schema: every output follows the grammar, also under "
                                                   "speculation.")

    def check_choices(self) -> None:
        """Cross-field rules, as a 400 naming the field: top_logprobs needs logprobs."""
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")

    @property
    def prompts(self) -> list[list[int]]:
        return []  # the chat template makes the one prompt (`OpenAIIngress._chat_prompt`)

    @property
    def top_logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def structured(self) -> StructuredOutput | None:
        """The grammar `response_format` asks for (None for text); a 400 naming the field for a schema that is
        not a valid JSON Schema."""
        return None if self.response_format is None else self.response_format.structured()

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
