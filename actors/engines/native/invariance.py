"""Whether this process's bf16 kernels are batch-invariant, measured once: `bf16_batch_invariant()`.

The packed bf16 path promises that a row's logits do not depend on the rest of the batch (so speculation keeps
greedy identity in bf16). That holds for the kernels oneDNN picks under specserve's ISA cap
(`packed.pin_onednn_isa`) and not for all of them, so a unit measures it at start, on a tiny random model, and
says so where it fails.
"""

from __future__ import annotations

import functools

import torch

from actors.engines.native.engine import Engine
from actors.engines.native.model import CausalLM, ModelArgs
from actors.engines.native.packed import can_pack

VOCAB, CONTEXT = 512, 300


def _tiny(seed: int) -> CausalLM:
    torch.manual_seed(seed)
    args = ModelArgs(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=True,
                     sliding_windows=(None, None), max_position_embeddings=1024)
    model = CausalLM(args, 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.05) if "norm" in name else p.normal_(0, 1.0 if "embed" in name else 0.1)
    return model.to(torch.bfloat16).eval()


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@functools.cache
def bf16_batch_invariant(seeds: tuple[int, ...] = (0, 1, 2)) -> bool | None:
    """True when rows of a ragged bf16 batch equal each row alone, bitwise, for tiny random models (the seeds
    where the unpacked kernels differ); None where the packed path does not apply (no native bf16)."""
    if not can_pack(torch.device("cpu"), torch.bfloat16):
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return all(_ragged_rows_equal(_tiny(seed)) for seed in seeds)
    finally:
        torch.set_num_threads(threads)


def _ragged_rows_equal(model: CausalLM) -> bool:
    prompts = [_ids(10 + i, CONTEXT - 60 * i) for i in range(5)]
    conts = [_ids(20 + i, 1 + i % 3) for i in range(5)]
    alone = []
    for p, c in zip(prompts, conts):
        engine = Engine(model, max_slots=1)
        engine.forward(["s"], [p], [1])
        alone.append(engine.forward(["s"], [c])[0, : len(c)])
    engine = Engine(model, max_slots=8, max_seq_len=512)
    ids = [f"s{i}" for i in range(5)]
    engine.forward(ids, prompts, [1] * 5)
    together = engine.forward(ids[::-1], conts[::-1]).flip(0)  # [5, 3, V]
    return all(torch.equal(together[i, : len(c)], alone[i]) for i, c in enumerate(conts))
