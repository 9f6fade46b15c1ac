"""The target's side of a round: crop, feed, and turn logits into something small enough to ship.

`TargetStep` runs one `TargetBatch` on an `Engine`: it crops each row's KV cache (rolling back last round's
rejected drafts), feeds the pending token plus drafts (or a prompt chunk), and, where the logits are (in-process,
or tensor-parallel rank 0), returns the `TargetResult` of `actors.scoring.score_round`: compact scores for greedy
and ASD rows, exact speculative sampling in place for sampled rows (no probability rows leave the process), and
`SampledScores` for relaxed sampled rows. `LocalTarget` is the in-process `TargetBackend`;
`actors.remote.tp.TargetGroup` runs one `TargetStep` per tensor-parallel shard.
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
