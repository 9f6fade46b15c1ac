"""A small causal LM drafting autoregressively, batched over rows, with its own `Engine` (KV cache per sequence).

Its vocabulary must equal the target's; `check_vocab` says so at load, naming both models. When any row samples,
the q rows of every drafted position come back (`draft_probs`), one-hot for greedy rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from actors.contracts import DraftBatch, DraftRequest, Engine
from actors.sampling import SeededGenerators
from policies.exact import process_logits


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

    free_drafts = False  # every drafted position costs a drafter forward

    def __init__(self, engine: Engine, name: str = "drafter"):
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
        # The last draft token of each row was sampled, not fed: its KV is not cached.
        for i, r in enumerate(requests):
            if rows[i]:
                self._cached[r.seq_id].pop()
        probs = None
        if sampling:
            width = max(1, max(len(r) for r in rows))
            probs = torch.zeros(len(requests), width, self.engine.vocab_size)  # [B, Kmax, V]
            for i, q_rows in enumerate(qs):
                if q_rows:
                    probs[i, : len(q_rows)] = torch.stack(q_rows)
        return DraftBatch.from_rows(rows, probs)

    def release(self, seq_id: str) -> None:
        if self._cached.pop(seq_id, None) is not None:
            self.engine.release(seq_id)
        self._generators.release(seq_id)

    def active_ids(self) -> list[str]:
        return list(self._cached)
