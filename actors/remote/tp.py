"""The tensor-parallel target: N Ray actors, one Megatron shard each, and the driver-side group.

`TargetShard` (a plain class; `ray.remote` is applied in `TargetGroup`) initialises torch.distributed inside
its actor (gloo on CPU, NCCL on CUDA; `tcp://` rendezvous on rank 0's free port), loads its shard of the
weights (`actors.engines.native.sharding`) and owns an `Engine`. Every step runs on all ranks; the all-reduces inside the
model keep them in lockstep, and only rank 0 computes full logits and a result.

A step takes the round's `actors.contracts.TargetBatch`: every rank runs an `actors.target.TargetStep` over
its engine (crop, feed, forward); the lead (rank 0) turns its logits into the `TargetResult` (compact
scores, sampled tokens; never full-vocab rows) and its own generators sample seeded rows.

Failure: if a shard dies, the pending step raises `TargetUnavailable` as soon as Ray reports the death (the
surviving ranks would otherwise wait in an all-reduce until the collective timeout); `rebuild()` then replaces
every shard (the process group cannot be re-joined), and all cached sequences are lost.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.contracts import TargetBatch, TargetResult, TargetUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSpec:
    """What every shard of one group loads and how it runs."""

    source: str
    tp_size: int = 1
    dtype: str = "float32"
    device: str = "cpu"  # "cpu" or "cuda" (each GPU shard sees its own GPU as cuda:0)
    max_slots: int = 64
    max_seq_len: int | None = None
    num_threads: int = 1  # torch threads per shard on CPU
    collective_timeout_s: float = 120.0  # a peer stuck this long in an all-reduce fails the step


class TargetShard:
    """One rank of the target: its process group, its weight shard, its Engine and `TargetStep`."""

    def __init__(self, spec: ShardSpec, tp_rank: int):
        self.spec, self.rank = spec, tp_rank
        self.engine = None
        self.run = None

    def rendezvous(self) -> str:
        """`tcp://ip:port` on this node with a free port (called on rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, init_method: str) -> dict:
        """Join the process group, load this rank's shard and create the Engine; returns `health()`."""
        import torch
        import torch.distributed as dist

        from actors.engines.native import Engine, load_model
        from actors.target import TargetStep

        spec = self.spec
        device = spec.device
        if device.startswith("cuda"):
            torch.cuda.set_device(0)
            device = "cuda:0"
        else:
            torch.set_num_threads(spec.num_threads)
        group = None
        if spec.tp_size > 1:
            dist.init_process_group(
                backend="nccl" if device.startswith("cuda") else "gloo",
                init_method=init_method,
                rank=self.rank,
                world_size=spec.tp_size,
                timeout=timedelta(seconds=spec.collective_timeout_s),
            )
            group = dist.group.WORLD
        model, _ = load_model(spec.source, spec.dtype, device, self.rank, spec.tp_size, group)
        self.engine = Engine(model, spec.max_slots, spec.max_seq_len)
        self.run = TargetStep(self.engine, lead=self.rank == 0)
        return self.health()

    def step(self, batch: TargetBatch) -> TargetResult | None:
        """One round on this rank; the lead returns the result, the other ranks None."""
        return self.run(batch)

    def forward(self, seq_ids: Sequence[str], tokens: Sequence[Sequence[int]], num_logits=None):
        """The engine's forward on this rank (all ranks must call it together); logits [B, T, V] on CPU."""
        return self.engine.forward(seq_ids, tokens, num_logits).cpu()

    def release(self, seq_ids: Sequence[str]) -> None:
        self.run.release(seq_ids)

    def health(self) -> dict:
        return {
            "rank": self.rank,
            "tp_size": self.spec.tp_size,
            "ready": self.engine is not None,
            "vocab_size": self.engine.vocab_size if self.engine else None,
            "active": len(self.engine.active_ids()) if self.engine else 0,
            "active_ids": self.engine.active_ids() if self.engine else [],
        }


class TargetGroup:
    """Driver side of a tensor-parallel target (a `TargetBackend`): creates the shards, fans each call out,
    returns rank 0's result.

    On GPU (`spec.device` = "cuda") each shard takes one GPU, all in one STRICT_PACK placement group (one node,
    NVLink); on CPU each takes `num_cpus` in a PACK placement group. `resources` (one shard's bundle, custom
    resources included) and `strategy` override those. A STRICT_PACK group goes to the caller's node (the unit's
    replica) when that node has room, elsewhere when not.
    """

    def __init__(
        self, spec: ShardSpec, num_cpus: float = 0.5, ready_timeout_s: float = 600.0,
        resources: dict[str, float] | None = None, strategy: str | None = None,
    ):
        from actors.engines.native.sharding import validate_tp
        from actors.sources import model_info

        info = model_info(spec.source)  # fail fast, before starting actors
        validate_tp(info["num_attention_heads"], info["num_key_value_heads"], spec.tp_size)
        gpu = spec.device.startswith("cuda")
        self.bundle = dict(resources or ({"GPU": 1, "CPU": 1} if gpu else {"CPU": num_cpus}))
        self.strategy = strategy or ("STRICT_PACK" if gpu else "PACK")
        self.spec, self.ready_timeout_s = spec, ready_timeout_s
        self.shards: list = []
        self.placement_group = None
        self._start()

    # --- lifecycle --------------------------------------------------------------------------------------------
    def _start(self) -> None:
        bundle = self.bundle
        # STRICT_PACK: on this process's node when it has room (the pod sized for the coordinator and its shards)
        near = ray.get_runtime_context().get_node_id() if self.strategy == "STRICT_PACK" else None
        self.placement_group = placement_group([bundle] * self.spec.tp_size, strategy=self.strategy,
                                               _soft_target_node_id=near)
        ray.get(self.placement_group.ready(), timeout=self.ready_timeout_s)
        actor = ray.remote(TargetShard)
        self.shards = [
            actor.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")} or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=r),
            ).remote(self.spec, r)
            for r in range(self.spec.tp_size)
        ]
        try:
            address = ray.get(self.shards[0].rendezvous.remote(), timeout=self.ready_timeout_s)
            ray.get([s.setup.remote(address) for s in self.shards], timeout=self.ready_timeout_s)
        except BaseException:
            self._stop()  # no half-started group keeps its actors or placement group
            raise
        log.info("target group up: %s, tp_size %d on %s", self.spec.source, self.spec.tp_size, self.spec.device)

    def _stop(self) -> None:
        for shard in self.shards:
            ray.kill(shard, no_restart=True)
        self.shards = []
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None

    async def close(self) -> None:
        """Kill every shard and free the placement group."""
        self._stop()

    async def rebuild(self) -> None:
        """Replace every shard (after one died); all cached sequences are lost."""
        self._stop()
        await asyncio.get_running_loop().run_in_executor(None, self._start)

    # --- calls ------------------------------------------------------------------------------------------------
    async def step(self, batch: TargetBatch) -> TargetResult:
        """Run one round on every rank; rank 0's result."""
        return (await self._gather([s.step.remote(batch) for s in self.shards]))[0]

    async def forward(self, seq_ids: Sequence[str], tokens: Sequence[Sequence[int]], num_logits=None):
        """The sharded engine's raw forward (parity checks): rank 0's logits [B, T, V]."""
        return (await self._gather([s.forward.remote(seq_ids, tokens, num_logits) for s in self.shards]))[0]

    async def release(self, seq_ids: Sequence[str]) -> None:
        await self._gather([s.release.remote(list(seq_ids)) for s in self.shards])

    async def active_ids(self) -> list[str]:
        return (await self._gather([self.shards[0].health.remote()]))[0]["active_ids"]

    def health(self, timeout_s: float = 10.0) -> list[dict]:
        """Every shard's health; raises TargetUnavailable if one is dead or does not answer in time."""
        try:
            return ray.get([s.health.remote() for s in self.shards], timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise TargetUnavailable(f"target group {self.spec.source}: {exc}") from exc

    async def _gather(self, refs: list) -> list:
        try:
            return await asyncio.gather(*refs)  # raises on the first failure, without waiting for the rest
        except ray.exceptions.RayActorError as exc:
            raise TargetUnavailable(f"target group {self.spec.source}: a shard died: {exc}") from exc
