"""Records the speculative loop hands to observers (telemetry, benchmarks).

The coordinator never imports cluster/: it calls an injected `LoopObserver` with these records, and
cluster.telemetry implements the observer. Times are seconds from the injected clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from actors.timing import END_DEFERRED


@dataclass(frozen=True)
class RoundRecord:
    """One batched round of a unit: every active sequence drafted, scored and verified once."""

    unit: str
    batch_size: int
    started_s: float  # wall clock (time.time()) at round start, for trace spans
    draft_s: float  # drafter call, wall time
    score_s: float  # target forward (all shards), wall time
    verify_s: float  # verification incl. the ASD ledger charge
    total_s: float  # whole round; orchestration = total - draft - score - verify
    rows: tuple["RowRecord", ...] = ()
    forward_s: float = 0.0  # the model forward inside the target; score_s - forward_s is the call around it

    @property
    def orchestration_s(self) -> float:
        return max(0.0, self.total_s - self.draft_s - self.score_s - self.verify_s)


@dataclass(frozen=True)
class RowRecord:
    """One sequence's part of a round."""

    request_id: str
    arm: str
    gamma: int  # tokens drafted this round (0 = plain decoding)
    accepted: int  # draft tokens kept
    relaxed: int = 0  # kept mismatches (ASD)
    regret: float = 0.0  # regret charged this round (ASD)


@dataclass(frozen=True)
class RequestRecord:
    """A finished request, as reported in `usage.speculative`.

    `verification` is the verification that ran for the request; `arm_verification` its arm's own (the same
    unless an ASD arm fell back to exact verification, and then `asd_fallback` says why: "sampled", a sampled
    request on an arm whose `sampled` rule is "exact"). `sampled`: temperature > 0.
    """

    request_id: str
    arm: str
    unit: str
    prompt_tokens: int
    output_tokens: int
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    gammas: tuple[int, ...]
    started_s: float
    first_token_s: float | None
    finished_s: float
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    degraded: bool = False  # drafter was unavailable for part of the request
    verification: str = "exact"  # "exact" | "asd": what ran
    regret_spent: float | None = None
    regret_budget: float | None = None
    relaxed_tokens: int | None = None
    ledger_exhausted: bool = False
    accepted_per_position: tuple[int, ...] = field(default=())  # [k] = rounds that kept position k
    arm_verification: str = ""  # "exact" | "asd": the arm's own; "" means the same as `verification`
    asd_fallback: str | None = None  # "sampled": why an ASD arm verified this request exactly
    sampled: bool = False  # temperature > 0
    timing_s: Mapping[str, float | None] = field(default_factory=dict)  # hops measured so far (actors.timing)

    def __post_init__(self):
        if not self.arm_verification:
            object.__setattr__(self, "arm_verification", self.verification)

    def speculative_usage(self) -> dict:
        """The `usage.speculative` object of the HTTP API (keys are a public contract)."""
        gammas = self.gammas or (0,)
        out = {
            "arm": self.arm,
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "mean_accepted_length": self.accepted_tokens / self.rounds if self.rounds else 0.0,
            "gamma_min": min(gammas),
            "gamma_mean": sum(gammas) / len(gammas),
            "gamma_max": max(gammas),
            "degraded": self.degraded,
            "verification": self.verification,
            "timing_s": {k: v for k, v in self.timing_s.items() if k != END_DEFERRED},
        }
        if self.asd_fallback is not None:
            out["asd_fallback"] = self.asd_fallback
        if self.arm_verification == "asd":
            out["regret_spent"] = self.regret_spent or 0.0
            out["regret_budget"] = self.regret_budget
            out["relaxed_tokens"] = self.relaxed_tokens or 0
        return out


class LoopObserver(Protocol):
    def on_round(self, record: RoundRecord) -> None: ...

    def on_request(self, record: RequestRecord) -> None: ...


class NullObserver:
    def on_round(self, record: RoundRecord) -> None:
        pass

    def on_request(self, record: RequestRecord) -> None:
        pass
