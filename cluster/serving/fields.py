"""The request fields this server does not honour, declared, and how it answers them: nothing is silently ignored.

Terms:
- **refused**: a field (of OpenAI's schema, or a vLLM extension) this server cannot honour yet. Sent with its
  **neutral** value, the one that asks for nothing (`logprobs: false`, `frequency_penalty: 0`, `tools: []`,
  or null), it is accepted, since the SDKs and harnesses send those; any other value is a 400 whose `param`
  names the field and whose code is `unsupported_parameter`. The OpenAPI document declares only the neutral
  values, so a client generator or fuzzer sees exactly what is accepted.
- **ignored**: a field whose OpenAI meaning leaves the generated tokens unchanged (`metadata`,
  `prompt_cache_key`, ...): any value of its type is accepted. `IGNORED` says why; the README lists them.
- **unknown**: a field in neither OpenAI's schema nor specserve's extensions: a 400 naming it, code
  `unknown_parameter` (OpenAI's own API refuses unrecognized arguments too).
- **null**: what an SDK sends for an Optional field set to None. It is neutral for a refused field, and means
  the default for the honoured fields of `NULL_IS_DEFAULT`, which specserve types without None.

The mixins below declare the refused and ignored fields of each request model in `cluster.serving.protocol`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

UNSUPPORTED = "unsupported_parameter"
UNKNOWN = "unknown_parameter"
NULL_IS_DEFAULT = ("temperature", "top_p", "n", "stream", "echo")

IGNORED = {  # field -> why ignoring it leaves the answer as OpenAI defines it
    "metadata": "tags a stored completion; nothing is stored (`store: true` is refused)",
    "prompt_cache_key": "a cache-routing hint for OpenAI's servers; it changes latency, not tokens",
    "prompt_cache_options": "cache breakpoints and lifetimes; they change latency, not tokens",
    "prompt_cache_retention": "a cache lifetime; it changes latency, not tokens",
    "messages[].content[].prompt_cache_breakpoint": "a cache breakpoint; it changes latency, not tokens",
    "safety_identifier": "an abuse-detection id for OpenAI; `user` is the one specserve uses (A/B stickiness)",
    "service_tier": "there is one tier; it changes latency and price, not tokens",
    "prediction": "Predicted Outputs promise the same tokens, only sooner; speculation drafts on its own",
    "parallel_tool_calls": "has no effect without tools (non-empty `tools` is refused)",
    "stream_options.include_obfuscation": "stream padding against side channels; chunks are sent unpadded",
}


def declare(*, or_null: bool = False, **schema: Any):
    """A field's JSON schema as its validators enforce it, where pydantic cannot derive it from the type;
    `or_null` adds null (see NULL_IS_DEFAULT)."""

    def update(field_schema: dict[str, Any]) -> None:
        if "anyOf" in schema:
            field_schema.pop("type", None)
        field_schema.update(schema)
        if or_null:
            kept = ("title", "description", "default", "anyOf")
            value = {k: field_schema.pop(k) for k in list(field_schema) if k not in kept}
            field_schema["anyOf"] = [*field_schema.get("anyOf", [value]), {"type": "null"}]

    return update


class StrictRequest(BaseModel):
    """A request model: an unknown field is a 400 naming it; null for a field of NULL_IS_DEFAULT is its default;
    values are not coerced across JSON types (`true` is not the integer 1, nor `1` the boolean true)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if not (v is None and k in NULL_IS_DEFAULT and k in cls.model_fields)}


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Equal to a neutral value as JSON compares them: 0 matches 0.0, but false is not 0."""
    return value is None or any(
        value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral
    )


def _neutral_text(neutral: tuple[Any, ...]) -> str:
    return " or ".join(["null", *(json.dumps(n) for n in neutral)])


def refused(*neutral: Any, why: str = "not supported yet") -> Any:
    """The annotation of a refused field: accepted only as null or one of `neutral` (see the module docstring).

    Use as `frequency_penalty: refused(0) = None`; the value is kept as sent."""
    accepted = _neutral_text(neutral)

    def check(value: Any) -> Any:
        if not _is_neutral(value, neutral):
            raise PydanticCustomError(UNSUPPORTED, "{why}; only {accepted} is accepted",
                                      {"why": why, "accepted": accepted})
        return value

    def neutral_only(field_schema: dict[str, Any]) -> None:
        field_schema["anyOf"] = [{"type": "null"}, *({"const": n} for n in neutral)]

    return Annotated[Any, AfterValidator(check),
                     Field(description=f"Refused ({why}) unless {accepted}.", json_schema_extra=neutral_only)]


def unsupported(why: str) -> PydanticCustomError:
    """The error of an honoured field's value this server cannot serve (e.g. `n` > 1)."""
    return PydanticCustomError(UNSUPPORTED, "{why}", {"why": why})


class RefusedCompletionFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    best_of: refused(1, why="more candidates than n are not supported yet") = None
    suffix: refused("", why="insertion is not supported") = None


class RefusedMessageFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tool_calls: refused([], why="tool calling is not supported yet") = None
    function_call: refused(why="function calling is not supported") = None
    refusal: refused(why="an assistant refusal is not templated yet; send it as content") = None
    audio: refused(why="audio is not supported") = None


class ChatFieldsNotHonoured(BaseModel):
    """Chat: the refused fields, then the ignored ones (`IGNORED` says why each is)."""

    model_config = ConfigDict(extra="forbid")

    tools: refused([], why="tool calling is not supported yet") = None
    tool_choice: refused("none", why="tool calling is not supported yet") = None
    functions: refused([], why="function calling is not supported") = None
    function_call: refused("none", why="function calling is not supported") = None
    audio: refused(why="audio output is not supported") = None
    modalities: refused(["text"], why="only text output is supported") = None
    moderation: refused(why="not supported") = None
    reasoning_effort: refused("none", why="the served model does not reason on a budget") = None
    verbosity: refused("medium", why="not supported") = None
    web_search_options: refused(why="web search is not supported") = None
    store: refused(False, why="completions are not stored") = None

    metadata: dict[str, str] | None = Field(None, description="Ignored: nothing is stored.")
    prompt_cache_key: str | None = Field(None, description="Ignored: a cache hint.")
    prompt_cache_options: dict[str, Any] | None = Field(None, description="Ignored: a cache hint.")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(None, description="Ignored: a cache hint.")
    safety_identifier: str | None = Field(None, description="Ignored: `user` drives the A/B assignment.")
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = Field(
        None, description="Ignored: there is one tier.")
    prediction: dict[str, Any] | None = Field(None, description="Ignored: speculation drafts on its own.")
    parallel_tool_calls: bool | None = Field(None, description="Ignored: no tools are called.")
