"""What ran, over real HTTP with the real `openai` client (issue 16): a tiny random Llama served with an exact
arm, an ASD arm whose sampled rule is exact, and a relaxed ASD arm; a second app whose `serving.defaults`
make greedy decoding the default. Requests leave `temperature` out, as the OpenAI SDK does by default."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from served_app import served_app

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

MODEL = "tiny"
APP = "tiny-what-ran"
GREEDY_APP = "tiny-greedy-default"
ARM = "x-specserve-arm"
MESSAGES = [{"role": "user", "content": "one two three one two three one two three"}]


def config(model_dir, name: str, defaults: dict | None = None) -> dict:
    return {
        "name": name,
        "target": {"source": str(model_dir), "served_name": MODEL, "max_seq_len": 256, "max_batch_size": 8,
                   "resources": {"num_cpus": 0.25}, "placement_strategy": "PACK"},
        "drafter": {"kind": "ngram", "resources": {"num_cpus": 0}},
        "arms": [
            {"name": "exact", "verification": "exact"},
            {"name": "asd", "verification": "asd", "asd": {"g": 2.0, "max_relaxed_per_block": 2, "budget": 8.0}},
            {"name": "relaxed", "verification": "asd",
             "asd": {"g": 2.0, "max_relaxed_per_block": 2, "budget": 8.0, "sampled": "relaxed"}},
        ],
        "serving": {"max_ongoing_requests": 8, "max_queued_requests": 8, "max_tokens_limit": 128,
                    "default_max_tokens": 16, **({"defaults": defaults} if defaults else {})},
        "unit": {"num_cpus": 0.25, "torch_threads": 1},
        "autoscaling": {"enabled": False, "min_replicas": 1, "max_replicas": 1},
    }


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_llama_dir):
    with served_app(config(tiny_llama_dir, APP), APP) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def speculative(completion) -> dict:
    return completion.usage.model_extra["speculative"]


def test_default_temperature_on_an_asd_arm_runs_exact_and_says_so(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                                           extra_headers={ARM: "asd"})
    assert raw.headers[ARM] == "asd"
    spec = speculative(raw.parse())
    assert spec["arm"] == "asd" and spec["verification"] == "exact" and spec["asd_fallback"] == "sampled"
    assert spec["regret_spent"] == 0.0 and spec["regret_budget"] == 8.0  # the arm's keys stay
    greedy = speculative(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                        extra_headers={ARM: "asd"}))
    assert greedy["verification"] == "asd" and "asd_fallback" not in greedy
    exact = speculative(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                                       extra_headers={ARM: "exact"}))
    assert exact["verification"] == "exact" and "asd_fallback" not in exact and "regret_spent" not in exact


def test_relaxed_arm_verifies_sampled_requests_by_asd_and_spends(client):
    """top_k = 4 makes sampled text repeat, so prompt lookup drafts; at a funded position the relaxed rule
    accepts a drafted token in the top 4 (p ≈ 1/4 < e^-ε) and charges c = min(ε, log(1/p)) > 0."""
    spec = speculative(client.completions.create(model=MODEL, prompt="a b a b a b a b", max_tokens=48, seed=3,
                                                 extra_body={"top_k": 4}, extra_headers={ARM: "relaxed"}))
    assert spec["verification"] == "asd" and "asd_fallback" not in spec
    assert spec["draft_tokens"] > 0 and 0 < spec["regret_spent"] <= spec["regret_budget"] == 8.0


def _metric(server: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server}/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_fallback_counter_and_report_warning(server, client, capsys):
    """More default-temperature requests on the asd arm: /metrics counts the fallbacks, and `specserve ab
    report` warns at the top that the asd arm ran exact verification, with the shares in --json."""
    from experiments.ab_report import main

    for user in range(4):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, user=f"u{user}",
                                       extra_headers={ARM: "asd"})
    deadline, fallbacks = time.time() + 30, 0.0
    while time.time() < deadline:  # units ship records to the hub every 0.5 s
        fallbacks = _metric(server, "specserve_asd_fallbacks_total", arm="asd", reason="sampled")
        if fallbacks >= 5:
            break
        time.sleep(0.5)
    assert fallbacks >= 5

    assert main(["--url", server, "--json", "--resamples", "50", "--reference", "exact"]) == 0
    report = json.loads(capsys.readouterr().out)
    warned = {w["arm"]: w for w in report["warnings"]}
    assert set(warned) == {"asd"} and warned["asd"]["share"] > 0.5
    assert report["arms"]["asd"]["own_verification_share"] < 0.5
    assert report["arms"]["asd"]["asd_fallbacks"]["sampled"] >= 5
    assert report["arms"]["relaxed"]["own_verification_share"] == 1.0
    assert report["arms"]["relaxed"]["sampled_asd"]["n"] >= 1
    assert main(["--url", server, "--resamples", "50", "--reference", "exact"]) == 0
    assert capsys.readouterr().out.startswith("WARNING: arm 'asd' ran exact verification")


def test_greedy_default_makes_the_same_request_run_asd(server, tiny_llama_dir):
    """`serving.defaults.temperature: 0` on a second app: the request that fell back above now runs ASD; a
    request that sends a temperature keeps it."""
    from ray import serve

    from cluster.cli import _kill_app_actors
    from cluster.serving.app import build_app

    serve.run(build_app({"config": config(tiny_llama_dir, GREEDY_APP, defaults={"temperature": 0})}),
              name=GREEDY_APP, route_prefix="/greedy")
    try:
        greedy = openai.OpenAI(base_url=f"{server}/greedy/v1", api_key="unused", max_retries=0, timeout=120)
        spec = speculative(greedy.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                                          extra_headers={ARM: "asd"}))
        assert spec["verification"] == "asd" and "asd_fallback" not in spec
        spec = speculative(greedy.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                                          temperature=1.0, extra_headers={ARM: "asd"}))
        assert spec["verification"] == "exact" and spec["asd_fallback"] == "sampled"
    finally:
        serve.delete(GREEDY_APP)
        _kill_app_actors(GREEDY_APP)
