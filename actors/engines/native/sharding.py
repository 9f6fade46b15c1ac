"""Megatron-style tensor-parallel sharding of a CausalLM state dict (pure torch, no process group).

Column-parallel: q_proj, k_proj, v_proj (by heads) and gate_proj, up_proj (by MLP columns): each rank keeps its
rows of the weight. Row-parallel: o_proj and down_proj keep the matching input columns; their partial outputs
are summed by an all-reduce in `actors.engines.native.model`. Embedding, norms and lm_head are replicated.
Heads are split by key/value head group, unevenly if need be, so the only limit is
tp_size <= num_key_value_heads.
"""

from __future__ import annotations

from torch import Tensor

from actors.engines.native.model import ModelArgs


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` items split into `parts` contiguous runs as evenly as possible, larger runs first."""
    base, extra = divmod(total, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def _run(total: int, parts: int, rank: int) -> tuple[int, int]:
    sizes = split_sizes(total, parts)
    lo = sum(sizes[:rank])
    return lo, lo + sizes[rank]


def validate_tp(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int = 0) -> None:
    """ValueError unless (tp_rank, tp_size) can shard a model with these (global) head counts."""
    if tp_size < 1:
        raise ValueError(f"tp_size: must be >= 1, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: must be in [0, {tp_size}), got {tp_rank}")
    if tp_size > num_kv_heads:
        raise ValueError(
            f"tp_size: {tp_size} ranks cannot split {num_kv_heads} key/value heads "
            f"({num_heads} attention heads); use tp_size <= {num_kv_heads}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads: {num_heads} attention heads are not a multiple of {num_kv_heads} kv heads")


def shard_args(args: ModelArgs, tp_rank: int, tp_size: int) -> ModelArgs:
    """The ModelArgs of rank `tp_rank`'s shard."""
    validate_tp(args.num_heads, args.num_kv_heads, tp_size, tp_rank)
    kv_lo, kv_hi = _run(args.num_kv_heads, tp_size, tp_rank)
    group = args.num_heads // args.num_kv_heads
    cols = split_sizes(args.intermediate_size, tp_size)[tp_rank]
    return args.sharded((kv_hi - kv_lo) * group, kv_hi - kv_lo, cols, tp_rank, tp_size)


def shard_state_dict(state: dict[str, Tensor], args: ModelArgs, tp_rank: int, tp_size: int) -> dict[str, Tensor]:
    """Rank `tp_rank`'s slice of a CausalLM state dict (names without the `model.` prefix)."""
    validate_tp(args.num_heads, args.num_kv_heads, tp_size, tp_rank)
    if tp_size == 1:
        return dict(state)
    d = args.head_dim
    group = args.num_heads // args.num_kv_heads
    kv_lo, kv_hi = _run(args.num_kv_heads, tp_size, tp_rank)
    q_rows = slice(kv_lo * group * d, kv_hi * group * d)
    kv_rows = slice(kv_lo * d, kv_hi * d)
    mlp_rows = slice(*_run(args.intermediate_size, tp_size, tp_rank))
    out = {}
    for name, t in state.items():
        leaf = name.split(".")[-2] if name.startswith("layers.") else ""
        kind = name.rsplit(".", 1)[-1]  # weight | bias
        if leaf == "q_proj":
            t = t[q_rows]
        elif leaf in ("k_proj", "v_proj"):
            t = t[kv_rows]
        elif leaf in ("gate_proj", "up_proj"):
            t = t[mlp_rows]
        elif leaf == "o_proj" and kind == "weight":
            t = t[:, q_rows]
        elif leaf == "down_proj" and kind == "weight":
            t = t[:, mlp_rows]
        elif leaf in ("o_proj", "down_proj") and kind == "bias" and tp_rank != 0:
            continue  # added once, on rank 0, after the all-reduce
        out[name] = t.contiguous()
    return out
