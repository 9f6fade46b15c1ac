"""The acceptance check on the real embedded model (SmolLM2-135M-Instruct): greedy speculative decoding is
token-identical to target-only greedy decoding, in-process and through Ray actors with TP = 2, on the exact arm
and on an ASD arm with budget 0."""

import pytest
import torch

from actors.coordinator import ArmSpec, GenerationRequest, SamplingParams
from actors.policy import LocalPolicy, PolicyCore
from actors.remote.policy import RemotePolicy
from actors.unit import TargetSetup, build_unit
from policies.asd import ASDConfig

pytestmark = pytest.mark.slow

SOURCE = "embedded:smollm2"
MAX_TOKENS = 32
MESSAGES = [
    "Write a Python function that returns the factorial of n.",
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "List the days of the week.",
    "Explain what a hash map is in two sentences.",
]
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    tok = smollm2_tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=False)
             for m in MESSAGES]
    return [tok(text, add_special_tokens=False)["input_ids"] for text in chats] + [tok(CODE)["input_ids"]]


def requests(prompts, tag, **kw):
    return [GenerationRequest(f"{tag}{i}", p, SamplingParams(max_tokens=MAX_TOKENS), **kw) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def local_unit():
    torch.set_num_threads(2)
    return build_unit(unit="smol", target=TargetSetup(SOURCE, max_slots=8, max_seq_len=512), on_ray=False,
                      policy=LocalPolicy(PolicyCore(gamma_max=6, prior_alpha=0.6, draft_cost=0.02)))


@pytest.fixture(scope="module")
def reference(local_unit, prompts):
    return [o.token_ids for o in local_unit.generate_many_sync(requests(prompts, "ref", speculate=False))]


def test_in_process_exact_and_asd_budget_zero_match_target_only(local_unit, prompts, reference):
    exact = local_unit.generate_many_sync(requests(prompts, "exact"))
    assert [o.token_ids for o in exact] == reference
    assert sum(o.record.accepted_tokens for o in exact) > 0  # the code prompt repeats itself: drafts land
    asd0 = ArmSpec("asd0", "asd", ASDConfig(g=3.0, max_relaxed_per_block=2, budget=0.0))
    asd = local_unit.generate_many_sync(requests(prompts, "asd", arm=asd0))
    assert [o.token_ids for o in asd] == reference
    assert all(o.record.regret_spent == 0.0 for o in asd)


def test_through_ray_with_tp2_matches_target_only(ray_cluster, prompts, reference):
    policy = RemotePolicy("test-smollm2-policy", gamma_max=6, prior_alpha=0.6, draft_cost=0.02)
    unit = build_unit(unit="smol-tp2", target=TargetSetup(SOURCE, tp_size=2, max_slots=8, max_seq_len=512,
                                                          resources={"num_cpus": 0.5}, placement_strategy="PACK"),
                      policy=policy)
    try:
        outs = unit.generate_many_sync(requests(prompts, "tp2"))
        assert [o.token_ids for o in outs] == reference
        asd0 = ArmSpec("asd0", "asd", ASDConfig(g=3.0, max_relaxed_per_block=2, budget=0.0))
        outs = unit.generate_many_sync(requests(prompts, "tp2asd", arm=asd0))
        assert [o.token_ids for o in outs] == reference
    finally:
        import asyncio

        asyncio.run(unit.close())
