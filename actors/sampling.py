"""How a row turns logits into tokens, and the per-sequence random generators of seeded requests.

Both the drafter (sampling its drafts) and the target (speculative sampling) read a row's `SamplingSpec`;
each keeps its own `SeededGenerators` so a seeded request draws the same numbers whatever else is batched
with it. Generators live on the device of the tensors they sample (CUDA refuses a host generator there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    `salt` separates streams that share a seed (the drafter's from the target's); `device` is where the
    numbers are drawn: the engine's device."""

    def __init__(self, salt: int = 0, device: torch.device | str = "cpu"):
        self.salt = salt
        self.device = torch.device(device)
        self._by_seq: dict[str, torch.Generator] = {}

    def get(self, seq_id: str, spec: SamplingSpec) -> torch.Generator | None:
        if spec.seed is None:
            return None
        if seq_id not in self._by_seq:
            self._by_seq[seq_id] = torch.Generator(device=self.device).manual_seed(spec.seed ^ self.salt)
        return self._by_seq[seq_id]

    def release(self, seq_id: str) -> None:
        self._by_seq.pop(seq_id, None)
