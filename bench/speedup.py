"""α, c and v(γ) of a run, measured from its single-stream rounds, and the speedup the policy's model predicts.

The estimates are the policy's own: α is `policies.estimators.Acceptance` (no decay, no prior) and c, v(γ) are a
`policies.estimators.CostModel` fed the run's median timings, so the bench judges the model the policy uses.
Everything is relative to t1, the target-only run's median plain-round score time. Terms and the prediction
rule: docs/benchmarks.md, "The fit".
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

from actors.stats import RoundRecord
from policies.estimators import Acceptance, CostModel
from policies.gamma import expected_tokens

STALL_FACTOR = 5.0  # a round whose score time exceeds this many t1 was stalled by other load


def _single_rows(rounds: Sequence[RoundRecord]) -> list[tuple[RoundRecord, int, int]]:
    """(round, drafted, accepted) of single-row rounds."""
    return [(r, r.rows[0].gamma, r.rows[0].accepted) for r in rounds if r.batch_size == 1 and len(r.rows) == 1]


def target_step_s(target_only_rounds: Sequence[RoundRecord]) -> float | None:
    """t1: median score seconds of the plain single-row rounds."""
    times = [r.score_s for r, k, _ in _single_rows(target_only_rounds) if k == 0]
    return statistics.median(times) if times else None


def acceptance(rounds: Sequence[RoundRecord]) -> float | None:
    """α, the truncated-geometric MLE over the rounds that drafted (None when none did)."""
    counts = Acceptance()
    for _, k, a in _single_rows(rounds):
        counts.update(k, a, decay=1.0)
    return counts.estimate(prior=0.0, weight=0.0) if counts.trials else None


def cost_model(rounds: Sequence[RoundRecord], t1: float) -> tuple[CostModel, int | None]:
    """The policy's cost model at batch size 1, fed t1 as the 1-token time, each drafted width's median score
    time and the drafter's seconds per drafted token; and the widest width drafted (None: nothing drafted)."""
    by_k: dict[int, list[float]] = defaultdict(list)
    for r, k, _ in _single_rows(rounds):
        if k > 0 and r.score_s > 0:
            by_k[k].append(r.score_s)
    drafted = sum(k for _, k, _ in _single_rows(rounds))
    draft_s = sum(r.draft_s for r, k, _ in _single_rows(rounds) if k > 0)
    model = CostModel(default_draft_cost=0.0, decay=0.0)
    model.observe(1, draft_s / drafted if drafted and draft_s > 0 else None,
                  {1: t1, **{k + 1: statistics.median(v) for k, v in by_k.items()}})
    return model, (max(k for _, k, _ in _single_rows(rounds)) if drafted else None)


def predicted_speedup(rounds: Sequence[RoundRecord], alpha: float, c: float, v: Sequence[float]) -> float | None:
    """Σ E(α, k_r) / Σ (k_r·c + v(k_r)) over the single-row rounds, `v[k]` = v(k) (None without rounds)."""
    rows = _single_rows(rounds)
    if not rows:
        return None
    tokens = sum(expected_tokens(alpha, k) for _, k, _ in rows)
    cost = sum(k * c + v[k] for _, k, _ in rows)
    return tokens / cost


def fit(run_rounds: Sequence[RoundRecord], target_only_rounds: Sequence[RoundRecord]) -> dict:
    """α, c, v(k) of a run and its predicted speedup, all relative to the target-only run's step time."""
    t1 = target_step_s(target_only_rounds)
    alpha = acceptance(run_rounds)
    if t1 is None or t1 <= 0:
        return {"t1_s": t1, "alpha": alpha, "c": None, "v": {}, "predicted": None}
    rows = _single_rows(run_rounds)
    model, widest = cost_model(run_rounds, t1)
    curve = model.verify_cost(1, widest or 0)
    widths = sorted({0} | {k for _, k, _ in rows})
    c = model.draft_cost(1) if widest else None
    if alpha is None or c is None:  # nothing drafted: the model predicts plain decoding
        predicted = 1.0 if rows else None
    else:
        predicted = predicted_speedup(run_rounds, alpha, c, curve)
    totals = {name: sum(getattr(r, name) for r, _, _ in rows) for name in ("draft_s", "score_s", "verify_s", "total_s")}
    orchestration = sum(r.orchestration_s for r, _, _ in rows)
    return {
        "t1_s": t1, "alpha": alpha, "c": c, "v": {str(k): curve[k] for k in widths}, "predicted": predicted,
        "rounds": len(rows), "stalled_rounds": sum(r.score_s > STALL_FACTOR * t1 for r, _, _ in rows),
        "mean_drafted": statistics.fmean(k for _, k, _ in rows) if rows else None,
        "drafted_round_share": sum(k > 0 for _, k, _ in rows) / len(rows) if rows else None,
        "round_time_share": {
            "draft": totals["draft_s"] / totals["total_s"] if totals["total_s"] else None,
            "score": totals["score_s"] / totals["total_s"] if totals["total_s"] else None,
            "verify": totals["verify_s"] / totals["total_s"] if totals["total_s"] else None,
            "orchestration": orchestration / totals["total_s"] if totals["total_s"] else None,
        },
    }
