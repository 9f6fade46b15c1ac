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


def app_ledgers(policy) -> list[str]:
    """The ledgers the app's policy actor holds once the unit's reports so far have reached it."""

    async def synced():
        await policy.synced()
        return await policy.app_ledgers()

    return policy.open_ledgers() + asyncio.run(synced())


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
        assert app_ledgers(policy) == []
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


def test_a_shard_death_mid_stream_resumes_every_request_on_the_rebuilt_group(ray_cluster, tiny_llama_pair,
                                                                             reference, policy):
    """Kill a TP shard while greedy exact and ASD streams run: the unit rebuilds the group and resumes each
    request from its prompt and the tokens it already streamed. Every stream completes with the undisturbed
    output (no token lost or repeated), no ledger goes over budget, and nothing is left cached or open."""
    target, _ = tiny_llama_pair
    unit = build_unit(unit="td", target=TargetSetup(str(target), tp_size=2, max_slots=8, max_seq_len=256,
                                                    resources={"num_cpus": 0.5}), policy=policy, eos_token_ids=[])
    arm = ArmSpec("asd", "asd", ASDConfig(g=50.0, max_relaxed_per_block=4, budget=3.0))
    reqs = [req(f"t{i}", p) for i, p in enumerate(PROMPTS)] + [req(f"a{i}", p, arm=arm) for i, p in enumerate(PROMPTS)]
    alone = [req(f"u{i}", p, arm=arm) for i, p in enumerate(PROMPTS)]  # the ASD streams, undisturbed

    async def scenario():
        killed = asyncio.Event()

        async def one(request):
            tokens, last = [], None
            async for chunk in unit.generate(request):
                tokens.extend(chunk.token_ids)
                last = chunk
                if request.request_id == "t0" and len(tokens) >= 6 and not killed.is_set():
                    killed.set()
                    ray.kill(unit.target.shards[1], no_restart=True)
            return tokens, last

        out = await asyncio.gather(*(one(r) for r in reqs))
        await unit.stop()
        return out

    try:
        undisturbed = unit.generate_many_sync(alone)
        outs = asyncio.run(scenario())
        assert [last.finish_reason for _, last in outs] == ["length"] * len(reqs)
        assert [tokens for tokens, _ in outs[: len(PROMPTS)]] == reference
        assert [tokens for tokens, _ in outs[len(PROMPTS):]] == [o.token_ids for o in undisturbed]
        assert all(last.record.regret_spent <= 3.0 + 1e-9 for _, last in outs[len(PROMPTS):])
        assert asyncio.run(unit.target.active_ids()) == [] and app_ledgers(policy) == []
        # the rebuilt group serves new requests exactly
        assert unit.generate_sync(req("t2", PROMPTS[1])).token_ids == reference[1]
    finally:
        asyncio.run(unit.close())


def test_policy_actor_restart_mid_request_restores_ledgers_and_finishes(ray_cluster, tiny_llama_pair):
    """Kill the policy actor's process while ASD requests are mid-flight (Ray restarts it, empty): nothing on
    the step waits for it, the unit keeps its ledger leases and sends them all to the restarted actor, the
    requests finish normally, never overspending, and the actor holds no ledger once they end."""
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
        assert app_ledgers(policy) == []
    finally:
        asyncio.run(unit.close())
        ray.kill(policy.handle, no_restart=True)
