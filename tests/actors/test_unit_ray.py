"""Units on a real local Ray cluster: TP=2 target over gloo, policy actor, drafter actor, failures."""

import asyncio
import time

import pytest
import ray

from actors.coordinator import ArmSpec, GenerationRequest, SamplingParams
from actors.policy_actor import PolicyCore, get_or_create_policy_actor
from actors.unit import build_unit
from policies.asd import ASDConfig

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [100, 200, 300, 100, 200], [42, 43, 44, 45, 46, 47, 42, 43]]


def req(rid, prompt, n=24, **kw):
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=n), **kw)


@pytest.fixture(scope="module")
def reference(tiny_llama_pair):
    target, _ = tiny_llama_pair
    local = build_unit(unit="ref", target_source=str(target), max_slots=8, max_seq_len=256, on_ray=False,
                       policy=PolicyCore(), eos_token_ids=[])
    return [local.generate_sync(req(f"ref{i}", p, speculate=False)).token_ids for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def policy(ray_cluster):
    return get_or_create_policy_actor("test-unit-policy", gamma_max=4, fixed_gamma=3)


def test_tp2_unit_greedy_identical_to_in_process_target_only(ray_cluster, tiny_llama_pair, reference, policy):
    target, _ = tiny_llama_pair
    unit = build_unit(unit="tp2", target_source=str(target), tp_size=2, max_slots=8, max_seq_len=256,
                      policy=policy, eos_token_ids=[], target_resources={"num_cpus": 0.5})
    try:
        asd0 = ArmSpec("asd0", "asd", ASDConfig(g=5.0, max_relaxed_per_block=2, budget=0.0))
        reqs = [req(f"e{i}", p) for i, p in enumerate(PROMPTS)] + [req(f"z{i}", p, arm=asd0) for i, p in enumerate(PROMPTS)]
        outs = unit.generate_many_sync(reqs)
        assert [o.token_ids for o in outs] == reference + reference
        assert sum(o.record.draft_tokens for o in outs) > 0
        assert asyncio.run(unit.target.active_ids()) == []
        assert ray.get(policy.open_ledgers.remote()) == []
    finally:
        unit.target.close()


def test_drafter_death_degrades_to_target_only_with_same_output(ray_cluster, tiny_llama_pair, reference, policy):
    target, drafter = tiny_llama_pair
    unit = build_unit(unit="dd", target_source=str(target), drafter_kind="model", drafter_source=str(drafter),
                      max_slots=8, max_seq_len=256, policy=policy, eos_token_ids=[],
                      target_resources={"num_cpus": 0.25}, drafter_resources={"num_cpus": 0.25})

    async def scenario():
        out, killed = [], False
        async for chunk in unit.generate(req("d", PROMPTS[0], n=60)):
            out.extend(chunk.token_ids)
            if not killed and out:
                ray.kill(unit.drafter.handle, no_restart=True)  # gone for good: the unit starts another
                killed = True
            last = chunk
        await unit.stop()
        return out, last.record

    try:
        full = build_unit(unit="full", target_source=str(target), max_slots=8, max_seq_len=256, on_ray=False,
                          policy=PolicyCore(), eos_token_ids=[])
        expected = full.generate_sync(req("x", PROMPTS[0], n=60, speculate=False)).token_ids
        out, record = asyncio.run(scenario())
        assert out == expected
        assert record.degraded
        # the drafter came back: a later request speculates again
        deadline = time.time() + 60
        while time.time() < deadline:
            later = unit.generate_sync(req(f"after{int(time.time()*1000)}", PROMPTS[1]))
            if later.record.draft_tokens > 0 and not later.record.degraded:
                break
            time.sleep(1)
        assert later.token_ids == reference[1] and later.record.draft_tokens > 0
    finally:
        unit.target.close()
        unit.drafter.kill()


def test_target_shard_death_fails_in_flight_requests_and_rebuilds(ray_cluster, tiny_llama_pair, reference, policy):
    target, _ = tiny_llama_pair
    unit = build_unit(unit="td", target_source=str(target), tp_size=2, max_slots=8, max_seq_len=256,
                      policy=policy, eos_token_ids=[], target_resources={"num_cpus": 0.5})

    async def scenario():
        chunks, killed = [], False
        async for chunk in unit.generate(req("t", PROMPTS[0], n=200, speculate=False)):
            chunks.append(chunk)
            if not killed:
                ray.kill(unit.target.shards[1], no_restart=True)
                killed = True
        await unit.stop()
        return chunks[-1]

    try:
        last = asyncio.run(scenario())
        assert last.finish_reason == "error" and "failed" in last.error
        assert ray.get(policy.open_ledgers.remote()) == []
        # the group was rebuilt: new requests are served, with the same output as before
        again = unit.generate_sync(req("t2", PROMPTS[1]))
        assert again.token_ids == reference[1]
    finally:
        unit.target.close()
