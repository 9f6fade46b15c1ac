"""Serve autoscaling of whole units on a local Ray cluster: replicas rise under a burst and fall after it, and no
request is lost or cut while a unit is drained and removed."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from served_app import served_app

pytestmark = pytest.mark.slow

APP = "tiny-autoscale"
MODEL = "tiny"
TOKENS = 120


def config(model_dir) -> dict:
    return {
        "name": APP,
        "target": {"source": str(model_dir), "served_name": MODEL, "max_seq_len": 256, "max_batch_size": 4,
                   "resources": {"num_cpus": 0.25}, "placement_strategy": "PACK"},
        "drafter": {"kind": "ngram", "resources": {"num_cpus": 0}},
        "arms": [{"name": "exact", "verification": "exact", "weight": 1}],
        "serving": {"max_ongoing_requests": 4, "max_queued_requests": 64, "max_tokens_limit": 200,
                    "default_max_tokens": 16},
        "unit": {"num_cpus": 0.25, "torch_threads": 1},
        # Short delays and windows so the test sees both directions within seconds.
        "autoscaling": {"enabled": True, "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                        "upscale_delay_s": 0.5, "downscale_delay_s": 3, "look_back_period_s": 2,
                        "metrics_interval_s": 0.5, "graceful_shutdown_timeout_s": 60},
    }


def _running_units() -> int:
    from ray import serve

    from cluster.serving.app import DECODER_DEPLOYMENT

    status = serve.status().applications[APP].deployments[DECODER_DEPLOYMENT]
    return status.replica_states.get("RUNNING", 0)


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return False


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_llama_dir):
    with served_app(config(tiny_llama_dir), APP) as url:
        yield url


def test_units_scale_up_under_a_burst_and_down_without_losing_requests(server):
    results: list[tuple[int, int, str]] = []
    stops = [threading.Event() for _ in range(6)]

    def client(i: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = 0
            while not stops[i].is_set():
                r = http.post(f"{server}/v1/completions", json={
                    "model": MODEL, "prompt": f"request {i} {n} " * 3, "max_tokens": TOKENS, "temperature": 0,
                })
                body = r.json()
                results.append((r.status_code, body.get("usage", {}).get("completion_tokens", -1),
                                body.get("choices", [{}])[0].get("finish_reason", "")))
                n += 1

    assert _running_units() == 1
    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        assert _wait_for(lambda: _running_units() == 2, 90), "no second unit under a burst of 6 clients"
        for event in stops[1:]:  # the burst ends; one client keeps sending while a unit is drained and removed
            event.set()
        assert _wait_for(lambda: _running_units() == 1, 90), "the second unit was not removed after the burst"
        time.sleep(1.0)
    finally:
        for event in stops:
            event.set()
    for t in threads:
        t.join(180)
    # Every request, including those in flight while a unit was drained, finished whole.
    assert len(results) > 6 and all(code == 200 for code, _, _ in results), results
    assert all(reason == "stop" or tokens == TOKENS for _, tokens, reason in results), results


def test_the_ramp_bench_sees_units_follow_the_load_up_and_down(server, tmp_path):
    """`bench.ramp`'s clients, sampler and figures on the served app: a ramp from 1 to 6 streams and back, with
    this module's short autoscaling delays; every request completes, Serve asks for a second unit and lets it
    go, and the plot is drawn."""
    import asyncio

    from bench import ramp

    preset = {"stages": ((1, 1, 1), (3, 1, 6), (12, 6, 6), (1, 6, 1)), "tail_s": 12.0, "max_tokens": 24}
    profile = ramp.stages(preset, downscale_delay_s=3)
    load = {"wanted": 0, "in_flight": 0}
    t0 = time.monotonic()
    sampler = ramp.Sampler(APP, t0, load)
    sampler.start()
    try:
        rows = asyncio.run(ramp.drive(server, MODEL, ["one two three", "four five six"], profile,
                                      preset["max_tokens"], t0, load))
    finally:
        sampler.stop.set()
        sampler.join()
    summary = ramp.summarize(rows, sampler.samples, target_ongoing=1)
    assert summary["ends"] == {"completed": len(rows)} and len(rows) > 10, summary["ends"]
    # Serve's target follows the load up to 2 units and back to 1. Whether the added unit also runs before the
    # peak ends depends on how fast this machine starts one (a slower machine missed it in the 12 s hold), so
    # that is asserted by the burst test above, which waits for it, and not here.
    replicas = [s["replicas"] for s in sampler.samples]
    assert max(replicas) == 2 and replicas[-1] == 1 and summary["units_at_end"] == 1, sampler.samples
    assert summary["ttft_p95_rise_s"] > 0 and summary["ttft_p95_steady_s"] > 0
    engine = {"engine": "native", "config": "tiny", "profile": profile, "samples": sampler.samples,
              "requests": rows, "summary": summary, "autoscaling": config("")["autoscaling"]}
    results = {"meta": {"command": "test", "started": "now", "elapsed_s": 1.0}, "engines": [engine]}
    plot = ramp.plot_ramp(results, tmp_path)
    assert plot == "ramp.png" and (tmp_path / plot).stat().st_size > 0
    assert "| requests |" in ramp.report_markdown(results, plot)
