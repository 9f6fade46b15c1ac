"""The suffix drafter: drafts continue the longest earlier match of the context's recent tokens, in the request's
own prompt and output or in the unit's cache of recent outputs, each token with a confidence (SuffixDecoding,
Oliaro et al. 2024; matching in `suffix_index`, drafting in `suffix_propose`).

Per request it keeps a `SuffixIndex` of the committed tokens, extended by the tokens committed since the last
round (microseconds), and rebuilt if the context is not a continuation of what it indexed. A draft stops
before the first token whose confidence, an estimate of P(all draft tokens up to it accepted), falls below
`min_confidence`, so the confidence sets each row's draft length up to the policy's γ, and rows with nothing
likely propose nothing (plain decoding that round). `release` frees the request's index and adds its output
to the unit's `SuffixCache` (bounded to `cache_tokens`; 0 turns it off). Greedy q is one-hot (probs None).

Like prompt lookup it costs microseconds and runs in the coordinator's process (`free_drafts`).
"""

from __future__ import annotations

from actors.contracts import DraftBatch, DraftRequest
from actors.drafting.suffix_index import SuffixIndex
from actors.drafting.suffix_propose import SuffixCache, propose


class SuffixDrafter:
    """Suffix-automaton drafter with per-token confidences; state per sequence id, freed by `release`."""

    free_drafts = True  # a proposal costs microseconds: the coordinator may fill a round's width with drafts

    def __init__(self, max_depth: int = 32, min_confidence: float = 0.4, cache_tokens: int = 65536):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must lie in [0, 1], got {min_confidence}")
        if cache_tokens < 0:
            raise ValueError(f"cache_tokens must be >= 0, got {cache_tokens}")
        self.max_depth, self.min_confidence = max_depth, min_confidence
        self.cache = SuffixCache(cache_tokens, max_depth) if cache_tokens else None
        self._indexes: dict[str, SuffixIndex] = {}
        self._prompt_lens: dict[str, int] = {}  # tokens indexed before the first draft: prompt + first token

    def active_ids(self) -> list[str]:
        """Sequences whose index is held (until `release`)."""
        return list(self._indexes)

    def _index(self, seq_id: str, context) -> SuffixIndex:
        """The sequence's index, extended to `context` (rebuilt when the context is not a continuation)."""
        index = self._indexes.get(seq_id)
        n = len(index) if index is not None else 0
        if index is None or len(context) < n or (n and context[n - 1] != index.tail(1)[0]):
            index = self._indexes[seq_id] = SuffixIndex(self.max_depth)
            self._prompt_lens[seq_id] = len(context)
            n = 0
        if len(context) > n:
            index.extend(context[n:])
        return index

    def propose(self, requests: list[DraftRequest]) -> DraftBatch:
        drafts = [propose(self._index(r.seq_id, r.context), self.cache, r.gamma, self.min_confidence)
                  for r in requests]
        return DraftBatch.from_rows([d.tokens for d in drafts], confidence=[d.confidence for d in drafts],
                                    match_lens=[d.match_len for d in drafts])

    def release(self, seq_id: str) -> None:
        index = self._indexes.pop(seq_id, None)
        prompt_len = self._prompt_lens.pop(seq_id, 0)
        if index is not None and self.cache is not None and len(index) > prompt_len:
            self.cache.add(index.tail(len(index) - prompt_len + 1))  # the output (its first token included)
