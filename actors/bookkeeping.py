"""One request's bookkeeping, the same on every engine: the rule that picks its verification, the γ clamp,
the accounting of its rounds, its degradation and the `RequestRecord` that becomes `usage.speculative`.

The native coordinator keeps a `RequestBook` per sequence; vLLM's worker keeps one per request and hands it to
the unit when the request ends. Neither engine keeps its own copy of these rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from actors.requests import ArmSpec, GenerationRequest, SamplingParams
from actors.timing import ROUND_PARTS
from actors.stats import RequestRecord
from policies.ledger import RegretLedger


def verification_for(arm: ArmSpec, params: SamplingParams) -> tuple[str, str | None]:
    """The verification that runs for a request, and why an ASD arm fell back to exact (else None).

    An ASD arm verifies greedy requests by ASD, and sampled ones by its `sampled` rule: "relaxed" is ASD's
    sampled rule, "exact" is exact speculative sampling (fallback reason "sampled")."""
    if arm.verification != "asd":
        return "exact", None
    if params.temperature == 0.0 or arm.sampled == "relaxed":
        return "asd", None
    return "exact", "sampled"


def draft_limit(params: SamplingParams, *, output_len: int, context_len: int, max_seq_len: int) -> int:
    """The γ clamp: most drafts a round may take, so that drafts + 1 emitted tokens fit both what is left of
    max_tokens and the context room."""
    left = params.max_tokens - output_len
    room = max_seq_len - context_len
    return max(0, min(left - 1, room - 1))


@dataclass
class RequestBook:
    """What specserve accounts for one request, on either engine.

    `ledger` is the request's regret ledger when ASD verifies it: the unit's lease of the whole budget, charged
    where verification runs and mirrored by the policy actor (`actors.policy`)."""

    request: GenerationRequest
    started_s: float
    first_token_s: float | None = None
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    gammas: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    degraded: bool = False  # a draft was wanted while the drafter was down
    resumes: int = 0  # times the request was resumed on a rebuilt engine
    ledger: RegretLedger | None = None
    ledger_summary: dict | None = None  # the ledger's summary, where the ledger itself stayed in another process
    # the hops of `actors.timing` the native loop measures: perf_counter marks, and the rounds' parts summed
    enqueued_t: float | None = None
    admitted_t: float | None = None
    prefilled_t: float | None = None  # the prompt is cached and its first token sampled
    last_token_t: float | None = None
    round_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # plan, draft, score, verify

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def greedy(self) -> bool:
        return self.request.params.temperature == 0.0

    @property
    def verification(self) -> str:
        return verification_for(self.request.arm, self.request.params)[0]

    @property
    def asd(self) -> bool:
        """ASD verifies this request (the verification that runs, not only the arm's)."""
        return self.verification == "asd"

    @property
    def asd_fallback(self) -> str | None:
        return verification_for(self.request.arm, self.request.params)[1]

    @property
    def budget(self) -> float | None:
        """The ledger's budget when ASD verifies this request, else None."""
        return self.request.arm.asd.budget if self.asd else None

    @property
    def seeded(self) -> bool:
        """A seeded sampled request: its γ may not depend on shared statistics, so that it reproduces."""
        params = self.request.params
        return params.seed is not None and params.temperature > 0

    def draft_limit(self, *, output_len: int, context_len: int, max_seq_len: int) -> int:
        if not self.request.speculate:
            return 0
        return draft_limit(self.request.params, output_len=output_len, context_len=context_len,
                           max_seq_len=max_seq_len)

    def account(self, drafted: int, accepted: int) -> None:
        """One round: `drafted` tokens verified (0 = plain), `accepted` of them kept."""
        self.rounds += 1
        self.gammas.append(drafted)
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.accepted_per_position.extend([0] * (accepted - len(self.accepted_per_position)))
        for k in range(accepted):
            self.accepted_per_position[k] += 1

    def add_round(self, plan_s: float, draft_s: float, score_s: float, verify_s: float) -> None:
        """One round this request was a row of, by part (`actors.timing.ROUND_PARTS`)."""
        parts = self.round_s
        parts[0] += plan_s
        parts[1] += draft_s
        parts[2] += score_s
        parts[3] += verify_s

    def timing(self, now: float) -> dict[str, float | None]:
        """The unit's hops (`actors.timing`) when its final message leaves at `now` (perf_counter)."""
        enqueued = self.enqueued_t if self.enqueued_t is not None else now
        admitted = self.admitted_t if self.admitted_t is not None else now
        out: dict[str, float | None] = {"queue": admitted - enqueued}
        if self.admitted_t is not None:
            out["prefill"] = (self.prefilled_t if self.prefilled_t is not None else now) - admitted
        if self.prefilled_t is not None:
            out.update(zip(ROUND_PARTS, self.round_s))
            last = self.last_token_t if self.last_token_t is not None else self.prefilled_t
            out["decode"] = max(0.0, last - self.prefilled_t - sum(self.round_s))
            out["end"] = now - last
        return out

    def export(self) -> dict:
        """The accounting in plain values (it crosses vLLM's process boundary); `restore` reads it back."""
        return {"rounds": self.rounds, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "gammas": list(self.gammas), "accepted_per_position": list(self.accepted_per_position),
                "degraded": self.degraded, "ledger": self.ledger.summary() if self.ledger is not None else None}

    @classmethod
    def restore(cls, request: GenerationRequest, exported: dict, *, started_s: float,
                first_token_s: float | None) -> RequestBook:
        """The book of `request` from another process's `export` ({} for a request that never ran a step)."""
        return cls(request, started_s, first_token_s, rounds=exported.get("rounds", 0),
                   draft_tokens=exported.get("draft_tokens", 0), accepted_tokens=exported.get("accepted_tokens", 0),
                   gammas=list(exported.get("gammas", ())),
                   accepted_per_position=list(exported.get("accepted_per_position", ())),
                   degraded=exported.get("degraded", False), ledger_summary=exported.get("ledger"))

    def record(self, *, unit: str, finish_reason: str, output_tokens: int, finished_s: float,
               timing_s: Mapping[str, float | None] | None = None) -> RequestRecord:
        """The finished request's record (the same keys and meanings on both engines); `timing_s`: the hops the
        engine measured (`actors.timing`)."""
        req, arm = self.request, self.request.arm
        summary = self.ledger.summary() if self.ledger is not None else self.ledger_summary
        on_asd_arm = arm.verification == "asd"
        return RequestRecord(
            request_id=self.rid, arm=arm.name, unit=unit, prompt_tokens=len(req.prompt_ids),
            output_tokens=output_tokens, rounds=self.rounds, draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens, gammas=tuple(self.gammas), started_s=self.started_s,
            first_token_s=self.first_token_s, finished_s=finished_s, finish_reason=finish_reason,
            degraded=self.degraded, verification=self.verification, arm_verification=arm.verification,
            asd_fallback=self.asd_fallback, sampled=not self.greedy,
            regret_spent=summary["spent"] if summary else (0.0 if self.asd else None),
            regret_budget=arm.asd.budget if arm.asd is not None else None,
            relaxed_tokens=(summary["relaxed_tokens"] if summary else 0) if on_asd_arm else None,
            ledger_exhausted=bool(summary and summary["exhausted"]),
            accepted_per_position=tuple(self.accepted_per_position), timing_s=dict(timing_s or {}),
        )
