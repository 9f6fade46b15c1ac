"""vLLM's per-request settings carry the whole ASD arm into the worker: g, M, B and the gate form."""

from types import SimpleNamespace

import pytest

from actors.engines.vllm.sampling import request_settings, worker_request as _request
from actors.requests import ArmSpec, GenerationRequest, SamplingParams
from policies.asd import ASDConfig


@pytest.mark.parametrize("gate", ["remaining", "fraction"])
def test_the_worker_rebuilds_the_arm_the_unit_sent(gate):
    arm = ArmSpec("asd", "asd", ASDConfig(g=4.0, max_relaxed_per_block=2, budget=8.0, gate=gate))
    request = GenerationRequest("r1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0), arm)
    params = SimpleNamespace(temperature=0.0, max_tokens=5, seed=None)
    rebuilt = _request(request_settings(request, speculate=True), params, [1, 2, 3])
    assert rebuilt.arm == arm and rebuilt.arm.asd.gate == gate
