"""Placement fields (`cluster.config.placement`): custom resources are validated, a unit's replica and shards
reserve them, and each rendered worker group advertises exactly what the actors it is made for reserve, so the
manifests place what tests/cluster/test_multinode.py proves on a real multi-node cluster."""

from __future__ import annotations

import json

import pytest
import yaml

from cluster.config import ConfigError, load_config, parse_config
from cluster.k8s.render import REPO_ROOT, ray_start_resources, shipped_manifests
from cluster.serving.app import decoder_options, ingress_options, replica_resources


def _config(**target_resources) -> dict:
    return {"name": "p", "target": {"source": "embedded:smollm2", "served_name": "m", "resources": target_resources}}


@pytest.mark.parametrize("custom", [{"CPU": 1}, {"GPU": 1}, {"memory": 1}, {"node:10.0.0.1": 1},
                                    {"specserve-unit": 0}, {"": 1}])
def test_ray_s_own_and_malformed_resources_are_refused(custom):
    with pytest.raises(ConfigError, match="custom"):
        parse_config(_config(custom=custom))


def test_a_replica_reserves_its_own_and_its_in_replica_shard_s_resources():
    config = parse_config({**_config(custom={"u": 1}), "unit": {"custom": {"u": 1, "c": 0.5}}})
    assert replica_resources(config)["resources"] == {"u": 2.0, "c": 0.5}  # the target runs in the replica
    apart = parse_config({**_config(custom={"u": 1}), "unit": {"custom": {"u": 1}}})
    apart = apart.model_copy(update={"target": apart.target.model_copy(update={"process": "actor"})})
    assert replica_resources(apart)["resources"] == {"u": 1.0}  # the shard's bundle reserves its own
    assert "resources" not in replica_resources(parse_config(_config()))  # one node: nothing custom


def test_the_ingress_runs_on_the_head():
    options = ingress_options(parse_config(_config()))
    assert options["ray_actor_options"]["resources"] == {"node:__internal_head__": 0.001}
    assert decoder_options(parse_config(_config()))["ray_actor_options"].get("resources") is None


def _advertised(group: dict) -> dict[str, float]:
    text = group["rayStartParams"].get("resources")
    return json.loads(text[1:-1].replace('\\"', '"')) if text else {}  # '"{\\"name\\": 1}"' as KubeRay reads it


def _reserved_per_unit(config) -> tuple[dict[str, float], dict[str, float]]:
    """(what one unit's replica and shards reserve, what its drafter actor reserves)."""
    unit = dict(replica_resources(config).get("resources") or {})
    if not config.target.in_replica and config.target.engine == "native":
        for name, amount in config.target.resources.custom.items():
            unit[name] = unit.get(name, 0.0) + amount * config.target.tensor_parallel_size
    drafter = dict(config.drafter.resources.custom) if config.drafter.kind == "model" else {}
    return unit, drafter


@pytest.mark.parametrize("config_path", sorted(shipped_manifests()), ids=lambda p: p.name)
def test_each_pod_advertises_what_its_actors_reserve(config_path):
    config = load_config(config_path, check_engines=False)
    manifest = yaml.safe_load(shipped_manifests()[config_path].read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    assert "resources" not in cluster["headGroupSpec"]["rayStartParams"]  # no unit ever lands on the head
    groups = {g["groupName"]: _advertised(g) for g in cluster["workerGroupSpecs"]}
    unit, drafter = _reserved_per_unit(config)
    if "drafter" in groups:
        assert groups.pop("drafter") == drafter
    else:
        for name, amount in drafter.items():
            unit[name] = unit.get(name, 0.0) + amount
    (advertised,) = groups.values()
    assert advertised == unit


def test_gpu_manifests_keep_units_and_drafters_apart():
    manifest = yaml.safe_load((REPO_ROOT / "k8s" / "rayservice-gpu-llama3-8b-tp2.yaml").read_text())
    groups = {g["groupName"]: _advertised(g) for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert groups == {"target": {"specserve-unit": 3}, "drafter": {"specserve-drafter": 1}}  # 2 shards + replica


def test_ray_start_resources_is_kuberay_s_quoted_json():
    assert ray_start_resources({"b": 0.5, "a": 2.0}) == '"{\\"a\\": 2, \\"b\\": 0.5}"'


def test_units_on_one_host_are_capped_by_its_cores():
    """`specserve serve` on one host runs at most cores // (threads per unit) CPU units: more would share cores."""
    from cluster.serving.app import fit_units_to_host

    local = load_config(REPO_ROOT / "configs/local.yaml")  # 2 threads a unit, up to 2 units
    capped, note = fit_units_to_host(local, cores=2)
    assert capped.autoscaling.max_replicas == 1 and capped.autoscaling.min_replicas == 1
    assert "2 cores" in note and "at most 1 unit" in note
    assert fit_units_to_host(local, cores=4) == (local, None)  # room for both
    vllm = load_config(REPO_ROOT / "configs/local-vllm.yaml")
    assert fit_units_to_host(vllm, cores=64)[1] is None  # one unit already
    two = vllm.model_copy(update={"autoscaling": vllm.autoscaling.model_copy(update={"enabled": True,
                                                                                      "max_replicas": 3})})
    assert fit_units_to_host(two, cores=64)[0].autoscaling.max_replicas == 1  # a vLLM CPU unit takes the cores
    gpu = parse_config({**_config(num_gpus=1), "target": {**_config(num_gpus=1)["target"], "device": "cuda"},
                        "autoscaling": {"max_replicas": 4}})
    assert fit_units_to_host(gpu, cores=2) == (gpu, None)  # GPU units bring their own device
