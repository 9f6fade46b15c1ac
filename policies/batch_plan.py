"""The step's draft plan: how many drafts each row of one batched step verifies, priced for the step as a whole
(why: docs/architecture.md, "The step's draft plan").

`plan_drafts` chooses the counts d_i ≤ cap_i that maximise the step's expected tokens per unit of cost,

    T(d) = (B + Σ_i (E(α_i, d_i) − 1)) / (cost(d) + c · max_i d_i),      T(0) = B (plain decoding),

where E(α, d) − 1 = α + … + α^d (`policies.gamma.expected_tokens`), c is the drafter step's cost (0 when the
drafts exist already) and cost(d), relative to a plain step, comes from v(γ), the verify-cost curve at this batch
size:
- ragged (vLLM: the target scores Σ_i d_i draft tokens): 1 when no row drafts, else v(max(1, Σ_i d_i / B)),
  linear between integer γ (v is measured that way: `scored_tokens`);
- padded (the native engine: every row is scored at the widest row's length): v(max_i d_i).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

_TIE = 1e-9  # drafting must beat the plainer plan by more than rounding


def plan_drafts(
    alphas: Sequence[float],
    caps: Sequence[int],
    verify_cost: Sequence[float],
    *,
    batch_size: int,
    draft_cost: float = 0.0,
    ragged: bool = True,
    fixed: Sequence[bool] | None = None,
) -> list[int]:
    """Each row's draft count, at most `caps[i]`, maximising T(d) above; the plainest plan on ties.

    `alphas[i]` is row i's acceptance estimate, `verify_cost[γ]` is v(γ) at this batch size (an entry for every
    γ up to max(caps)), `batch_size` counts every row of the step (rows not planned here decode plainly and add
    one token each). A `fixed` row keeps its cap whatever it costs (a seeded request, whose γ may not depend on
    load). Within a row, drafts are kept as a prefix, in order of their expected gain α_i^k.
    """
    rows = len(caps)
    fixed = [False] * rows if fixed is None else list(fixed)
    _check(alphas, caps, verify_cost, batch_size, draft_cost, fixed)
    if rows == 0 or max(caps, default=0) == 0:
        return [0] * rows
    cap = np.asarray(caps, dtype=np.int64)  # [R]
    pinned = np.asarray(fixed, dtype=bool)  # [R]
    k = np.arange(1, int(cap.max()) + 1)  # [K]
    # gain[i, k - 1] = α_i^k, what row i's k-th draft adds to the expected tokens (0 past its cap)
    gain = np.where(k[None, :] <= cap[:, None], np.asarray(alphas, dtype=np.float64)[:, None] ** k[None, :], 0.0)
    base = batch_size + float(gain[pinned].sum())  # one token a row, and the fixed rows' drafts
    v = np.asarray(verify_cost, dtype=np.float64)
    plan = _ragged if ragged else _padded
    return plan(gain, cap, pinned, base, v, batch_size, draft_cost)


def _ragged(gain, cap, pinned, base, v, batch_size, draft_cost) -> list[int]:
    rows, ks = np.nonzero(np.arange(1, gain.shape[1] + 1)[None, :] <= cap[:, None])  # every draft a cap allows
    keep = ~pinned[rows]
    rows, ks = rows[keep], ks[keep] + 1
    order = np.lexsort((ks, -gain[rows, ks - 1]))  # best gain first; within a row k ascends
    rows, ks = rows[order], ks[order]
    gains = base + np.concatenate([[0.0], np.cumsum(gain[rows, ks - 1])])  # [N + 1] by how many are kept
    drafted = int(cap[pinned].sum()) + np.arange(len(rows) + 1)  # [N + 1] draft tokens in the step
    widest = np.maximum.accumulate(np.concatenate([[cap[pinned].max(initial=0)], ks]))  # [N + 1]
    mean = np.maximum(1.0, drafted / batch_size)
    cost = np.where(drafted == 0, 1.0, np.interp(mean, np.arange(len(v)), v)) + draft_cost * widest
    best = _best(gains / cost)
    counts = np.where(pinned, cap, 0)
    np.maximum.at(counts, rows[:best], ks[:best])
    return counts.tolist()


def _padded(gain, cap, pinned, base, v, batch_size, draft_cost) -> list[int]:
    widths = np.arange(int(cap[pinned].max(initial=0)), int(cap.max()) + 1)  # [W] the step's width
    free = np.concatenate([[0.0], gain[~pinned].sum(axis=0).cumsum()])  # [K + 1] by width
    rates = (base + free[widths]) / (v[widths] + draft_cost * widths)
    width = int(widths[_best(rates)])
    return np.where(pinned, cap, np.minimum(cap, width)).tolist()


def _best(rates: np.ndarray) -> int:
    """The index of the largest rate; a later index wins only by more than `_TIE` (relative)."""
    best = 0
    for j in range(1, len(rates)):
        if rates[j] > rates[best] * (1 + _TIE):
            best = j
    return best


def _check(alphas, caps, verify_cost, batch_size, draft_cost, fixed) -> None:
    if not len(alphas) == len(caps) == len(fixed):
        raise ValueError(f"alphas, caps and fixed need one entry per row, got {len(alphas)}, {len(caps)}, "
                         f"{len(fixed)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < max(1, len(caps)):
        raise ValueError(f"batch_size must be an int ≥ the planned rows ({len(caps)}) and ≥ 1, got {batch_size!r}")
    if not all(isinstance(a, (int, float)) and 0.0 <= a <= 1.0 for a in alphas):
        raise ValueError("alphas must lie in [0, 1]")
    if not all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 0 for k in caps):
        raise ValueError("caps must be ints ≥ 0")
    if len(verify_cost) <= max(caps, default=0):
        raise ValueError(f"verify_cost needs an entry for every γ up to {max(caps)}, got {len(verify_cost)}")
    if not all(math.isfinite(x) and x > 0 for x in verify_cost):
        raise ValueError("verify_cost entries must be finite and > 0")
    if not (math.isfinite(draft_cost) and draft_cost >= 0):
        raise ValueError(f"draft_cost must be finite and ≥ 0, got {draft_cost}")


def scored_tokens(lens: Sequence[int]) -> int:
    """The n (tokens scored per row) a ragged step with these draft lengths is costed at: 1 only when no row
    drafted, else 1 + the rows' mean draft, at least 2. A step with any draft pays the speculative path whole, so
    it must not raise the plain baseline (which would make every v(γ) look cheaper)."""
    drafted = sum(lens)
    return 1 if drafted == 0 else 1 + max(1, round(drafted / len(lens)))
