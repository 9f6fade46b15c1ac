"""Quality audit: replay a sample of greedy ASD requests on the exact reference arm and compare the outputs.

Per audited request an `AuditRecord`: **exact match** (identical token sequences), **common prefix** (tokens
agreeing before the first divergence), **edit distance** (token-level Levenshtein, cost 1 per edit) and the
request's **regret spent**. Only greedy ASD requests qualify (`AuditSampler`): the exact greedy replay is
deterministic, so every difference comes from a relaxed token, and a request that spent no regret must match
(up to batch numerics). The ingress asks `AuditSampler.should_audit(...)` when an ASD response finishes and hands
the replay to `AuditRunner.submit(...)`, which runs it in the background (at most `max_pending`) and passes the
record to a sink (the telemetry hub); `summarize(records)` gives the A/B report's per-arm figures.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

import numpy as np

from cluster.records import AuditRecord
from cluster.serving.ab import stable_unit_interval

logger = logging.getLogger(__name__)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading positions where a and b agree."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def edit_distance(a: Sequence[int], b: Sequence[int]) -> int:
    """Token Levenshtein distance between a and b (unit costs).

    The shared prefix and suffix are stripped first (ASD outputs usually agree for long stretches); the rest
    is the row-by-row DP, vectorised: with t[j] = min(prev[j] + 1, prev[j-1] + [a_i != b_j]), the insertion
    chain row[j] = min_k≤j (t[k] + j - k) is a running minimum of t[k] - k.
    """
    start = common_prefix_length(a, b)
    a, b = list(a[start:]), list(b[start:])
    end = common_prefix_length(a[::-1], b[::-1])
    if end:
        a, b = a[: len(a) - end], b[: len(b) - end]
    if not a or not b:
        return len(a) + len(b)
    b_ids = np.asarray(b, dtype=np.int64)  # [m]
    m = len(b)
    offsets = np.arange(m + 1)  # [m+1]
    prev = offsets.copy()  # [m+1] distance from the empty prefix of a
    for i, token in enumerate(a, start=1):
        t = np.empty(m + 1, dtype=np.int64)  # [m+1]
        t[0] = i
        t[1:] = np.minimum(prev[1:] + 1, prev[:-1] + (b_ids != token))
        prev = np.minimum.accumulate(t - offsets) + offsets
    return int(prev[-1])


def compare(
    request_id: str,
    arm: str,
    reference_arm: str,
    asd_tokens: Sequence[int],
    ref_tokens: Sequence[int],
    regret_spent: float,
    unit: str = "",
) -> AuditRecord:
    """The audit record of one ASD output against its exact replay (both as token ids)."""
    asd, ref = list(asd_tokens), list(ref_tokens)
    return AuditRecord(
        request_id=request_id,
        arm=arm,
        reference_arm=reference_arm,
        exact_match=asd == ref,
        common_prefix=common_prefix_length(asd, ref),
        edit_distance=edit_distance(asd, ref),
        asd_tokens=len(asd),
        ref_tokens=len(ref),
        regret_spent=float(regret_spent or 0.0),
        unit=unit,
    )


class AuditSampler:
    """Decides which requests are audited: greedy ASD requests, a `fraction` of them.

    The decision is a stable hash of (seed, request id), so it is reproducible and needs no shared state
    across ingress replicas.
    """

    def __init__(self, fraction: float, seed: int | str = 0):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
        self.fraction = fraction
        self._salt = f"specserve-audit:{seed}"

    def should_audit(self, request_id: str, verification: str, temperature: float) -> bool:
        """True when the request is greedy (temperature 0), served by an ASD arm, and drawn."""
        if verification != "asd" or temperature != 0 or self.fraction == 0.0:
            return False
        return stable_unit_interval(self._salt, request_id) < self.fraction


class AuditRunner:
    """Runs audit replays in the background of an asyncio loop, at most `max_pending` at once.

    `sink(record)` receives each finished `AuditRecord` (e.g. `lambda r: hub.record.remote([r])`).
    A submission beyond `max_pending` is skipped (counted in `skipped`), never queued without bound.
    """

    def __init__(self, reference_arm: str, sink: Callable[[AuditRecord], object], max_pending: int = 16):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.reference_arm = reference_arm
        self.max_pending = max_pending
        self.skipped = 0
        self.failed = 0
        self._sink = sink
        self._tasks: set[asyncio.Task] = set()

    @property
    def pending(self) -> int:
        return len(self._tasks)

    def submit(
        self,
        request_id: str,
        arm: str,
        asd_tokens: Sequence[int],
        regret_spent: float,
        replay: Callable[[], Awaitable[Sequence[int]]],
        unit: str = "",
    ) -> bool:
        """Schedule `replay()` (the same prompt decoded greedily on the reference arm, returning its token
        ids) and the comparison; False when skipped because `max_pending` replays are already running.
        Call from inside the running event loop."""
        if self.pending >= self.max_pending:
            self.skipped += 1
            logger.info("audit of %s skipped: %d replays pending", request_id, self.pending)
            return False
        task = asyncio.get_running_loop().create_task(
            self._run(request_id, arm, list(asd_tokens), regret_spent, replay, unit)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def drain(self) -> None:
        """Wait for every pending replay (shutdown, tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _run(self, request_id, arm, asd_tokens, regret_spent, replay, unit) -> None:
        try:
            ref_tokens = await replay()
            record = compare(request_id, arm, self.reference_arm, asd_tokens, ref_tokens, regret_spent, unit)
            self._sink(record)
        except Exception:  # an audit must never take the serving path down
            self.failed += 1
            logger.exception("audit replay of %s failed", request_id)


# --------------------------------------------------------------------------------------------- summaries


def exact_match_rate(records: Sequence[AuditRecord]) -> float | None:
    return float(np.mean([r.exact_match for r in records])) if records else None


def mean_prefix_agreement(records: Sequence[AuditRecord]) -> float | None:
    return float(np.mean([r.prefix_agreement for r in records])) if records else None


def rank_correlation(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None when undefined (n < 3 or a constant)."""
    if len(x) != len(y):
        raise ValueError(f"x and y must have equal lengths, got {len(x)} and {len(y)}")
    if len(x) < 3:
        return None
    rx, ry = _average_ranks(np.asarray(x, float)), _average_ranks(np.asarray(y, float))
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _average_ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values), dtype=float)
    uniq, inverse = np.unique(values, return_inverse=True)
    sums = np.bincount(inverse, weights=ranks)
    counts = np.bincount(inverse)
    return (sums / counts)[inverse]


def divergence_by_regret(records: Sequence[AuditRecord], bins: int = 4) -> list[dict]:
    """Audit figures binned by regret spent: one bin for zero regret (must match exactly), then quantile
    bins of the positive regrets. Each bin: regret_lo, regret_hi, n, exact_match_rate,
    mean_prefix_agreement, mean_normalized_edit_distance."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    zero = [r for r in records if r.regret_spent <= 0]
    positive = sorted((r for r in records if r.regret_spent > 0), key=lambda r: r.regret_spent)
    groups = [(0.0, 0.0, zero)] if zero else []
    for chunk in np.array_split(np.arange(len(positive)), min(bins, len(positive))) if positive else []:
        members = [positive[i] for i in chunk]
        groups.append((members[0].regret_spent, members[-1].regret_spent, members))
    return [
        {
            "regret_lo": lo,
            "regret_hi": hi,
            "n": len(members),
            "exact_match_rate": exact_match_rate(members),
            "mean_prefix_agreement": mean_prefix_agreement(members),
            "mean_normalized_edit_distance": float(np.mean([r.normalized_edit_distance for r in members])),
        }
        for lo, hi, members in groups
    ]


def summarize(records: Iterable[AuditRecord]) -> dict:
    """Per-arm-ready audit summary: n, exact_match_rate, mean_common_prefix, mean_prefix_agreement,
    mean_edit_distance, mean_normalized_edit_distance, regret_divergence_spearman (regret spent vs
    normalised edit distance), by_regret (see `divergence_by_regret`). Means are None when n = 0."""
    records = list(records)
    return {
        "n": len(records),
        "exact_match_rate": exact_match_rate(records),
        "mean_common_prefix": _mean([r.common_prefix for r in records]),
        "mean_prefix_agreement": mean_prefix_agreement(records),
        "mean_edit_distance": _mean([r.edit_distance for r in records]),
        "mean_normalized_edit_distance": _mean([r.normalized_edit_distance for r in records]),
        "regret_divergence_spearman": rank_correlation(
            [r.regret_spent for r in records], [r.normalized_edit_distance for r in records]
        ),
        "by_regret": divergence_by_regret(records),
    }
