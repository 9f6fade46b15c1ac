"""The Engine: sequences by id over a CausalLM and its slot KV cache.

`forward(seq_ids, tokens, num_logits)` appends each row's tokens to its sequence's cache (created on first use)
and returns logits for them, every row in one batched forward whatever its cached length and new-token count:
prefill, decode and teacher-forced scoring alike. `crop` rolls back rejected drafts; `release` frees the slot.
A forward runs eager, as packed rows when padding would be most of it, or, for decode and verify on a GPU, at a
fixed shape (`graphs.StaticForward`): docs/architecture.md, "The native engine". The host's work per forward
is bookkeeping over the rows and one host-to-device copy of the round's ints.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from actors.devices import to_device
from actors.engines.native.graphs import StaticForward, batch_bucket, compile_pointwise
from actors.engines.native.kv_cache import CacheBatch, SlotCache, aligned
from actors.engines.native.model import CausalLM, Packing
from actors.engines.native.packed import can_pack, can_prepack

log = logging.getLogger(__name__)

POSITION_ALIGN = 128  # a preallocated cache holds max_seq_len + 1 (the junk position) rounded up to this
MEMORY_SHARE = 0.9  # a preallocated cache may take at most this share of the device's free memory
PACK_MIN_PADDING = 16  # an eager forward packs its rows when padding is at least this many tokens ...
PACK_MIN_SHARE = 0.5  # ... and at least this share of B·T (below that, the gathers cost more than they save)


def packs_rows(counts: Sequence[int]) -> bool:
    """Whether an eager forward of rows with these new-token counts runs packed (see the module docstring)."""
    padding = len(counts) * max(counts) - sum(counts)
    return padding >= PACK_MIN_PADDING and padding >= PACK_MIN_SHARE * len(counts) * max(counts)


class Engine:
    """Batched forward over per-sequence KV caches.

    max_slots: most sequences cached at once. max_seq_len: most cached positions per sequence (default: the
    model's max_position_embeddings). graphs: run decode and verify steps as fixed-shape forwards, captured as
    CUDA graphs on CUDA (default: on for a CUDA model without tensor parallelism). preallocate: allocate the
    whole KV cache up front (default: on CUDA, and always with graphs). By default a cache that would take
    over MEMORY_SHARE of the free device memory grows on demand instead (without graphs); asked for
    explicitly, it is a ValueError. The Engine fuses its model's projections (`CausalLM.fuse_projections`).
    packed: run the packed, batch-invariant CPU forward (`CausalLM.pack_for_cpu`; default: for bf16 weights on
    a CPU with native bf16, where it is also the fast path); True where that is impossible is a ValueError.
    float32 weights on a CPU get prepacked oneDNN linears by default (`CausalLM.pack_linears`); False keeps
    PyTorch's plain `F.linear` for both. compiled: swap RMSNorm, RoPE and SiLU·up for `torch.compile`d
    kernels (`graphs.compile_pointwise`; default: where graphs are on by default, staying eager with a warning
    if compiling fails); True where compiling fails is a RuntimeError.
    """

    def __init__(self, model: CausalLM, max_slots: int = 64, max_seq_len: int | None = None, *,
                 graphs: bool | None = None, preallocate: bool | None = None, max_graph_tokens: int = 16,
                 packed: bool | None = None, compiled: bool | None = None):
        if max_slots < 1:
            raise ValueError(f"max_slots: must be >= 1, got {max_slots}")
        self.model = model.fuse_projections()
        self._pack(packed)
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len or model.args.max_position_embeddings
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len: must be >= 1, got {max_seq_len}")
        args, device = model.args, model.device
        on_cuda = device.type == "cuda"
        asked = graphs is True or preallocate is True  # explicit: a cache that does not fit is an error
        self.compiled = (on_cuda and args.tp_size == 1 if compiled is None else compiled) and compile_pointwise(model)
        if compiled and not self.compiled:
            raise RuntimeError("compiled: torch.compile of the pointwise functions failed (see the log)")
        graphs = on_cuda and args.tp_size == 1 if graphs is None else graphs
        fixed = None
        if graphs or (on_cuda if preallocate is None else preallocate):
            shape = (batch_bucket(max_slots), -(-(self.max_seq_len + 1) // POSITION_ALIGN) * POSITION_ALIGN)
            if self._fits(*shape, required=asked):
                fixed = shape
            else:  # a default: fall back to the growing cache, whose steps cannot be captured
                graphs = False
        self.cache = SlotCache(args.num_layers, args.num_kv_heads, args.head_dim, model.dtype, device, fixed)
        self.static = StaticForward(model, self.cache, max_graph_tokens) if graphs else None
        self._group = args.num_heads // args.num_kv_heads
        self._windows = tuple(dict.fromkeys(args.sliding_windows or (None,)))
        self._slot: dict[str, int] = {}
        self._length: dict[str, int] = {}

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @property
    def device(self) -> torch.device:
        return self.model.device

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

    @torch.inference_mode()
    def forward(self, seq_ids: Sequence[str], tokens: Sequence[Sequence[int]] | Tensor,
                num_logits: Sequence[int] | None = None) -> Tensor:
        """Append tokens[b] to sequence seq_ids[b] and return logits.

        `tokens`: per row a list of ids, or a long tensor [B, T] on the engine's device (every row T new
        tokens; its values are not checked, as reading them would wait for the device).
        Without num_logits: [B, T_max, V], row b valid for its first len(tokens[b]) positions.
        With num_logits: [B, max(num_logits), V], row b holding the logits of its LAST num_logits[b] tokens
        (in order; valid for its first num_logits[b] rows). Prefill needs 1, scoring a block of K drafts K + 1:
        the lm_head is then run only where needed.
        """
        counts = [tokens.shape[1]] * tokens.shape[0] if isinstance(tokens, Tensor) else [len(t) for t in tokens]
        self._validate(seq_ids, tokens, counts, num_logits)
        new = [sid for sid in seq_ids if sid not in self._slot]
        for sid in new:  # new sequences take the lowest free slots, in batch order
            self._slot[sid] = min(set(range(self.max_slots)) - set(self._slot.values()))
            self._length[sid] = 0
        slots = [self._slot[s] for s in seq_ids]
        starts = [self._length[s] for s in seq_ids]
        logit_index = None  # every position, in order
        if num_logits is not None:  # row b, column j -> new token counts[b] - want[b] + j (clamped: padding)
            K = max(num_logits)
            logit_index = torch.tensor([[min(n - k + j, n - 1) for j in range(K)]
                                        for n, k in zip(counts, num_logits)])  # [B, K]
        try:
            if self.static is not None and self.static.fits(max(counts), max(slots) + 1):
                logits = self.static(slots, starts, counts, tokens, logit_index)
            else:
                logits = self._eager(slots, starts, counts, tokens, logit_index)
        except Exception:  # a failed forward leaves no new sequence behind (cached ones keep their lengths)
            for sid in new:
                del self._slot[sid], self._length[sid]
            raise
        for sid, n in zip(seq_ids, counts):
            self._length[sid] += n
        return logits

    def forward_last(self, seq_ids: Sequence[str], tokens: Sequence[Sequence[int]] | Tensor) -> Tensor:
        """Logits [B, V] after each row's last new token (prefill / plain decode)."""
        return self.forward(seq_ids, tokens, [1] * len(seq_ids))[:, 0]

    def _eager(self, slots: list[int], starts: list[int], counts: list[int], tokens, logit_index) -> Tensor:
        """One forward of exactly these rows, in slot order; logits in the caller's order."""
        order = sorted(range(len(slots)), key=slots.__getitem__)
        sorted_slots = [slots[b] for b in order]
        T, end = max(counts), max(s + n for s, n in zip(starts, counts))
        self.cache.reserve(sorted_slots[-1] + 1, end)
        order_t = torch.tensor(order)  # [B]
        inverse = torch.empty_like(order_t).scatter_(0, order_t, torch.arange(len(order)))  # [B]
        host = [torch.tensor(sorted_slots), torch.tensor(starts)[order_t], torch.tensor(counts)[order_t],
                order_t, inverse]
        if not isinstance(tokens, Tensor):
            host.append(torch.tensor([list(tokens[b]) + [0] * (T - counts[b]) for b in order]))  # [B, T] padded
        if logit_index is not None:
            host.append(logit_index[order_t])  # [B, K]
        pack = packs_rows(counts)
        if pack:  # the real positions, row-major in slot order
            host.append(torch.cat([torch.arange(counts[b]) + i * T for i, b in enumerate(order)]))  # [N]
        moved = to_device(host, self.device)
        slots_d, starts_d, counts_d, order_d, inverse_d = moved[:5]
        rest = moved[5:]
        ids = tokens[order_d] if isinstance(tokens, Tensor) else rest.pop(0)  # [B, T]
        index = rest.pop(0) if logit_index is not None else None
        packing = Packing(rest.pop(0), len(counts), T) if pack else None
        lo = sorted_slots[0]
        contiguous = sorted_slots == list(range(lo, lo + len(slots)))
        kv_len = min(aligned(end), self.cache.capacity)
        batch = CacheBatch.build(slots_d, starts_d, counts_d, T, kv_len, (lo, lo + len(slots)) if contiguous else None,
                                 self.cache.junk, self.model.dtype, self._group, self._windows)
        logits = self.model(ids, self.cache, batch, index, packing)  # [B, K or T, V] in slot order
        return logits if order == sorted(order) else logits[inverse_d]

    def _pack(self, packed: bool | None) -> None:
        model = self.model
        possible = can_pack(model.device, model.dtype) and model.args.tp_size == 1
        if packed and not possible and not model.packed:
            raise ValueError(f"packed: needs bfloat16 weights on a CPU with AVX512-BF16 or AMX-BF16 and no tensor "
                             f"parallelism, got {model.dtype} on {model.device}, tp_size {model.args.tp_size}")
        if possible and packed is not False:
            model.pack_for_cpu()
        elif packed is not False and model.args.tp_size == 1 and can_prepack(model.device, model.dtype):
            model.pack_linears()  # float32 on a CPU: oneDNN's prepacked GEMMs (see CausalLM.pack_linears)
        elif model.device.type == "cpu" and model.dtype == torch.bfloat16 and not model.packed and packed is None:
            log.warning("bfloat16 on this CPU runs emulated or unpacked (no AVX512-BF16/AMX-BF16, or tensor "
                        "parallel): slow, and not batch-invariant, so speculative output may differ from "
                        "target-only; float32 keeps greedy identity")

    def _fits(self, slots: int, capacity: int, required: bool) -> bool:
        """Whether a preallocated cache fits in MEMORY_SHARE of the device's free memory; ValueError if not
        and `required`, else a warning."""
        args = self.model.args
        need = SlotCache.nbytes(args.num_layers, args.num_kv_heads, args.head_dim, self.model.dtype, slots, capacity)
        device = self.model.device
        if device.type == "cuda" and torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info(device)
            if need > MEMORY_SHARE * free:
                message = (f"a KV cache of {slots} slots x {capacity} positions needs {need / 2**30:.1f} GiB, over "
                           f"{MEMORY_SHARE:.0%} of the {free / 2**30:.1f} GiB free on {device}")
                if required:
                    raise ValueError(f"max_slots: {message}; lower max_slots or max_seq_len")
                log.warning("%s: the cache grows on demand instead, and steps run without CUDA graphs", message)
                return False
        log.info("KV cache preallocated: %d slots x %d positions, %.2f GiB", slots, capacity, need / 2**30)
        return True

    def _validate(self, seq_ids, tokens, counts, num_logits) -> None:
        if isinstance(seq_ids, str) or not len(seq_ids):
            raise ValueError("seq_ids: expected a non-empty list of sequence ids")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids: duplicate ids in {list(seq_ids)}")
        if len(tokens) != len(seq_ids):
            raise ValueError(f"tokens: {len(tokens)} rows for {len(seq_ids)} seq_ids")
        if isinstance(tokens, Tensor) and (tokens.dim() != 2 or tokens.device != self.device):
            raise ValueError(f"tokens: a tensor must be [B, T] on {self.device}, got {tuple(tokens.shape)} on "
                             f"{tokens.device}")
        vocab = self.vocab_size
        for b, (sid, count) in enumerate(zip(seq_ids, counts)):
            if not count:
                raise ValueError(f"tokens: empty token list for {sid!r}")
            if not isinstance(tokens, Tensor) and (min(tokens[b]) < 0 or max(tokens[b]) >= vocab):
                raise ValueError(f"tokens: ids for {sid!r} must be in [0, {vocab})")
            if self._length.get(sid, 0) + count > self.max_seq_len:
                raise ValueError(
                    f"tokens: {sid!r} would hold {self._length.get(sid, 0) + count} positions, "
                    f"over max_seq_len {self.max_seq_len}"
                )
        new = sum(sid not in self._slot for sid in seq_ids)
        if len(self._slot) + new > self.max_slots:
            raise ValueError(f"seq_ids: {new} new sequences do not fit: {len(self._slot)} of max_slots {self.max_slots} in use")
        if num_logits is not None:
            if len(num_logits) != len(seq_ids):
                raise ValueError(f"num_logits: {len(num_logits)} entries for {len(seq_ids)} seq_ids")
            for sid, k, count in zip(seq_ids, num_logits, counts):
                if not 1 <= k <= count:
                    raise ValueError(f"num_logits: {k} for {sid!r} must be in [1, {count}]")
