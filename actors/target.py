"""The target's side of a round: commit, feed, and turn logits into something small enough to ship.

`TargetStep` wraps an `Engine` and runs one `TargetBatch`: it crops each row's KV cache (rolling back last
round's rejected drafts), feeds the pending token plus drafts (or the prompt), and, where the logits are
(in-process, or tensor-parallel rank 0), returns a `TargetResult`:

- greedy and ASD rows: compact scores (argmax id, its logit, the draft token's logit per position), ~100 bytes
  a row instead of (K+1)·V floats; verification happens in the coordinator / policy actor.
- sampled rows: exact speculative sampling in place (`verify_sampled`), with the row's own generator, so no
  probability rows leave the process;
- sampled rows an ASD arm verifies with the relaxed rule (`TargetBatch.relaxed_sampled`): the same draws from
  the same generator, reduced to `SampledScores` (`policies.asd_sampled.sampled_scores`) for the policy, which
  decides and charges their ledgers.

`LocalTarget` is the in-process `TargetBackend`; `actors.remote.tp.TargetGroup` runs one `TargetStep` per
tensor-parallel shard.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from actors.contracts import NO_CROP, Engine, TargetBatch, TargetResult
from actors.sampling import SamplingSpec, SeededGenerators
from policies.asd_sampled import sampled_scores
from policies.exact import process_logits, verify_sampled
from policies.scores import compact_scores


class TargetStep:
    """One target step over an `Engine`. `lead` (rank 0, or the only rank) post-processes the logits; other
    tensor-parallel ranks run the same forward for its all-reduces and return None."""

    def __init__(self, engine: Engine, lead: bool = True):
        self.engine = engine
        self.lead = lead
        self._generators = SeededGenerators()

    def __call__(self, batch: TargetBatch) -> TargetResult | None:
        engine = self.engine
        for seq_id, crop in zip(batch.seq_ids, batch.crops):  # validate all before changing any
            if crop != NO_CROP and not 0 <= crop <= engine.length(seq_id):
                raise ValueError(f"crops: {crop} out of [0, {engine.length(seq_id)}] for {seq_id!r}")
        for seq_id, crop in zip(batch.seq_ids, batch.crops):
            if crop != NO_CROP:
                engine.crop(seq_id, crop)
        # only the lead's logits are used: the other ranks skip most of the lm_head
        rows = batch.num_logits() if self.lead else [1] * len(batch.seq_ids)
        start = time.perf_counter()
        logits = engine.forward(batch.seq_ids, batch.tokens, rows)  # [B, T, V]
        forward_s = time.perf_counter() - start
        return self.postprocess(logits, batch, forward_s) if self.lead else None

    def postprocess(self, logits: torch.Tensor, batch: TargetBatch, forward_s: float = 0.0) -> TargetResult:
        # logits: [B, T, V] from `batch.num_logits()`: row b's scored positions first
        k_max = batch.draft_ids.shape[1]
        if logits.shape[1] < k_max + 1:  # positions no row drafted: never read, padded for the block shape
            logits = torch.nn.functional.pad(logits, (0, 0, 0, k_max + 1 - logits.shape[1]))
        rows = logits[:, : k_max + 1]  # [B, Kmax+1, V]
        scores = compact_scores(batch.draft_ids, rows)
        tokens: dict[int, list[int]] = {}
        accepted: dict[int, int] = {}
        relaxed = {}
        for b, spec in enumerate(batch.sampling):
            if spec.greedy:
                continue
            p = process_logits(rows[b : b + 1], spec.temperature, spec.top_k, spec.top_p)  # [1, Kmax+1, V]
            q = None if batch.draft_probs is None else batch.draft_probs[b : b + 1]  # [1, Kmax, V]
            generator = self._generator(batch.seq_ids[b], spec)
            config = batch.relaxed_sampled.get(b)
            if config is not None:
                relaxed[b] = sampled_scores(batch.draft_ids[b : b + 1], q, p, config, generator,
                                            batch.draft_lens[b : b + 1]).to("cpu")
                continue
            verdict = verify_sampled(
                batch.draft_ids[b : b + 1], q, p, generator=generator, draft_lens=batch.draft_lens[b : b + 1],
            )
            n = int(verdict.num_accepted[0])
            tokens[b] = verdict.tokens[0, : n + 1].tolist()
            accepted[b] = n
        return TargetResult(scores, tokens, accepted, forward_s, relaxed)

    def _generator(self, seq_id: str, spec: SamplingSpec) -> list[torch.Generator] | None:
        # a list of one: the row draws exactly K_b + 1 uniforms, whatever the batch's widest block
        gen = self._generators.get(seq_id, spec)
        return None if gen is None else [gen]

    def release(self, seq_ids: Sequence[str]) -> None:
        for seq_id in seq_ids:
            self.engine.release(seq_id)  # unknown ids are ignored
            self._generators.release(seq_id)


class LocalTarget:
    """The target in the caller's process: one `Engine`, no tensor parallelism, no Ray."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.run = TargetStep(engine)

    async def step(self, batch: TargetBatch) -> TargetResult:
        return self.run(batch)

    async def release(self, seq_ids: Sequence[str]) -> None:
        self.run.release(seq_ids)

    async def active_ids(self) -> list[str]:
        return list(self.engine.active_ids())

    async def rebuild(self) -> None:
        """An in-process engine fails only with a bug; drop every sequence so the next requests start clean."""
        self.run.release(self.engine.active_ids())

    async def close(self) -> None:
        pass
