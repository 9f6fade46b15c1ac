"""The slot KV cache and the per-forward description of where a batch sits in it.

Layout per layer: keys and values [slots, Hkv, capacity, D]. A sequence owns one slot (a row); its cached
positions are 0 .. length-1 of that row. The cache is either **grown** in chunks up to the Engine's limits
(the CPU default: a cache sized for 64 sequences of 8k tokens costs nothing until it is used; growing copies
it once) or **preallocated** at its full size (on GPUs: fixed addresses, which CUDA graphs need, and no
copies). Steady-state steps never copy it: a batch whose slots form a contiguous range reads a view, any
other batch gathers only its own rows up to its longest length.

The last position of every row is the **junk position**: tokens that are padding (positions past a row's
own new tokens, rows of a fixed-shape batch that hold no sequence) write their keys and values there. It is
never a real position (capacity > the longest sequence), so no real query ever reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SLOT_CHUNK = 8  # slots added per growth
POSITION_CHUNK = 256  # positions added per growth
KEY_ALIGN = 16  # keys read per row are a multiple of this: fused attention kernels want aligned masks


@dataclass(frozen=True)
class CacheBatch:
    """Where the B rows of one forward sit in the cache, all on the model's device.

    Row b had `starts[b]` cached positions before this forward; its new tokens take positions starts[b],
    starts[b] + 1, ... (columns past its own count are padding). Attention biases use the grouped-query
    layout of `actors.engines.native.model.Attention`: row g·T + t of kv head h is query head h·G + g at
    new token t, so one additive bias [B, 1, G·T, S] serves every head without repeating keys.
    """

    slots: Tensor  # [B] long
    positions: Tensor  # [B, T] long, for RoPE and the causal mask
    write_positions: Tensor  # [B, T] long, where keys and values are stored: padding goes to the junk position
    biases: dict  # window (None = full attention) -> [B, 1, G*T, S] additive mask in the model's dtype
    kv_len: int  # S: keys read per row
    slot_range: tuple[int, int] | None  # (lo, hi) when slots == arange(lo, hi): read a view

    @classmethod
    def build(cls, slots: Tensor, starts: Tensor, counts: Tensor, num_tokens: int, kv_len: int,
              slot_range: tuple[int, int] | None, junk: int, dtype: torch.dtype, group: int,
              windows: tuple[int | None, ...] = (None,)) -> CacheBatch:
        """From device tensors slots, starts, counts [B] and host ints: T = `num_tokens`, S = `kv_len`.

        Reads no tensor values on the host, so it runs inside a CUDA graph."""
        device = starts.device
        steps = torch.arange(num_tokens, device=device)  # [T]
        positions = starts[:, None] + steps  # [B, T]
        write_positions = torch.where(steps < counts[:, None], positions, junk)  # [B, T]
        keys = torch.arange(kv_len, device=device)  # [S]
        causal = keys <= positions[:, :, None]  # [B, T, S]
        biases = {}
        for window in dict.fromkeys(windows):
            allowed = causal if window is None else causal & (keys > positions[:, :, None] - window)  # [B, T, S]
            bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
            B, T, S = bias.shape
            biases[window] = bias[:, None, None].expand(B, 1, group, T, S).reshape(B, 1, group * T, S)
        return cls(slots, positions, write_positions, biases, kv_len, slot_range)


def aligned(length: int) -> int:
    return -(-length // KEY_ALIGN) * KEY_ALIGN


class SlotCache:
    """Keys and values of every layer for up to `num_slots` sequences.

    With `fixed=(slots, capacity)` the whole cache is allocated at once and never grows; otherwise it grows
    in chunks (`reserve`).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 fixed: tuple[int, int] | None = None):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.num_slots = 0
        self.capacity = 0
        self.fixed = fixed is not None
        self.k: list[Tensor] = []  # per layer [slots, Hkv, capacity, D]
        self.v: list[Tensor] = []
        if fixed is not None:
            self._allocate(*fixed)

    @staticmethod
    def nbytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, slots: int, capacity: int) -> int:
        return 2 * num_layers * slots * num_kv_heads * capacity * head_dim * dtype.itemsize

    @property
    def junk(self) -> int:
        """The junk position of every row (see the module docstring)."""
        return self.capacity - 1

    def reserve(self, num_slots: int, length: int) -> None:
        """Make slots 0..num_slots-1 hold `length` positions each, plus the junk position."""
        if num_slots <= self.num_slots and length < self.capacity:
            return
        if self.fixed:
            raise ValueError(f"length: {num_slots} slots of {length} positions exceed the preallocated cache "
                             f"({self.num_slots} slots of {self.capacity - 1})")
        slots = max(self.num_slots, -(-num_slots // SLOT_CHUNK) * SLOT_CHUNK)
        capacity = max(self.capacity, -(-(length + 1) // POSITION_CHUNK) * POSITION_CHUNK)
        self._allocate(slots, capacity)

    def _allocate(self, slots: int, capacity: int) -> None:
        shape = (slots, self.num_kv_heads, capacity, self.head_dim)
        # zeros, not empty: masked keys must still be finite, or 0 * NaN poisons the attention output
        grown = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * self.num_layers)]
        for old, new in zip(self.k + self.v, grown):
            new[: self.num_slots, :, : self.capacity] = old
        self.k, self.v = grown[: self.num_layers], grown[self.num_layers :]
        self.num_slots, self.capacity = slots, capacity

    def write(self, layer: int, batch: CacheBatch, k: Tensor, v: Tensor) -> None:
        """Store new keys/values k, v [B, T, Hkv, D] at the batch's write positions."""
        index = (batch.slots[:, None], slice(None), batch.write_positions)  # -> [B, T, Hkv, D]
        self.k[layer][index] = k.to(self.dtype)  # packed models compute k in fp32 (RoPE), v in bf16
        self.v[layer][index] = v.to(self.dtype)

    @torch.inference_mode()  # a cache grown inside a forward holds inference tensors
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
