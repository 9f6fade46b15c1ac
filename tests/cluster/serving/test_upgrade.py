"""An upgrade under load: a changed config (new arm weights, an added arm and a changed γ setting) deployed with
`serve.run` while 16 clients send completions back to back, as KubeRay's in-place update of `serveConfigV2`
redeploys an app. Serve versions every deployment by the app's arguments, so the unit restarts: no request
fails, new requests are split by the new arms and served by the new unit, and the export and the A/B report say
when the arms changed."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from served_app import served_app

pytestmark = pytest.mark.slow

APP = "tiny-upgrade"
MODEL = "tiny"
STREAMS = 16
ASD = {"name": "asd", "verification": "asd", "asd": {"g": 4.0, "max_relaxed_per_block": 2, "budget": 8.0}}


def config(model_dir, *, arms=None, gamma_max: int = 8) -> dict:
    return {
        "name": APP,
        "target": {"source": str(model_dir), "served_name": MODEL, "max_seq_len": 256, "max_batch_size": 16,
                   "resources": {"num_cpus": 0.25}, "placement_strategy": "PACK"},
        "drafter": {"kind": "ngram", "resources": {"num_cpus": 0}},
        "arms": arms or [{"name": "exact", "verification": "exact", "weight": 1}, {**ASD, "weight": 1}],
        "gamma": {"gamma_max": gamma_max},
        "serving": {"max_ongoing_requests": 16, "max_queued_requests": 64, "max_tokens_limit": 200,
                    "default_max_tokens": 16},
        "unit": {"num_cpus": 0.25, "torch_threads": 1},
        "autoscaling": {"enabled": False, "min_replicas": 1, "max_replicas": 1, "graceful_shutdown_timeout_s": 60},
    }


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_llama_dir):
    with served_app(config(tiny_llama_dir), APP) as url:
        yield url


class Load:
    """`STREAMS` clients sending greedy completions back to back; each row: (sent, done, status, arm)."""

    def __init__(self, url: str):
        self.url, self.rows, self.stop = url, [], threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(STREAMS)]

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = 0
            while not self.stop.is_set():
                sent = time.monotonic()
                r = http.post(f"{self.url}/v1/completions", json={
                    "model": MODEL, "prompt": f"client {i} request {n} " * 3, "max_tokens": 24, "temperature": 0,
                    "user": f"user-{i}-{n}"})
                arm = r.json().get("usage", {}).get("speculative", {}).get("arm") if r.status_code == 200 else None
                self.rows.append((sent, time.monotonic(), r.status_code, arm))
                n += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)


def upgrade(new_config: dict) -> tuple[float, float]:
    """Deploy `new_config` over the running app; (monotonic start, end of `serve.run`: the new version runs)."""
    from ray import serve

    from cluster.serving.app import build_app

    start = time.monotonic()
    serve.run(build_app({"config": new_config}), name=APP, route_prefix="/")
    return start, time.monotonic()


def units_serving(url: str) -> set[str]:
    return {row["unit"] for row in httpx.get(f"{url}/v1/specserve/export", timeout=30).json()["requests"]}


def test_a_changed_config_under_load_loses_no_request(server, tiny_llama_dir):
    new_arms = [{"name": "exact", "verification": "exact", "weight": 1}, {**ASD, "weight": 3},
                {"name": "asd-wide", "verification": "asd", "weight": 2,
                 "asd": {"g": 8.0, "max_relaxed_per_block": 4, "budget": 16.0}}]
    with Load(server) as load:
        time.sleep(3)
        units_before = units_serving(server)
        wall = time.time()
        started, deployed = upgrade(config(tiny_llama_dir, arms=new_arms, gamma_max=4))
        wall_deployed = time.time()
        time.sleep(3)
    assert all(status == 200 for *_, status, _ in load.rows), [r for r in load.rows if r[2] != 200]
    before = {arm for sent, done, _, arm in load.rows if done < started}
    after = {arm for sent, done, _, arm in load.rows if sent > deployed + 1.0}  # the old version has drained
    assert before <= {"exact", "asd"} and "asd-wide" in after, (before, after)
    assert len(units_before) == 1 and units_serving(server) - units_before  # a new unit served after the change
    export = httpx.get(f"{server}/v1/specserve/export", timeout=30).json()
    assert [d["arms"] for d in export["deployments"]][-2:] == [["exact", "asd"], ["exact", "asd", "asd-wide"]]
    from experiments.ab_report import build_report

    (change,) = build_report(export, resamples=10)["changes"]
    assert wall <= change["at_s"] <= wall_deployed  # when the new version's ingress started
    assert change["requests_before"] > 0 and change["requests_after"] > 0
