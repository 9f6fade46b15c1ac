"""A unit on Ray whose TP = 1 target runs in the coordinator's own process (`in_replica`): no shard actor, the
same greedy output, a model drafter still in its own actor."""

import asyncio

from actors.drafting import DrafterSetup, SuffixDrafter
from actors.remote.drafter import RemoteDrafter
from actors.remote.policy import RemotePolicy
from actors.requests import GenerationRequest, SamplingParams
from actors.target import LocalTarget
from actors.unit import TargetSetup, build_unit

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [100, 200, 300, 100, 200], [42, 43, 44, 45, 46, 47, 42, 43]]


def req(rid, prompt, n=24, **kw):
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=n), **kw)


def test_in_replica_target_matches_target_only(ray_cluster, tiny_llama_pair):
    target, drafter = tiny_llama_pair
    setup = TargetSetup(str(target), max_slots=8, max_seq_len=256, in_replica=True)
    policy = RemotePolicy("test-in-replica-policy", gamma_max=8)
    local = build_unit(unit="ref", target=TargetSetup(str(target), max_slots=8, max_seq_len=256), on_ray=False,
                       eos_token_ids=[])
    reference = [local.generate_sync(req(f"t{i}", p, speculate=False)).token_ids for i, p in enumerate(PROMPTS)]
    unit = build_unit(unit="inrep", target=setup, drafter=DrafterSetup("suffix"), policy=policy, eos_token_ids=[])
    try:
        assert isinstance(unit.target, LocalTarget) and isinstance(unit.drafter.drafter, SuffixDrafter)
        outs = unit.generate_many_sync([req(f"s{i}", p) for i, p in enumerate(PROMPTS)])
        assert [o.token_ids for o in outs] == reference
        assert sum(o.record.draft_tokens for o in outs) > 0
        assert asyncio.run(unit.target.active_ids()) == [] and unit.drafter.drafter.active_ids() == []
    finally:
        asyncio.run(unit.close())
    model_unit = build_unit(unit="inrep-model", target=setup, policy=policy, eos_token_ids=[],
                            drafter=DrafterSetup("model", str(drafter), resources={"num_cpus": 0.25}))
    try:
        assert isinstance(model_unit.target, LocalTarget) and isinstance(model_unit.drafter, RemoteDrafter)
    finally:
        asyncio.run(model_unit.close())
