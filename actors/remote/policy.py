"""The app's policy actor: one named, detached `actors.policy.PolicyCore` that every unit reports to.

Ray restarts it when its process dies (`max_restarts=-1`); the restarted actor is rebuilt from the units' next
reports. `RemotePolicy` is a unit's `UnitPolicy` whose reports go to the actor: one call in flight, never
awaited on the step; a report that meets a dead actor is sent again, to the actor looked up again by name.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import ray

from actors.policy import PolicyCore, UnitPolicy, UnitReport
from actors.remote.placement import on_head

NAMESPACE = "specserve"


def get_or_create_policy_actor(name: str, **settings: Any):
    """The app's policy actor (named, detached, on the head node), created on first use by whichever unit starts
    first."""
    actor_cls = ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1)(PolicyCore)
    return actor_cls.options(name=name, get_if_exists=True, lifetime="detached", namespace=NAMESPACE,
                             resources=on_head()).remote(**settings)


class ActorLink:
    """Reports to the policy actor `name` (created with `settings` if it does not exist)."""

    def __init__(self, name: str, settings: dict[str, Any]):
        self.name, self.settings = name, settings
        self.handle = get_or_create_policy_actor(name, **settings)

    def submit(self, report: UnitReport) -> concurrent.futures.Future:
        return self.handle.report.remote(report).future()

    def reconnect(self) -> None:
        try:
            self.handle = get_or_create_policy_actor(self.name, **self.settings)
        except Exception:  # noqa: BLE001 - still restarting: the next report tries again
            pass


class RemotePolicy(UnitPolicy):
    """A unit's policy whose authority is the app's policy actor `name`."""

    def __init__(self, name: str, unit: str = "local", **settings: Any):
        self.name = name
        super().__init__(ActorLink(name, settings), unit=unit, **settings)

    @property
    def handle(self):
        return self.link.handle

    async def app_ledgers(self) -> list[str]:
        """Every unit's open ledgers, as the actor holds them."""
        return await self.link.handle.open_ledgers.remote()


async def forget_ledger(name: str, settings: dict[str, Any], request_id: str) -> None:
    """Drop a ledger whose unit died before closing it (the unit can no longer report)."""
    await get_or_create_policy_actor(name, **settings).forget.remote(request_id)


def policy_actor_address(name: str) -> dict[str, str]:
    """How a process outside Ray's workers (vLLM's worker) finds the app's policy actor `name`."""
    return {"address": ray.get_runtime_context().gcs_address, "namespace": NAMESPACE, "name": name}


def policy_from_outside(where: dict[str, str], *, unit: str, **settings: Any) -> RemotePolicy:
    """A `RemotePolicy` in a process that joins the unit's Ray cluster as a driver (`policy_actor_address`)."""
    if not ray.is_initialized():
        ray.init(address=where["address"], namespace=where["namespace"], log_to_driver=False, configure_logging=False)
    return RemotePolicy(where["name"], unit=unit, **settings)
