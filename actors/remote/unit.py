"""The Ray side of a unit: the target's tensor-parallel group and, for a model drafter, the drafter actor."""

from __future__ import annotations

from actors.contracts import DrafterBackend, TargetBackend
from actors.drafting import DrafterSetup, LocalDrafter, make_drafter
from actors.remote.drafter import RemoteDrafter, start_drafter_actor
from actors.remote.tp import ShardSpec, TargetGroup


def ray_backends(target, drafter: DrafterSetup, *, max_seq_len: int, torch_threads: int | None
                 ) -> tuple[TargetBackend, DrafterBackend | None]:
    """(target group, drafter backend) of a unit on Ray; `target` is an `actors.unit.TargetSetup`.

    The n-gram drafter stays in the coordinator's process: it costs microseconds, far less than an actor hop."""
    spec = ShardSpec(source=target.source, tp_size=target.tp_size, dtype=target.dtype, device=target.device,
                     max_slots=target.max_slots, max_seq_len=max_seq_len, num_threads=torch_threads or 1)
    group = TargetGroup(spec, num_cpus=target.resources.get("num_cpus", 0.5), resources=_bundle(target.resources),
                        strategy=target.placement_strategy)
    if drafter.kind == "model":
        return group, remote_drafter(target, drafter, max_seq_len=max_seq_len, torch_threads=torch_threads)
    local = make_drafter(drafter, max_slots=target.max_slots, max_seq_len=max_seq_len)
    return group, None if local is None else LocalDrafter(local)


def remote_drafter(target, drafter: DrafterSetup, *, max_seq_len: int, torch_threads: int | None) -> RemoteDrafter:
    """A model drafter in its own actor (restarted when it dies), for the target `target` serves."""
    return RemoteDrafter(lambda: start_drafter_actor(drafter, target.max_slots, max_seq_len, torch_threads or 1))


def _bundle(resources: dict) -> dict | None:
    """One shard's placement-group bundle from config resources {num_cpus, num_gpus, custom}."""
    if not resources:
        return None
    bundle = {"CPU": float(resources.get("num_cpus", 0.5))}
    if resources.get("num_gpus"):
        bundle["GPU"] = float(resources["num_gpus"])
    bundle.update(resources.get("custom") or {})  # the nodes made for this unit's target (cluster.config.placement)
    return bundle  # memory_gb sizes Kubernetes pods; Ray does not schedule shards by it
