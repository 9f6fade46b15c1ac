"""Prompt lookup (vLLM's `prompt_lookup_min` / `prompt_lookup_max`): drafts copied from the context itself.

The longest suffix n-gram of the context, n in [min, max], that also occurs earlier; the tokens after its most
recent earlier occurrence are the draft. No match means no draft: that row decodes plainly this round. Greedy
q is one-hot (`draft_probs` None). It costs microseconds, so it runs in the coordinator's process.
"""

from __future__ import annotations

import numpy as np

from actors.contracts import DraftBatch, DraftRequest


def ngram_lookup(context: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens following an earlier occurrence of the longest suffix n-gram (n_min ≤ n ≤ n_max).

    Among occurrences, the most recent one with k tokens after it (locality: the copy being edited), else
    the earliest (the longest continuation, e.g. inside a repeating loop).
    """
    length = len(context)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = context[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], n)  # [L-n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= length]
            start = int(full[-1] if full.size else hits[0]) + n
            return context[start : start + k].tolist()
    return []


class NgramDrafter:
    """Prompt-lookup drafter; stateless, so `release` has nothing to free. Greedy q is one-hot (probs None)."""

    free_drafts = True  # a lookup costs microseconds: the coordinator may fill a round's width with drafts

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({prompt_lookup_max}) must be >= prompt_lookup_min ({prompt_lookup_min})"
            )
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, requests: list[DraftRequest]) -> DraftBatch:
        rows = [
            ngram_lookup(np.asarray(r.context, dtype=np.int64), r.gamma, self.n_min, self.n_max) if r.gamma else []
            for r in requests
        ]
        return DraftBatch.from_rows(rows)

    def release(self, seq_id: str) -> None:
        pass


