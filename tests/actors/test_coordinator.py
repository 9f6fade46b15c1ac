"""The speculative loop in-process: greedy identity, ASD, seeded sampling, distribution, cleanup."""

import asyncio
import time

import pytest
import torch

from actors.coordinator import ArmSpec, Coordinator, GenerationRequest, SamplingParams
from actors.drafting import LocalDrafter, ModelDrafter, NgramDrafter
from actors.engines.native.engine import Engine
from actors.engines.native import load_model
from actors.engines.native.packed import can_pack
from actors.policy import PolicyCore
from bench.harness import RoundCollector
from policies.asd import ASDConfig

from tests.conftest import REPETITIVE_PROMPTS, save_tiny_llama

PROMPTS = REPETITIVE_PROMPTS


@pytest.fixture(scope="module")
def tiny(tiny_llama_pair):
    torch.set_num_threads(1)
    target, drafter = tiny_llama_pair
    return load_model(target)[0], load_model(drafter)[0]


def unit(model, drafter=None, fixed=None, **kw):
    return Coordinator.local(Engine(model, max_slots=16, max_seq_len=256), drafter,
                             PolicyCore(gamma_max=6, fixed_gamma=fixed), **kw)


def greedy(rid, prompt, n=24, **kw):
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=n), **kw)


@pytest.fixture(scope="module")
def reference(tiny):
    """Target-only greedy outputs (γ = 0 every round)."""
    coord = unit(tiny[0], NgramDrafter(1, 3))
    return [coord.generate_sync(greedy(f"ref{i}", p, speculate=False)).token_ids for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("fixed", [None, 1, 4])
def test_ngram_greedy_identical_to_target_only(tiny, reference, fixed):
    coord = unit(tiny[0], NgramDrafter(1, 3), fixed=fixed)
    outs = coord.generate_many_sync([greedy(f"r{i}", p) for i, p in enumerate(PROMPTS)])
    assert [o.token_ids for o in outs] == reference
    assert sum(o.record.draft_tokens for o in outs) > 0  # speculation actually happened
    assert coord.target.engine.active_ids() == [] and coord.policy.core.open_ledgers() == []


def test_model_drafter_greedy_identical_to_target_only(tiny, reference):
    drafter = ModelDrafter(Engine(tiny[1], max_slots=16, max_seq_len=256))
    coord = unit(tiny[0], drafter, fixed=3)
    outs = [coord.generate_sync(greedy(f"m{i}", p)) for i, p in enumerate(PROMPTS)]
    assert [o.token_ids for o in outs] == reference
    assert all(o.record.draft_tokens > 0 for o in outs)
    assert drafter.active_ids() == []


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                    reason="this CPU lacks native bf16 (AVX512-BF16 or AMX-BF16): bf16 runs emulated and unpacked, "
                           "and speculative bf16 output is not promised to equal target-only")
def test_bf16_greedy_identical_to_bf16_target_only(tiny_llama_pair):
    """bf16 on the packed, batch-invariant CPU path: speculation (batched, ragged) equals bf16 target-only.

    This tiny model is too small to separate the packed path from the plain one (both pass here); the bitwise
    tests in tests/actors/engines/test_packed.py do, and scripts/bf16_check.py measures it on SmolLM2."""
    target, drafter = (load_model(d, "bfloat16")[0] for d in tiny_llama_pair)
    coord = unit(target, NgramDrafter(1, 3))
    assert coord.target.engine.model.packed
    reference = [coord.generate_sync(greedy(f"ref{i}", p, speculate=False)).token_ids for i, p in enumerate(PROMPTS)]
    for fixed in (None, 4):
        outs = unit(target, NgramDrafter(1, 3), fixed=fixed).generate_many_sync(
            [greedy(f"r{i}", p) for i, p in enumerate(PROMPTS)])
        assert [o.token_ids for o in outs] == reference
    model_drafter = ModelDrafter(Engine(drafter, max_slots=16, max_seq_len=256))
    outs = unit(target, model_drafter, fixed=3).generate_many_sync([greedy(f"m{i}", p) for i, p in enumerate(PROMPTS)])
    assert [o.token_ids for o in outs] == reference
    assert all(o.record.draft_tokens > 0 for o in outs)


def test_asd_budget_zero_is_exact_and_budget_is_respected(tiny, reference):
    zero = ArmSpec("asd0", "asd", ASDConfig(g=5.0, max_relaxed_per_block=3, budget=0.0))
    coord = unit(tiny[0], NgramDrafter(1, 3), fixed=4)
    outs = coord.generate_many_sync([greedy(f"z{i}", p, arm=zero) for i, p in enumerate(PROMPTS)])
    assert [o.token_ids for o in outs] == reference
    assert all(o.record.speculative_usage()["regret_spent"] == 0.0 for o in outs)

    # the tiny target loops on one token, so n-gram drafts are all exact: use the other tiny model as drafter
    loose = ArmSpec("asd", "asd", ASDConfig(g=50.0, max_relaxed_per_block=4, budget=3.0))
    coord = unit(tiny[0], ModelDrafter(Engine(tiny[1], max_slots=16, max_seq_len=256)), fixed=4)
    outs = coord.generate_many_sync([greedy(f"a{i}", p, arm=loose) for i, p in enumerate(PROMPTS)])
    usage = [o.record.speculative_usage() for o in outs]
    assert all(u["regret_spent"] <= 3.0 + 1e-6 and u["regret_budget"] == 3.0 for u in usage)
    assert sum(u["relaxed_tokens"] for u in usage) > 0  # a random tiny model disagrees with prompt lookup often
    assert coord.policy.core.open_ledgers() == []


def test_seeded_sampling_reproduces_alone_and_in_a_batch(tiny):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, seed=11)
    alone = unit(tiny[0], NgramDrafter(1, 3)).generate_sync(GenerationRequest("s", PROMPTS[0], params))
    others = [GenerationRequest(f"o{i}", p, SamplingParams(max_tokens=20, temperature=1.0, seed=i))
              for i, p in enumerate(PROMPTS[1:])]
    batched = unit(tiny[0], NgramDrafter(1, 3)).generate_many_sync([GenerationRequest("s", PROMPTS[0], params)] + others)
    assert batched[0].token_ids == alone.token_ids


def test_sampled_speculation_follows_the_target_distribution(tmp_path_factory, smollm2_tokenizer):
    """Joint law of the first two tokens under speculative sampling with a model drafter (q ≠ p) equals the
    target's p(t1)·p(t2 | t1). Vocabulary 8, 4000 seeded requests, chi-square over cells with expected ≥ 5.
    The statistic is deterministic at these fixed seeds; the bound p > 1e-4 leaves a wide margin, and a biased
    sampler (e.g. accepting drafts without the min(1, p/q) test) fails it by orders of magnitude."""
    from scipy import stats as scipy_stats
    vocab = 8
    tgt_dir = save_tiny_llama(tmp_path_factory.mktemp("v8t"), smollm2_tokenizer, seed=3, vocab_size=vocab,
                              bos_token_id=0, eos_token_id=0, pad_token_id=0)
    drf_dir = save_tiny_llama(tmp_path_factory.mktemp("v8d"), smollm2_tokenizer, seed=4, vocab_size=vocab,
                              bos_token_id=0, eos_token_id=0, pad_token_id=0)
    target, drafter = load_model(tgt_dir)[0], load_model(drf_dir)[0]
    prompt = [1, 2, 3, 4]
    temperature = 2.0  # flatten the random model's distribution so every cell is populated
    p1 = _next_probs(target, prompt, temperature)  # [V]
    p12 = torch.stack([p1[t1] * _next_probs(target, prompt + [t1], temperature) for t1 in range(vocab)])  # [V, V]
    n = 4000
    coord = Coordinator.local(Engine(target, max_slots=64, max_seq_len=32),
                              ModelDrafter(Engine(drafter, max_slots=64, max_seq_len=32)),
                              PolicyCore(gamma_max=3, fixed_gamma=3), max_batch_size=64)
    reqs = [GenerationRequest(f"d{i}", prompt, SamplingParams(max_tokens=4, temperature=temperature, seed=i),
                              speculate=True) for i in range(n)]
    outs = coord.generate_many_sync(reqs)
    counts = torch.zeros(vocab, vocab)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    expected = (p12 * n).flatten()
    observed = counts.flatten()
    big = expected >= 5
    chi2 = float((((observed - expected) ** 2) / expected)[big].sum())
    dof = int(big.sum()) - 1
    assert scipy_stats.chi2.sf(chi2, dof) > 1e-4, (chi2, dof)
    assert sum(o.record.accepted_tokens for o in outs) > 0


def _next_probs(model, context, temperature):
    e = Engine(model, max_slots=1, max_seq_len=32)
    return torch.softmax(e.forward(["x"], [context])[0, -1] / temperature, -1)


def test_cancelled_stream_frees_caches_and_ledger(tiny):
    coord = unit(tiny[0], NgramDrafter(1, 3), fixed=2)
    arm = ArmSpec("asd", "asd", ASDConfig(g=2.0, max_relaxed_per_block=1, budget=1.0))

    async def scenario():
        stream = coord.generate(greedy("c", PROMPTS[0], n=200, arm=arm))
        first = await stream.__anext__()
        assert first.token_ids
        await stream.aclose()  # the client went away
        for _ in range(1000):  # a hang guard; the end work (caches, ledger) follows the request's end
            await asyncio.sleep(0.01)
            state = (coord.active_requests(), coord.target.engine.active_ids(), coord.policy.core.open_ledgers())
            if state == ([], [], []):
                break
        await coord.stop()
        return state

    assert asyncio.run(scenario()) == ([], [], [])


def test_abort_returns_after_cleanup(tiny):
    coord = unit(tiny[0], NgramDrafter(1, 3))

    async def scenario():
        chunks = []

        async def consume():
            async for c in coord.generate(greedy("a", PROMPTS[1], n=200)):
                chunks.append(c)

        task = asyncio.create_task(consume())
        while not chunks:
            await asyncio.sleep(0.005)
        await coord.abort("a")
        await task
        await coord.stop()
        return chunks[-1].finish_reason, coord.target.engine.active_ids()

    assert asyncio.run(scenario()) == ("abort", [])


def test_bad_requests_raise_value_errors(tiny):
    coord = unit(tiny[0], NgramDrafter(1, 3))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_tokens=1, top_p=1.5)
    with pytest.raises(ValueError, match="prompt_ids"):
        coord.generate_sync(greedy("e", []))
    with pytest.raises(ValueError, match="prompt_ids"):
        coord.generate_sync(greedy("e", [10**9]))
    with pytest.raises(ValueError, match="max_seq_len"):
        coord.generate_sync(greedy("e", [1] * 300))


def test_free_drafts_fill_the_round_width():
    """A forward is as wide as its widest row: with prompt lookup every speculating row drafts up to that width
    (within its own limits); target-only rows stay at 0, and a costly drafter keeps each row's own plan."""
    from actors.scheduler import Scheduler

    scheduler = Scheduler(max_batch_size=8, max_seq_len=256, vocab_size=None, clock=lambda: 0.0)
    specs = [("a", True, 50), ("b", True, 50), ("c", False, 50), ("d", True, 3)]

    async def enqueue():
        return [scheduler.enqueue(GenerationRequest(rid, [1, 2, 3], SamplingParams(max_tokens=n), speculate=spec))
                for rid, spec, n in specs]

    rows = asyncio.run(enqueue())
    scheduler.admit()
    scheduler.set_plan([r.key() for r in rows], [5, 0, 4, 5])
    assert scheduler.gammas(rows, can_draft=True, free_drafts=True) == [5, 5, 0, 2]  # d may emit 3: 2 drafts + 1
    assert scheduler.gammas(rows, can_draft=True, free_drafts=False) == [5, 0, 0, 2]
    assert scheduler.gammas(rows, can_draft=False, free_drafts=True) == [0, 0, 0, 0]


def test_a_unit_serves_again_on_a_new_event_loop(tiny):
    """generate_many_sync runs each call on its own event loop: state tied to the first loop (the loop task,
    a γ plan deferred by an exact-only round, which `stop` drops) must not carry into the next one."""
    coord = unit(tiny[0], NgramDrafter(1, 3))
    first = coord.generate_many_sync([greedy(f"a{i}", p) for i, p in enumerate(PROMPTS)])
    asd = ArmSpec("asd0", "asd", ASDConfig(g=5.0, max_relaxed_per_block=3, budget=0.0))
    again = coord.generate_many_sync([greedy(f"b{i}", p, arm=asd) for i, p in enumerate(PROMPTS)])
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


class _SlowRelease:
    """A target whose release takes a while (an actor call): the final message must not wait for it."""

    def __init__(self, target, seconds=0.05):
        self.inner, self.seconds, self.released_at, self.steps = target, seconds, {}, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def step(self, batch):
        self.steps.append(time.perf_counter())
        return await self.inner.step(batch)

    async def release(self, seq_ids):
        await asyncio.sleep(self.seconds)
        await self.inner.release(seq_ids)
        self.released_at.update((rid, time.perf_counter()) for rid in seq_ids)


def test_timing_hops_partition_the_request_and_its_end_follows_the_answer(tiny):
    """`usage.speculative.timing_s` from the unit: non-negative hops within the request's time; the first token
    leaves before the next forward, the final message before the caches are freed, `stats` waits for that, and
    the record keeps `end_deferred`."""
    from actors.requests import collect
    from actors.timing import END_DEFERRED, ROUND_PARTS

    observer = RoundCollector()
    coord = unit(tiny[0], NgramDrafter(1, 3), observer=observer)
    coord.target = _SlowRelease(coord.target)

    async def run():
        async def one(i, prompt):
            start = time.perf_counter()
            result = await collect(coord.generate(greedy(f"t{i}", prompt, n=12)))
            return result, start, time.perf_counter()

        try:
            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS[:3])))
            stats = await coord.stats()
        finally:
            await coord.stop()
        return results, stats

    async def first_token():
        stream = coord.generate(greedy("alone", PROMPTS[0], n=4))
        await stream.__anext__()
        seen = time.perf_counter()
        await stream.aclose()
        await coord.stop()
        return seen

    seen = asyncio.run(first_token())
    assert sum(t < seen for t in coord.target.steps) == 1  # the prefill's forward only, not the first round's
    coord.target.steps.clear()
    results, stats = asyncio.run(run())
    assert stats["target_sequences"] == [] and stats["active_requests"] == []
    for result, start, answered in results:
        timing = result.record.speculative_usage()["timing_s"]
        assert set(timing) == {"queue", "prefill", *ROUND_PARTS, "decode", "end"}
        assert all(v >= 0 for v in timing.values()), timing
        assert sum(timing.values()) <= answered - start
        assert result.record.rounds > 0 and timing["score"] > 0 and timing["prefill"] > 0
        assert answered < coord.target.released_at[result.record.request_id]  # answered before the release
    deferred = {r.request_id: r.timing_s[END_DEFERRED] for r in observer.requests}
    assert sorted(deferred) == ["alone", "t0", "t1", "t2"] and min(deferred.values()) >= 0.05


class _DrafterThatDiesOnce(LocalDrafter):
    """Fault injection: the first propose fails, and the first recovery outlasts the private loop it runs in."""

    def __init__(self):
        super().__init__(NgramDrafter(1, 3))
        self.failed, self.recoveries = False, 0

    async def propose(self, requests):
        if not self.failed:
            self.failed = True
            raise RuntimeError("drafter died")
        return await super().propose(requests)

    async def recover(self):
        self.recoveries += 1
        if self.recoveries == 1:
            await asyncio.sleep(60)  # cancelled when generate_sync's loop ends


def test_a_recovery_cut_short_by_its_loop_is_retried_not_a_hang(tiny, reference):
    """A drafter recovery still running when a `generate_sync` loop ends is cancelled with it; the next request
    restarts it (it used to raise CancelledError in the round and leave every later request hanging)."""
    coord = unit(tiny[0])
    coord.drafter = _DrafterThatDiesOnce()
    first = coord.generate_sync(greedy("d0", PROMPTS[0]))
    assert first.token_ids == reference[0] and first.record.degraded
    later = [coord.generate_sync(greedy(f"d{i}", PROMPTS[i % len(PROMPTS)])) for i in range(1, 4)]
    assert [o.token_ids for o in later] == [reference[i % len(PROMPTS)] for i in range(1, 4)]
    assert coord.drafter.recoveries == 2 and later[-1].record.draft_tokens > 0
