"""More than one node (issue 26): a real Ray cluster of three raylets on this machine (`bench.multinode`, Ray's
`cluster_utils.Cluster`), the manifests' placement proven on it, and a worker node killed under load.

The nodes stand for the KubeRay pods: the head (no custom resources: Serve's proxy and controller, the ingress,
the policy actor, the telemetry hub), a unit node `units` and a node `mixed` with room for units and drafters.
Two units, each a coordinator replica with its target shard in a STRICT_PACK placement group and a model drafter
that reserves the drafters' resource: Serve spreads the units over both nodes, so the unit on `units` drafts
across the node boundary. Then `units` is killed while requests stream: every request completes or ends with a
clean 503, none is lost or hangs, the service answers again, the lost unit is placed again on the surviving
node, nothing is left open and no ledger is overspent. What is asserted is outcomes; how fast the service
recovers is the reliability bench's figure (`specserve bench --section reliability`), never a bound here.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

pytestmark = pytest.mark.slow

APP, MODEL = "multinode", "tiny-multinode"
GUARD_S = 240.0  # a hang guard for waits on the cluster, not a bound it must meet
TIMEOUT_S = 90.0  # request_timeout_s: past it (+ slack) a request counts as hung
PROMPTS_SEED = 0


@pytest.fixture(scope="module")
def cluster():
    """Head + the two worker nodes of `bench.multinode.NODES`; the session's single-node cluster, if running, is
    stopped for the module and started again after it (one Ray cluster per process)."""
    ray = pytest.importorskip("ray")
    from bench.multinode import NODES, LocalCluster

    restore = ray.is_initialized()
    if restore:
        ray.shutdown()
    try:
        with LocalCluster(NODES) as local:
            yield local
    finally:
        if restore:  # as tests/conftest.py's `ray_cluster` made it
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)


@pytest.fixture(scope="module")
def served(cluster, tiny_llama_pair):
    """Two units of the tiny pair (`bench.reliability.fault_config`: a model drafter and the target each in their
    own actor; `bench.multinode.multinode_config`: their nodes), over HTTP through the head's proxy."""
    from ray import serve

    from bench.multinode import multinode_config, start_serve
    from bench.reliability import fault_config
    from cluster.cli import _kill_app_actors
    from cluster.serving.app import build_app
    from tests.cluster.serving.served_app import free_port

    target, drafter = tiny_llama_pair
    config = {"name": APP, "target": {"source": str(target), "served_name": MODEL, "max_seq_len": 256,
                                      "resources": {"num_cpus": 0.25}},
              "arms": [{"name": "exact"}, {"name": "asd", "verification": "asd",
                                           "asd": {"g": 2.0, "max_relaxed_per_block": 2, "budget": 8.0}}],
              "serving": {"max_tokens_limit": 128, "default_max_tokens": 16},
              "unit": {"num_cpus": 0.25, "torch_threads": 1}}
    port = free_port()
    start_serve(port)
    try:
        config = multinode_config(fault_config(config, drafter_source=str(drafter), concurrency=8, timeout_s=TIMEOUT_S))
        serve.run(build_app({"config": config}), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        _kill_app_actors(APP)


def prompts() -> list[tuple[int, ...]]:
    rng = random.Random(PROMPTS_SEED)
    return [tuple(rng.randrange(3, 49152) for _ in range(n)) for n in (5, 40, 120)]


def test_placement_follows_the_manifests(cluster, served):
    from bench.multinode import DRAFTER_RESOURCE, UNIT_RESOURCE, placement_groups, wait_replaced, where

    names = cluster.node_names()
    units = wait_replaced(APP, names, 2)
    roles = where(APP, names)
    # the singletons on the head, beside Serve's proxy (HeadOnly) and controller
    for role in ("ingress", "policy", "hub", "proxy", "controller"):
        assert roles.get(role) == ["head"], (role, roles)
    # units spread over both worker nodes; each one's target shard on its own node; drafters on the drafters' node
    assert [u["unit"] for u in units] == ["mixed", "units"], units
    assert all(u["shards"] == [u["unit"]] for u in units), units
    assert all(u["drafters"] == ["mixed"] for u in units), units
    # the target's shards in one STRICT_PACK group on one node, reserving the units' resource
    shard_groups = [pg for pg in placement_groups() if any(UNIT_RESOURCE in b for b in pg["bundles"])]
    assert len(shard_groups) == 2 and all(pg["strategy"] == "STRICT_PACK" and len(pg["nodes"]) == 1
                                          for pg in shard_groups), shard_groups
    assert not any(DRAFTER_RESOURCE in b for pg in shard_groups for b in pg["bundles"])


def test_greedy_output_is_the_same_on_every_node(cluster, served):
    """Every unit's speculative output (the one on `units` drafting on another node) equals target-only greedy."""
    import asyncio

    from bench.load import LoadRequest, run_load

    requests = [LoadRequest(i, p, 24, stream, "exact") for i, (p, stream) in
                enumerate((p, s) for p in prompts() for s in (False, True))]
    plain = asyncio.run(run_load(served, MODEL, requests, concurrency=4, timeout_s=TIMEOUT_S, speculate=False))
    # twice over, so Serve's router sends some of each kind to both units
    spec = asyncio.run(run_load(served, MODEL, requests * 2, concurrency=4, timeout_s=TIMEOUT_S))
    assert all(o.end == "completed" for o in plain + spec), [o for o in plain + spec if o.end != "completed"]
    reference = {r.prompt: o.text for r, o in zip(requests, plain)}
    assert all(o.text == reference[r.prompt] for r, o in zip(requests * 2, spec))


def test_a_node_killed_under_load_ends_every_request_cleanly(cluster, served):
    from bench.multinode import KILLED, wait_replaced
    from bench.reliability import run_faults

    names = cluster.node_names()
    killed: list[dict] = []

    def kill_units_node() -> dict:
        killed.append(cluster.kill_node(KILLED))
        return dict(killed[-1])

    result = run_faults(APP, served, MODEL, prompts(), requests=32, concurrency=8, lengths=(8, 24, 48),
                        arms=("exact", "asd"), exact_arm="exact", timeout_s=TIMEOUT_S, faults=("node",),
                        injectors={"node": kill_units_node})
    report = json.dumps(result, indent=1, default=str)
    print(report)  # the node fault's figures, in the log of a passing run too
    assert killed and killed[0]["actors"] >= 2, report  # the unit's replica and its shard died with the node
    assert result["completed"] + result["errored"] == 32 and result["completed"] > 0, report
    goals = {key: ok for key, ok in result["goals"].items() if key != "recovered_within_30s"}  # the bench's figure
    assert goals == {"none_lost_or_hung": True, "greedy_identical": True, "ledgers_within_budget": True,
                     "nothing_leaked": True}, report
    assert result["faults"][0]["recovery_s"] is not None, report  # the service answered again
    assert set(result["error_codes"]) <= {"unit_unavailable", "unit_failed"}, report
    # the lost unit is placed again, on the surviving node, with its shard and a drafter
    units = wait_replaced(APP, names, 2, timeout_s=GUARD_S)
    assert units == [{"unit": "mixed", "shards": ["mixed"], "drafters": ["mixed"]}] * 2, units
    reply = httpx.post(f"{served}/v1/completions", timeout=TIMEOUT_S,
                       json={"model": MODEL, "prompt": list(prompts()[0]), "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
