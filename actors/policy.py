"""The policy: γ per round, running α and cost statistics, and the per-request ASD regret ledgers.

`PolicyCore` is the plain object; `LocalPolicy` is its async `PolicyBackend` view for in-process units, and
`actors.remote.policy` puts the same object behind one named Ray actor per app. All request-scoped state is
keyed by request id and dropped by `close_request`, which returns the ledger summary: nothing leaks between
requests.

One call per round: `settle` verifies the round's ASD rows against their ledgers, records every row's
acceptance and the round's measured costs, and returns the γ plan for the next round. ASD rows come one arm
and one rule per call: greedy rows (`verify_asd_scores`) or an arm's relaxed sampled rows
(`verify_asd_sampled_scores`); a unit whose round holds several makes one call per group.

Restart: a restarted policy actor has no ledgers. `settle` then raises `LedgersLost` before charging anything,
and the unit reopens each of its ASD requests with the budget and the regret it has already spent (the unit
knows both: every charge reaches it in a verdict), then settles again. α and cost statistics start over from
the priors.
"""

from __future__ import annotations

import logging

from actors.contracts import ASDBatch, LedgersLost, RoundReport, RowKey
from policies import Verdict
from policies.asd import RegretLedger, verify_asd_scores
from policies.asd_sampled import SampledScores, verify_asd_sampled_scores
from policies.gamma import GammaPolicy, best_gamma

log = logging.getLogger(__name__)


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

    # --- request lifecycle -------------------------------------------------------------------------------
    def open_request(self, request_id: str, budget: float | None, spent: float = 0.0) -> None:
        """Open a request; with a budget, its ledger. `spent` restores a ledger after a policy restart."""
        if request_id in self.ledgers:
            raise ValueError(f"request_id {request_id!r} already has an open ledger")
        if budget is not None:
            self.ledgers[request_id] = RegretLedger.restored(budget, spent, request_id=request_id)

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
            missing = [r for r in asd.request_ids if r not in self.ledgers]
            if missing:
                raise LedgersLost(missing)
            ledgers = [self.ledgers[r] for r in asd.request_ids]
            verify = verify_asd_sampled_scores if isinstance(asd.scores, SampledScores) else verify_asd_scores
            verdict = verify(asd.draft_ids, asd.scores, ledgers, asd.config, draft_lens=asd.draft_lens)
            for rid, k, n in zip(asd.request_ids, asd.draft_lens.tolist(), verdict.num_accepted.tolist()):
                self.gamma.observe(rid, asd.arm, k, n)
        if report is not None:
            drafts = report.drafts or (None,) * len(report.rows)
            for (key, gamma, accepted), draft in zip(report.rows, drafts):
                confidence, match_len = draft if draft and gamma else ((), 0)
                self.gamma.observe(key.request_id, key.arm, gamma, accepted, confidence, match_len)
            # a forward that also fed prompt chunks says nothing about the cost of scoring drafts
            scored = {} if report.prompt_tokens else {report.score_tokens: report.score_s}
            self.gamma.observe_costs(report.batch_size, report.draft_step_s or None, scored)
        plan = [self.seeded_gamma if r.seeded else self.gamma.choose(r.request_id, r.arm, batch_size)
                for r in plan_for]
        return verdict, plan


class LocalPolicy:
    """A `PolicyCore` in the unit's own process, behind the async `PolicyBackend` contract."""

    def __init__(self, core: PolicyCore):
        self.core = core

    async def open_request(self, request_id: str, budget: float | None, spent: float = 0.0) -> None:
        self.core.open_request(request_id, budget, spent)

    async def close_request(self, request_id: str) -> dict | None:
        return self.core.close_request(request_id)

    async def settle(self, asd, report, plan_for, batch_size):
        return self.core.settle(asd, report, plan_for, batch_size)

    async def open_ledgers(self) -> list[str]:
        return self.core.open_ledgers()
