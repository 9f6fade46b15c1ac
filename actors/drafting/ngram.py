"""Prompt lookup (vLLM's `prompt_lookup_min` / `prompt_lookup_max`): drafts copied from the context itself.

The longest suffix n-gram of the context, n in [min, max], that also occurs earlier; the tokens after its most
recent earlier occurrence with k tokens after it (else its earliest) are the draft. No match means no draft:
that row decodes plainly this round. Greedy q is one-hot (`draft_probs` None).

`ngram_lookup` is the rule, stateless: it rescans the whole context. `NgramDrafter` keeps an `NgramIndex` per
sequence id that indexes only the tokens appended since its last call and answers exactly as `ngram_lookup`
does, in O(new tokens · (max - min + 1) + k) per row whatever the context's length; a context that does not
continue what was indexed (shorter, or one of its last `CHECKED_TAIL` indexed tokens changed) is indexed again
from scratch. `release` frees a sequence's index. It costs microseconds, so it runs in the coordinator's process.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from actors.contracts import DraftBatch, DraftRequest

# Indexed tokens compared with each new context: a rollback or rewrite within them is caught exactly; tokens
# before them are committed, so a sequence id's context never changes there.
CHECKED_TAIL = 16


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


class NgramIndex:
    """Every n-gram (n_min ≤ n ≤ n_max) of one growing token stream, by start position.

    `_latest[gram]` is the latest start of `gram` (a tuple of n tokens) and `_prev[n][i]` the start before i of
    the n-gram starting at i (-1: none), so a gram's occurrences form a chain, newest first.
    """

    def __init__(self, n_min: int, n_max: int):
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}
        self._prev = {n: array("q") for n in range(n_min, n_max + 1)}
        self.n_min, self.n_max = n_min, n_max

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        held = len(self.tokens)
        self.tokens += tokens
        toks, latest = self.tokens, self._latest
        for n, prev in self._prev.items():
            first = max(0, held - n + 1)  # the n-grams that end in a new token start here
            for i, gram in enumerate(zip(*(toks[first + j :] for j in range(n))), first):
                prev.append(latest.get(gram, -1))
                latest[gram] = i

    def lookup(self, k: int) -> list[int]:
        """`ngram_lookup(self.tokens, k, n_min, n_max)`."""
        toks, length = self.tokens, len(self.tokens)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            prev = self._prev[n]
            i = prev[length - n]  # the suffix starts at length - n; its earlier occurrences chain from there
            earliest = i
            while i >= 0 and i + n + k > length:  # fewer than k tokens after i: at most k such occurrences
                earliest, i = i, prev[i]
            if earliest >= 0:
                start = (i if i >= 0 else earliest) + n
                return toks[start : start + k]
        return []


def _as_list(tokens: Sequence[int]) -> list[int]:
    return tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)


class NgramDrafter:
    """Prompt-lookup drafter; an `NgramIndex` per sequence id, freed by `release`. Greedy q is one-hot."""

    free_drafts = True  # a lookup costs microseconds: the coordinator may fill a round's width with drafts

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({prompt_lookup_max}) must be >= prompt_lookup_min ({prompt_lookup_min})"
            )
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self._indexes: dict[str, NgramIndex] = {}

    def active_ids(self) -> list[str]:
        """Sequences whose index is held (until `release`)."""
        return list(self._indexes)

    def _index(self, seq_id: str, context: Sequence[int]) -> NgramIndex:
        """The sequence's index, extended to `context` (indexed again when it is not a continuation)."""
        index = self._indexes.get(seq_id)
        held = len(index) if index is not None else 0
        checked = max(0, held - CHECKED_TAIL)
        tail = _as_list(context[checked:])
        if index is None or tail[: held - checked] != index.tokens[checked:held]:  # also when context is shorter
            index = self._indexes[seq_id] = NgramIndex(self.n_min, self.n_max)
            tail, held, checked = _as_list(context), 0, 0
        index.extend(tail[held - checked :])
        return index

    def propose(self, requests: list[DraftRequest]) -> DraftBatch:
        rows = [self._index(r.seq_id, r.context).lookup(r.gamma) if r.gamma else [] for r in requests]
        return DraftBatch.from_rows(rows)

    def release(self, seq_id: str) -> None:
        self._indexes.pop(seq_id, None)
