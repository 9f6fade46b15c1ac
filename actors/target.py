"""The target's side of a round: feed tokens, then turn logits into something small enough to ship.

One `TargetBatch` per round carries every active row of a unit: the crop that commits the previous round
(rolled-back drafts never stay in the KV cache), the tokens to feed (the pending token plus the row's drafts,
or a whole prompt at prefill), and how the row verifies. `TargetStep` runs where the logits are (in-process,
or on tensor-parallel rank 0) and returns a `TargetResult`:

- greedy and ASD rows: compact scores (argmax id, its logit, the draft token's logit per position), ~100 bytes
  a row instead of (K+1)·V floats; verification happens in the coordinator / policy actor.
- sampled rows: exact speculative sampling in place (`verify_sampled`), with the row's own generator, so no
  probability rows leave the process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from actors.drafters import SamplingSpec, SeededGenerators
from policies import PAD_TOKEN_ID
from policies.exact import process_logits, verify_sampled
from policies.scores import TargetScores, compact_scores

NO_CROP = -1


@dataclass(frozen=True)
class TargetBatch:
    seq_ids: list[str]
    crops: list[int]  # per row: KV length to keep before feeding, NO_CROP to keep all
    tokens: list[list[int]]  # per row: pending token + drafts (or the prompt at prefill)
    draft_ids: torch.Tensor  # [B, Kmax] long, PAD_TOKEN_ID beyond a row's drafts
    draft_lens: torch.Tensor  # [B] long
    sampling: list[SamplingSpec]  # per row
    draft_probs: torch.Tensor | None = None  # [B, Kmax, V] q rows of a model drafter, None = one-hot q
    prefill: bool = False  # rows are prompts: only the last position is scored


@dataclass(frozen=True)
class TargetResult:
    scores: TargetScores  # compact scores, all rows (sampled rows' entries unused)
    sampled_tokens: dict[int, list[int]] = field(default_factory=dict)  # row -> emitted tokens (sampled rows)
    sampled_accepted: dict[int, int] = field(default_factory=dict)  # row -> draft tokens accepted
    forward_s: float = 0.0  # model forward time inside the target


def num_logits(batch: TargetBatch) -> list[int]:
    """Logit rows each row needs: the last prompt position at prefill, pending + drafts otherwise."""
    return [1] * len(batch.tokens) if batch.prefill else [len(t) for t in batch.tokens]


class TargetStep:
    """Post-processing next to the logits; owns the per-sequence generators of seeded sampled rows."""

    def __init__(self):
        self._generators = SeededGenerators()

    def _generators_for(self, seq_id: str, spec: SamplingSpec) -> list[torch.Generator] | None:
        # a list of one: the row draws exactly K_b + 1 uniforms, whatever the batch's widest block
        gen = self._generators.get(seq_id, spec)
        return None if gen is None else [gen]

    def release(self, seq_id: str) -> None:
        self._generators.release(seq_id)

    def __call__(self, logits: torch.Tensor, batch: TargetBatch) -> TargetResult:
        # logits: [B, T, V] from `num_logits(batch)`: row b's scored positions first
        k_max = batch.draft_ids.shape[1]
        if logits.shape[1] < k_max + 1:  # positions no row drafted: never read, padded for the block shape
            logits = torch.nn.functional.pad(logits, (0, 0, 0, k_max + 1 - logits.shape[1]))
        rows = logits[:, : k_max + 1]  # [B, Kmax+1, V]
        scores = compact_scores(batch.draft_ids, rows)
        tokens: dict[int, list[int]] = {}
        accepted: dict[int, int] = {}
        for b, spec in enumerate(batch.sampling):
            if spec.greedy:
                continue
            p = process_logits(rows[b : b + 1], spec.temperature, spec.top_k, spec.top_p)  # [1, Kmax+1, V]
            q = None if batch.draft_probs is None else batch.draft_probs[b : b + 1]  # [1, Kmax, V]
            verdict = verify_sampled(
                batch.draft_ids[b : b + 1], q, p, generator=self._generators_for(batch.seq_ids[b], spec),
                draft_lens=batch.draft_lens[b : b + 1],
            )
            n = int(verdict.num_accepted[0])
            tokens[b] = verdict.tokens[0, : n + 1].tolist()
            accepted[b] = n
        return TargetResult(scores=scores, sampled_tokens=tokens, sampled_accepted=accepted)


class LocalTarget:
    """The target in the caller's process: one `Engine`, no tensor parallelism, no Ray."""

    def __init__(self, engine):
        self.engine = engine
        self.postprocess = TargetStep()

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def step(self, batch: TargetBatch) -> TargetResult:
        for seq_id, crop in zip(batch.seq_ids, batch.crops):
            if crop != NO_CROP:
                self.engine.crop(seq_id, crop)
        start = time.perf_counter()
        logits = self.engine.forward(batch.seq_ids, batch.tokens, num_logits(batch))  # [B, T, V]
        forward_s = time.perf_counter() - start
        result = self.postprocess(logits, batch)
        return TargetResult(result.scores, result.sampled_tokens, result.sampled_accepted, forward_s)

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            if seq_id in self.engine.active_ids():
                self.engine.release(seq_id)
            self.postprocess.release(seq_id)

    def active_ids(self) -> list[str]:
        return list(self.engine.active_ids())


__all__ = ["NO_CROP", "PAD_TOKEN_ID", "TargetBatch", "TargetResult", "TargetStep", "LocalTarget"]
