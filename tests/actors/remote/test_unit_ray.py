"""Units on a real local Ray cluster: TP=2 target over gloo, policy actor, drafter actor, failures."""

import asyncio
import time

import pytest
import ray

from actors.drafting import DrafterSetup
from actors.remote.policy import RemotePolicy
from actors.requests import ArmSpec, GenerationRequest, SamplingParams
from actors.unit import TargetSetup, build_unit
from policies.asd import ASDConfig

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [100, 200, 300, 100, 200], [42, 43, 44, 45, 46, 47, 42, 43]]


def req(rid, prompt, n=24, **kw):
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=n), **kw)


@pytest.fixture(scope="module")
def reference(tiny_llama_pair):
    target, _ = tiny_llama_pair
    local = build_unit(unit="ref", target=TargetSetup(str(target), max_slots=8, max_seq_len=256), on_ray=False,
                       eos_token_ids=[])
    return [local.generate_sync(req(f"ref{i}", p, speculate=False)).token_ids for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def policy(ray_cluster):
    return RemotePolicy("test-unit-policy", gamma_max=4, fixed_gamma=3)


def test_tp2_unit_greedy_identical_to_in_process_target_only(ray_cluster, tiny_llama_pair, reference, policy):
    target, _ = tiny_llama_pair
    unit = build_unit(unit="tp2", target=TargetSetup(str(target), tp_size=2, max_slots=8, max_seq_len=256,
                                                     resources={"num_cpus": 0.5}), policy=policy, eos_token_ids=[])
    try:
        asd0 = ArmSpec("asd0", "asd", ASDConfig(g=5.0, max_relaxed_per_block=2, budget=0.0))
        reqs = [req(f"e{i}", p) for i, p in enumerate(PROMPTS)] + [req(f"z{i}", p, arm=asd0) for i, p in enumerate(PROMPTS)]
        outs = unit.generate_many_sync(reqs)
        assert [o.token_ids for o in outs] == reference + reference
        assert sum(o.record.draft_tokens for o in outs) > 0
        assert asyncio.run(unit.target.active_ids()) == []
        assert asyncio.run(policy.open_ledgers()) == []
    finally:
        asyncio.run(unit.close())


def test_drafter_death_degrades_to_target_only_with_same_output(ray_cluster, tiny_llama_pair, reference, policy):
    target, drafter = tiny_llama_pair
    unit = build_unit(unit="dd", target=TargetSetup(str(target), max_slots=8, max_seq_len=256,
                                                    resources={"num_cpus": 0.25}),
                      drafter=DrafterSetup("model", str(drafter), resources={"num_cpus": 0.25}), policy=policy,
                      eos_token_ids=[])

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
        full = build_unit(unit="full", target=TargetSetup(str(target), max_slots=8, max_seq_len=256), on_ray=False,
                          eos_token_ids=[])
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
        asyncio.run(unit.close())


def test_target_shard_death_fails_in_flight_requests_and_rebuilds(ray_cluster, tiny_llama_pair, reference, policy):
    target, _ = tiny_llama_pair
    unit = build_unit(unit="td", target=TargetSetup(str(target), tp_size=2, max_slots=8, max_seq_len=256,
                                                    resources={"num_cpus": 0.5}), policy=policy, eos_token_ids=[])

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
        assert asyncio.run(policy.open_ledgers()) == []
        # the group was rebuilt: new requests are served, with the same output as before
        again = unit.generate_sync(req("t2", PROMPTS[1]))
        assert again.token_ids == reference[1]
    finally:
        asyncio.run(unit.close())


def test_policy_actor_restart_mid_request_restores_ledgers_and_finishes(ray_cluster, tiny_llama_pair):
    """Kill the policy actor's process while ASD requests are mid-flight (Ray restarts it, empty): the unit
    restores each request's ledger with the regret already spent and the requests finish normally, never
    overspending; the restarted actor then holds no ledger once they end."""
    target, drafter = tiny_llama_pair
    policy = RemotePolicy("test-restart-policy", gamma_max=4, fixed_gamma=4)
    unit = build_unit(unit="pr", target=TargetSetup(str(target), max_slots=8, max_seq_len=256,
                                                    resources={"num_cpus": 0.25}),
                      drafter=DrafterSetup("model", str(drafter), resources={"num_cpus": 0.25}), policy=policy,
                      eos_token_ids=[])
    arm = ArmSpec("asd", "asd", ASDConfig(g=50.0, max_relaxed_per_block=4, budget=3.0))

    async def scenario():
        async def one(rid, prompt):
            chunks, seen = [], 0
            async for chunk in unit.generate(req(rid, prompt, n=40, arm=arm)):
                chunks.append(chunk)
                seen += len(chunk.token_ids)
                if rid == "p0" and seen >= 4 and not getattr(one, "killed", False):
                    one.killed = True
                    ray.kill(policy.handle, no_restart=False)  # the process dies; Ray restarts the actor
            return chunks[-1]

        out = await asyncio.gather(*(one(f"p{i}", p) for i, p in enumerate(PROMPTS)))
        await unit.stop()
        return out

    try:
        finals = asyncio.run(scenario())
        assert [f.finish_reason for f in finals] == ["length"] * len(PROMPTS)
        usage = [f.record.speculative_usage() for f in finals]
        assert all(u["regret_spent"] <= 3.0 + 1e-9 for u in usage)
        assert sum(u["relaxed_tokens"] for u in usage) > 0  # ASD really ran across the restart
        assert asyncio.run(policy.open_ledgers()) == []
    finally:
        asyncio.run(unit.close())
        ray.kill(policy.handle, no_restart=True)
