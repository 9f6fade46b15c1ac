"""Tensor parallelism: shards reassemble to the full weights; TP=2 on gloo in a local Ray cluster matches TP=1.

Tolerance: fp32 logits within atol 1e-4 (the all-reduce changes summation order only; observed ~1e-6).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from actors.engines.native.engine import Engine
from actors.engines.native.loading import load_model, read_state_dict
from actors.engines.native.model import ModelArgs
from actors.engines.native.sharding import shard_args, shard_state_dict, split_sizes
from actors.contracts import NO_CROP, TargetBatch, TargetResult, TargetUnavailable
from actors.remote.tp import ShardSpec, TargetGroup
from actors.sampling import SamplingSpec
from tests.conftest import save_tiny_llama

ATOL = 1e-4


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory, smollm2_tokenizer):
    """SmolLM2's head layout scaled down: 6 query / 3 kv heads, so TP=2 splits them 2+1 kv heads."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("uneven"), smollm2_tokenizer, seed=3, hidden_size=96, num_attention_heads=6,
        num_key_value_heads=3, intermediate_size=160,
    )


def test_split_sizes():
    assert split_sizes(3, 2) == [2, 1] and split_sizes(1536, 2) == [768, 768] and split_sizes(9, 3) == [3, 3, 3]


def test_shards_reassemble_to_the_full_weights(uneven_dir):
    from transformers import AutoConfig

    state = read_state_dict(uneven_dir)
    args = ModelArgs.from_hf_config(AutoConfig.from_pretrained(uneven_dir), state)
    shards = [shard_state_dict(state, args, r, 2) for r in range(2)]
    assert [shard_args(args, r, 2).num_kv_heads for r in range(2)] == [2, 1]
    assert [shard_args(args, r, 2).num_heads for r in range(2)] == [4, 2]
    for name, full in state.items():
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        if any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj", "down_proj")):
            torch.testing.assert_close(torch.cat([s[name] for s in shards], dim), full, atol=0, rtol=0)
        else:
            assert all(torch.equal(s[name], full) for s in shards)  # replicated


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 3, 11)]


def _batch(ids, tokens, crops=None, prefill=False):
    """A greedy TargetBatch with no drafts: each row scores its last position."""
    n = len(ids)
    return TargetBatch(list(ids), list(crops or [NO_CROP] * n), [list(t) for t in tokens], torch.full((n, 1), -1),
                       torch.zeros(n, dtype=torch.long), [SamplingSpec()] * n, prompt_rows=n if prefill else 0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["even", "uneven"])
def test_tp2_matches_tp1_logits_and_greedy_tokens(ray_cluster, tiny_llama_dir, uneven_dir, layout):
    source = str(tiny_llama_dir if layout == "even" else uneven_dir)
    torch.set_num_threads(1)
    ref = Engine(load_model(source)[0], max_slots=4)
    group = TargetGroup(ShardSpec(source, tp_size=2, max_slots=4))
    try:
        ids, prompts = ("a", "b", "c"), _prompts()
        got = asyncio.run(group.forward(ids, prompts))  # ragged prefill, all rows
        want = ref.forward(ids, prompts)
        for b, p in enumerate(prompts):
            torch.testing.assert_close(got[b, : len(p)], want[b, : len(p)], atol=ATOL, rtol=0)
        # greedy decoding, batched, with a rejected block rolled back by a crop half way
        tp_next = ref_next = [[int(want[b, len(p) - 1].argmax())] for b, p in enumerate(prompts)]
        tp_out, ref_out = [], []
        for step in range(8):
            if step == 4:  # append junk, then crop it away within the same step as the next tokens
                asyncio.run(group.forward(ids, [[5, 6]] * 3))
                ref.forward(ids, [[5, 6]] * 3)
                crops = [ref.length(i) - 2 for i in ids]
                for i, c in zip(ids, crops):
                    ref.crop(i, c)
                result = asyncio.run(group.step(_batch(ids, tp_next, crops)))
                ref_logits = ref.forward(ids, ref_next, [1, 1, 1])  # [3, 1, V]
                torch.testing.assert_close(result.scores.argmax_logits[:, 0], ref_logits[:, 0].max(-1).values,
                                           atol=ATOL, rtol=0)
                tp_next = [[int(t)] for t in result.scores.argmax_ids[:, 0]]
            else:
                tp_logits = asyncio.run(group.forward(ids, tp_next, [1, 1, 1]))  # [3, 1, V]
                ref_logits = ref.forward(ids, ref_next, [1, 1, 1])
                torch.testing.assert_close(tp_logits, ref_logits, atol=ATOL, rtol=0)
                tp_next = [[int(t)] for t in tp_logits[:, 0].argmax(-1)]
            ref_next = [[int(t)] for t in ref_logits[:, 0].argmax(-1)]
            tp_out.append(tp_next)
            ref_out.append(ref_next)
        assert tp_out == ref_out
        asyncio.run(group.release(["a", "b"]))
        assert [h["active"] for h in group.health()] == [1, 1]
    finally:
        asyncio.run(group.close())


@pytest.mark.slow
def test_lead_target_step_runs_on_rank_0_and_a_dead_shard_fails_fast_then_rebuilds(ray_cluster, tiny_llama_dir):
    source = str(tiny_llama_dir)
    group = TargetGroup(ShardSpec(source, tp_size=2, max_slots=4))
    try:
        greedy = [SamplingSpec()]
        prefill = _batch(["r"], [[1, 2]], prefill=True)
        # pending token 3, then drafts 17, 18: three scored positions
        batch = TargetBatch(["r"], [NO_CROP], [[3, 17, 18]], torch.tensor([[17, 18]]), torch.tensor([2]), greedy)
        asyncio.run(group.step(prefill))
        result = asyncio.run(group.step(batch))
        want = Engine(load_model(source)[0]).forward(["r"], [[1, 2, 3, 17, 18]])[0, 2:]  # [3, V]
        assert isinstance(result, TargetResult) and result.forward_s > 0
        assert result.scores.argmax_ids[0].tolist() == want.argmax(-1).tolist()

        import ray

        ray.kill(group.shards[1], no_restart=True)
        started = time.perf_counter()
        with pytest.raises(TargetUnavailable):
            asyncio.run(group.step(_batch(["r"], [[4]])))
        assert time.perf_counter() - started < 30  # no hang until the collective timeout
        asyncio.run(group.rebuild())
        assert [h["active"] for h in group.health()] == [0, 0]  # caches are gone with the old shards
        asyncio.run(group.step(prefill))
        again = asyncio.run(group.step(batch))
        assert again.scores.argmax_ids.tolist() == result.scores.argmax_ids.tolist()
    finally:
        asyncio.run(group.close())


def test_group_refuses_a_tp_size_the_heads_cannot_split_before_starting_actors(tiny_llama_dir):
    with pytest.raises(ValueError, match="^tp_size:"):
        TargetGroup(ShardSpec(str(tiny_llama_dir), tp_size=3))  # 2 kv heads
