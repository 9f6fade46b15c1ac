"""Fixed-shape decode and verify forwards, captured as CUDA graphs: the GPU path of the Engine.

A step runs in **slot space**: its rows are the cache's slots 0..Bb-1 (Bb the batch bucket covering the highest
slot in the batch), slots outside the batch are **dummy rows** (zero new tokens: keys and values to the junk
position, logits dropped), and the cache is read as the view [0:Bb] with no gather. T (new tokens per row,
≤ `max_tokens`) is exact and S (keys read per row) rounded up to a bucket. A graph's inputs are one static int
tensor, `meta` [Bb, 2 + 2T], filled by one host-to-device copy. Graphs share one memory pool, the least recently
used dropped past `max_graphs`; on a CPU the same forward runs uncaptured. Why: docs/architecture.md, "The
native engine".
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from actors.devices import to_device
from actors.engines.native.kv_cache import CacheBatch, SlotCache
from actors.engines.native.model import MLP, Attention, CausalLM, RMSNorm, apply_rope, rms_norm, silu_mul

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs on a side stream before a capture (allocator, cuBLAS workspaces, compiled kernels)


def batch_bucket(rows: int) -> int:
    """Rows of a fixed-shape batch: 1, 2, 4, 8, then multiples of 8."""
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 8) * 8


def kv_bucket(length: int) -> int:
    """Keys read per row: `length` rounded up to a multiple of max(128, 2^(bits - 4)): at most ~1/8 extra."""
    step = max(128, 1 << max(0, length.bit_length() - 4))
    return -(-length // step) * step


@dataclass
class _Graph:
    meta: Tensor  # [Bb, 2 + 2T] long: the graph's input
    graph: "torch.cuda.CUDAGraph | None"  # None on a CPU: run the body instead of replaying
    out: Tensor | None  # [Bb, T, V]: the captured output


class StaticForward:
    """Decode and verify steps of one Engine as fixed-shape forwards (see the module docstring)."""

    def __init__(self, model: CausalLM, cache: SlotCache, max_tokens: int = 16, max_graphs: int = 64,
                 capture: bool | None = None):
        if not cache.fixed:
            raise ValueError("cache: fixed-shape forwards need a preallocated cache")
        self.model, self.cache, self.max_tokens, self.max_graphs = model, cache, max_tokens, max_graphs
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.group = model.args.num_heads // model.args.num_kv_heads
        self.windows = tuple(dict.fromkeys(model.args.sliding_windows or (None,)))
        self._graphs: OrderedDict[tuple[int, int, int], _Graph] = OrderedDict()
        self._pool = None
        self.captures = 0  # graphs captured so far (for benchmarks)

    def fits(self, num_tokens: int, slot_end: int) -> bool:
        return num_tokens <= self.max_tokens and batch_bucket(slot_end) <= self.cache.num_slots

    def __call__(self, slots: list[int], starts: list[int], counts: list[int], tokens,
                 logit_index: Tensor | None) -> Tensor:
        """Logits [B, K, V] in the caller's row order (K = T without logit_index), like `Engine.forward`."""
        T = max(counts)
        rows = batch_bucket(max(slots) + 1)
        end = max(s + n for s, n in zip(starts, counts))
        key = (rows, T, min(kv_bucket(end), self.cache.capacity))
        index = torch.tensor(slots)  # [B]
        meta = torch.zeros(rows, 2 + 2 * T, dtype=torch.long)  # [Bb, 2 + 2T]; dummy rows stay 0
        meta[index, 0] = torch.tensor(starts)
        meta[index, 1] = torch.tensor(counts)
        if not isinstance(tokens, Tensor):
            meta[index, 2 : 2 + T] = torch.tensor([list(t) + [0] * (T - len(t)) for t in tokens])
        want = T if logit_index is None else logit_index.shape[1]
        every = torch.arange(T).expand(len(slots), T)  # [B, T]: no logit_index means every position
        meta[index, 2 + T : 2 + T + want] = every if logit_index is None else logit_index
        meta_d, index_d = to_device([meta, index], self.model.device)
        entry = self._entry(key)
        entry.meta.copy_(meta_d)
        if isinstance(tokens, Tensor):
            entry.meta[index_d, 2 : 2 + T] = tokens
        if entry.graph is not None:
            entry.graph.replay()
            out = entry.out
        else:
            out = self._body(entry.meta, key)
        return out[index_d, :want]  # [B, K, V], a copy: the graph's output is overwritten by the next replay

    def _body(self, meta: Tensor, key: tuple[int, int, int]) -> Tensor:
        rows, T, kv_len = key
        starts, counts = meta[:, 0], meta[:, 1]  # [Bb]
        ids, logit_index = meta[:, 2 : 2 + T], meta[:, 2 + T :]  # [Bb, T] each
        slots = torch.arange(rows, device=meta.device)  # [Bb]
        batch = CacheBatch.build(slots, starts, counts, T, kv_len, (0, rows), self.cache.junk, self.model.dtype,
                                 self.group, self.windows)
        return self.model(ids, self.cache, batch, logit_index)  # [Bb, T, V]

    def _entry(self, key: tuple[int, int, int]) -> _Graph:
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            return entry
        rows, T, _ = key
        meta = torch.zeros(rows, 2 + 2 * T, dtype=torch.long, device=self.model.device)  # every row a dummy
        entry = _Graph(meta, None, None)
        if self.capture:
            entry.graph, entry.out = self._capture(meta, key)
        self._graphs[key] = entry
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry

    def _capture(self, meta: Tensor, key: tuple[int, int, int]):
        """Warm up on a side stream, then record one forward (all rows dummies: only the junk is written)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._body(meta, key)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._body(meta, key)
        self._pool = graph.pool()
        self.captures += 1
        log.debug("captured a CUDA graph for %d rows x %d tokens x %d keys", *key)
        return graph, out


def compile_pointwise(model: CausalLM) -> bool:
    """Swap the model's pointwise functions (RMSNorm, RoPE, SiLU·up) for `torch.compile`d ones, fusing each
    into one kernel; returns False (model unchanged) where compiling fails, e.g. without Triton or a C
    compiler. Shapes are dynamic, so new batch shapes recompile only while warming up, never in a graph."""
    device, dtype = model.device, model.dtype
    try:
        norm = torch.compile(rms_norm, dynamic=True)
        rope = torch.compile(apply_rope, dynamic=True)
        act = torch.compile(silu_mul, dynamic=True)
        x = torch.randn(2, 3, 4, 8, device=device, dtype=dtype)
        with torch.inference_mode():
            norm(x, torch.ones(8, device=device, dtype=dtype), 1e-5)
            rope(x, x[:, :, :1], x[:, :, :1])
            act(x)
    except Exception as exc:  # a missing toolchain surfaces at the first call
        log.warning("torch.compile of the pointwise functions failed (%s); staying eager", exc)
        return False
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fn = norm
        elif isinstance(module, Attention):
            module.rope_fn = rope
        elif isinstance(module, MLP):
            module.act_fn = act
    return True
