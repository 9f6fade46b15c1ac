"""A multi-node Ray cluster on one machine, made with Ray's own `ray.cluster_utils.Cluster`: a head and worker
nodes, each a raylet with its own processes and the custom resources of the pods it stands for (the KubeRay
manifests' worker groups, `cluster.k8s.render`). The CI test (tests/cluster/test_multinode.py) and the
reliability section's node fault use it.

`where(app)` says which node each of the app's actors is on, from the GCS actor table. A node removed with
`kill_node` (its raylet and every process on it, SIGKILL) stays listed as alive in the GCS for a while, and
its actors may answer for a few seconds more: `kill_node` waits for its actors to be reported dead, never on
the node list.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field

UNIT_RESOURCE = "specserve-unit"  # what a unit's coordinator and target shards reserve (the manifests' unit pods)
DRAFTER_RESOURCE = "specserve-drafter"  # what a model drafter kept apart reserves (the manifests' drafter pods)
DEATH_TIMEOUT_S = 120.0  # a guard against a hang, not a bound the cluster must meet
REPLACE_TIMEOUT_S = 300.0  # the same, for a lost unit to be placed again
# The layout of the test and the bench: a unit node, and a node with room for units and drafters, each for two
# units (a replica and a shard reserve one UNIT_RESOURCE each). Killing `units` leaves room for both on `mixed`.
NODES = {"units": {"num_cpus": 2, "resources": {UNIT_RESOURCE: 4}},
         "mixed": {"num_cpus": 2, "resources": {UNIT_RESOURCE: 4, DRAFTER_RESOURCE: 2}}}
KILLED = "units"


@dataclass
class LocalCluster:
    """A head (no custom resources: the ingress, the proxy, the controller, the policy actor, the hub) and the
    named worker nodes, each `{"num_cpus": ..., "resources": {...}}`; `ray.init` joins it on entry."""

    workers: dict[str, dict]
    head_cpus: float = 1
    cluster: object = None
    nodes: dict[str, object] = field(default_factory=dict)  # name → ray._private.node.Node, "head" included

    def __enter__(self) -> "LocalCluster":
        import ray
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": self.head_cpus,
                                                                    "include_dashboard": False})
        self.nodes["head"] = self.cluster.head_node
        for name, args in self.workers.items():
            self.nodes[name] = self.cluster.add_node(**args)
        ray.init(address=self.cluster.address, log_to_driver=False, configure_logging=False)
        return self

    def __exit__(self, *exc) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            self.cluster.shutdown()

    def node_names(self) -> dict[str, str]:
        """Node id (hex) → its name here."""
        return {node.node_id: name for name, node in self.nodes.items()}

    def kill_node(self, name: str, timeout_s: float = DEATH_TIMEOUT_S) -> dict:
        """Kill worker node `name` (raylet and all its processes); returns once every actor that lived on it is
        reported dead: {"node", "actors", "at" (monotonic, the kill), "dead_after_s"}."""
        node = self.nodes.pop(name)
        on_it = [a["ActorID"] for a in _actors() if a["State"] == "ALIVE" and _node_id(a) == node.node_id]
        at = time.monotonic()
        self.cluster.remove_node(node, allow_graceful=False)
        while any(a["ActorID"] in on_it and a["State"] == "ALIVE" for a in _actors()):
            if time.monotonic() - at > timeout_s:
                raise TimeoutError(f"actors on node {name} still alive {timeout_s:.0f} s after it was killed")
            time.sleep(0.25)
        return {"node": name, "actors": len(on_it), "at": at, "dead_after_s": time.monotonic() - at}


def start_serve(port: int) -> None:
    """Serve with one HTTP proxy, on the head (as the manifests: `proxy_location: HeadOnly`); one proxy per
    node would bind the same port on this one machine."""
    from ray import serve

    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})


def _actors() -> list[dict]:
    import ray._private.state

    return list(ray._private.state.actors().values())


def _node_id(actor: dict) -> str | None:
    return (actor.get("Address") or {}).get("NodeID")


def _address(actor: dict, key: str) -> tuple:
    address = actor.get(key) or {}
    return address.get("IPAddress"), address.get("Port")


def where(app: str, names: dict[str, str]) -> dict[str, list[str]]:
    """The node (by name, `LocalCluster.node_names`) of each live actor of Serve app `app`, by role: replicas of
    each deployment, target shards, drafters, the policy actor, the telemetry hub, Serve's proxy and controller."""
    from cluster.observability.telemetry import hub_name
    from cluster.serving.app import DECODER_DEPLOYMENT, INGRESS_DEPLOYMENT
    from cluster.serving.decoder import policy_actor_name

    roles = {f"ServeReplica:{app}:{DECODER_DEPLOYMENT}": "unit", f"ServeReplica:{app}:{INGRESS_DEPLOYMENT}": "ingress",
             "TargetShard": "target_shard", "DrafterHost": "drafter", "ProxyActor": "proxy",
             "ServeController": "controller"}
    named = {policy_actor_name(app): "policy", hub_name(app): "hub"}
    out: dict[str, list[str]] = {}
    for actor in _actors():
        role = named.get(actor.get("Name")) or roles.get(actor["ActorClassName"])
        if role and actor["State"] == "ALIVE":
            out.setdefault(role, []).append(names.get(_node_id(actor), "unknown"))
    return {role: sorted(nodes) for role, nodes in out.items()}


def units_with_nodes(app: str, names: dict[str, str]) -> list[dict]:
    """Each live unit replica with its node, its target shards' nodes and its drafter's node."""
    from cluster.serving.app import DECODER_DEPLOYMENT

    actors = [a for a in _actors() if a["State"] == "ALIVE"]
    owner = {"TargetShard": "shards", "DrafterHost": "drafters"}
    units = []
    for replica in (a for a in actors if a["ActorClassName"] == f"ServeReplica:{app}:{DECODER_DEPLOYMENT}"):
        address = _address(replica, "Address")
        unit = {"unit": names.get(_node_id(replica), "unknown"), "shards": [], "drafters": []}
        for actor in actors:
            if actor["ActorClassName"] in owner and _address(actor, "OwnerAddress") == address:
                unit[owner[actor["ActorClassName"]]].append(names.get(_node_id(actor), "unknown"))
        units.append(unit)
    return sorted(units, key=lambda u: u["unit"])


def placement_groups() -> list[dict]:
    """Every live placement group: {"strategy", "nodes" (node ids of its bundles), "bundles"}."""
    import ray

    table = ray.util.placement_group_table()
    return [{"strategy": pg["strategy"], "nodes": sorted(set(pg["bundles_to_node_id"].values())),
             "bundles": list(pg["bundles"].values())}
            for pg in table.values() if pg["state"] == "CREATED"]


def multinode_config(config: dict, *, units: int = 2) -> dict:
    """The dumped `config` (e.g. `bench.reliability.fault_config`'s) for `NODES`: `units` units whose replica and
    STRICT_PACK target shards reserve `UNIT_RESOURCE` and whose model drafter reserves `DRAFTER_RESOURCE`."""
    from cluster.config import dump_config, parse_config

    out = dump_config(parse_config(config))
    out["target"]["placement_strategy"] = "STRICT_PACK"
    out["target"]["resources"]["custom"] = {UNIT_RESOURCE: 1}
    out["unit"]["custom"] = {UNIT_RESOURCE: 1}
    out["drafter"]["resources"]["custom"] = {DRAFTER_RESOURCE: 1}
    out["autoscaling"].update(enabled=False, min_replicas=units, max_replicas=units, initial_replicas=units)
    return dump_config(parse_config(out))


def wait_replaced(app: str, names: dict[str, str], units: int, timeout_s: float = REPLACE_TIMEOUT_S) -> list[dict]:
    """`units_with_nodes` once `units` units run again, each with its shard and drafter."""
    deadline = time.monotonic() + timeout_s
    while True:
        placed = units_with_nodes(app, names)
        if len(placed) == units and all(u["shards"] and u["drafters"] for u in placed):
            return placed
        if time.monotonic() > deadline:
            raise TimeoutError(f"{units} units not placed again after {timeout_s:.0f} s: {placed}")
        time.sleep(0.5)


def node_fault(config: dict, port: int, load) -> dict:
    """A node killed under load: `config` (a dumped `multinode_config`) served on a `LocalCluster` of `NODES`;
    `load(app, url, injectors)` runs the load and injects the fault "node" with `injectors["node"]`, which kills
    node `KILLED` (`bench.reliability.run_faults`), and returns its figures. Adds where the units ran before and
    after, and when every unit ran again (seconds from the kill)."""
    from ray import serve

    from cluster.serving.app import build_app

    app = config["name"]
    with LocalCluster(NODES) as local:
        start_serve(port)
        try:
            serve.run(build_app({"config": config}), name=app, route_prefix="/")
            names = local.node_names()
            units = len(wait_replaced(app, names, config["autoscaling"]["min_replicas"]))
            before = units_with_nodes(app, names)
            killed: list[dict] = []
            replaced: dict = {}

            def watch() -> None:  # from the kill until every unit runs again, while the load goes on
                replaced["units"] = wait_replaced(app, names, units)
                replaced["after_s"] = time.monotonic() - killed[0]["at"]

            def kill() -> dict:
                killed.append(local.kill_node(KILLED))
                replaced["watch"] = threading.Thread(target=watch, daemon=True)
                replaced["watch"].start()
                return dict(killed[-1])

            result = load(app, f"http://127.0.0.1:{port}", {"node": kill})
            replaced["watch"].join(REPLACE_TIMEOUT_S)
            result.update(units_before=before, units_after=replaced.get("units"),
                          replaced_after_s=replaced.get("after_s"))
            return result
        finally:
            serve.shutdown()


SIM_RESOURCE = "specserve-sim"  # the worker node that simulated units run on (the capacity sections)


def _run_point(point, units: int, kwargs: dict) -> dict:
    import asyncio

    import torch

    torch.set_num_threads(1)
    return asyncio.run(point(units, **kwargs))


def across_nodes(point, counts, **kwargs) -> list[dict]:
    """`point(n, **kwargs)` (a coroutine function: n simulated units against an app singleton) for each n in
    `counts`, run on a worker node of a two-node cluster while the singleton sits on the head, as the manifests
    place it: every report crosses the node boundary. One cluster for all points; one line per point on stderr."""
    import ray

    run = ray.remote(num_cpus=0, resources={SIM_RESOURCE: 1}, max_retries=0)(_run_point)
    points = []
    with LocalCluster({"sim": {"num_cpus": 1, "resources": {SIM_RESOURCE: 1}}}):
        for n in counts:
            points.append(ray.get(run.remote(point, n, kwargs)))
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in points[-1].items()}),
                  file=sys.stderr, flush=True)
    return points
