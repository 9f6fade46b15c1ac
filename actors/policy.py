"""The γ policy and the regret ledgers: a unit's local policy (`UnitPolicy`) and the app's authority
(`PolicyCore`).

A unit chooses γ and verifies ASD rows from its `UnitPolicy`, with no call on the step. The unit reports what it
observed (acceptance by arm, step and draft costs) and the state of its ledgers in batches (`flush`: at most one
report in flight) to the authority, which merges every unit's observations into the arm statistics and keeps a
mirror of every open ledger. Its reply, a `PolicySnapshot`, carries the merged statistics, which the unit adopts
(plus what it observed since): a new unit starts from what the app has learned.

Ledgers: a request runs on one unit, which holds its whole budget as a lease, charges it where verification
runs and reports the absolute spend, so a ledger cannot be overspent and a restarted authority is rebuilt from
the next reports (a new `epoch` asks every unit for all of its open ledgers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from actors.contracts import ASDBatch, RoundReport, RowKey
from policies import Verdict
from policies.asd import RegretLedger, verify_asd_scores
from policies.asd_sampled import SampledScores, verify_asd_sampled_scores
from policies.gamma import ArmStatistics, GammaPolicy, best_gamma

log = logging.getLogger(__name__)

CLOSED_KEPT = 1024  # closed ledgers the authority remembers
SYNC_TIMEOUT_S = 10.0  # `UnitPolicy.synced` / `flush(wait=True)`: how long to wait for the authority


def gamma_policy(*, gamma_max: int = 8, gamma_min: int = 0, prior_alpha: float = 0.6, draft_cost: float = 0.05,
                 fixed_gamma: int | None = None, batch_plan: bool = True, draft_floor: bool = False) -> GammaPolicy:
    """The `GammaPolicy` of the policy settings every unit and the authority share (`draft_floor`: the unit's
    drafter runs every round, as vLLM's own proposers do)."""
    return GammaPolicy(gamma_max=gamma_max, gamma_min=gamma_min, prior_alpha=prior_alpha, draft_cost=draft_cost,
                       fixed_gamma=fixed_gamma, batch_plan=batch_plan, draft_floor=draft_floor)


@dataclass(frozen=True)
class LedgerState:
    """A ledger as its unit last reported it."""

    request_id: str
    unit: str
    arm: str
    budget: float
    spent: float
    relaxed_tokens: int
    blocks: int


@dataclass(frozen=True)
class UnitReport:
    """What a unit observed since its last report, and its ledgers that changed."""

    unit: str
    rows: tuple[tuple[str, int, int, tuple[float, ...], int], ...] = ()  # (arm, γ, accepted, confidence, match_len)
    costs: tuple[tuple[int, float | None, tuple[tuple[int, float], ...]], ...] = ()  # (batch, draft s, ((n, s),))
    ledgers: tuple[LedgerState, ...] = ()  # open ledgers, as they are now
    closed: tuple[LedgerState, ...] = ()  # ledgers closed since the last report, as they ended

    def __bool__(self) -> bool:
        return bool(self.rows or self.costs or self.ledgers or self.closed)


@dataclass(frozen=True)
class PolicySnapshot:
    epoch: str  # the authority's incarnation
    stats: ArmStatistics


class PolicyCore:
    """The app's authority: merged arm statistics and the mirror of every open ledger. No model, no Ray."""

    def __init__(self, **settings: Any):
        self.settings = dict(settings)
        self.gamma = gamma_policy(**settings)
        self.epoch = uuid.uuid4().hex
        self.ledgers: dict[str, LedgerState] = {}
        self.closed: dict[str, LedgerState] = {}  # the last CLOSED_KEPT ledgers closed, as they ended (audits)
        self.reports, self.rows, self.busy_s = 0, 0, 0.0  # merged so far, and the time spent merging

    def report(self, report: UnitReport) -> PolicySnapshot:
        """Merge one unit's report; the merged statistics come back."""
        start = time.perf_counter()
        for arm, gamma, accepted, confidence, match_len in report.rows:
            self.gamma.observe_arm(arm, gamma, accepted, confidence, match_len)
        for batch_size, draft_step_s, scored in report.costs:
            self.gamma.observe_costs(batch_size, draft_step_s, dict(scored))
        for state in report.ledgers:
            if state.spent > state.budget + 1e-6:
                log.error("ledger %s reported over budget: %s", state.request_id, state)
            self.ledgers[state.request_id] = state
        for state in report.closed:
            self.ledgers.pop(state.request_id, None)
            self.closed[state.request_id] = state
            while len(self.closed) > CLOSED_KEPT:
                self.closed.pop(next(iter(self.closed)))
        self.reports += 1
        self.rows += len(report.rows)
        self.busy_s += time.perf_counter() - start
        return self.snapshot()

    def snapshot(self) -> PolicySnapshot:
        return PolicySnapshot(self.epoch, self.gamma.arm_statistics())

    def open_ledgers(self) -> list[str]:
        return sorted(self.ledgers)

    def forget(self, request_id: str) -> None:
        """Drop the mirror of a ledger whose unit died (it will report no close)."""
        self.ledgers.pop(request_id, None)

    def ledger(self, request_id: str) -> LedgerState | None:
        """An open ledger as last reported, else a recently closed one as it ended; None if unknown."""
        return self.ledgers.get(request_id) or self.closed.get(request_id)

    def summary(self) -> dict:
        return {"epoch": self.epoch, "reports": self.reports, "rows": self.rows, "busy_s": self.busy_s,
                "open_ledgers": len(self.ledgers),
                "gamma": self.gamma.summary()}


class PolicyLink(Protocol):
    """How a unit's reports reach the authority."""

    def submit(self, report: UnitReport) -> concurrent.futures.Future: ...

    def reconnect(self) -> None: ...


class InProcessLink:
    """The authority in the unit's own process (CLI, tests, benchmarks): reports are merged at once."""

    def __init__(self, core: PolicyCore):
        self.core = core

    def submit(self, report: UnitReport) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(self.core.report(report))
        return done

    def reconnect(self) -> None:
        pass


class UnitPolicy:
    """One unit's γ choices, ASD verification and ledger leases, reported to the authority through `link`."""

    def __init__(self, link: PolicyLink, *, unit: str = "local", **settings: Any):
        self.link, self.unit, self.settings = link, unit, dict(settings)
        self.gamma = gamma_policy(**settings)
        fixed, prior = settings.get("fixed_gamma"), self.gamma.prior_alpha
        # Seeded sampled requests must reproduce whatever else runs: their γ may not depend on shared,
        # load-dependent statistics, so they use the γ the prior alone implies.
        self.seeded_gamma = fixed if fixed is not None else max(
            self.gamma.gamma_min, best_gamma(prior, self.gamma.costs.default_draft_cost, self.gamma.gamma_max))
        self.ledgers: dict[str, tuple[str, RegretLedger]] = {}  # request id -> (arm, the lease)
        self._dirty: set[str] = set()
        self._closed: list[LedgerState] = []
        self._rows: list[tuple[str, int, int, tuple[float, ...], int]] = []
        self._costs: list[tuple[int, float | None, tuple[tuple[int, float], ...]]] = []
        self._epoch: str | None = None
        self._pending: tuple[concurrent.futures.Future, UnitReport] | None = None
        self._send(UnitReport(unit))  # the app's statistics so far, before the first request

    # --- requests ----------------------------------------------------------------------------------------
    def open_request(self, request_id: str, arm: str, budget: float | None) -> RegretLedger | None:
        """Start a request; with a budget, its ledger (the unit's lease of the whole budget)."""
        if request_id in self.ledgers:
            raise ValueError(f"request_id {request_id!r} already has an open ledger")
        if budget is None:
            return None
        ledger = RegretLedger(budget, request_id=request_id)
        self.ledgers[request_id] = (arm, ledger)
        self._dirty.add(request_id)
        return ledger

    def close_request(self, request_id: str) -> dict | None:
        """Drop the request's state; its ledger summary (None for exact requests). The close is reported."""
        self.gamma.forget(request_id)
        entry = self.ledgers.pop(request_id, None)
        if entry is None:
            return None
        self._dirty.discard(request_id)
        self._closed.append(self._state(request_id, entry))
        return entry[1].summary()

    def open_ledgers(self) -> list[str]:
        return sorted(self.ledgers)

    # --- γ -----------------------------------------------------------------------------------------------
    def choose(self, request_id: str, arm: str, batch_size: int, *, seeded: bool = False) -> int:
        return self.seeded_gamma if seeded else self.gamma.choose(request_id, arm, batch_size)

    def plan(self, keys: list[RowKey], batch_size: int) -> list[int]:
        """γ of each row of the native engine's next round (padded: every row is scored at the widest)."""
        gammas = [self.choose(k.request_id, k.arm, batch_size, seeded=k.seeded) for k in keys]
        return self.plan_step([(k.request_id, k.arm, g, k.seeded) for k, g in zip(keys, gammas)], batch_size,
                              ragged=False)

    def plan_step(self, rows: list[tuple[str, str, int, bool]], batch_size: int, *, ragged: bool = True,
                  drafted: bool = False) -> list[int]:
        return self.gamma.plan_step(rows, batch_size, ragged=ragged, drafted=drafted)

    def observe(self, request_id: str, arm: str, gamma: int, accepted: int, confidence: tuple[float, ...] = (),
                match_len: int = 0) -> None:
        self.gamma.observe(request_id, arm, gamma, accepted, confidence, match_len)
        if gamma:
            self._rows.append((arm, gamma, accepted, tuple(confidence), match_len))

    def observe_costs(self, batch_size: int, draft_step_s: float | None, scored: dict[int, float]) -> None:
        self.gamma.observe_costs(batch_size, draft_step_s, scored)
        self._costs.append((batch_size, draft_step_s, tuple(scored.items())))

    def observe_round(self, report: RoundReport) -> None:
        """A native round's acceptance (its exact rows; ASD rows are observed by `verify_asd`) and costs."""
        drafts = report.drafts or (None,) * len(report.rows)
        for (key, gamma, accepted), draft in zip(report.rows, drafts):
            confidence, match_len = draft if draft and gamma else ((), 0)
            self.observe(key.request_id, key.arm, gamma, accepted, confidence, match_len)
        # a forward that also fed prompt chunks says nothing about the cost of scoring drafts
        scored = {} if report.prompt_tokens else {report.score_tokens: report.score_s}
        self.observe_costs(report.batch_size, report.draft_step_s or None, scored)

    # --- ASD ---------------------------------------------------------------------------------------------
    def verify_asd(self, asd: ASDBatch) -> Verdict:
        """Verify one arm's ASD rows against their leases (charging them) and learn their acceptance."""
        ledgers = [self.ledgers[rid][1] for rid in asd.request_ids]
        verify = verify_asd_sampled_scores if isinstance(asd.scores, SampledScores) else verify_asd_scores
        verdict = verify(asd.draft_ids, asd.scores, ledgers, asd.config, draft_lens=asd.draft_lens)
        for rid, k, n in zip(asd.request_ids, asd.draft_lens.tolist(), verdict.num_accepted.tolist()):
            self.observe(rid, asd.arm, k, n)
        self.charged(asd.request_ids)
        return verdict

    def charged(self, request_ids) -> None:
        """These requests' leases were charged: their state goes with the next report."""
        self._dirty.update(request_ids)

    # --- reports -----------------------------------------------------------------------------------------
    def flush(self, *, wait: bool = False) -> None:
        """Send what was observed since the last report, unless one is still in flight (then it goes with the
        next flush). `wait`: block until this is merged (off the step path: a unit going idle)."""
        if self._pending is not None:
            if wait:
                concurrent.futures.wait([self._pending[0]], timeout=SYNC_TIMEOUT_S)
            if not self._pending[0].done():
                return
            self._receive()
        self._send(self._take())
        if wait and self._pending is not None:
            concurrent.futures.wait([self._pending[0]], timeout=SYNC_TIMEOUT_S)
            if self._pending[0].done():
                self._receive()

    async def synced(self) -> None:
        """Everything observed so far has been merged by the authority (a unit going idle; tests)."""
        for _ in range(2):  # the report in flight, then what came after it
            if self._pending is not None:
                await asyncio.to_thread(concurrent.futures.wait, [self._pending[0]], SYNC_TIMEOUT_S)
            self.flush()
        if self._pending is not None:
            await asyncio.to_thread(concurrent.futures.wait, [self._pending[0]], SYNC_TIMEOUT_S)
            if self._pending[0].done():
                self._receive()

    def _take(self) -> UnitReport:
        ledgers = tuple(self._state(rid) for rid in sorted(self._dirty) if rid in self.ledgers)
        report = UnitReport(self.unit, tuple(self._rows), tuple(self._costs), ledgers, tuple(self._closed))
        self._rows, self._costs, self._dirty, self._closed = [], [], set(), []
        return report

    def _state(self, request_id: str, entry: tuple[str, RegretLedger] | None = None) -> LedgerState:
        arm, ledger = entry or self.ledgers[request_id]
        return LedgerState(request_id, self.unit, arm, ledger.budget, ledger.spent, len(ledger.events),
                           ledger.blocks)

    def _send(self, report: UnitReport) -> None:
        if not report and self._epoch is not None:
            return
        try:
            self._pending = (self.link.submit(report), report)
        except Exception as err:  # noqa: BLE001 - the authority is unreachable: keep the report for later
            log.warning("unit %s: policy report not sent (%s)", self.unit, err)
            self._requeue(report)
            self.link.reconnect()
            return
        if self._pending[0].done():
            self._receive()

    def _receive(self) -> None:
        future, report = self._pending
        self._pending = None
        try:
            snapshot: PolicySnapshot = future.result()
        except Exception as err:  # noqa: BLE001 - the authority died or restarts: send it all again later
            log.warning("unit %s: policy report lost (%s); resending its ledgers", self.unit, err)
            self._requeue(report)
            self.link.reconnect()
            return
        if snapshot.epoch != self._epoch:  # a new authority: it needs every open ledger
            self._dirty.update(self.ledgers)
            self._epoch = snapshot.epoch
        self.gamma.adopt(snapshot.stats)
        for row in self._rows:  # observed since the report left: not in the snapshot yet
            self.gamma.observe_arm(*row)
        for batch_size, draft_step_s, scored in self._costs:
            self.gamma.costs.observe(batch_size, draft_step_s, dict(scored))

    def _requeue(self, report: UnitReport) -> None:
        self._dirty.update(s.request_id for s in report.ledgers)
        self._closed.extend(report.closed)


class LocalPolicy(UnitPolicy):
    """A unit's policy whose authority is a `PolicyCore` in the same process."""

    def __init__(self, core: PolicyCore, unit: str = "local"):
        super().__init__(InProcessLink(core), unit=unit, **core.settings)
        self.core = core
