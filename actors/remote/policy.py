"""The app's policy actor: one named, detached `actors.policy.PolicyCore` that every unit reports to.

Ray restarts it when its process dies (`max_restarts=-1`); the restarted actor is rebuilt from the units' next
reports. `RemotePolicy` is a unit's `UnitPolicy` whose reports go to the actor: one call in flight, never
awaited on the step; a report that meets a dead actor is sent again, to the actor looked up again by name.

A unit that dies with its node takes its last reports with it (a request answered just before may never report
its close): each unit registers its Ray actor, and the actor forgets the ledger mirrors of units whose actor is
gone, as the ingress does for a request whose unit it saw die (`PolicyActor.sweep`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

import ray

from actors.policy import PolicyCore, PolicySnapshot, UnitPolicy, UnitReport
from actors.remote.placement import on_head

log = logging.getLogger(__name__)

NAMESPACE = "specserve"
SWEEP_S = 5.0  # on reports, look for dead units at most this often


class PolicyActor(PolicyCore):
    """The policy actor's body: the `PolicyCore`, plus the units' Ray actors, so the mirrors of a dead unit's
    ledgers are dropped (on `open_ledgers`, and at most every `SWEEP_S` on reports)."""

    def __init__(self, **settings: Any):
        super().__init__(**settings)
        self.unit_actors: dict[str, str] = {}  # unit → its Ray actor's id (hex)
        self._swept = time.monotonic()

    def register(self, unit: str, actor_id: str) -> None:
        self.unit_actors[unit] = actor_id

    def report(self, report: UnitReport) -> PolicySnapshot:
        snapshot = super().report(report)
        if time.monotonic() - self._swept > SWEEP_S:
            self.sweep()
        return snapshot

    def open_ledgers(self) -> list[str]:
        self.sweep()
        return super().open_ledgers()

    def sweep(self) -> list[str]:
        """Forget the ledgers of registered units whose actor is gone; the request ids forgotten."""
        self._swept = time.monotonic()
        units = {state.unit for state in self.ledgers.values()} & set(self.unit_actors)
        gone = {unit for unit in units if _dead(self.unit_actors[unit])}
        dropped = [rid for rid, state in self.ledgers.items() if state.unit in gone]
        for rid in dropped:
            self.forget(rid)
        for unit in gone:
            del self.unit_actors[unit]
        if dropped:
            log.warning("units %s are gone: their %d open ledgers forgotten", sorted(gone), len(dropped))
        return dropped


def _dead(actor_id: str) -> bool:
    """The GCS reports the actor dead for good (not restarting, not merely unreachable on a lost node yet)."""
    import ray._private.state

    try:  # Ray's public state API needs the dashboard; the GCS table does not
        return ray._private.state.actors(actor_id=actor_id).get("State") == "DEAD"
    except Exception:  # noqa: BLE001 - unknown: keep its ledgers
        return False


def get_or_create_policy_actor(name: str, **settings: Any):
    """The app's policy actor (named, detached, on the head node), created on first use by whichever unit starts
    first."""
    actor_cls = ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1)(PolicyActor)
    return actor_cls.options(name=name, get_if_exists=True, lifetime="detached", namespace=NAMESPACE,
                             resources=on_head()).remote(**settings)


class ActorLink:
    """Reports to the policy actor `name` (created with `settings` if it does not exist), for `unit`, registered
    with the actor when this process is a Ray actor (a Serve replica)."""

    def __init__(self, name: str, settings: dict[str, Any], unit: str = "local"):
        self.name, self.settings, self.unit = name, settings, unit
        self.handle = get_or_create_policy_actor(name, **settings)
        self._register()

    def submit(self, report: UnitReport) -> concurrent.futures.Future:
        return self.handle.report.remote(report).future()

    def reconnect(self) -> None:
        try:
            self.handle = get_or_create_policy_actor(self.name, **self.settings)
            self._register()  # a restarted actor knows no unit
        except Exception:  # noqa: BLE001 - still restarting: the next report tries again
            pass

    def _register(self) -> None:
        actor_id = ray.get_runtime_context().get_actor_id()
        if actor_id:
            self.handle.register.remote(self.unit, actor_id)


class RemotePolicy(UnitPolicy):
    """A unit's policy whose authority is the app's policy actor `name`."""

    def __init__(self, name: str, unit: str = "local", **settings: Any):
        self.name = name
        super().__init__(ActorLink(name, settings, unit), unit=unit, **settings)

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
