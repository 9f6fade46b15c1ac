"""A model drafter in its own Ray actor, and the coordinator's async view of it.

`DrafterHost` builds the drafter from its `DrafterSetup` inside the actor (its own dtype, device and threads);
Ray restarts a crashed host (`max_restarts`). Meanwhile the unit decodes target-only and marks requests
degraded; `RemoteDrafter.recover()` returns once the drafter answers again, starting a fresh actor when the
old one is gone for good.
"""

from __future__ import annotations

from collections.abc import Callable

import ray

from actors.contracts import DraftBatch, DraftRequest
from actors.drafting import DrafterSetup, make_drafter


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


def start_drafter_actor(setup: DrafterSetup, max_slots: int, max_seq_len: int | None, torch_threads: int = 1):
    """A new drafter actor (restarted by Ray when its process dies)."""
    resources = setup.resources
    memory_gb = resources.get("memory_gb")
    actor = ray.remote(DrafterHost).options(
        num_cpus=resources.get("num_cpus", 0.5), num_gpus=resources.get("num_gpus", 0),
        memory=int(memory_gb * 2**30) if memory_gb else None, max_restarts=-1, max_task_retries=0,
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
        ray.kill(self.handle, no_restart=True)
