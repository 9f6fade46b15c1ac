"""Our own Llama-family causal LM over an explicit slot KV cache (gpt-fast style).

Covers Llama and SmolLM2 (tied embeddings), Mistral (sliding window), Qwen2 (q/k/v bias) and Qwen3 (per-head
q_norm / k_norm); parity with `transformers.AutoModelForCausalLM` is tested in tests/actors/engines/test_model.py.
Terms: a **slot** is a row of the KV cache; a row's **start** is how many positions it already has cached; a
**ragged batch** has rows with different starts and new-token counts, right-padded to T (padding writes to the
cache's junk position, never read by a real query); **packed rows** (`Packing`) run the token-wise layers on the
N real tokens only. Logits are float32 on the packed path. Fused projections, the grouped-query layout, tensor
parallelism and the packed CPU forward: docs/architecture.md, "The native engine".
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from actors.engines.native.kv_cache import CacheBatch, SlotCache
from actors.engines.native.packed import PackedLinear, invariant_attention

# RoPE variants whose frequencies do not depend on the running sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelArgs:
    """Shapes and switches of one (possibly sharded) model. Head and MLP counts are this rank's."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # MLP columns held by this rank
    num_layers: int
    num_heads: int  # query heads held by this rank
    num_kv_heads: int  # key/value heads held by this rank
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_word_embeddings: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    max_position_embeddings: int = 2048
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def from_hf_config(cls, config, weight_names: Collection[str]) -> "ModelArgs":
        """Read a transformers config; biases and q/k norms are detected from the checkpoint's weight names."""
        names = {n.removeprefix("model.") for n in weight_names}
        text = getattr(config, "text_config", None) or config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        window = getattr(text, "sliding_window", None)
        layer_types = getattr(text, "layer_types", None)
        if layer_types:
            windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
        else:
            windows = (window,) * text.num_hidden_layers
        return cls(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_layers=text.num_hidden_layers,
            num_heads=text.num_attention_heads,
            num_kv_heads=text.num_key_value_heads or text.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=text.rms_norm_eps,
            qkv_bias="layers.0.self_attn.q_proj.bias" in names,
            o_bias="layers.0.self_attn.o_proj.bias" in names,
            mlp_bias="layers.0.mlp.gate_proj.bias" in names,
            qk_norm="layers.0.self_attn.q_norm.weight" in names,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)) or "lm_head.weight" not in names,
            sliding_windows=windows,
            max_position_embeddings=text.max_position_embeddings,
        )

    def sharded(self, num_heads: int, num_kv_heads: int, intermediate_size: int, rank: int, size: int) -> "ModelArgs":
        return replace(
            self, num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
            tp_rank=rank, tp_size=size,
        )


def rope_frequencies(config) -> tuple[Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scale of the config's RoPE.

    Delegates to transformers' own initialisers so llama3 / linear / yarn scaling match exactly; RoPE types
    that change with the sequence length (dynamic, longrope) are refused.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    text = getattr(config, "text_config", None) or config
    params = getattr(text, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"config: rope_type {rope_type!r} is not supported (supported: {STATIC_ROPE_TYPES})")
    if rope_type == "default":
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        base = params.get("rope_theta", getattr(text, "rope_theta", 10000.0))
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](text, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # y = w * x / sqrt(mean(x^2) + eps), computed in float32 as transformers does
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fn = rms_norm  # actors.engines.native.graphs.compile_pointwise may swap in a compiled one

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x, self.weight, self.eps)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x [B, T, H, D], cos/sin [B, T, 1, D]
    return x * cos + rotate_half(x) * sin


def silu_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # [..., I] each
    return F.silu(gate) * up


def silu_mul_fp32(gate_up: Tensor) -> Tensor:
    return silu_mul(gate_up.float())  # the packed path: bf16 pointwise kernels are slower than fp32 ones on CPU


def fuse_linear(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the given Linears' outputs concatenated (weights and biases stacked)."""
    first = linears[0].weight
    fused = nn.Linear(first.shape[1], sum(m.weight.shape[0] for m in linears), bias=linears[0].bias is not None,
                      device=first.device, dtype=first.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([m.weight for m in linears]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([m.bias for m in linears]))
    return fused.requires_grad_(False)


def all_reduce(x: Tensor, args: ModelArgs, group) -> Tensor:
    """Sum a row-parallel projection's partial outputs over the tensor-parallel group (no-op at size 1)."""
    if args.tp_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


@dataclass(frozen=True)
class Packing:
    """The real tokens of a padded [B, T] batch: `index` [N] into the flattened B·T positions, row-major."""

    index: Tensor  # [N] long, on the model's device
    rows: int  # B
    width: int  # T

    def scatter(self, x: Tensor) -> Tensor:
        """[N, F] -> [B, T, F], zeros at padded positions."""
        out = x.new_zeros(self.rows * self.width, x.shape[-1])
        out[self.index] = x
        return out.view(self.rows, self.width, x.shape[-1])

    def gather(self, x: Tensor) -> Tensor:
        """[B, T, F] -> [N, F]."""
        return x.reshape(self.rows * self.width, x.shape[-1])[self.index]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, tp_group=None):
        super().__init__()
        self.args, self.layer, self.tp_group = args, layer, tp_group
        self.window = args.sliding_windows[layer] if args.sliding_windows else None
        d, h, kv = args.head_dim, args.num_heads, args.num_kv_heads
        self.q_proj = nn.Linear(args.hidden_size, h * d, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, kv * d, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, kv * d, bias=args.qkv_bias)
        # Row-parallel: a bias must be added once, after the all-reduce, so only rank 0 holds it.
        self.o_proj = nn.Linear(h * d, args.hidden_size, bias=args.o_bias and args.tp_rank == 0)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self.rope_fn = apply_rope
        self.attention_fn = F.scaled_dot_product_attention  # pack_for_cpu swaps in invariant_attention

    def fuse(self) -> None:
        if hasattr(self, "q_proj"):
            self.qkv_proj = fuse_linear(self.q_proj, self.k_proj, self.v_proj)
            del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: SlotCache, batch: CacheBatch,
                pack: Packing | None = None) -> Tensor:
        # x [B, T, hidden], or [N, hidden] with `pack`
        B, T = (pack.rows, pack.width) if pack is not None else x.shape[:2]
        d, h, kv = self.args.head_dim, self.args.num_heads, self.args.num_kv_heads
        qkv = self.qkv_proj(x)  # [B, T | N, (Hq + 2 Hkv)·D]
        if pack is not None:
            qkv = pack.scatter(qkv)  # [B, T, (Hq + 2 Hkv)·D]
        qkv = qkv.view(B, T, h + 2 * kv, d)  # [B, T, Hq + 2 Hkv, D]
        q, k, v = qkv.split((h, kv, kv), dim=2)  # [B, T, Hq | Hkv | Hkv, D]
        if self.args.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope_fn(q, cos, sin), self.rope_fn(k, cos, sin)
        cache.write(self.layer, batch, k, v)
        keys, values = cache.read(self.layer, batch)  # [B, Hkv, S, D] each
        g = h // kv
        q = q.view(B, T, kv, g, d).permute(0, 2, 3, 1, 4).reshape(B, kv, g * T, d)  # [B, Hkv, G*T, D]
        out = self.attention_fn(q, keys, values, attn_mask=batch.biases[self.window])  # [B, Hkv, G*T, D]
        out = out.view(B, kv, g, T, d).permute(0, 3, 1, 2, 4).reshape(B, T, h * d)  # [B, T, Hq*D]
        if pack is not None:
            out = pack.gather(out)  # [N, Hq*D]
        return all_reduce(self.o_proj(out), self.args, self.tp_group)  # [B, T | N, hidden]


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, tp_group=None):
        super().__init__()
        self.args, self.tp_group = args, tp_group
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias and args.tp_rank == 0)
        self.act_fn = silu_mul

    def fuse(self) -> None:
        if hasattr(self, "gate_proj"):
            self.gate_up_proj = fuse_linear(self.gate_proj, self.up_proj)
            del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        out = self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [B, T, hidden]
        return all_reduce(out, self.args, self.tp_group)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, tp_group=None):
        super().__init__()
        self.self_attn = Attention(args, layer, tp_group)
        self.mlp = MLP(args, tp_group)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: SlotCache, batch: CacheBatch,
                pack: Packing | None = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, batch, pack)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """A Llama-family decoder whose KV cache is passed in (owned by actors.engine.Engine).

    Parameter names equal transformers' without the `model.` prefix, so a HF state dict loads after
    `strip_prefix`. Build with `CausalLM(args, inv_freq, rope_scale)` then `load_state_dict`, or use
    actors.loading.load_model; an Engine fuses the projections before its first forward.
    """

    def __init__(self, args: ModelArgs, inv_freq: Tensor, rope_scale: float = 1.0, tp_group=None):
        super().__init__()
        self.args = args
        self.tp_group = tp_group
        self.rope_scale = rope_scale
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i, tp_group) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [D/2]
        self.packed = False  # see `pack_for_cpu`

    def fuse_projections(self) -> CausalLM:
        """Concatenate q/k/v and gate/up weights (see the module docstring); idempotent, returns self."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def pack_linears(self) -> CausalLM:
        """Run the four projections and the lm_head as oneDNN `PackedLinear`s (weights reordered once);
        idempotent, returns self. Inference only, on a CPU (`packed.can_prepack`).

        The projections' plain weights are dropped for their packed copies; the lm_head gets a packed copy
        beside the embedding. For float32 this is the whole change (`Engine` does it by default): PyTorch's
        float32 `F.linear` on a CPU is much slower for a few rows than for one, so scoring a few draft tokens
        cost far more than a decode step; prepacked, a few rows cost about what one does, and a row's result no
        longer depends on the row count (docs/benchmarks.md, "Component costs behind design choices")."""
        if isinstance(self.lm_head, PackedLinear):
            return self
        self.fuse_projections()
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj, attn.o_proj = PackedLinear(attn.qkv_proj), PackedLinear(attn.o_proj)
            mlp.gate_up_proj, mlp.down_proj = PackedLinear(mlp.gate_up_proj), PackedLinear(mlp.down_proj)
        self.lm_head = PackedLinear(self.lm_head)
        return self

    def pack_for_cpu(self) -> CausalLM:
        """Switch to the packed, batch-invariant bf16 forward (see the module docstring); idempotent, returns self.

        For bf16 weights on a CPU with native bf16 (`packed.can_pack`); inference only: `pack_linears`, and
        attention and SiLU swapped for their batch-invariant, fp32-accumulating versions."""
        if self.packed:
            return self
        self.pack_linears()
        for layer in self.layers:
            layer.self_attn.attention_fn, layer.mlp.act_fn = invariant_attention, silu_mul_fp32
        self.packed = True
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [B, T, 1, D] for integer positions [B, T] (float32 when packed: RoPE runs in fp32)."""
        dtype = torch.float32 if self.packed else self.dtype
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        cos = (emb.cos() * self.rope_scale).to(dtype)
        sin = (emb.sin() * self.rope_scale).to(dtype)
        return cos[:, :, None, :], sin[:, :, None, :]

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: SlotCache, batch: CacheBatch, logit_index: Tensor | None = None,
                pack: Packing | None = None) -> Tensor:
        """Append `tokens` [B, T] to the batch's slots and return logits.

        logit_index [B, K] (positions within each row's T new tokens) selects which logits rows to compute:
        the lm_head over a 49152-token vocabulary dominates small-model steps, and prefill needs one row.
        `pack` runs the real tokens only (see the module docstring); logit_index must then select real ones.
        Returns [B, K, V] (or [B, T, V] when logit_index is None).
        """
        x = self.embed_tokens(tokens if pack is None else tokens.reshape(-1)[pack.index])  # [B, T | N, hidden]
        if self.packed:
            x = x.float()  # the residual stream stays fp32; bf16 GEMM outputs are added to it
        cos, sin = self.rope(batch.positions)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, batch, pack)
        if pack is not None:
            x = pack.scatter(x)  # [B, T, hidden] (padding: zeros, never selected)
        if logit_index is not None:
            x = torch.gather(x, 1, logit_index[..., None].expand(-1, -1, x.shape[-1]))  # [B, K, hidden]
        logits = self.lm_head(self.norm(x))  # [B, K, V]
        # packed: float32 logits, as an argmax over a bf16 row is slower on a CPU than the copy plus an fp32 one
        return logits.float() if self.packed else logits


def strip_prefix(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers names (`model.layers.0...`, `lm_head.weight`) -> CausalLM names."""
    return {k.removeprefix("model."): v for k, v in state_dict.items()}
