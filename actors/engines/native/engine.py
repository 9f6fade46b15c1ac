"""The Engine: sequences by id over a CausalLM and its slot KV cache.

Prefill, decode and teacher-forced scoring are all one call, `forward(seq_ids, tokens)`: each row's tokens are
appended to that sequence's cache (the sequence is created on first use) and logits come back for them, all
rows in ONE batched forward however their cached lengths and new-token counts differ. `crop` rolls back
rejected draft positions; `release` frees the slot.

Rows are run in slot order (so a contiguous run of slots reads cache views, see actors.kv_cache) and
returned in the caller's order; releasing compacts the slots so that run is the common case.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from actors.engines.native.kv_cache import CacheBatch, SlotCache
from actors.engines.native.model import CausalLM


class Engine:
    """Batched forward over per-sequence KV caches.

    max_slots: most sequences cached at once. max_seq_len: most cached positions per sequence
    (default: the model's max_position_embeddings).
    """

    def __init__(self, model: CausalLM, max_slots: int = 64, max_seq_len: int | None = None):
        if max_slots < 1:
            raise ValueError(f"max_slots: must be >= 1, got {max_slots}")
        self.model = model
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len or model.args.max_position_embeddings
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len: must be >= 1, got {max_seq_len}")
        args = model.args
        self.cache = SlotCache(args.num_layers, args.num_kv_heads, args.head_dim, model.dtype, model.device)
        self._slot: dict[str, int] = {}
        self._length: dict[str, int] = {}

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    def active_ids(self) -> list[str]:
        return list(self._slot)

    def length(self, seq_id: str) -> int:
        """Cached positions of a sequence."""
        if seq_id not in self._length:
            raise ValueError(f"seq_id: unknown sequence {seq_id!r}")
        return self._length[seq_id]

    def crop(self, seq_id: str, length: int) -> None:
        """Keep the first `length` cached positions of a sequence (roll back rejected drafts)."""
        current = self.length(seq_id)
        if not 0 <= length <= current:
            raise ValueError(f"length: must be in [0, {current}] for {seq_id!r}, got {length}")
        self._length[seq_id] = length  # stale positions past `length` are masked, then overwritten

    def release(self, seq_id: str) -> bool:
        """Free a sequence's slot. Unknown ids are ignored (abort paths may release twice); True if freed.

        The sequence in the highest slot moves into the freed one (one copy of its cached positions), so the
        occupied slots stay 0..n-1 and a batch of every active sequence reads the cache as a view.
        """
        self._length.pop(seq_id, None)
        freed = self._slot.pop(seq_id, None)
        if freed is None:
            return False
        if self._slot:
            last_id = max(self._slot, key=self._slot.get)
            if self._slot[last_id] > freed:
                self.cache.move(self._slot[last_id], freed, self._length[last_id])
                self._slot[last_id] = freed
        return True

    def forward(
        self, seq_ids: Sequence[str], tokens: Sequence[Sequence[int]], num_logits: Sequence[int] | None = None
    ) -> Tensor:
        """Append tokens[b] to sequence seq_ids[b] and return logits.

        Without num_logits: [B, T_max, V], row b valid for its first len(tokens[b]) positions.
        With num_logits: [B, max(num_logits), V], row b holding the logits of its LAST num_logits[b] tokens
        (in order; valid for its first num_logits[b] rows). Prefill needs 1, scoring a block of K drafts K + 1:
        the lm_head is then run only where needed.
        """
        self._validate(seq_ids, tokens, num_logits)
        order = sorted(range(len(seq_ids)), key=lambda b: self._slot.get(seq_ids[b], self.max_slots))
        for b in order:  # new sequences take the lowest free slots, in batch order
            if seq_ids[b] not in self._slot:
                self._slot[seq_ids[b]] = min(set(range(self.max_slots)) - set(self._slot.values()))
                self._length[seq_ids[b]] = 0
        order.sort(key=lambda b: self._slot[seq_ids[b]])

        slots = [self._slot[seq_ids[b]] for b in order]
        starts = [self._length[seq_ids[b]] for b in order]
        counts = [len(tokens[b]) for b in order]
        T = max(counts)
        device = self.model.device
        ids = torch.zeros(len(order), T, dtype=torch.long, device=device)  # [B, T], right-padded
        for i, b in enumerate(order):
            ids[i, : counts[i]] = torch.as_tensor(tokens[b], dtype=torch.long)
        logit_index = None
        if num_logits is not None:
            want = [num_logits[b] for b in order]
            K = max(want)
            # row i, column j -> position counts[i] - want[i] + j (clamped for padding columns)
            logit_index = torch.tensor(
                [[min(n - k + j, n - 1) for j in range(K)] for n, k in zip(counts, want)], dtype=torch.long, device=device
            )  # [B, K]
        self.cache.reserve(max(slots) + 1, max(starts) + T)
        batch = CacheBatch.build(slots, starts, counts, device)
        logits = self.model(ids, self.cache, batch, logit_index)  # [B, K or T, V] in slot order
        for i, b in enumerate(order):
            self._length[seq_ids[b]] += counts[i]
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return logits if order == sorted(order) else logits[inverse.to(device)]

    def forward_last(self, seq_ids: Sequence[str], tokens: Sequence[Sequence[int]]) -> Tensor:
        """Logits [B, V] after each row's last new token (prefill / plain decode)."""
        return self.forward(seq_ids, tokens, [1] * len(seq_ids))[:, 0]

    def _validate(self, seq_ids, tokens, num_logits) -> None:
        if isinstance(seq_ids, str) or not len(seq_ids):
            raise ValueError("seq_ids: expected a non-empty list of sequence ids")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids: duplicate ids in {list(seq_ids)}")
        if len(tokens) != len(seq_ids):
            raise ValueError(f"tokens: {len(tokens)} rows for {len(seq_ids)} seq_ids")
        vocab = self.vocab_size
        for sid, row in zip(seq_ids, tokens):
            if not len(row):
                raise ValueError(f"tokens: empty token list for {sid!r}")
            if min(row) < 0 or max(row) >= vocab:
                raise ValueError(f"tokens: ids for {sid!r} must be in [0, {vocab})")
            if self._length.get(sid, 0) + len(row) > self.max_seq_len:
                raise ValueError(
                    f"tokens: {sid!r} would hold {self._length.get(sid, 0) + len(row)} positions, "
                    f"over max_seq_len {self.max_seq_len}"
                )
        new = sum(sid not in self._slot for sid in seq_ids)
        if len(self._slot) + new > self.max_slots:
            raise ValueError(f"seq_ids: {new} new sequences do not fit: {len(self._slot)} of max_slots {self.max_slots} in use")
        if num_logits is not None:
            if len(num_logits) != len(seq_ids):
                raise ValueError(f"num_logits: {len(num_logits)} entries for {len(seq_ids)} seq_ids")
            for sid, k, row in zip(seq_ids, num_logits, tokens):
                if not 1 <= k <= len(row):
                    raise ValueError(f"num_logits: {k} for {sid!r} must be in [1, {len(row)}]")
