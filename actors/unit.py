"""A unit: what a Serve decoder replica runs, and the one place that picks its engine.

`Unit` is the contract both engines implement (`actors.coordinator.Coordinator` on the native engine,
`actors.engines.vllm.unit.VllmUnit` on vLLM). `make_unit` builds either from the config's setups, with its
`UnitPolicy` reporting to the app's policy actor on Ray, or to a `PolicyCore` in the process off Ray.
`build_unit` assembles a native unit: on Ray, a tensor-parallel `TargetGroup` of shard actors and a model drafter
in its own actor; off Ray (or `in_replica`), the engine in the caller's process.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol, Sequence

from actors.coordinator import Coordinator
from actors.drafting import DrafterSetup, LocalDrafter, check_vocab, make_drafter
from actors.policy import LocalPolicy, PolicyCore, UnitPolicy
from actors.requests import GenerationChunk, GenerationRequest
from actors.setup import TargetSetup
from actors.sources import context_length
from actors.stats import LoopObserver
from actors.target import LocalTarget

log = logging.getLogger(__name__)


class Unit(Protocol):
    """One decoding unit, on either engine."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the request's tokens; the last chunk carries the finish reason and the `RequestRecord`."""

    async def abort(self, request_id: str) -> None: ...

    async def close(self) -> None:
        """Abort what runs and free the unit's engine, actors and placement."""

    def healthy(self) -> bool:
        """False once the unit cannot serve again (Serve then replaces its replica)."""

    async def stats(self) -> dict[str, Any]:
        """What it holds: active_requests, target_sequences, drafter_sequences, open_ledgers (leak checks)."""

    def active_requests(self) -> list[str]: ...


def build_unit(*, unit: str, target: TargetSetup, drafter: DrafterSetup = DrafterSetup(),
               policy: UnitPolicy | None = None, observer: LoopObserver | None = None,
               torch_threads: int | None = None, on_ray: bool = True,
               eos_token_ids: Sequence[int] | None = None) -> Coordinator:
    """Assemble a unit. `policy`: the app's `RemotePolicy` (on_ray), else a `LocalPolicy` (default: a fresh
    `PolicyCore`). `await coordinator.close()` frees its actors and placement group."""
    import torch

    from actors.sources import model_info

    info = model_info(target.source)
    if drafter.kind == "model":
        check_vocab(target.source, info["vocab_size"], drafter.source, model_info(drafter.source)["vocab_size"])
    max_seq_len = context_length(target.max_seq_len, info)
    if on_ray and policy is None:
        raise ValueError("policy (the app's RemotePolicy) is required when on_ray=True")
    if on_ray and not target.in_replica:
        from actors.remote.unit import ray_backends

        target_backend, drafter_backend = ray_backends(target, drafter, max_seq_len=max_seq_len,
                                                       torch_threads=torch_threads)
    else:
        from actors.engines.native import Engine, load_model

        if target.tp_size != 1:
            raise ValueError("tp_size > 1 needs on_ray=True and in_replica=False (shards are Ray actors)")
        if torch_threads:
            torch.set_num_threads(torch_threads)
        model, _ = load_model(target.source, target.dtype, target.device)
        if target.dtype == "bfloat16" and target.device == "cpu":
            from actors.engines.native.invariance import bf16_batch_invariant

            if bf16_batch_invariant() is False:
                log.warning("unit %s: bf16 rows depend on the batch on this CPU (measured at start): speculative "
                            "output may differ from target-only; float32 keeps greedy identity", unit)
        target_backend = LocalTarget(Engine(model, target.max_slots, max_seq_len))
        if on_ray and drafter.kind == "model":
            from actors.remote.unit import remote_drafter

            drafter_backend = remote_drafter(target, drafter, max_seq_len=max_seq_len, torch_threads=torch_threads)
        else:
            local = make_drafter(drafter, max_slots=target.max_slots, max_seq_len=max_seq_len)
            drafter_backend = None if local is None else LocalDrafter(local)
    return Coordinator(
        target=target_backend, drafter=drafter_backend, policy=policy or LocalPolicy(PolicyCore(), unit=unit),
        eos_token_ids=info["eos_token_ids"] if eos_token_ids is None else eos_token_ids, max_seq_len=max_seq_len,
        max_batch_size=target.max_slots, unit=unit, observer=observer, vocab_size=info["vocab_size"],
        prefill_chunk_tokens=target.prefill_chunk_tokens, tokenizer_source=target.source,
    )


def make_unit(*, unit: str, target: TargetSetup, drafter: DrafterSetup, policy: dict[str, Any],
              policy_actor: str | None = None, observer: LoopObserver | None = None,
              torch_threads: int | None = None, on_ray: bool = True) -> Unit:
    """The unit of a config on its engine, started. `policy`: the γ settings (`actors.policy.gamma_policy`);
    `policy_actor`: the app's policy actor (on Ray; None with on_ray=False, an in-process authority)."""
    if on_ray and policy_actor is None:
        raise ValueError("policy_actor (the app's policy actor name) is required when on_ray=True")
    if target.engine == "vllm":
        from actors.engines.vllm.unit import VllmUnit

        return VllmUnit(unit=unit, setup=target, drafter=drafter, policy=policy, observer=observer,
                        torch_threads=torch_threads or 1, policy_actor=policy_actor if on_ray else None).start()
    if on_ray:
        from actors.remote.policy import RemotePolicy

        unit_policy: UnitPolicy = RemotePolicy(policy_actor, unit=unit, **policy)
    else:
        unit_policy = LocalPolicy(PolicyCore(**policy), unit=unit)
    return build_unit(unit=unit, target=target, drafter=drafter, policy=unit_policy, observer=observer,
                      torch_threads=torch_threads, on_ray=on_ray)


def replica_resources(target: TargetSetup, coordinator_cpus: float,
                      coordinator_custom: dict[str, float] | None = None) -> dict[str, Any]:
    """Ray resources of one unit's Serve replica: the coordinator's, plus the target's where it runs in the
    replica (vLLM's engine core and its `tp_size` workers are the replica's subprocesses: every shard's; on vLLM's
    Ray executor the workers reserve theirs in the replica's placement group, `replica_placement`). Custom
    resources (`coordinator_custom`, the shards' `custom`) add up the same way."""
    if ray_executor(target):
        return _with_custom({"num_cpus": coordinator_cpus}, coordinator_custom)
    shards = target.tp_size if target.engine == "vllm" else (1 if target.in_replica else 0)
    options = {"num_cpus": coordinator_cpus + target.resources.get("num_cpus", 1.0) * shards}
    if shards and target.resources.get("num_gpus"):
        options["num_gpus"] = target.resources["num_gpus"] * shards
    shard_custom = {k: v * shards for k, v in (target.resources.get("custom") or {}).items()} if shards else {}
    return _with_custom(options, _add(coordinator_custom or {}, shard_custom))


def _add(*amounts: dict[str, float]) -> dict[str, float]:
    total: dict[str, float] = {}
    for amount in amounts:
        for key, value in amount.items():
            total[key] = total.get(key, 0.0) + value
    return total


def _with_custom(options: dict[str, Any], custom: dict[str, float] | None) -> dict[str, Any]:
    return {**options, "resources": dict(custom)} if custom else options


def ray_executor(target: TargetSetup) -> bool:
    """The target runs on vLLM's Ray executor (`engine_kwargs.distributed_executor_backend: ray`)."""
    return target.engine == "vllm" and target.engine_kwargs.get("distributed_executor_backend") == "ray"


def replica_placement(target: TargetSetup, coordinator_cpus: float,
                      coordinator_custom: dict[str, float] | None = None) -> dict[str, Any]:
    """On vLLM's Ray executor, the replica's placement group, as Ray Serve LLM places vLLM: the first bundle hosts
    the replica, one bundle per tensor-parallel worker follows it (`target.resources`), and vLLM's workers are Ray
    actors in those; Serve removes it with the replica. Other units need none ({})."""
    if not ray_executor(target):
        return {}
    worker = {"CPU": target.resources.get("num_cpus", 1.0) or 1.0}  # the CPU platform counts CPUs as its device
    if target.resources.get("num_gpus"):
        worker["GPU"] = target.resources["num_gpus"]
    worker.update(target.resources.get("custom") or {})
    replica = {"CPU": coordinator_cpus or 0.001}  # a bundle cannot be empty: a replica reserving no CPU gets a sliver
    replica.update(coordinator_custom or {})  # the replica's own resources must fit its bundle
    return {"placement_group_bundles": [replica, *(dict(worker) for _ in range(target.tp_size))],
            "placement_group_strategy": target.placement_strategy}
