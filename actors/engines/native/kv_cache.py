"""The slot KV cache and the per-forward description of where a batch sits in it.

Layout per layer: keys and values [slots, Hkv, capacity, D]. A sequence owns one slot (a row); its cached
positions are 0 .. length-1 of that row. Both the slot count and the capacity grow in chunks up to the
Engine's limits, so a cache sized for 64 sequences of 8k tokens costs nothing until it is used. Growing
copies the cache once; steady-state steps never copy it: a batch whose slots form a contiguous range
reads a view, any other batch gathers only its own rows up to its longest length. The Engine keeps the
occupied slots packed at 0..n-1, so a batch of all its sequences is always a view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SLOT_CHUNK = 8  # slots added per growth
POSITION_CHUNK = 256  # positions added per growth


@dataclass(frozen=True)
class CacheBatch:
    """Where the B rows of one forward sit in the cache.

    starts[b] is row b's cached length before this forward; its new tokens take positions
    starts[b] .. starts[b] + T - 1 (positions past its own token count are padding).
    """

    slots: Tensor  # [B] long
    positions: Tensor  # [B, T] long
    mask: Tensor  # [B, 1, T, S] bool: query t of row b may attend key j
    kv_len: int  # S = max_b(starts[b] + new[b]): keys read per row
    slot_range: tuple[int, int] | None  # (lo, hi) when slots == arange(lo, hi): read a view

    @classmethod
    def build(cls, slots: list[int], starts: list[int], num_new: list[int], device: torch.device) -> "CacheBatch":
        T = max(num_new)
        slots_t = torch.tensor(slots, dtype=torch.long, device=device)  # [B]
        positions = torch.tensor(starts, dtype=torch.long, device=device)[:, None] + torch.arange(T, device=device)
        kv_len = max(s + n for s, n in zip(starts, num_new))
        keys = torch.arange(kv_len, device=device)  # [S]
        mask = keys[None, None, :] <= positions[:, :, None]  # [B, T, S] causal over cache + new tokens
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        return cls(
            slots=slots_t,
            positions=positions,
            mask=mask[:, None],
            kv_len=kv_len,
            slot_range=(slots[0], slots[0] + len(slots)) if contiguous else None,
        )

    def window_mask(self, window: int) -> Tensor:
        """The causal mask restricted to the last `window` positions (Mistral-style sliding window)."""
        keys = torch.arange(self.kv_len, device=self.positions.device)  # [S]
        recent = keys[None, None, :] > self.positions[:, :, None] - window  # [B, T, S]
        return self.mask & recent[:, None]


class SlotCache:
    """Keys and values of every layer for up to `max_slots` sequences."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.num_slots = 0
        self.capacity = 0
        self.k: list[Tensor] = []  # per layer [slots, Hkv, capacity, D]
        self.v: list[Tensor] = []

    def reserve(self, num_slots: int, length: int) -> None:
        """Grow (in chunks) so slots 0..num_slots-1 can hold `length` positions each."""
        if num_slots <= self.num_slots and length <= self.capacity:
            return
        slots = max(self.num_slots, -(-num_slots // SLOT_CHUNK) * SLOT_CHUNK)
        capacity = max(self.capacity, -(-length // POSITION_CHUNK) * POSITION_CHUNK)
        shape = (slots, self.num_kv_heads, capacity, self.head_dim)
        # zeros, not empty: masked keys must still be finite, or 0 * NaN poisons the attention output
        grown = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * self.num_layers)]
        for old, new in zip(self.k + self.v, grown):
            new[: self.num_slots, :, : self.capacity] = old
        self.k, self.v = grown[: self.num_layers], grown[self.num_layers :]
        self.num_slots, self.capacity = slots, capacity

    def write(self, layer: int, batch: CacheBatch, k: Tensor, v: Tensor) -> None:
        """Store new keys/values k, v [B, T, Hkv, D] at the batch's positions."""
        index = (batch.slots[:, None], slice(None), batch.positions)  # -> [B, T, Hkv, D]
        self.k[layer][index] = k
        self.v[layer][index] = v

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (every layer)."""
        for cache in self.k + self.v:
            cache[dst, :, :length] = cache[src, :, :length]

    def read(self, layer: int, batch: CacheBatch) -> tuple[Tensor, Tensor]:
        """Keys and values [B, Hkv, S, D] of the batch's rows up to S = batch.kv_len."""
        if batch.slot_range is not None:
            lo, hi = batch.slot_range
            return self.k[layer][lo:hi, :, : batch.kv_len], self.v[layer][lo:hi, :, : batch.kv_len]
        return self.k[layer][batch.slots, :, : batch.kv_len], self.v[layer][batch.slots, :, : batch.kv_len]
