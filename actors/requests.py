"""What a caller hands a unit and gets back: sampling parameters, the arm, streamed chunks, the result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from actors.sampling import SamplingSpec
from actors.stats import RequestRecord
from policies.asd import ASDConfig


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")

    def spec(self) -> SamplingSpec:
        top_p = None if self.top_p >= 1.0 else self.top_p
        return SamplingSpec(self.temperature, self.top_k, top_p, self.seed)


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
class GenerationChunk:
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" on the last chunk
    record: RequestRecord | None = None  # on the last chunk
    error: str | None = None


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    record: RequestRecord | None


async def collect(chunks) -> GenerationResult:
    """A whole result from a request's stream of `GenerationChunk`s (the last carries the reason and record)."""
    tokens, last = [], None
    async for chunk in chunks:
        tokens.extend(chunk.token_ids)
        last = chunk
    return GenerationResult(tokens, last.finish_reason, last.record)
