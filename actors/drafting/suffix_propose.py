"""Drafts from suffix indexes (SuffixDecoding, Oliaro et al. 2024): the request's own `SuffixIndex` and a unit's
`SuffixCache` of recent outputs each propose the most frequent continuation of the context, with a confidence
per drafted token (terms: `suffix_index`).

A step's probability is p = (N_c + w·π(m)) / (N + w) (`ConfidencePrior`); draft token j's confidence is
Π_{i ≤ j} p_i, an estimate of P(draft tokens 0..j all accepted), non-increasing along the draft. A draft stops
before the first token below `min_confidence`, and the source with the higher expected accepted length
(Σ_j confidence_j) wins. The rule: docs/architecture.md, "Drafters".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from actors.drafting.suffix_index import SEPARATOR, Match, SuffixIndex

SOURCE_REQUEST = "request"
SOURCE_CACHE = "cache"


@dataclass(frozen=True)
class ConfidencePrior:
    """The prior each draft step's probability is shrunk toward: `weight` pseudo-occurrences that continue
    correctly with probability π(m) = m / (m + half_length), m the pattern length at that step."""

    weight: float = 2.0  # both fitted by likelihood to SmolLM2-135M's greedy traces (edit, code, summary, chat)
    half_length: float = 2.0

    def __post_init__(self):
        if self.weight < 0:
            raise ValueError(f"weight must be >= 0, got {self.weight}")
        if self.half_length < 0:
            raise ValueError(f"half_length must be >= 0, got {self.half_length}")

    def step(self, chosen: int, total: int, pattern_len: int) -> float:
        """p = (N_c + w·π(m)) / (N + w): probability that the chosen continuation is the next token."""
        prior = pattern_len / (pattern_len + self.half_length) if pattern_len + self.half_length > 0 else 1.0
        return (chosen + self.weight * prior) / (total + self.weight)


DEFAULT_PRIOR = ConfidencePrior()
# Matches in other requests' outputs continue far less often than matches in the request itself (SmolLM2
# traces, docs/benchmarks.md), so the cache's steps lean on a heavier, slower-rising prior.
CACHE_PRIOR = ConfidencePrior(weight=16.0, half_length=8.0)


@dataclass(frozen=True)
class Draft:
    """Proposed tokens; `confidence[j]` estimates P(tokens 0..j all accepted), non-increasing in j."""

    tokens: tuple[int, ...]
    confidence: tuple[float, ...]
    match_len: int  # L of the pattern the draft continues (0 when nothing is proposed)
    source: str | None  # SOURCE_REQUEST, SOURCE_CACHE, or None when nothing is proposed

    @property
    def expected_accepted(self) -> float:
        """E[accepted draft tokens] = Σ_j P(tokens 0..j accepted) under the confidence estimates."""
        return sum(self.confidence)

    @staticmethod
    def empty() -> Draft:
        return Draft(tokens=(), confidence=(), match_len=0, source=None)


_Cursor = tuple[SuffixIndex, int, int]  # (index, state, matched)


class SuffixCache:
    """A unit's recent finished outputs, searchable like a request's stream, bounded to `max_tokens`.

    Storage is `segments` suffix indexes of at most max_tokens // segments tokens each (a sequence's tokens
    plus its `SEPARATOR`); new sequences go to the newest, and when it is full a new one starts and the oldest
    beyond `segments` is dropped. So the tokens held never exceed max_tokens, and eviction is oldest-first in
    steps of one segment. A sequence longer than a segment keeps its beginning (openings repeat most often
    across requests). Counts add up over segments; ties go to the newest.
    """

    def __init__(self, max_tokens: int, max_depth: int = 32, segments: int = 4):
        if segments < 1:
            raise ValueError(f"segments must be >= 1, got {segments}")
        if max_tokens < 2 * segments:
            raise ValueError(f"max_tokens must be >= 2 * segments ({2 * segments}), got {max_tokens}")
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_tokens, self.max_depth, self.segments = max_tokens, max_depth, segments
        self.segment_tokens = max_tokens // segments
        self._segments: deque[SuffixIndex] = deque()  # oldest first

    @property
    def num_tokens(self) -> int:
        """Tokens held, separators included."""
        return sum(len(s) for s in self._segments)

    def add(self, tokens: Iterable[int]) -> None:
        """Add one finished sequence (an output, or a prompt)."""
        tokens = [int(t) for t in tokens][: self.segment_tokens - 1]
        if not tokens:
            return
        if min(tokens) < 0:
            raise ValueError(f"tokens must be >= 0, got {min(tokens)}")
        if not self._segments or len(self._segments[-1]) + len(tokens) + 1 > self.segment_tokens:
            self._segments.append(SuffixIndex(self.max_depth))
            if len(self._segments) > self.segments:
                self._segments.popleft()
        self._segments[-1]._append(tokens + [SEPARATOR])

    def _cursors(self, pattern: Sequence[int]) -> tuple[list[_Cursor], int]:
        """Each segment's cursor for `pattern`, and L: the longest pattern suffix with a continuation anywhere."""
        cursors = [(segment, *segment._cursor(pattern)) for segment in self._segments]
        longest = max((index._continued(state, matched)[1] for index, state, matched in cursors), default=0)
        return cursors, longest

    def match(self, pattern: Sequence[int]) -> Match:
        """The longest suffix of `pattern` (≤ max_depth) found in the cache with a continuation, and its
        continuation counts summed over segments."""
        cursors, length = self._cursors(pattern)
        counts: dict[int, int] = {}
        for index, state in _participants(cursors, length) if length else ():
            for token, n in index._counts(state).items():
                counts[token] = counts.get(token, 0) + n
        return Match(length, counts)


def _participants(cursors: list[_Cursor], pattern_len: int) -> list[tuple[SuffixIndex, int]]:
    """(index, state of the pattern) for the indexes that hold the whole pattern."""
    return [(index, index._at_length(state, pattern_len)) for index, state, matched in cursors
            if matched >= pattern_len]


def _walk(cursors: list[_Cursor], pattern_len: int, max_depth: int, max_tokens: int, min_confidence: float,
          prior: ConfidencePrior) -> tuple[list[int], list[float]]:
    """Follow the most frequent continuation of the pattern (its last `pattern_len` tokens, tracked by one
    cursor per index) over all indexes that hold it."""
    tokens: list[int] = []
    confidence: list[float] = []
    running = 1.0
    while len(tokens) < max_tokens:
        holders = _participants(cursors, pattern_len)
        if len(holders) == 1:
            best, chosen, total = holders[0][0]._best_continuation(holders[0][1])
        else:
            best, chosen, total = _merged_best_continuation(holders)
        if not total:
            break
        running *= prior.step(chosen, total, pattern_len)
        if running < min_confidence:
            break
        tokens.append(best)
        confidence.append(running)
        # An index that lacks the extended pattern may hold it again once its oldest token drops (at max_depth),
        # so every cursor advances, not only the holders'.
        cursors = [(index, *index._advance(state, matched, best)) for index, state, matched in cursors]
        pattern_len = min(pattern_len + 1, max_depth)
    return tokens, confidence


def _merged_best_continuation(holders: list[tuple[SuffixIndex, int]]) -> tuple[int, int, int]:
    """`_best_continuation` over several indexes (oldest first): counts add up; ties go to the most recent
    occurrence, in the newest index."""
    totals: dict[int, int] = {}
    recency: dict[int, tuple[int, int]] = {}
    for rank, (index, state) in enumerate(holders):
        for token, child in index.children(state):
            if token != SEPARATOR:
                totals[token] = totals.get(token, 0) + index._count[child]
                recency[token] = max(recency.get(token, (-1, -1)), (rank, index._last_end[child]))
    if not totals:
        return -1, 0, 0
    best = max(totals, key=lambda t: (totals[t], recency[t]))
    return best, totals[best], sum(totals.values())


def propose(index: SuffixIndex | None, cache: SuffixCache | None, max_tokens: int, min_confidence: float = 0.3,
            prior: ConfidencePrior = DEFAULT_PRIOR, cache_prior: ConfidencePrior = CACHE_PRIOR,
            context_tail: Sequence[int] | None = None) -> Draft:
    """Up to `max_tokens` draft tokens continuing the context, from the request's own index or the cache,
    whichever expects more accepted tokens (ties: the request). `context_tail` (the context's last tokens,
    used to search the cache) defaults to the index's tail. Returns `Draft.empty()` when nothing matches or the
    first token's confidence is below `min_confidence`."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if not 0.0 <= min_confidence <= 1.0:
        raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
    if max_tokens == 0:
        return Draft.empty()
    best = Draft.empty()
    if index is not None and len(index):
        state, matched = index._own_cursor()
        length = index._continued(state, matched)[1]
        if length:
            tokens, confidence = _walk([(index, state, matched)], length, index.max_depth, max_tokens,
                                       min_confidence, prior)
            if tokens:
                best = Draft(tuple(tokens), tuple(confidence), length, SOURCE_REQUEST)
    if cache is not None:
        if context_tail is None:
            context_tail = index.tail(cache.max_depth) if index is not None else ()
        cursors, length = cache._cursors(context_tail)
        if length:
            tokens, confidence = _walk(cursors, length, cache.max_depth, max_tokens, min_confidence, cache_prior)
            if tokens and sum(confidence) > best.expected_accepted:
                best = Draft(tuple(tokens), tuple(confidence), length, SOURCE_CACHE)
    return best
