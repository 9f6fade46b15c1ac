"""Faults under load, bounded for CI: 40 greedy requests at concurrency 8 over HTTP (mixed lengths, streamed
and not, both arms) on the tiny model pair, while the drafter actor, the target shard, the policy actor and the
decoder replica are each killed once. Every request completes or ends with a clean error, exact-arm output is
the target-only greedy output, ledgers stay within budget, nothing is leaked, and the service answers again
after each fault (how fast is the bench's figure, not a CI bound). The full run is `specserve bench --section reliability`."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "cluster" / "serving"))
from served_app import served_app  # noqa: E402
from tests.cluster.serving.test_http import tiny_config  # noqa: E402

pytestmark = pytest.mark.slow

APP = "tiny-faults"


def test_the_client_sees_clean_ends_through_every_fault(ray_cluster, tiny_llama_pair):
    from bench.faults import FAULTS
    from bench.reliability import fault_config, run_faults

    target, drafter = tiny_llama_pair
    config = tiny_config(target)
    config["name"] = APP
    config = fault_config(config, drafter_source=str(drafter), concurrency=8, timeout_s=60.0)
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(3, 49152) for _ in range(n)) for n in (5, 40, 120)]
    with served_app(config, APP) as url:
        result = run_faults(APP, url, "tiny", prompts, requests=40, concurrency=8, lengths=(8, 24, 48),
                            arms=("exact", "asd"), exact_arm="exact", timeout_s=60.0)
    report = json.dumps(result, indent=1, default=str)
    print(report)  # the recovery figures, in the log of a passing run too
    assert [f["fault"] for f in result["faults"]] == list(FAULTS), report
    assert result["completed"] + result["errored"] == 40 and result["completed"] > 0, report
    # outcomes only: the 30-s recovery goal is the bench's to measure and report (a slower machine took 30.6 s
    # for the replica fault in CI); here the service must answer again after every fault
    goals = {key: ok for key, ok in result["goals"].items() if key != "recovered_within_30s"}
    assert goals == {"none_lost_or_hung": True, "greedy_identical": True, "ledgers_within_budget": True,
                     "nothing_leaked": True}, report
    assert all(f["recovery_s"] is not None for f in result["faults"]), report
    # clean ends only: a 503 (unit failed or gone, queue full) or a 408 for a request that waited out the replica's
    # restart past its deadline (CI once took 70 s to replace the replica; a 60-s deadline then answers 408)
    assert set(result["error_codes"]) <= {"unit_failed", "unit_unavailable", "queue_full", "request_timeout"}, report
