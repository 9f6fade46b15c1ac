"""Where the app's singletons run on a multi-node cluster: the head.

The policy actor, the telemetry hub and the ingress sit beside Serve's proxy and controller on the head node
(the KubeRay manifests' head pod), never on a worker node that a scale-down, a preemption or a drain may take;
each reserves a sliver of the resource Ray gives the head node alone. A unit's actors go where their custom
resources are (`cluster.config.placement`).
"""

from __future__ import annotations

HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray advertises 1 of it on the head node only
SLIVER = 0.001  # reserving this little never limits how many singletons fit


def on_head() -> dict[str, float]:
    """Ray `resources` that place an actor on the head node."""
    return {HEAD_NODE_RESOURCE: SLIVER}

