"""Upgrades under load, deployed as KubeRay deploys them (the rendered serveConfigV2's application, through Serve's
controller) while 16 clients send completions back to back:
- new arm weights and an added arm change only the ingress's user_config, which the running ingress takes in place
  (`OpenAIIngress.reconfigure`): no unit restarts;
- a changed γ setting changes the application's arguments, by which Serve versions every deployment, so the unit
  restarts (a surge replica first).
Either way no request fails, new requests are split by the new arms, and the export and the A/B report say when
the arms changed."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from served_app import deploy_declaratively, served_declaratively

pytestmark = pytest.mark.slow

APP = "tiny-upgrade"
MODEL = "tiny"
STREAMS = 16
ASD = {"name": "asd", "verification": "asd", "asd": {"g": 4.0, "max_relaxed_per_block": 2, "budget": 8.0}}
NEW_ARMS = [{"name": "exact", "verification": "exact", "weight": 1}, {**ASD, "weight": 3},
            {"name": "asd-wide", "verification": "asd", "weight": 2,
             "asd": {"g": 8.0, "max_relaxed_per_block": 4, "budget": 16.0}}]


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
    with served_declaratively(config(tiny_llama_dir), APP) as url:
        yield url


class Load:
    """`STREAMS` clients sending greedy completions back to back; each row: (sent, done, status, arm), wall
    times."""

    def __init__(self, url: str):
        self.url, self.rows, self.stop = url, [], threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(STREAMS)]

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = 0
            while not self.stop.is_set():
                sent = time.time()
                r = http.post(f"{self.url}/v1/completions", json={
                    "model": MODEL, "prompt": f"client {i} request {n} " * 3, "max_tokens": 24, "temperature": 0,
                    "user": f"user-{i}-{n}"})
                arm = r.json().get("usage", {}).get("speculative", {}).get("arm") if r.status_code == 200 else None
                self.rows.append((sent, time.time(), r.status_code, arm))
                n += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)


def units_serving(url: str) -> set[str]:
    return {row["unit"] for row in export(url)["requests"]}


def export(url: str) -> dict:
    return httpx.get(f"{url}/v1/specserve/export", timeout=30).json()


def arms_after(rows, since: float) -> set[str]:
    return {arm for sent, done, _, arm in rows if sent > since}


def test_new_arms_reach_the_running_ingress_without_restarting_a_unit(server, tiny_llama_dir):
    with Load(server) as load:
        time.sleep(3)
        units_before = units_serving(server)
        started = deploy_declaratively(config(tiny_llama_dir, arms=NEW_ARMS), APP)
        while export(server)["deployments"][-1]["arms"] != ["exact", "asd", "asd-wide"]:
            assert time.time() < started + 60, export(server)["deployments"]
            time.sleep(0.2)
        applied = time.time()
        time.sleep(3)
    assert load.rows and all(status == 200 for *_, status, _ in load.rows), [r for r in load.rows if r[2] != 200]
    before = {arm for sent, done, _, arm in load.rows if done < started}
    assert before <= {"exact", "asd"} and "asd-wide" in arms_after(load.rows, applied), load.rows
    assert len(units_before) == 1 and units_serving(server) == units_before  # the same unit served throughout
    deployments = export(server)["deployments"]
    assert deployments[-2:] == [
        {"arms": ["exact", "asd"], "weights": {"exact": 1.0, "asd": 1.0}, "at_s": deployments[-2]["at_s"]},
        {"arms": ["exact", "asd", "asd-wide"], "weights": {"exact": 1.0, "asd": 3.0, "asd-wide": 2.0},
         "at_s": deployments[-1]["at_s"]}]
    from experiments.ab_report import build_report

    (change,) = build_report(export(server), resamples=10)["changes"]
    assert started <= change["at_s"] <= applied  # when the running ingress took the new arms
    assert change["requests_before"] > 0 and change["requests_after"] > 0


def test_a_changed_gamma_setting_restarts_the_unit_and_loses_no_request(server, tiny_llama_dir):
    with Load(server) as load:
        time.sleep(3)
        units_before = units_serving(server)
        started = deploy_declaratively(config(tiny_llama_dir, arms=NEW_ARMS, gamma_max=4), APP)
        deployed = time.time()
        time.sleep(3)
    assert load.rows and all(status == 200 for *_, status, _ in load.rows), [r for r in load.rows if r[2] != 200]
    assert units_serving(server) - units_before  # a new unit served after the change
    assert {"exact", "asd", "asd-wide"} >= arms_after(load.rows, deployed) and arms_after(load.rows, deployed)
    assert started < deployed
    assert len(export(server)["deployments"]) == 2  # the same arms and weights: no change of arms
