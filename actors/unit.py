"""A unit: one coordinator with its drafter and its target (tensor-parallel group on Ray, or in-process).

`build_unit(on_ray=True)` is what a Serve decoder replica runs: a `TargetGroup` of `tp_size` shard actors in
one placement group, a model drafter in its own actor (restarted by Ray when it dies; meanwhile the unit
decodes target-only and marks requests degraded), and the app's policy actor. `build_unit(on_ray=False)`
builds the same unit in the caller's process (CLI `generate`, tests, benchmarks). The n-gram drafter always
runs in the coordinator's process: it costs microseconds, an actor round trip ~1.5 ms.
"""

from __future__ import annotations

import logging

from actors.coordinator import Coordinator
from actors.drafters import ModelDrafter, NgramDrafter, check_vocab
from actors.target import TargetStep, num_logits

log = logging.getLogger(__name__)


class DrafterHost:
    """A `ModelDrafter` with its own engine, as a Ray actor body."""

    def __init__(self, source: str, dtype: str = "float32", device: str = "cpu", max_slots: int = 64,
                 max_seq_len: int | None = None, torch_threads: int | None = 1):
        import torch

        from actors.engine import Engine
        from actors.loading import load_model

        if torch_threads and device == "cpu":
            torch.set_num_threads(torch_threads)
        model, _ = load_model(source, dtype, "cuda:0" if device == "cuda" else device)
        self.drafter = ModelDrafter(Engine(model, max_slots, max_seq_len), name=source)

    def propose(self, requests):
        return self.drafter.propose(requests)

    def release(self, seq_id: str) -> None:
        self.drafter.release(seq_id)

    def active_ids(self) -> list[str]:
        return self.drafter.active_ids()


class RemoteDrafter:
    """The coordinator's view of a drafter actor: same methods, each returning an awaitable ObjectRef.

    `recover()` brings a failed drafter back: it waits for Ray's own restart (a crashed process, restarted
    by `max_restarts`), or starts a fresh actor when the old one is gone for good.
    """

    def __init__(self, factory):
        self.factory = factory
        self.handle = factory()

    async def recover(self) -> None:
        import ray

        try:
            await self.handle.active_ids.remote()
        except ray.exceptions.RayActorError:
            self.handle = self.factory()
            await self.handle.active_ids.remote()

    def propose(self, requests):
        return self.handle.propose.remote(requests)

    def release(self, seq_id: str):
        return self.handle.release.remote(seq_id)

    def kill(self) -> None:
        import ray

        ray.kill(self.handle, no_restart=True)


class RemotePolicy:
    """The coordinator's view of the policy actor (`actors.policy_actor.PolicyCore` behind Ray)."""

    def __init__(self, handle):
        self.handle = handle

    def open_request(self, request_id, budget):
        return self.handle.open_request.remote(request_id, budget)

    def close_request(self, request_id):
        return self.handle.close_request.remote(request_id)

    def settle(self, asd, report, plan_for, batch_size):
        return self.handle.settle.remote(asd, report, plan_for, batch_size)

    def plan(self, rows, batch_size):
        return self.handle.plan.remote(rows, batch_size)


def build_unit(*, unit: str, target_source: str, dtype: str = "float32", device: str = "cpu", tp_size: int = 1,
               max_slots: int = 64, max_seq_len: int | None = None, drafter_kind: str = "ngram",
               drafter_source: str | None = None, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4,
               policy=None, target_resources: dict | None = None, drafter_resources: dict | None = None,
               placement_strategy: str = "STRICT_PACK", torch_threads: int | None = None, observer=None,
               on_ray: bool = True, eos_token_ids=None) -> Coordinator:
    """Assemble a unit. `policy`: the policy actor handle (on_ray) or a `PolicyCore` (in-process)."""
    from actors.loading import model_info

    if drafter_kind not in ("ngram", "model", "none"):
        raise ValueError(f"drafter_kind must be 'ngram', 'model' or 'none', got {drafter_kind!r}")
    if drafter_kind == "model" and not drafter_source:
        raise ValueError("drafter_source is required when drafter_kind is 'model'")
    info = model_info(target_source)
    if drafter_kind == "model":
        check_vocab(target_source, info["vocab_size"], drafter_source, model_info(drafter_source)["vocab_size"])
    max_seq_len = min(max_seq_len or info["max_position_embeddings"], info["max_position_embeddings"])
    eos = info["eos_token_ids"] if eos_token_ids is None else eos_token_ids
    common = dict(eos_token_ids=eos, max_seq_len=max_seq_len, max_batch_size=max_slots, unit=unit,
                  observer=observer, vocab_size=info["vocab_size"])
    if on_ray:
        return _on_ray(unit, target_source, dtype, device, tp_size, max_slots, max_seq_len, drafter_kind,
                       drafter_source, prompt_lookup_min, prompt_lookup_max, policy, target_resources or {},
                       drafter_resources or {}, torch_threads, placement_strategy, common)
    import torch

    from actors.engine import Engine
    from actors.loading import load_model
    from actors.policy_actor import PolicyCore

    if torch_threads:
        torch.set_num_threads(torch_threads)
    if tp_size != 1:
        raise ValueError("tp_size > 1 needs on_ray=True (tensor-parallel shards are Ray actors)")
    model, _ = load_model(target_source, dtype, device)
    drafter = None
    if drafter_kind == "ngram":
        drafter = NgramDrafter(prompt_lookup_min, prompt_lookup_max)
    elif drafter_kind == "model":
        drafter_model, _ = load_model(drafter_source, dtype, device)
        drafter = ModelDrafter(Engine(drafter_model, max_slots, max_seq_len), name=drafter_source)
    return Coordinator.local(Engine(model, max_slots, max_seq_len), drafter, policy or PolicyCore(), **common)


def _on_ray(unit, target_source, dtype, device, tp_size, max_slots, max_seq_len, drafter_kind, drafter_source,
            prompt_lookup_min, prompt_lookup_max, policy, target_resources, drafter_resources, torch_threads,
            placement_strategy, common) -> Coordinator:
    import ray

    from actors.tp import ShardSpec, TargetGroup

    if policy is None:
        raise ValueError("policy (the policy actor handle) is required when on_ray=True")
    spec = ShardSpec(source=target_source, tp_size=tp_size, dtype=dtype, device=device, max_slots=max_slots,
                     max_seq_len=max_seq_len, num_threads=torch_threads or 1, logit_rows=num_logits,
                     postprocess=TargetStep())
    target = TargetGroup(spec, num_cpus=target_resources.get("num_cpus", 0.5), resources=_bundle(target_resources),
                         strategy=placement_strategy)
    drafter = None
    if drafter_kind == "ngram":
        drafter = NgramDrafter(prompt_lookup_min, prompt_lookup_max)
    elif drafter_kind == "model":
        actor = ray.remote(DrafterHost).options(
            num_cpus=drafter_resources.get("num_cpus", 0.5), num_gpus=drafter_resources.get("num_gpus", 0),
            memory=int(drafter_resources["memory_gb"] * 2**30) if drafter_resources.get("memory_gb") else None,
            max_restarts=-1, max_task_retries=0,
        )
        drafter = RemoteDrafter(
            lambda: actor.remote(drafter_source, dtype, device, max_slots, max_seq_len, torch_threads or 1)
        )
    coordinator = Coordinator(target=target, drafter=drafter, policy=RemotePolicy(policy),
                              **common)
    return coordinator


def _bundle(resources: dict) -> dict | None:
    """One shard's placement-group bundle from config resources {num_cpus, num_gpus}."""
    if not resources:
        return None
    bundle = {"CPU": float(resources.get("num_cpus", 0.5))}
    if resources.get("num_gpus"):
        bundle["GPU"] = float(resources["num_gpus"])
    return bundle  # memory_gb sizes Kubernetes pods; Ray does not schedule shards by it
