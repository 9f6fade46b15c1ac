"""The request fields this server does not honour, and how it answers them: nothing is silently ignored.

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
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

UNSUPPORTED = "unsupported_parameter"
UNKNOWN = "unknown_parameter"

IGNORED = {  # field -> why ignoring it leaves the answer as OpenAI defines it
    "metadata": "tags a stored completion; nothing is stored (`store: true` is refused)",
    "prompt_cache_key": "a cache-routing hint; the prefix cache needs none",
    "prompt_cache_options": "cache breakpoints and lifetimes; they change latency, not tokens",
    "prompt_cache_retention": "a cache lifetime; it changes latency, not tokens",
    "messages[].content[].prompt_cache_breakpoint": "a cache breakpoint; it changes latency, not tokens",
    "safety_identifier": "an abuse-detection id for OpenAI; `user` is the one specserve uses (A/B stickiness)",
    "service_tier": "there is one tier; it changes latency and price, not tokens",
    "prediction": "Predicted Outputs promise the same tokens, only sooner; speculation drafts on its own",
    "parallel_tool_calls": "has no effect without tools (non-empty `tools` is refused)",
    "stream_options.include_obfuscation": "stream padding against side channels; chunks are sent unpadded",
}


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

    def declare(field_schema: dict[str, Any]) -> None:
        field_schema["anyOf"] = [{"type": "null"}, *({"const": n} for n in neutral)]

    return Annotated[Any, AfterValidator(check),
                     Field(description=f"Refused ({why}) unless {accepted}.", json_schema_extra=declare)]


def unsupported(why: str) -> PydanticCustomError:
    """The error of an honoured field's value this server cannot serve (e.g. `n` > 1)."""
    return PydanticCustomError(UNSUPPORTED, "{why}", {"why": why})
