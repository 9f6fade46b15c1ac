"""What a caller hands a unit and gets back: sampling parameters, the arm, streamed chunks, the result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from actors.sampling import SamplingSpec
from actors.stats import RequestRecord
from policies.asd import ASDConfig


STRUCTURED_KINDS = ("json_object", "json_schema")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar every output must follow: `kind` 'json_object' (any JSON object) or 'json_schema' (`schema`,
    a JSON Schema serialized as a JSON string)."""

    kind: str
    schema: str | None = None

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if (self.kind == "json_schema") != (self.schema is not None):
            raise ValueError("structured: a schema is given exactly when kind is 'json_schema'")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: each output token's logprob and the n most likely
    frequency_penalty: float = 0.0  # OpenAI's: z -= f * (count of the token in the output so far)
    presence_penalty: float = 0.0  # OpenAI's: z -= p * (1 if the token is in the output so far)
    repetition_penalty: float = 1.0  # vLLM's: z / r if z > 0 else z * r, for tokens in the prompt or output
    logit_bias: Mapping[int, float] | None = None  # token id -> bias added to its logit
    min_tokens: int = 0  # vLLM's: no EOS or stop token id before this many output tokens
    structured: StructuredOutput | None = None  # the grammar the output follows (response_format)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
                             f"got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.logit_bias is not None:
            if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
                raise ValueError("logit_bias keys must be token ids (integers >= 0)")
            if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")

    @property
    def penalised(self) -> bool:
        """Whether any rule changes the target's logits before verification (penalties, bias, min_tokens)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def spec(self) -> SamplingSpec:
        top_p = None if self.top_p >= 1.0 else self.top_p
        return SamplingSpec(self.temperature, self.top_k, top_p, self.seed)


MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (OpenAI's limit)
# repetition_penalty: a logit divided by 1e-300 overflows to inf; past these bounds a penalty bans or forces anyway
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
SAMPLED_RULES = ("exact", "relaxed")


@dataclass(frozen=True)
class ArmSpec:
    """A verification setting traffic is routed to. On an ASD arm, greedy requests are verified by ASD
    (`policies.asd`); sampled ones (temperature > 0) by the arm's `sampled` rule: "exact" speculative sampling
    (the default), or "relaxed", the approximate rule of `policies.asd_sampled` with the same `ASDConfig`."""

    name: str
    verification: str = "exact"  # "exact" | "asd"
    asd: ASDConfig | None = None
    sampled: str = "exact"  # "exact" | "relaxed": how an ASD arm verifies sampled requests

    def __post_init__(self):
        if self.verification not in ("exact", "asd"):
            raise ValueError(f"verification must be 'exact' or 'asd', got {self.verification!r}")
        if self.verification == "asd" and self.asd is None:
            raise ValueError(f"arm {self.name!r}: verification 'asd' needs an asd config")
        if self.sampled not in SAMPLED_RULES:
            raise ValueError(f"sampled must be one of {SAMPLED_RULES}, got {self.sampled!r}")
        if self.sampled == "relaxed" and self.verification != "asd":
            raise ValueError(f"arm {self.name!r}: sampled 'relaxed' needs verification 'asd'")


EXACT = ArmSpec("exact")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    arm: ArmSpec = EXACT
    speculate: bool = True  # False: target-only decoding (γ = 0 every round)


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the target, and the `SamplingParams.logprobs` most likely
    tokens at its position (most likely first). The distribution is the raw one: log_softmax of the target's
    logits before penalties, bias, temperature, top-k and top-p (vLLM's default `logprobs_mode`)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationChunk:
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" on the last chunk
    record: RequestRecord | None = None  # on the last chunk
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids when the request asked for them


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    record: RequestRecord | None
    logprobs: list[TokenLogprob] | None = None


async def collect(chunks) -> GenerationResult:
    """A whole result from a request's stream of `GenerationChunk`s (the last carries the reason and record)."""
    tokens, logprobs, last = [], None, None
    async for chunk in chunks:
        tokens.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            logprobs = (logprobs or []) + list(chunk.logprobs)
        last = chunk
    return GenerationResult(tokens, last.finish_reason, last.record, logprobs)
