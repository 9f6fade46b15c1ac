"""A unit: one coordinator with its drafter, its target and the policy (DESIGN.md: the thing autoscaling
replicates).

`build_unit(on_ray=True)` is what a Serve decoder replica runs: a tensor-parallel `TargetGroup` of shard
actors in one placement group, a model drafter in its own actor (restarted by Ray when it dies; meanwhile the
unit decodes target-only and marks requests degraded), and the app's policy actor. `build_unit(on_ray=False)`
builds the same unit in the caller's process (CLI `generate`, tests, benchmarks). The n-gram and suffix
drafters always run in the coordinator's process.

A target with `in_replica=True` (tensor-parallel size 1 only) runs in the coordinator's process on Ray too:
no actor call per round (~5 ms on a 2-core CPU), at the price that the replica holds the model and its torch
threads, and a crash of the engine's process takes the replica down (Serve restarts it) instead of one actor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from actors.coordinator import Coordinator
from actors.drafting import DrafterSetup, LocalDrafter, check_vocab, make_drafter
from actors.policy import LocalPolicy, PolicyCore, UnitPolicy
from actors.stats import LoopObserver
from actors.target import LocalTarget


@dataclass(frozen=True)
class TargetSetup:
    """The target of a unit: its model, engine placement and KV capacity."""

    source: str
    dtype: str = "float32"
    device: str = "cpu"
    tp_size: int = 1
    max_slots: int = 8  # sequences decoded together (KV cache slots)
    max_seq_len: int | None = None  # None: the model's max_position_embeddings
    prefill_chunk_tokens: int | None = None  # prompt tokens per unit step (actors.prefill); None: whole prompts
    resources: dict = field(default_factory=dict)  # Ray resources of each shard: num_cpus, num_gpus, memory_gb
    placement_strategy: str = "STRICT_PACK"
    in_replica: bool = False  # TP 1: the engine in the coordinator's process, also on Ray (no shard actor)


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
    max_seq_len = min(target.max_seq_len or info["max_position_embeddings"], info["max_position_embeddings"])
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
        prefill_chunk_tokens=target.prefill_chunk_tokens,
    )
