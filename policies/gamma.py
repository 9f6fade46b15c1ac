"""Choosing γ, the number of draft tokens per round: the speedup model and the adaptive `GammaPolicy`.

`best_gamma` maximises S(γ) = E(γ) / (γ·c + v(γ)), with α, c and v(γ) as defined in docs/architecture.md,
"Terms"; γ = 0 is plain decoding, S = 1.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from policies.batch_plan import plan_drafts
from policies.confidence import ConfidenceAcceptance
from policies.estimators import Acceptance, CostModel

_TIE = 1e-9  # speculation must beat plain decoding (S = 1) by more than rounding: α = c is a tie, not a win


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(γ) = 1 + α + … + α^γ, the expected tokens one round emits (accepted + the recovered/bonus token)."""
    _check_alpha(alpha)
    _check_gamma("gamma", gamma)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float, verify_cost: Sequence[float] | None = None) -> float:
    """S(γ) = E(γ) / (γ·c + v(γ)); `verify_cost[γ]` is v(γ), None means v ≡ 1. γ = 0 gives 1."""
    _check_gamma("gamma", gamma)
    if not (math.isfinite(c) and c >= 0):
        raise ValueError(f"c must be finite and ≥ 0, got {c}")
    if gamma == 0:
        _check_alpha(alpha)
        return 1.0
    v = 1.0 if verify_cost is None else _check_verify_cost(verify_cost, gamma)[gamma]
    return expected_tokens(alpha, gamma) / (gamma * c + v)


def best_gamma(alpha: float, c: float, gamma_max: int, verify_cost: Sequence[float] | None = None) -> int:
    """The smallest γ in 0..gamma_max maximising S(γ); 0 (speculation off) unless some γ ≥ 1 beats 1."""
    _check_gamma("gamma_max", gamma_max)
    if verify_cost is not None:
        _check_verify_cost(verify_cost, gamma_max)
    best, best_speedup = 0, 1.0 + _TIE
    for gamma in range(1, gamma_max + 1):
        speedup = expected_speedup(alpha, gamma, c, verify_cost)
        if speedup > best_speedup:
            best, best_speedup = gamma, speedup
    return best


def explore_gamma(block: int, gamma_max: int, c: float, verify_cost: Sequence[float]) -> int:
    """γ after a fully accepted block of `block` tokens: 2·block when that pays if the run goes on half as far
    again (block/2 more tokens expected for the extra drafting and scoring), else `block`; never past the γ
    that pays best at α = 1, since no acceptance makes a longer block pay.

    Acceptance in copy-heavy text comes in runs (a verbatim stretch is accepted until it ends), which a
    geometric α learns only after many rounds; doubling reaches γ_max = 16 from γ = 2 in three rounds. One
    accepted token is no run: a block of 1 stays 1.
    Compared per unit of cost with the block just accepted, d = 2·block (at most γ_max):
    (block + 1 + (d − block)/2) / (d·c + v(d)) against (block + 1) / (block·c + v(block)).
    """
    ceiling = best_gamma(1.0, c, gamma_max, verify_cost)
    doubled = min(2 * block, gamma_max)
    if block < 2 or doubled <= block:
        return min(block, gamma_max, ceiling)
    stay = (block + 1) / (block * c + verify_cost[block])
    grow = (block + 1 + (doubled - block) / 2) / (doubled * c + verify_cost[doubled])
    return min(doubled if grow > stay else block, ceiling)


@dataclass
class ArmStatistics:
    """The statistics of a `GammaPolicy` that belong to arms, not requests: what units share."""

    arms: dict[str, Acceptance]
    confidence: dict[str, ConfidenceAcceptance]
    costs: CostModel


@dataclass
class _RequestState:
    acceptance: Acceptance = field(default_factory=Acceptance)
    plain_streak: int = 0  # consecutive observed rounds with γ = 0
    full_block: int = 0  # size of the last block when it was fully accepted, else 0
    draft_alpha: float | None = None  # calibrated α of the last draft that came with confidences


class GammaPolicy:
    """Adaptive γ per request from running acceptance and cost estimates. State is explicit and picklable.

    Acceptance. Each observed round (γ drafted, a accepted) is a truncated geometric sample: a < γ tells a + 1
    Bernoulli trials with a successes, a = γ tells γ successes and no failure. Counts are exponentially
    weighted per round (`decay` for a request, `arm_decay` for an arm), so estimates follow a shift within
    about 20 rounds. The arm estimate starts from `prior_alpha` with `prior_weight` pseudo-trials; a request's
    estimate starts from its arm's with `request_weight` pseudo-trials, so a new request borrows the arm's α.

    Costs. `observe_costs` feeds measured seconds: one drafter step, and scoring n tokens, at a batch size.
    c(B) = draft step / target time for 1 token; v(γ)(B) = time for γ+1 tokens / time for 1 token, linear in
    n between measured token counts (extrapolated from the last two), made non-decreasing, and interpolated
    linearly between measured batch sizes. Until a 1-token time is measured (or inferred from two other token
    counts), v ≡ 1 and c = `draft_cost`.

    Drafts with confidences (`observe(..., confidence=, match_len=)`, the suffix drafter): the arm learns α as
    a function of each draft token's match length and confidence (`policies.confidence`); a request's α is
    the higher of its running count and the calibrated α of its last draft (known as soon as the draft is).

    Choice. γ = best_gamma(α, c, gamma_max, v), and 0 whenever α ≤ c. Exploration: a request that has been
    observed for `probe_interval` consecutive plain rounds (report them with gamma=0) is given γ = 1 once,
    so a workload whose acceptance recovered is noticed; `probe_interval=None` turns this off. The default, 8,
    is short because a probe is cheap (scoring 2 tokens costs little more than one decode step) and requests
    are short: a request shorter than the interval that starts plain (its arm's α is low, or an early cost
    sample was slow) would never draft. After a fully accepted block, a speculating request's γ is at least
    `explore_gamma` of it (doubling while that pays, at most the γ that pays best at α = 1), so a verbatim
    stretch reaches γ_max in a few rounds; `explore=False` turns this off. `gamma_min` is a floor on every
    choice (set it ≥ 1 to always speculate).
    `fixed_gamma` returns one γ always.

    Drafter floor. With `draft_floor`, the drafter runs one step every round, γ = 0 included (vLLM's own
    proposers, which keep their KV cache in step with the target's), so a plain round costs 1 + c: c and v(γ)
    (γ ≥ 1) are then priced relative to that round, c / (1 + c) and v(γ) / (1 + c), and a low α no longer
    turns speculation off by itself (the drafter's step is paid either way). Its costs are measured as without
    the floor: c the drafter's step, v the target's scoring alone.

    Steps. `plan_step` cuts a batched step's γs (or drafts) to what pays for the step as a whole
    (`policies.batch_plan`); `batch_plan=False` keeps the per-row choices.

    Parameters: `gamma_max` the largest γ; `prior_alpha`, `prior_weight` the cold-start α of an arm and its
    weight in pseudo-trials; `request_weight` the arm estimate's weight in a request's estimate; `decay`
    (per round of the request) and `arm_decay` (per observed row-round of the arm: a round of B rows ages it
    B times) the forgetting rates; `draft_cost` c before it is measured; `cost_decay` the forgetting rate of
    the cost means (per sample); `probe_interval`, `gamma_min`, `fixed_gamma`, `batch_plan` as above.
    """

    def __init__(
        self,
        gamma_max: int = 8,
        gamma_min: int = 0,
        prior_alpha: float = 0.6,
        prior_weight: float = 4.0,
        request_weight: float = 2.0,
        decay: float = 0.8,
        arm_decay: float = 0.95,
        draft_cost: float = 0.1,
        cost_decay: float = 0.8,
        probe_interval: int | None = 8,
        fixed_gamma: int | None = None,
        explore: bool = True,
        batch_plan: bool = True,
        draft_floor: bool = False,
    ) -> None:
        _check_gamma("gamma_max", gamma_max)
        _check_gamma("gamma_min", gamma_min)
        if gamma_min > gamma_max:
            raise ValueError(f"gamma_min ({gamma_min}) must be ≤ gamma_max ({gamma_max})")
        if not 0.0 <= prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha must lie in [0, 1], got {prior_alpha}")
        for name, weight in (("prior_weight", prior_weight), ("request_weight", request_weight)):
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"{name} must be finite and > 0, got {weight}")
        for name, rate in (("decay", decay), ("arm_decay", arm_decay), ("cost_decay", cost_decay)):
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"{name} must lie in [0, 1), got {rate}")
        if not (math.isfinite(draft_cost) and draft_cost >= 0):
            raise ValueError(f"draft_cost must be finite and ≥ 0, got {draft_cost}")
        if probe_interval is not None and (not isinstance(probe_interval, int) or probe_interval < 1):
            raise ValueError(f"probe_interval must be an int ≥ 1 or None, got {probe_interval!r}")
        if fixed_gamma is not None:
            _check_gamma("fixed_gamma", fixed_gamma)
        self.gamma_max = gamma_max
        self.gamma_min = gamma_min
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.request_weight = request_weight
        self.decay = decay
        self.arm_decay = arm_decay
        self.probe_interval = probe_interval
        self.fixed_gamma = fixed_gamma
        self.explore = explore
        self.batch_plan = batch_plan
        self.draft_floor = draft_floor
        self._plain_steps = 0  # consecutive planned steps that drafted nothing (probes wait for probe_interval)
        self.costs = CostModel(default_draft_cost=draft_cost, decay=cost_decay)
        self._arms: dict[str, Acceptance] = {}
        self._confidence: dict[str, ConfidenceAcceptance] = {}  # per arm, for drafts with confidences
        self._requests: dict[str, _RequestState] = {}

    @classmethod
    def fixed(cls, gamma: int) -> GammaPolicy:
        """A policy that always returns `gamma` (benchmarks: the best fixed γ vs adaptive)."""
        return cls(gamma_max=max(gamma, 0), fixed_gamma=gamma)

    def observe(self, request_id: str, arm: str, gamma: int, accepted: int, confidence: Sequence[float] = (),
                match_len: int = 0) -> None:
        """Record one round of one request: `gamma` tokens drafted, `accepted` of them kept (γ = 0: plain);
        `confidence` (one per drafted token) and `match_len` when the drafter reports them."""
        _check_gamma("gamma", gamma)
        if isinstance(accepted, bool) or not isinstance(accepted, int) or not 0 <= accepted <= gamma:
            raise ValueError(f"accepted must be an int in [0, gamma={gamma}], got {accepted!r}")
        if confidence and len(confidence) != gamma:
            raise ValueError(f"confidence must have one entry per drafted token ({gamma}), got {len(confidence)}")
        state = self._requests.setdefault(request_id, _RequestState())
        if gamma == 0:
            state.plain_streak += 1
            state.full_block = 0
            return
        state.plain_streak = 0
        state.full_block = gamma if accepted == gamma else 0
        state.acceptance.update(gamma, accepted, self.decay)
        self.observe_arm(arm, gamma, accepted, confidence, match_len)
        if confidence:
            state.draft_alpha = self._confidence[arm].draft_alpha(match_len, confidence)

    def observe_arm(self, arm: str, gamma: int, accepted: int, confidence: Sequence[float] = (),
                    match_len: int = 0) -> None:
        """The arm's part of `observe` alone: what an authority merging many units' rounds learns."""
        if gamma == 0:
            return
        self._arms.setdefault(arm, Acceptance()).update(gamma, accepted, self.arm_decay)
        if confidence:
            self._confidence.setdefault(arm, ConfidenceAcceptance()).observe(match_len, confidence, accepted)

    def arm_statistics(self) -> ArmStatistics:
        """What units share: α per arm, the confidence tables and the measured costs (the policy's own
        objects, not a copy: pickle it or `adopt` it, which copies)."""
        return ArmStatistics(self._arms, self._confidence, self.costs)

    def adopt(self, stats: ArmStatistics) -> None:
        """Replace the shared statistics with `stats` (a copy of another policy's); requests' own state stays."""
        stats = copy.deepcopy(stats)
        self._arms, self._confidence, self.costs = stats.arms, stats.confidence, stats.costs

    def observe_costs(
        self,
        batch_size: int,
        draft_step_s: float | None = None,
        score_s_by_tokens: Mapping[int, float] | None = None,
    ) -> None:
        """Record measured seconds at a batch size: one drafter step, and target scoring of n tokens per row."""
        self.costs.observe(batch_size, draft_step_s, score_s_by_tokens)

    def alpha(self, request_id: str | None, arm: str) -> float:
        """Acceptance estimate of a request on an arm (the arm's alone when request_id is None or unseen)."""
        arm_counts = self._arms.get(arm)
        arm_alpha = self.prior_alpha if arm_counts is None else arm_counts.estimate(self.prior_alpha, self.prior_weight)
        state = self._requests.get(request_id) if request_id is not None else None
        if state is None:
            return arm_alpha
        counted = state.acceptance.estimate(arm_alpha, self.request_weight)
        # A drafter with confidences cuts its own drafts short where they turn unlikely, so γ is only a cap
        # there: the higher of the two estimates costs little when the next draft is junk (it is cut), while
        # the lower one would cut a confident verbatim copy.
        return counted if state.draft_alpha is None else max(state.draft_alpha, counted)

    def verify_cost(self, batch_size: int) -> list[float]:
        """v(γ) for γ = 0..gamma_max at this batch size, relative to a plain round (v(0) = 1; with
        `draft_floor` a plain round includes the drafter's step)."""
        v = self.costs.verify_cost(batch_size, self.gamma_max)
        if not self.draft_floor:
            return v
        plain = 1.0 + self.costs.draft_cost(batch_size)
        return [1.0] + [x / plain for x in v[1:]]

    def draft_cost(self, batch_size: int) -> float:
        """c: one drafter step relative to a plain round at this batch size (one target step; with
        `draft_floor`, one target step and one drafter step)."""
        c = self.costs.draft_cost(batch_size)
        return c / (1.0 + c) if self.draft_floor else c

    def choose(self, request_id: str, arm: str, batch_size: int) -> int:
        """γ for the next round of this request, given how many rows the round will batch."""
        if self.fixed_gamma is not None:
            return self.fixed_gamma
        alpha = self.alpha(request_id, arm)
        c = self.draft_cost(batch_size)
        verify_cost = self.verify_cost(batch_size)
        gamma = 0 if alpha <= c and not self.draft_floor else best_gamma(alpha, c, self.gamma_max, verify_cost)
        state = self._requests.get(request_id)
        if gamma == 0 and state is not None and self.probe_interval is not None:
            if state.plain_streak >= self.probe_interval and self.gamma_max >= 1:
                gamma = 1
        if self.explore and gamma >= 1 and state is not None and state.full_block:  # not after a probe
            gamma = max(gamma, explore_gamma(state.full_block, self.gamma_max, c, verify_cost))
        return max(gamma, self.gamma_min)

    def plan_step(self, rows: Sequence[tuple[str, str, int, bool]], batch_size: int, *, ragged: bool = True,
                  drafted: bool = False) -> list[int]:
        """Each row's draft count for one batched step of `batch_size` rows; a row is (request_id, arm, cap, fixed):
        its γ (or the drafts it has) and whether its γ may not depend on load (a seeded request). `ragged`: the
        engine scores each row's own drafts (vLLM), else every row at the widest (native). `drafted`: the drafts
        exist, so drafting costs nothing more. A row in a fully accepted run is priced at α ≥ block/(block + 1),
        so exploration survives the plan; after `probe_interval` plain steps in a row, the rows due a probe get
        it. The caps themselves with batch_plan off, fixed_gamma, or gamma_min ≥ 1."""
        caps = [cap for _, _, cap, _ in rows]
        if not self.batch_plan or self.fixed_gamma is not None or self.gamma_min > 0:
            return caps
        plan = self._plan(rows, caps, batch_size, ragged, drafted) if any(caps) else caps
        if any(plan):
            self._plain_steps = 0
            return plan
        self._plain_steps += 1
        if self.probe_interval is None or self._plain_steps < self.probe_interval:
            return plan
        due = [self._due_probe(request_id) for request_id, *_ in rows]
        if any(due):
            self._plain_steps = 0
        return [min(cap, 1) if probe else 0 for cap, probe in zip(caps, due)]

    def _plan(self, rows, caps: list[int], batch_size: int, ragged: bool, drafted: bool) -> list[int]:
        alphas = []
        for request_id, arm, _, _ in rows:
            state, alpha = self._requests.get(request_id), self.alpha(request_id, arm)
            alphas.append(alpha if state is None or not state.full_block else
                          max(alpha, state.full_block / (state.full_block + 1)))
        return plan_drafts(alphas, caps, self.verify_cost(batch_size), batch_size=batch_size,
                           draft_cost=0.0 if drafted else self.draft_cost(batch_size), ragged=ragged,
                           fixed=[fixed for *_, fixed in rows])

    def _due_probe(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        return state is not None and state.plain_streak >= self.probe_interval

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state (its arm keeps what it learned)."""
        self._requests.pop(request_id, None)

    def summary(self) -> dict:
        """Plain-dict view for telemetry: α per arm, tracked requests, measured costs, and how they price a step
        at each measured batch size (`pricing`: c and v(γ) for γ = 0..gamma_max, as `choose` uses them)."""
        costs = self.costs.summary()
        return {
            "arms": {arm: self.alpha(None, arm) for arm in self._arms},
            "confidence": {arm: table.summary() for arm, table in self._confidence.items()},
            "requests": len(self._requests),
            "costs": costs,
            "pricing": {bs: {"c": self.draft_cost(bs), "v": self.verify_cost(bs)}
                        for bs in sorted({*costs["draft_step_s"], *costs["score_s"]})},
            "fixed_gamma": self.fixed_gamma,
        }


def _check_alpha(alpha: float) -> None:
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")


def _check_gamma(name: str, gamma: int) -> None:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"{name} must be an int ≥ 0, got {gamma!r}")


def _check_verify_cost(verify_cost: Sequence[float], gamma: int) -> Sequence[float]:
    if len(verify_cost) <= gamma:
        raise ValueError(f"verify_cost needs an entry for every γ up to {gamma}, got {len(verify_cost)}")
    if not all(math.isfinite(v) and v > 0 for v in verify_cost[: gamma + 1]):
        raise ValueError("verify_cost entries must be finite and > 0")
    return verify_cost
