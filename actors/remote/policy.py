"""The app's policy actor: one named, detached `actors.policy.PolicyCore` shared by every unit.

Ray restarts it when its process dies (`max_restarts=-1`); a restarted actor has lost its ledgers, which the
units restore (see `actors.policy`). `RemotePolicy` is a unit's `PolicyBackend` view: a call that meets a
dead or restarting actor raises `PolicyUnavailable`, and the next call looks the actor up again by name,
creating it if it is gone for good.
"""

from __future__ import annotations

import ray

from actors.contracts import ASDBatch, LedgersLost, PolicyUnavailable, RoundReport, RowKey
from actors.policy import PolicyCore

NAMESPACE = "specserve"


def get_or_create_policy_actor(name: str, **policy_kwargs):
    """The app's policy actor (named, detached), created on first use by whichever unit starts first."""
    actor_cls = ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1)(PolicyCore)
    return actor_cls.options(name=name, get_if_exists=True, lifetime="detached", namespace=NAMESPACE).remote(
        **policy_kwargs
    )


class RemotePolicy:
    """A unit's view of the policy actor `name`, created with `policy_kwargs` if it does not exist."""

    def __init__(self, name: str, **policy_kwargs):
        self.name, self.policy_kwargs = name, policy_kwargs
        self.handle = get_or_create_policy_actor(name, **policy_kwargs)

    async def _call(self, method: str, *args):
        try:
            return await getattr(self.handle, method).remote(*args)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, LedgersLost):  # the unit restores them: pass the plain error on
                raise exc.cause from None
            raise
        except ray.exceptions.RayActorError as exc:
            self.handle = get_or_create_policy_actor(self.name, **self.policy_kwargs)
            raise PolicyUnavailable(f"policy actor {self.name}: {exc}") from exc

    async def open_request(self, request_id: str, budget: float | None, spent: float = 0.0) -> None:
        await self._call("open_request", request_id, budget, spent)

    async def close_request(self, request_id: str) -> dict | None:
        return await self._call("close_request", request_id)

    async def settle(self, asd: ASDBatch | None, report: RoundReport | None, plan_for: list[RowKey],
                     batch_size: int):
        return await self._call("settle", asd, report, plan_for, batch_size)

    async def open_ledgers(self) -> list[str]:
        return await self._call("open_ledgers")
