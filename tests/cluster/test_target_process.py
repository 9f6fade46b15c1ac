"""Where a unit's target runs on Ray: in the replica's own process (TP = 1) or in shard actors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.config import load_config
from cluster.serving.app import decoder_options, replica_resources
from cluster.serving.decoder import unit_setup


def _config(**target):
    config = load_config("configs/local.yaml")
    return config.model_copy(update={"target": config.target.model_copy(update=target)})


@pytest.mark.parametrize("process, tp, in_replica", [("auto", 1, True), ("auto", 2, False), ("replica", 1, True),
                                                     ("actor", 1, False)])
def test_process_decides_in_replica(process, tp, in_replica):
    config = _config(process=process, tensor_parallel_size=tp)
    assert config.target.in_replica is in_replica
    assert unit_setup(config)["target"].in_replica is in_replica


def test_replica_process_needs_tp_1():
    config = load_config("configs/local.yaml").model_dump()
    config["target"].update(process="replica", tensor_parallel_size=2)
    with pytest.raises(ValidationError, match="tensor_parallel_size 1"):
        type(load_config("configs/local.yaml")).model_validate(config)


def test_a_replica_holding_the_target_reserves_its_resources():
    config = _config(process="replica")
    assert replica_resources(config) == {"num_cpus": config.unit.num_cpus + config.target.resources.num_cpus}
    gpu = _config(process="replica", resources=config.target.resources.model_copy(update={"num_gpus": 1.0}))
    assert replica_resources(gpu)["num_gpus"] == 1.0
    assert replica_resources(_config(process="actor")) == {"num_cpus": config.unit.num_cpus}


def test_on_vllms_ray_executor_the_replica_places_its_workers_in_its_placement_group():
    config = load_config("configs/local-vllm.yaml")
    resources = config.target.resources.model_copy(update={"num_cpus": 0.5})
    target = config.target.model_copy(update={"tensor_parallel_size": 2, "resources": resources,
                                              "engine_kwargs": {"distributed_executor_backend": "ray"}})
    options = decoder_options(config.model_copy(update={"target": target}))
    assert options["ray_actor_options"] == {"num_cpus": config.unit.num_cpus}  # the workers reserve their own
    assert options["placement_group_bundles"] == [{"CPU": config.unit.num_cpus}, {"CPU": 0.5}, {"CPU": 0.5}]
    assert options["placement_group_strategy"] == target.placement_strategy
    assert "placement_group_bundles" not in decoder_options(config)  # multiprocessing: the replica holds them
