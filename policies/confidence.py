"""α as a function of a draft token's match length and confidence, for drafters that report them (the suffix
drafter, `actors.drafting.suffix`).

Draft step j has its own probability p_j = c_j / c_{j-1} (c_j ≈ P(tokens 0..j all accepted), c_{-1} = 1) and
pattern length m_j = L + j (L the draft's match length). `ConfidenceAcceptance` learns a step's acceptance rate
per (m_j, p_j) cell, each cell shrunk toward p_j with `weight` pseudo-trials, so an empty cell trusts the
drafter. A round with a of k drafted tokens accepted observes steps 0..min(a, k − 1). Why: docs/architecture.md,
"Drafters".
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

MATCH_EDGES = (2, 3, 4, 8, 16)  # cells of m: [1, 2), [2, 3), [3, 4), [4, 8), [8, 16), [16, ∞)
STEP_EDGES = (0.3, 0.5, 0.7, 0.9)  # cells of p: [0, .3), [.3, .5), [.5, .7), [.7, .9), [.9, 1]


class ConfidenceAcceptance:
    """Exponentially weighted acceptance counts per (pattern length, step confidence) cell. Plain state."""

    def __init__(self, weight: float = 4.0, decay: float = 0.995):
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be finite and > 0, got {weight}")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must lie in [0, 1], got {decay}")
        self.weight, self.decay = weight, decay
        cells = (len(MATCH_EDGES) + 1) * (len(STEP_EDGES) + 1)
        self._successes = [0.0] * cells
        self._trials = [0.0] * cells

    @staticmethod
    def _cell(pattern_len: int, step: float) -> int:
        return bisect.bisect_right(MATCH_EDGES, pattern_len) * (len(STEP_EDGES) + 1) + bisect.bisect_right(
            STEP_EDGES, step)

    @staticmethod
    def steps(match_len: int, confidence: Sequence[float]) -> list[tuple[int, float]]:
        """(m_j, p_j) of each draft token: its pattern length and its own step probability."""
        out, previous = [], 1.0
        for j, c in enumerate(confidence):
            out.append((match_len + j, c / previous if previous > 0 else 0.0))
            previous = c
        return out

    def step_alpha(self, pattern_len: int, step: float) -> float:
        """P(a step is accepted | the steps before it were), given its pattern length and its own p."""
        cell = self._cell(pattern_len, step)
        return (self._successes[cell] + self.weight * step) / (self._trials[cell] + self.weight)

    def observe(self, match_len: int, confidence: Sequence[float], accepted: int) -> None:
        """Record one draft (its confidences, of length k ≥ 1) of which the first `accepted` tokens were kept."""
        if not confidence:
            return
        if isinstance(accepted, bool) or not isinstance(accepted, int) or not 0 <= accepted <= len(confidence):
            raise ValueError(f"accepted must be an int in [0, {len(confidence)}], got {accepted!r}")
        if self.decay < 1.0:  # age every cell once per observed draft
            self._successes = [self.decay * s for s in self._successes]
            self._trials = [self.decay * t for t in self._trials]
        for j, (m, p) in enumerate(self.steps(match_len, confidence)[: accepted + 1]):
            cell = self._cell(m, p)
            self._successes[cell] += 1.0 if j < accepted else 0.0
            self._trials[cell] += 1.0

    def draft_alpha(self, match_len: int, confidence: Sequence[float]) -> float | None:
        """The α a geometric model gives this draft: the mean calibrated step probability (None when empty)."""
        if not confidence:
            return None
        steps = self.steps(match_len, confidence)
        return sum(self.step_alpha(m, p) for m, p in steps) / len(steps)

    def summary(self) -> dict:
        """Cells with observations: (m cell, p cell) → (acceptance rate, weighted trials)."""
        width = len(STEP_EDGES) + 1
        return {f"{cell // width},{cell % width}": (s / t, t)
                for cell, (s, t) in enumerate(zip(self._successes, self._trials)) if t > 0}
