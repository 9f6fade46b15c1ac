"""The packed CPU kernels: oneDNN GEMMs on weights reordered once, and attention whose per-row bits do not depend
on the batch.

**packed**: a weight W [N, K] reordered once into oneDNN's blocked layout and run with
`mkldnn._linear_pointwise`, as inductor's CPU path does (`CausalLM.pack_linears`, float32 and bf16).
**batch-invariant**: a row's result is bitwise the same whatever else is in the forward (other rows, other new
tokens of the same row, the padded key length S); `CausalLM.pack_for_cpu` gives that for bf16 weights on a CPU
with native bf16 dot products (`can_pack`), tested in tests/actors/engines/test_packed.py. Why it holds:
docs/architecture.md, "The native engine".
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# PyTorch hands a bf16 (b, M, K) @ (b, K, N) matmul to oneDNN only when b·M·K·N > 16³ (checksize in
# aten/src/ATen/native/mkldnn/Matmul.cpp); smaller ones take a naive kernel that rounds differently.
ONEDNN_MIN_WORK = 16**3
QUERY_ROWS = 1024  # invariant_attention scores at most this many query rows at once (bounds prefill memory)
PACK_BATCH_HINT = 2  # the row count oneDNN's weight layout is chosen for (decode: 1, run as 2)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16), read from /proc/cpuinfo.

    Without them oneDNN emulates bf16 GEMMs: slower than fp32, and their rounding is unverified."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether float32 linears can run prepacked on oneDNN (`CausalLM.pack_linears`): float32 on a CPU with
    oneDNN (bf16 goes the whole packed way, `can_pack`)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


ISA_FOR_INVARIANCE = "AVX512_CORE_BF16"  # oneDNN's AMX bf16 kernels split the reduction by row count; these do not


def pin_onednn_isa() -> None:
    """Cap oneDNN at AVX512-BF16 on a CPU with native bf16, unless the user set ONEDNN_MAX_CPU_ISA: with AMX, a
    bf16 GEMM row's bits depend on how many rows share it, which breaks the packed path's batch invariance.
    oneDNN reads the cap once, at its first use in the process, so this runs when the module is imported."""
    if cpu_has_native_bf16():
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ISA_FOR_INVARIANCE)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the packed path applies: bfloat16 weights on a CPU with native bf16 and oneDNN."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and cpu_has_native_bf16())


pin_onednn_isa()


class PackedLinear(nn.Module):
    """y = x Wᵀ + b with W packed (see the module docstring); replaces an inference-only `nn.Linear`.

    bfloat16 or float32 weights. The input is cast to the weight dtype (a float32 residual stream feeds bf16
    GEMMs); the output is in it. Rows are batch-invariant in both dtypes (float32 tested the same way)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.dtype, self.out_features = weight.dtype, weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)  # [N, K] blocked
        self.bias = None if linear.bias is None else linear.bias.detach()  # [N]

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(self.dtype)  # [M, K]
        m = rows.shape[0]
        if m == 1:  # oneDNN's M = 1 kernel rounds differently; decode reads the weight anyway, so the copy is free
            rows = rows.expand(2, -1)  # [2, K]
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed, self.bias, "none", [], "")  # [M', N]
        return out[:m].view(*x.shape[:-1], self.out_features)


def invariant_attention(q: Tensor, keys: Tensor, values: Tensor, attn_mask: Tensor) -> Tensor:
    """Softmax attention whose per-query result does not depend on B, on the other queries or on S.

    q [B, Hkv, R, D] (R query rows per kv head, the grouped layout of `model.Attention`), any float dtype;
    keys, values [B, Hkv, S, D] bf16, S a multiple of KEY_ALIGN; attn_mask [B, 1, R, S] additive (0 or -inf).
    Returns [B, Hkv, R, D] in the keys' dtype. q·kᵀ and p·v are oneDNN bf16 matmuls with fp32 accumulation,
    the scaled, masked softmax runs in fp32 (as Hugging Face's eager bf16 attention rounds).
    """
    b, hkv, r, d = q.shape
    s = keys.shape[2]
    q = q.to(keys.dtype)
    # enough query rows to keep both matmuls on oneDNN; zero rows, dropped again (tiny heads and contexts only)
    min_rows = ONEDNN_MIN_WORK // (b * hkv * d * s) + 1
    outs = []
    for lo in range(0, r, QUERY_ROWS):
        qc, mc = q[:, :, lo : lo + QUERY_ROWS], attn_mask[:, :, lo : lo + QUERY_ROWS]
        rows = qc.shape[2]
        pad = max(0, min_rows - rows)
        scores = torch.matmul(F.pad(qc, (0, 0, 0, pad)), keys.transpose(-1, -2))[:, :, :rows]  # [B, Hkv, Rc, S]
        scores = scores.float().mul_(d**-0.5).add_(mc)  # softmax(q·kᵀ / √D + mask), in fp32
        probs = torch.softmax(scores, dim=-1).to(values.dtype)  # [B, Hkv, Rc, S]
        outs.append(torch.matmul(F.pad(probs, (0, 0, 0, pad)), values)[:, :, :rows])  # [B, Hkv, Rc, D]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
