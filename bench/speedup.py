"""Measured α, c and v(γ) from a run's rounds, and the speedup the model predicts from them.

Terms (DESIGN.md). From the single-stream rounds of one run:
- **t1**: one target step, the median score time of the plain (0-draft) rounds of the target-only run.
- **v(k)**: median score time of rounds that fed k drafts (k + 1 tokens), over t1; v(0) = 1.
- **c**: drafter time per drafted token over t1 (the n-gram drafter costs one lookup per round).
- **α**: the maximum-likelihood acceptance of a truncated geometric: Σ accepted / (Σ accepted + rounds with a
  rejection), the estimator the policy itself uses.

**Predicted speedup** of a run: Σ_r E(α, k_r) / Σ_r (k_r·c + v(k_r)) over its rounds, where k_r is what the
drafter actually proposed in round r (prompt lookup often proposes fewer than γ, or nothing). With every k_r = γ
this is S(γ) of the design. **Realized** is decode tokens/s of the run over that of target-only decoding (prefill
excluded, as the model has no prefill). realized / predicted < 1 measures what the model leaves out: per-round
orchestration and verification, and acceptance that is not i.i.d.

**Stalled rounds**: rounds whose score time exceeds `STALL_FACTOR`·t1 (scoring 9 tokens costs about 2·t1 on
this CPU). They come from other processes taking the CPU, not from the model; a run with many is noisy.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

from actors.stats import RoundRecord
from policies.gamma import expected_tokens

STALL_FACTOR = 5.0


def _single_rows(rounds: Sequence[RoundRecord]) -> list[tuple[RoundRecord, int, int]]:
    """(round, drafted, accepted) of single-row rounds."""
    return [(r, r.rows[0].gamma, r.rows[0].accepted) for r in rounds if r.batch_size == 1 and len(r.rows) == 1]


def target_step_s(target_only_rounds: Sequence[RoundRecord]) -> float | None:
    """t1: median score seconds of the plain single-row rounds."""
    times = [r.score_s for r, k, _ in _single_rows(target_only_rounds) if k == 0]
    return statistics.median(times) if times else None


def acceptance(rounds: Sequence[RoundRecord]) -> float | None:
    """α (truncated-geometric MLE) over the rounds that drafted."""
    accepted = failures = 0
    for _, k, a in _single_rows(rounds):
        if k > 0:
            accepted += a
            failures += a < k
    return accepted / (accepted + failures) if accepted + failures else None


def verify_costs(rounds: Sequence[RoundRecord], t1: float) -> dict[int, float]:
    """v(k) for every draft width k seen in single-row rounds; v(0) = 1 by definition."""
    by_k: dict[int, list[float]] = defaultdict(list)
    for r, k, _ in _single_rows(rounds):
        if k > 0:
            by_k[k].append(r.score_s)
    return {0: 1.0, **{k: statistics.median(v) / t1 for k, v in sorted(by_k.items())}}


def draft_cost(rounds: Sequence[RoundRecord], t1: float) -> float | None:
    """c: drafter seconds per drafted token, over t1."""
    drafted = sum(k for _, k, _ in _single_rows(rounds))
    seconds = sum(r.draft_s for r, k, _ in _single_rows(rounds) if k > 0)
    return seconds / drafted / t1 if drafted else None


def _interpolate(costs: dict[int, float], k: int) -> float:
    if k in costs:
        return costs[k]
    known = sorted(costs)
    lower = max((x for x in known if x < k), default=known[0])
    upper = min((x for x in known if x > k), default=None)
    if upper is None:  # beyond the widest measured: extend the last slope
        if len(known) < 2:
            return costs[lower]
        a, b = known[-2], known[-1]
        return costs[b] + (costs[b] - costs[a]) / (b - a) * (k - b)
    return costs[lower] + (costs[upper] - costs[lower]) * (k - lower) / (upper - lower)


def predicted_speedup(rounds: Sequence[RoundRecord], alpha: float, c: float, v: dict[int, float]) -> float | None:
    """Σ E(α, k_r) / Σ (k_r·c + v(k_r)) over the single-row rounds (None without rounds)."""
    rows = _single_rows(rounds)
    if not rows:
        return None
    tokens = sum(expected_tokens(alpha, k) for _, k, _ in rows)
    cost = sum(k * c + _interpolate(v, k) for _, k, _ in rows)
    return tokens / cost


def fit(run_rounds: Sequence[RoundRecord], target_only_rounds: Sequence[RoundRecord]) -> dict:
    """α, c, v(k) of a run and its predicted speedup, all relative to the target-only run's step time."""
    t1 = target_step_s(target_only_rounds)
    alpha = acceptance(run_rounds)
    if t1 is None or t1 <= 0:
        return {"t1_s": t1, "alpha": alpha, "c": None, "v": {}, "predicted": None}
    v = verify_costs(run_rounds, t1)
    c = draft_cost(run_rounds, t1)
    rows = _single_rows(run_rounds)
    if alpha is None or c is None:  # nothing drafted: the model predicts plain decoding
        predicted = 1.0 if rows else None
    else:
        predicted = predicted_speedup(run_rounds, alpha, c, v)
    totals = {name: sum(getattr(r, name) for r, _, _ in rows) for name in ("draft_s", "score_s", "verify_s", "total_s")}
    orchestration = sum(r.orchestration_s for r, _, _ in rows)
    return {
        "t1_s": t1, "alpha": alpha, "c": c, "v": {str(k): x for k, x in v.items()}, "predicted": predicted,
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
