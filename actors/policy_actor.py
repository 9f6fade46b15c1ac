"""The policy actor: γ per round, running α and cost statistics, and the per-request ASD regret ledgers.

`PolicyCore` is the plain object (in-process units and tests use it directly); `PolicyActor` is the same
object behind a Ray actor, one named detached actor per app. All request-scoped state is keyed by request id
and dropped by `close_request`, which returns the ledger summary: nothing leaks between requests.

One call per round: `settle` verifies the round's ASD rows against their ledgers, records every row's
acceptance and the round's measured costs, and returns the γ plan for the next round. Exact-only rounds
don't wait for it; the coordinator picks the plan up at the start of the next round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from policies import Verdict
from policies.asd import ASDConfig, RegretLedger, verify_asd_scores
from policies.gamma import GammaPolicy, best_gamma
from policies.scores import TargetScores

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowKey:
    request_id: str
    arm: str
    seeded: bool = False  # seeded sampled requests plan from their own history only, to reproduce


@dataclass(frozen=True)
class RoundReport:
    """What a unit measured in one round, for the α and cost estimates."""

    rows: tuple[tuple[RowKey, int, int], ...]  # (row, gamma drafted, accepted)
    batch_size: int
    draft_step_s: float  # drafter time per drafted position (0 when nothing was drafted)
    score_s: float  # target forward time for the round
    score_tokens: int  # tokens fed per row (max over rows: the padded width of the forward)


@dataclass(frozen=True)
class ASDBatch:
    """The ASD rows of one round, in compact form."""

    request_ids: tuple[str, ...]
    draft_ids: torch.Tensor  # [A, K] long, PAD beyond draft_lens
    draft_lens: torch.Tensor  # [A] long
    scores: TargetScores  # [A, ...] compact target scores
    config: ASDConfig
    arm: str


class PolicyCore:
    """Owns a `GammaPolicy` and the open ledgers. Pure bookkeeping; no model, no Ray."""

    def __init__(self, *, gamma_max: int = 8, gamma_min: int = 0, prior_alpha: float = 0.6,
                 draft_cost: float = 0.05, fixed_gamma: int | None = None):
        self.gamma = GammaPolicy(
            gamma_max=gamma_max, gamma_min=gamma_min, prior_alpha=prior_alpha, draft_cost=draft_cost,
            fixed_gamma=fixed_gamma,
        )
        # Seeded sampled requests must reproduce whatever else runs: their γ may not depend on shared,
        # load-dependent statistics, so they use the γ the prior alone implies.
        self.seeded_gamma = fixed_gamma if fixed_gamma is not None else max(
            gamma_min, best_gamma(prior_alpha, draft_cost, gamma_max))
        self.ledgers: dict[str, RegretLedger] = {}
        self.budgets: dict[str, float] = {}

    # --- request lifecycle -------------------------------------------------------------------------------
    def open_request(self, request_id: str, budget: float | None) -> None:
        if request_id in self.ledgers:
            raise ValueError(f"request_id {request_id!r} already has an open ledger")
        if budget is not None:
            self.ledgers[request_id] = RegretLedger(budget, request_id=request_id)

    def close_request(self, request_id: str) -> dict | None:
        """Drop all state of the request; return its ledger summary (None for exact requests)."""
        self.gamma.forget(request_id)
        ledger = self.ledgers.pop(request_id, None)
        return None if ledger is None else ledger.summary()

    def open_ledgers(self) -> list[str]:
        return list(self.ledgers)

    # --- one round ---------------------------------------------------------------------------------------
    def settle(self, asd: ASDBatch | None, report: RoundReport | None,
               plan_for: list[RowKey], batch_size: int) -> tuple[Verdict | None, list[int]]:
        """Verify ASD rows (charging ledgers), learn from the report, and plan γ for `plan_for`."""
        verdict = None
        if asd is not None:
            ledgers = [self.ledgers[r] for r in asd.request_ids]
            verdict = verify_asd_scores(asd.draft_ids, asd.scores, ledgers, asd.config, draft_lens=asd.draft_lens)
            for rid, k, n in zip(asd.request_ids, asd.draft_lens.tolist(), verdict.num_accepted.tolist()):
                self.gamma.observe(rid, asd.arm, k, n)
        if report is not None:
            self.observe(report)
        return verdict, self.plan(plan_for, batch_size)

    def observe(self, report: RoundReport) -> None:
        for key, gamma, accepted in report.rows:
            self.gamma.observe(key.request_id, key.arm, gamma, accepted)
        self.gamma.observe_costs(report.batch_size, report.draft_step_s or None, {report.score_tokens: report.score_s})

    def plan(self, rows: list[RowKey], batch_size: int) -> list[int]:
        return [self.seeded_gamma if r.seeded else self.gamma.choose(r.request_id, r.arm, batch_size) for r in rows]

    def snapshot(self) -> dict:
        return {"open_ledgers": len(self.ledgers), "gamma": self.gamma.summary()}


def get_or_create_policy_actor(name: str, **policy_kwargs):
    """The app's policy actor (named, detached), created on first use by whichever unit starts first."""
    import ray

    actor_cls = ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1)(PolicyCore)
    return actor_cls.options(name=name, get_if_exists=True, lifetime="detached", namespace="specserve").remote(
        **policy_kwargs
    )
