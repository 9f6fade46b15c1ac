"""A model drafter in its own Ray actor, the coordinator's async view of it, and the vLLM worker's client.

`DrafterHost` builds the drafter from its `DrafterSetup` inside the actor (its own dtype, device and threads);
Ray restarts a crashed host (`max_restarts`). Meanwhile the unit decodes target-only and marks requests
degraded; `RemoteDrafter.recover()` returns once the drafter answers again, starting a fresh actor when the
old one is gone for good.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import ray

from actors.contracts import DraftBatch, DraftRequest
from actors.drafting import DrafterSetup, make_drafter

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0  # a drafter's own close (a vLLM engine's shutdown) before its actor is killed


class DrafterHost:
    """The drafter actor's body."""

    def __init__(self, setup: DrafterSetup, max_slots: int, max_seq_len: int | None, torch_threads: int = 1):
        import torch

        if setup.device == "cpu":
            torch.set_num_threads(torch_threads)
        self.drafter = make_drafter(setup, max_slots=max_slots, max_seq_len=max_seq_len)

    def propose(self, requests: list[DraftRequest]) -> DraftBatch:
        return self.drafter.propose(requests)

    def release(self, seq_id: str) -> None:
        self.drafter.release(seq_id)

    def active_ids(self) -> list[str]:
        return self.drafter.active_ids()

    def close(self) -> None:
        """Free what the drafter holds outside this process (a vLLM drafter's engine processes and their shared
        memory), before the actor is killed."""
        close = getattr(self.drafter, "close", None)
        if close is not None:
            close()


def start_drafter_actor(setup: DrafterSetup, max_slots: int, max_seq_len: int | None, torch_threads: int = 1,
                        name: str | None = None):
    """A new drafter actor (restarted by Ray when its process dies); `name`: findable by other processes of
    the cluster (the vLLM engine's worker calls it)."""
    resources = setup.resources
    memory_gb = resources.get("memory_gb")
    actor = ray.remote(DrafterHost).options(
        num_cpus=resources.get("num_cpus", 0.5), num_gpus=resources.get("num_gpus", 0),
        memory=int(memory_gb * 2**30) if memory_gb else None, max_restarts=-1, max_task_retries=0, name=name,
        resources=resources.get("custom") or None,  # the drafter's nodes (cluster.config.placement)
    )
    return actor.remote(setup, max_slots, max_seq_len, torch_threads)


class RemoteDrafter:
    """The coordinator's `DrafterBackend` for a drafter actor; `factory()` starts a fresh actor."""

    free_drafts = False  # every drafted position costs the drafter model a forward

    def __init__(self, factory: Callable[[], "ray.actor.ActorHandle"]):
        self.factory = factory
        self.handle = factory()

    async def propose(self, requests: list[DraftRequest]) -> DraftBatch:
        return await self.handle.propose.remote(requests)

    async def release(self, seq_id: str) -> None:
        await self.handle.release.remote(seq_id)

    async def recover(self) -> None:
        try:
            await self.handle.active_ids.remote()
        except ray.exceptions.RayActorError:
            self.handle = self.factory()
            await self.handle.active_ids.remote()

    async def close(self) -> None:
        await asyncio.to_thread(kill_drafter, self.handle)


class NamedDrafterClient:
    """A model drafter in its own Ray actor (`DrafterHost`, started by `start_named_drafter`), called from vLLM's
    worker (`actors.engines.vllm.worker`) once per step. vLLM's worker is not a Ray process, so it joins the
    unit's cluster as a driver. Drafts are greedy: vLLM verifies model drafts like n-gram drafts (q one-hot),
    which is exact for any draft that is a function of the context, sampled requests included.

    Only tensor-parallel rank 0 calls the actor (vLLM takes drafts from its output rank). When the actor is
    down (Ray restarts it, or the unit replaces it), `propose` returns None and the rows decode target-only,
    marked degraded.
    """

    def __init__(self, address: str, namespace: str, name: str, rank0: bool = True, timeout_s: float = 10.0,
                 retry_s: float = 1.0):
        self.rank0 = rank0
        self.name, self.namespace, self.timeout_s, self.retry_s = name, namespace, timeout_s, retry_s
        self.handle, self._down_until = None, 0.0
        if self.rank0:
            if not ray.is_initialized():
                ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)
            self.handle = ray.get_actor(name, namespace=namespace)

    def propose(self, requests: list[DraftRequest]) -> DraftBatch | None:
        """The drafts, or None while the actor is unavailable: a call that fails or takes over `timeout_s`
        (drafting takes milliseconds once warm) marks it down for `retry_s`, so a dead drafter does not stall every
        step; then the actor is looked up by name again (the unit replaces one that is gone for good)."""
        if not self.rank0:
            return DraftBatch.empty(len(requests))
        if time.monotonic() < self._down_until:
            return None
        try:
            if self.handle is None:
                self.handle = ray.get_actor(self.name, namespace=self.namespace)
            return ray.get(self.handle.propose.remote(requests), timeout=self.timeout_s)
        except (ray.exceptions.RayError, TimeoutError, ValueError) as err:  # ValueError: no actor by that name
            log.warning("drafter actor %s unavailable (%s); decoding target-only", self.name, type(err).__name__)
            self.handle, self._down_until = None, time.monotonic() + self.retry_s
            return None

    def release(self, seq_id: str) -> None:
        if self.rank0 and self.handle is not None:
            self.handle.release.remote(seq_id)  # fire and forget: the actor frees the sequence's KV

    def active_ids(self) -> list[str]:
        if not self.rank0 or self.handle is None:
            return []
        try:
            return ray.get(self.handle.active_ids.remote(), timeout=self.timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            return []


def start_named_drafter(unit: str, drafter: DrafterSetup, max_slots: int, max_seq_len: int, torch_threads: int,
                        name: str | None = None, wait: bool = True):
    """A drafter actor named so that a process outside Ray's workers (vLLM's worker) can find it, and where it is:
    (handle, {address, namespace, name}, ready). Its model load and a first (compiling) draft are queued on the
    actor; `ready` holds their refs, resolved here when `wait` (else the caller waits, e.g. while its target
    engine starts). Joins a local Ray cluster when none is initialized (CLI use on one machine)."""
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    context = ray.get_runtime_context()
    name = name or f"{unit}-drafter-{os.getpid()}-{time.monotonic_ns()}"
    handle = start_drafter_actor(drafter, max_slots, max_seq_len, torch_threads, name=name)
    ready = [handle.active_ids.remote(),  # the model is loaded before a draft is asked for
             handle.propose.remote([DraftRequest("warm-up", [1, 2, 3], 1)]),  # a first call compiles and warms
             handle.release.remote("warm-up")]
    if wait:
        ray.get(ready)
    return handle, {"address": context.gcs_address, "namespace": context.namespace, "name": name}, ready


def wait_started(ready: list) -> None:
    """Wait for the `ready` refs of `start_named_drafter(..., wait=False)`; raises the actor's start error."""
    ray.get(ready)


def drafter_gone(handle, timeout_s: float = 5.0) -> bool:
    """True when the actor is dead for good (not merely restarting or slow)."""
    try:
        ray.get(handle.active_ids.remote(), timeout=timeout_s)
        return False
    except ray.exceptions.RayActorError:
        return True
    except (ray.exceptions.RayError, TimeoutError):
        return False


def kill_drafter(handle) -> None:
    """End the drafter actor for good, closing its drafter first where it still answers."""
    try:
        ray.get(handle.close.remote(), timeout=CLOSE_TIMEOUT_S)
    except (ray.exceptions.RayError, TimeoutError):
        pass  # dead or stuck: the kill below ends it all the same
    ray.kill(handle, no_restart=True)
