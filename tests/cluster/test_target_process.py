"""Where a unit's target runs on Ray: in the replica's own process (TP = 1) or in shard actors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.config import load_config
from cluster.serving.app import replica_resources
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
