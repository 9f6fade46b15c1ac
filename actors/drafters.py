"""Drafters: propose γ tokens per sequence behind one small interface.

- `NgramDrafter`: prompt lookup (vLLM's `prompt_lookup_min` / `prompt_lookup_max`). The longest suffix n-gram
  of the context, n in [min, max], that also occurs earlier; the tokens after its most recent earlier occurrence
  are the draft. No match means no draft: that row decodes plainly this round. Cost: microseconds, so it runs
  inside the coordinator's process rather than behind an actor round trip (~1.5 ms).
- `ModelDrafter`: a small causal LM with its own `Engine` (KV cache per sequence). Its vocabulary must equal the
  target's; `check_vocab` says so at load, naming both models.

A drafter proposes for a batch of `DraftRequest`s and returns one `DraftBatch`. Draft ids beyond a row's own
length are `PAD_TOKEN_ID`; `draft_lens[b]` may be below the γ asked for (the n-gram drafter finds fewer tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from policies import PAD_TOKEN_ID
from policies.exact import process_logits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSpec:
    """How a row turns logits into tokens; temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingSpec()


class SeededGenerators:
    """One `torch.Generator` per seeded sequence, so a seeded request draws the same numbers in any batch.

    `salt` separates streams that share a seed (the drafter's from the target's)."""

    def __init__(self, salt: int = 0):
        self.salt = salt
        self._by_seq: dict[str, torch.Generator] = {}

    def get(self, seq_id: str, spec: SamplingSpec) -> torch.Generator | None:
        if spec.seed is None:
            return None
        if seq_id not in self._by_seq:
            self._by_seq[seq_id] = torch.Generator().manual_seed(spec.seed ^ self.salt)
        return self._by_seq[seq_id]

    def release(self, seq_id: str) -> None:
        self._by_seq.pop(seq_id, None)


@dataclass(frozen=True)
class DraftRequest:
    seq_id: str
    context: Sequence[int]  # committed tokens: prompt + output so far
    gamma: int  # tokens wanted (≥ 1)
    sampling: SamplingSpec = GREEDY


@dataclass(frozen=True)
class DraftBatch:
    draft_ids: torch.Tensor  # [B, Kmax] long, padded with PAD_TOKEN_ID
    draft_lens: torch.Tensor  # [B] long, tokens actually proposed per row
    draft_probs: torch.Tensor | None  # [B, Kmax, V] float q rows when any row samples, else None

    @staticmethod
    def empty(batch_size: int) -> "DraftBatch":
        """No drafts: one padded column, since a block always has K ≥ 1 positions (draft_lens 0 = plain)."""
        return DraftBatch(
            draft_ids=torch.full((batch_size, 1), PAD_TOKEN_ID, dtype=torch.long),
            draft_lens=torch.zeros(batch_size, dtype=torch.long),
            draft_probs=None,
        )


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> DraftBatch: ...

    def release(self, seq_id: str) -> None: ...


def _pack(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), PAD_TOKEN_ID, dtype=torch.long)  # [B, Kmax]
    for b, row in enumerate(rows):
        if row:
            ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    return ids, torch.tensor([len(r) for r in rows], dtype=torch.long)


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
        ids, lens = _pack(rows)
        return DraftBatch(draft_ids=ids, draft_lens=lens, draft_probs=None)

    def release(self, seq_id: str) -> None:
        pass


def check_vocab(target_name: str, target_vocab: int, drafter_name: str, drafter_vocab: int) -> None:
    if target_vocab != drafter_vocab:
        raise ValueError(
            f"drafter {drafter_name!r} has vocabulary size {drafter_vocab} but target {target_name!r} has "
            f"{target_vocab}; speculative decoding needs the same tokenizer and vocabulary"
        )


class ModelDrafter:
    """A small causal LM drafting autoregressively, batched over rows, with a KV cache per sequence.

    The cache holds the committed context plus the previous round's drafts; each round crops it back to the
    longest common prefix with the new context and feeds only the tokens it has not seen.
    """

    def __init__(self, engine, name: str = "drafter"):
        self.engine = engine
        self.name = name
        self._cached: dict[str, list[int]] = {}  # tokens whose KV sits in the engine, per sequence
        self._generators = SeededGenerators(salt=0x5EED)

    def _sync(self, seq_id: str, context: Sequence[int]) -> list[int]:
        """Crop the cache to the common prefix with context; return the tokens to feed (never empty)."""
        cached = self._cached.get(seq_id, [])
        common = 0
        limit = min(len(cached), len(context))
        if limit:
            a = np.asarray(cached[:limit])
            b = np.asarray(context[:limit])
            diff = np.flatnonzero(a != b)
            common = int(diff[0]) if diff.size else limit
        common = min(common, len(context) - 1)  # always feed ≥ 1 token to get next-token logits
        if seq_id in self._cached:
            self.engine.crop(seq_id, common)
        self._cached[seq_id] = list(context)
        return list(context[common:])

    def propose(self, requests: list[DraftRequest]) -> DraftBatch:
        active = [i for i, r in enumerate(requests) if r.gamma > 0]
        rows: list[list[int]] = [[] for _ in requests]
        qs: list[list[torch.Tensor]] = [[] for _ in requests]
        sampling = any(not requests[i].sampling.greedy for i in active)
        feed = {i: self._sync(requests[i].seq_id, requests[i].context) for i in active}
        step = 0
        while active:
            seq_ids = [requests[i].seq_id for i in active]
            logits = self.engine.forward(seq_ids, [feed[i] for i in active])  # [B, T, V]
            last = torch.tensor([len(feed[i]) - 1 for i in active])
            z = logits[torch.arange(len(active)), last]  # [B, V]
            next_active = []
            for j, i in enumerate(active):
                spec = requests[i].sampling
                if spec.greedy:
                    token = int(z[j].argmax())
                    if sampling:
                        qs[i].append(torch.nn.functional.one_hot(torch.tensor(token), z.shape[-1]).float())
                else:
                    q = process_logits(z[j : j + 1], spec.temperature, spec.top_k, spec.top_p)[0]  # [V]
                    token = int(torch.multinomial(q, 1, generator=self._generators.get(requests[i].seq_id, spec)))
                    qs[i].append(q)
                rows[i].append(token)
                self._cached[requests[i].seq_id].append(token)
                if len(rows[i]) < requests[i].gamma:
                    feed[i] = [token]
                    next_active.append(i)
            active = next_active
            step += 1
        # The last draft token of each row was sampled, not fed: its KV is not cached.
        for i, r in enumerate(requests):
            if rows[i]:
                self._cached[r.seq_id].pop()
        ids, lens = _pack(rows)
        probs = None
        if sampling:
            vocab = self.engine.vocab_size
            probs = torch.zeros(len(requests), ids.shape[1], vocab)  # [B, Kmax, V]
            for i, q_rows in enumerate(qs):
                if q_rows:
                    probs[i, : len(q_rows)] = torch.stack(q_rows)
        return DraftBatch(draft_ids=ids, draft_lens=lens, draft_probs=probs)

    def release(self, seq_id: str) -> None:
        if self._cached.pop(seq_id, None) is not None:
            self.engine.release(seq_id)
        self._generators.release(seq_id)

    def active_ids(self) -> list[str]:
        return list(self._cached)
