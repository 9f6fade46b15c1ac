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

Both run on the engine's device (`actors.scoring`): the round's tensors go there once and the results come
back to the host once, so a GPU target syncs with the host once per round.

`LocalTarget` is the in-process `TargetBackend`; `actors.remote.tp.TargetGroup` runs one `TargetStep` per
tensor-parallel shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from actors.contracts import NO_CROP, Engine, TargetBatch, TargetResult
from actors.devices import DeviceTimer
from actors.sampling import SeededGenerators
from actors.scoring import score_round


class TargetStep:
    """One target step over an `Engine`. `lead` (rank 0, or the only rank) post-processes the logits; other
    tensor-parallel ranks run the same forward for its all-reduces and return None."""

    def __init__(self, engine: Engine, lead: bool = True):
        self.engine = engine
        self.lead = lead
        self._generators = SeededGenerators(device=getattr(engine, "device", "cpu"))

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
        timer = DeviceTimer(self._generators.device).start()
        logits = engine.forward(batch.seq_ids, batch.tokens, rows)  # [B, T, V]
        timer.stop()
        if not self.lead:
            return None
        result = self.postprocess(logits, batch)  # brings the results to the host: the forward is done
        return replace(result, forward_s=timer.seconds())

    def postprocess(self, logits: torch.Tensor, batch: TargetBatch, forward_s: float = 0.0) -> TargetResult:
        # logits: [B, T, V] on the engine's device from `batch.num_logits()`: row b's scored positions first
        return score_round(logits, batch, self._generators.get, forward_s)

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
