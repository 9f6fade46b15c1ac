"""Loading a source's weights into the native engine's `CausalLM` (whole, or one tensor-parallel shard)."""

from __future__ import annotations

from pathlib import Path

import torch

from actors.engines.native.model import CausalLM, ModelArgs, rope_frequencies, strip_prefix
from actors.engines.native.sharding import shard_args, shard_state_dict
from actors.sources import load_tokenizer, resolve

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a directory's *.safetensors files, with CausalLM names."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"source: {directory} holds no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return strip_prefix(state)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def build_model(
    config, state: dict[str, torch.Tensor], dtype="float32", device="cpu", tp_rank=0, tp_size=1, tp_group=None
) -> CausalLM:
    """A CausalLM (rank `tp_rank`'s shard) from a transformers config and a state dict (either naming)."""
    state = strip_prefix(state)
    args = ModelArgs.from_hf_config(config, state.keys())
    local = shard_args(args, tp_rank, tp_size)
    if args.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    state = shard_state_dict(state, args, tp_rank, tp_size)
    torch_dtype = resolve_dtype(dtype)
    inv_freq, rope_scale = rope_frequencies(config)
    with torch.device("meta"):
        model = CausalLM(local, inv_freq, rope_scale, tp_group)
    model.load_state_dict({k: v.to(device=device, dtype=torch_dtype) for k, v in state.items()}, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = inv_freq.to(device)
    return model.eval()


def load_model(source, dtype="float32", device="cpu", tp_rank=0, tp_size=1, tp_group=None):
    """(CausalLM, tokenizer) for a source; with tp_size > 1, only rank `tp_rank`'s shard of the weights."""
    from transformers import AutoConfig

    directory = resolve(source)
    config = AutoConfig.from_pretrained(directory)
    model = build_model(config, read_state_dict(directory), dtype, device, tp_rank, tp_size, tp_group)
    return model, load_tokenizer(directory)


