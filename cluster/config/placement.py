"""Placement on a multi-node cluster: Ray custom resources an actor reserves, so it runs only on the nodes
that advertise them (on Kubernetes, the worker group whose pods `render-k8s` gives those resources).

A unit's actors name a resource of their kind (e.g. `specserve-unit` for the coordinator and the target shards,
`specserve-drafter` for a drafter kept apart); a node advertises as much as the actors it is sized for reserve,
so a pod holds exactly the unit it was made for, and Ray's autoscaler (KubeRay's) knows which group to grow.
The ingress, the policy actor and the telemetry hub need none: they run on the head (`actors.remote.placement`).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

RAY_OWN = ("CPU", "GPU", "memory", "object_store_memory")  # Ray's resources, set by their own fields
CUSTOM_DESCRIPTION = ("Ray custom resources reserved (name: amount), so the actor runs only on nodes that advertise "
                      "them; `render-k8s` gives each worker group the sum its unit's actors reserve. {} on one node.")


def _not_ray_own(resources: dict[str, float]) -> dict[str, float]:
    reserved = sorted(set(resources) & set(RAY_OWN))
    if reserved:
        raise ValueError(f"{reserved} are Ray's own resources, set by num_cpus / num_gpus / memory_gb")
    return resources


# Names without ':' (Ray's `node:<ip>` resources are its own) that travel as JSON in KubeRay's rayStartParams.
ResourceName = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[A-Za-z][A-Za-z0-9_.-]*$")]
CustomResources = Annotated[dict[ResourceName, Annotated[float, Field(gt=0)]], AfterValidator(_not_ray_own)]
