"""The tensor-parallel target: N Ray actors, one Megatron shard each, and the driver-side group.

`TargetShard` (a plain class; `ray.remote` is applied in `TargetGroup`) initialises torch.distributed inside
its actor (gloo on CPU, NCCL on CUDA; `tcp://` rendezvous on rank 0's free port), loads its shard of the
weights (actors.sharding) and owns an `Engine`. Every step runs on all ranks; the all-reduces inside the
model keep them in lockstep, and only rank 0 computes full logits and a result.

A step takes a **score request**: any object with `seq_ids`, `crops` (per row: cached length to keep before
appending, NO_CROP to keep all) and `tokens` (per row: the tokens to append), e.g. actors.target.TargetBatch.
`logit_rows(request) -> list[int] | None` says how many trailing logits rows each row needs (None = all), and
`postprocess(logits, request) -> result` turns rank 0's logits [B, K, V] into what crosses the actor boundary
(compact scores, sampled tokens; not full-vocab rows). Both are picklable and injected; a copy of
`postprocess` lives on rank 0, and its `release(seq_id)`, if it has one, is called when a sequence is released.
Without a postprocess, rank 0 returns the logits.

Failure: if a shard dies, the pending step raises `TargetUnavailable` as soon as Ray reports the death (the
surviving ranks would otherwise wait in an all-reduce until the collective timeout); `rebuild()` then replaces
every shard (the process group cannot be re-joined), and all cached sequences are lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

NO_CROP = -1  # crops[b] meaning: keep every cached position (same value as actors.target.NO_CROP)


@dataclass(frozen=True)
class ScoreRequest:
    """The plain score request. Any object with these attributes (and optionally num_logits) works too."""

    seq_ids: tuple[str, ...]
    tokens: tuple[tuple[int, ...], ...]  # per row: tokens to append
    crops: tuple[int, ...] = ()  # per row: cached length to keep first (NO_CROP = keep all); () = no crops
    num_logits: tuple[int, ...] | None = None  # per row: trailing logits rows wanted; None = all


class TargetUnavailable(RuntimeError):
    """A shard of the target group died; in-flight sequences are lost until `TargetGroup.rebuild()`."""


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
    logit_rows: Callable[[Any], Sequence[int] | None] | None = None  # None: request.num_logits if present
    postprocess: Callable[[Any, Any], Any] | None = None  # (logits [B, K, V], request) -> result; rank 0 only


class TargetShard:
    """One rank of the target: its process group, its weight shard, its Engine."""

    def __init__(self, spec: ShardSpec, tp_rank: int):
        self.spec, self.rank = spec, tp_rank
        self.engine = None
        self.postprocess = spec.postprocess

    def rendezvous(self) -> str:
        """`tcp://ip:port` on this node with a free port (called on rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, init_method: str) -> dict:
        """Join the process group, load this rank's shard and create the Engine; returns `health()`."""
        import torch
        import torch.distributed as dist

        from actors.engine import Engine
        from actors.loading import load_model

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
        return self.health()

    def step(self, request) -> tuple[Any, float] | None:
        """Crop, append and run one forward; rank 0 returns (result, forward seconds), other ranks None."""
        engine = self.engine
        for seq_id, crop in zip(request.seq_ids, request.crops):  # validate all before changing any
            if crop != NO_CROP and not 0 <= crop <= engine.length(seq_id):
                raise ValueError(f"crops: {crop} out of [0, {engine.length(seq_id)}] for {seq_id!r}")
        for seq_id, crop in zip(request.seq_ids, request.crops):
            if crop != NO_CROP:
                engine.crop(seq_id, crop)
        rows = self.spec.logit_rows(request) if self.spec.logit_rows else getattr(request, "num_logits", None)
        if self.rank != 0:
            rows = [1] * len(request.seq_ids)  # only rank 0's logits are used: skip most of the lm_head
        start = time.perf_counter()
        logits = engine.forward(request.seq_ids, request.tokens, rows)  # [B, K, V]
        forward_s = time.perf_counter() - start
        if self.rank != 0:
            return None
        if self.postprocess is None:
            return logits.cpu(), forward_s
        return self.postprocess(logits, request), forward_s

    def release(self, seq_ids: Sequence[str]) -> None:
        release = getattr(self.postprocess, "release", None)
        for seq_id in seq_ids:
            self.engine.release(seq_id)
            if release is not None:
                release(seq_id)

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
    """Driver side of a tensor-parallel target: creates the shards, fans each call out, returns rank 0's result.

    On GPU (`spec.device` = "cuda") each shard takes one GPU, all in one STRICT_PACK placement group (one node,
    NVLink); on CPU each takes `num_cpus` in a PACK placement group. `resources` (one shard's bundle) and
    `strategy` override those. Same call surface as actors.target.LocalTarget: `step`, `release`,
    `active_ids`, plus `rebuild`, `health` and `close`; `*_sync` variants block.
    """

    def __init__(
        self, spec: ShardSpec, num_cpus: float = 0.5, ready_timeout_s: float = 600.0,
        resources: dict[str, float] | None = None, strategy: str | None = None,
    ):
        from actors.loading import model_info
        from actors.sharding import validate_tp

        info = model_info(spec.source)  # fail fast, before starting actors
        validate_tp(info["num_attention_heads"], info["num_key_value_heads"], spec.tp_size)
        gpu = spec.device.startswith("cuda")
        self.bundle = dict(resources or ({"GPU": 1, "CPU": 1} if gpu else {"CPU": num_cpus}))
        self.strategy = strategy or ("STRICT_PACK" if gpu else "PACK")
        self.spec, self.ready_timeout_s = spec, ready_timeout_s
        self.vocab_size = info["vocab_size"]
        self.shards: list = []
        self.placement_group = None
        self._start()

    # --- lifecycle --------------------------------------------------------------------------------------------
    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundle
        self.placement_group = placement_group([bundle] * self.spec.tp_size, strategy=self.strategy)
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
            self.close()  # no half-started group keeps its actors or placement group
            raise
        log.info("target group up: %s, tp_size %d on %s", self.spec.source, self.spec.tp_size, self.spec.device)

    def close(self) -> None:
        """Kill every shard and free the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for shard in self.shards:
            ray.kill(shard, no_restart=True)
        self.shards = []
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None

    async def rebuild(self) -> None:
        """Replace every shard (after one died); all cached sequences are lost."""
        self.close()
        await asyncio.get_running_loop().run_in_executor(None, self._start)

    def rebuild_sync(self) -> None:
        self.close()
        self._start()

    # --- calls ------------------------------------------------------------------------------------------------
    async def step(self, request):
        """Run one step on every rank; rank 0's result (its `forward_s` field filled in, if it has one)."""
        replies = await self._gather([s.step.remote(request) for s in self.shards])
        return _with_forward_time(*replies[0])

    def step_sync(self, request):
        replies = self._get([s.step.remote(request) for s in self.shards])
        return _with_forward_time(*replies[0])

    async def release(self, seq_ids: Sequence[str]) -> None:
        await self._gather([s.release.remote(list(seq_ids)) for s in self.shards])

    def release_sync(self, seq_ids: Sequence[str]) -> None:
        self._get([s.release.remote(list(seq_ids)) for s in self.shards])

    async def active_ids(self) -> list[str]:
        return (await self._gather([self.shards[0].health.remote()]))[0]["active_ids"]

    def health(self, timeout_s: float = 10.0) -> list[dict]:
        """Every shard's health; raises TargetUnavailable if one is dead or does not answer in time."""
        import ray

        try:
            return ray.get([s.health.remote() for s in self.shards], timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            raise TargetUnavailable(f"target group {self.spec.source}: {exc}") from exc

    async def _gather(self, refs: list) -> list:
        import ray

        try:
            return await asyncio.gather(*refs)  # raises on the first failure, without waiting for the rest
        except ray.exceptions.RayActorError as exc:
            raise TargetUnavailable(f"target group {self.spec.source}: a shard died: {exc}") from exc

    def _get(self, refs: list) -> list:
        import ray

        pending = list(refs)
        try:
            while pending:  # first failure wins: a dead peer leaves the others blocked in an all-reduce
                ready, pending = ray.wait(pending, num_returns=1)
                ray.get(ready)
        except ray.exceptions.RayActorError as exc:
            raise TargetUnavailable(f"target group {self.spec.source}: a shard died: {exc}") from exc
        return ray.get(refs)


def _with_forward_time(result, forward_s: float):
    if dataclasses.is_dataclass(result) and any(f.name == "forward_s" for f in dataclasses.fields(result)):
        return dataclasses.replace(result, forward_s=forward_s)
    return result
