"""The suffix drafter in a unit: greedy identity with target-only decoding (fp32, tiny random model and the real
SmolLM2), confidences that reach the policy, state freed with each request, bounded memory over 500 requests."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest
import torch

from actors.contracts import DraftBatch, DraftRequest
from actors.coordinator import Coordinator, GenerationRequest, SamplingParams
from actors.drafting import DrafterSetup, SuffixDrafter, make_drafter
from actors.engines.native import load_model
from actors.engines.native.engine import Engine
from actors.policy import PolicyCore
from policies import PAD_TOKEN_ID
from tests.conftest import REPETITIVE_PROMPTS

PROMPTS = REPETITIVE_PROMPTS


@pytest.fixture(scope="module")
def tiny(tiny_llama_pair):
    torch.set_num_threads(1)
    return load_model(tiny_llama_pair[0], "float32")[0]


def unit(model, drafter, fixed=None):
    return Coordinator.local(Engine(model, max_slots=16, max_seq_len=256), drafter,
                             PolicyCore(gamma_max=8, fixed_gamma=fixed))


def greedy(rid, prompt, n=24, **kw):
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=n), **kw)


def test_make_drafter_builds_the_suffix_drafter():
    drafter = make_drafter(DrafterSetup(kind="suffix", suffix_max_depth=16, suffix_min_confidence=0.25,
                                        suffix_cache_tokens=0), max_slots=4, max_seq_len=64)
    assert isinstance(drafter, SuffixDrafter) and drafter.free_drafts
    assert (drafter.max_depth, drafter.min_confidence, drafter.cache) == (16, 0.25, None)


@pytest.mark.parametrize("kwargs, name", [({"max_depth": 0}, "max_depth"), ({"min_confidence": 1.5}, "min_confidence"),
                                          ({"cache_tokens": -1}, "cache_tokens")])
def test_bad_settings_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SuffixDrafter(**kwargs)


def test_proposals_carry_confidences_that_shorten_drafts():
    drafter = SuffixDrafter(min_confidence=0.0, cache_tokens=0)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4]
    batch = drafter.propose([DraftRequest("a", context, 8), DraftRequest("b", [5, 6], 4)])
    assert batch.draft_ids[0, :5].tolist() == [5, 6, 7, 8, 9] and batch.draft_lens.tolist() == [8, 0]
    conf, match_len = batch.row_confidence(0)
    assert match_len == 4 and len(conf) == 8 and all(a >= b for a, b in zip(conf, conf[1:]))
    assert batch.row_confidence(1) == ((), 0)
    # a higher floor cuts the same draft where its confidence falls below it
    strict = SuffixDrafter(min_confidence=conf[2], cache_tokens=0).propose([DraftRequest("a", context, 8)])
    assert int(strict.draft_lens[0]) == 3


def test_index_follows_the_context_and_rebuilds_when_it_changes():
    drafter = SuffixDrafter(cache_tokens=0)
    drafter.propose([DraftRequest("a", [1, 2, 3, 1, 2], 4)])
    drafter.propose([DraftRequest("a", [1, 2, 3, 1, 2, 3, 1], 4)])
    assert len(drafter._indexes["a"]) == 7
    drafter.propose([DraftRequest("a", [7, 7, 7], 4)])  # not a continuation: rebuilt
    assert drafter._indexes["a"].tail(10) == [7, 7, 7]


def test_scatter_places_rows_and_keeps_confidences():
    sub = DraftBatch.from_rows([[4, 5], [6]], confidence=[[0.9, 0.5], [0.7]], match_lens=[3, 1])
    full = sub.scatter([2, 0], 3)
    assert full.draft_ids.tolist() == [[6, PAD_TOKEN_ID], [PAD_TOKEN_ID] * 2, [4, 5]]
    assert full.draft_lens.tolist() == [1, 0, 2] and full.match_lens.tolist() == [1, 0, 3]
    conf, match_len = full.row_confidence(2)
    assert conf == pytest.approx((0.9, 0.5)) and match_len == 3 and full.row_confidence(1) == ((), 0)
    assert DraftBatch.from_rows([[1]]).scatter([1], 2).row_confidence(1) is None


@pytest.fixture(scope="module")
def reference(tiny):
    coord = unit(tiny, None)
    return [coord.generate_sync(greedy(f"ref{i}", p, speculate=False)).token_ids for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("fixed", [None, 2, 8])
def test_suffix_greedy_identical_to_target_only(tiny, reference, fixed):
    drafter = SuffixDrafter(min_confidence=0.0, cache_tokens=4096)
    coord = unit(tiny, drafter, fixed=fixed)
    outs = coord.generate_many_sync([greedy(f"r{i}", p) for i, p in enumerate(PROMPTS)])
    assert [o.token_ids for o in outs] == reference
    assert sum(o.record.draft_tokens for o in outs) > 0  # speculation actually happened
    assert drafter.active_ids() == [] and coord.target.engine.active_ids() == []
    assert drafter.cache.num_tokens > 0  # finished outputs went to the cache
    if fixed is None:  # the policy learned α per (match length, confidence) cell from the reported drafts
        assert coord.policy.core.gamma.summary()["confidence"]["exact"]


def test_drafter_state_is_freed_on_abort(tiny):
    drafter = SuffixDrafter(cache_tokens=0)
    coord = unit(tiny, drafter)

    async def run():
        stream = coord.generate(greedy("a", PROMPTS[0], n=200))
        await stream.__anext__()
        await stream.__anext__()
        await coord.abort("a")
        async for _ in stream:
            pass
        await coord.stop()

    import asyncio

    asyncio.run(run())
    assert drafter.active_ids() == []


def test_memory_does_not_grow_over_500_requests():
    """500 requests of 300-token prompts and 64 output tokens, drafted round by round and released. The cache
    (8k tokens in 4 segments of ~31 outputs) is full after ~130 requests; from request 150 to 500 the traced
    memory may not grow by more than one cache segment (2k tokens, ~200 kB at ~99 B per token) plus one
    request's index (~40 kB): segments are replaced, not added, and nothing per request is left behind."""
    rng = random.Random(0)
    drafter = SuffixDrafter(min_confidence=0.3, cache_tokens=8192)
    phrases = [[rng.randrange(50_000) for _ in range(rng.randint(3, 12))] for _ in range(200)]

    def request(i):
        prompt = [t for _ in range(40) for t in rng.choice(phrases)][:300]
        context = list(prompt) + [rng.randrange(50_000)]
        while len(context) < len(prompt) + 64:
            batch = drafter.propose([DraftRequest(f"r{i}", context, 8)])
            accepted = rng.randint(0, int(batch.draft_lens[0]))
            context += batch.draft_ids[0, :accepted].tolist() + [rng.randrange(50_000)]
        drafter.release(f"r{i}")

    gc.collect()
    tracemalloc.start()
    try:
        for i in range(150):
            request(i)
        gc.collect()
        warm = tracemalloc.get_traced_memory()[0]
        for i in range(150, 500):
            request(i)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - warm
    finally:
        tracemalloc.stop()
    assert drafter.active_ids() == [] and drafter._prompt_lens == {}
    assert drafter.cache.num_tokens <= 8192
    assert grown < 300_000, f"drafter memory grew by {grown} bytes from request 150 to 500"


@pytest.mark.slow
def test_suffix_greedy_identical_on_smollm2(smollm2_tokenizer):
    """The real embedded model in fp32: speculative output with the suffix drafter equals target-only."""
    torch.set_num_threads(2)
    tok = smollm2_tokenizer
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
    chat = tok.apply_chat_template([{"role": "user", "content": "Repeat twice: the quick brown fox."}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = [tok(code)["input_ids"], tok(chat, add_special_tokens=False)["input_ids"]]
    model = load_model("embedded:smollm2", "float32", "cpu")[0]
    drafter = SuffixDrafter()
    coord = Coordinator.local(Engine(model, max_slots=4, max_seq_len=512), drafter,
                              PolicyCore(gamma_max=16, draft_cost=0.02), eos_token_ids=[2])
    ref = [coord.generate_sync(greedy(f"t{i}", p, n=48, speculate=False)).token_ids for i, p in enumerate(prompts)]
    outs = coord.generate_many_sync([greedy(f"s{i}", p, n=48) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in outs] == ref
    assert sum(o.record.accepted_tokens for o in outs) > 0
