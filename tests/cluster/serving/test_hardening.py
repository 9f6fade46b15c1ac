"""Hostile and malformed input against the real served app: schemathesis over every route (no 5xx, every
answer as declared, nothing leaked), API keys, the body limit and request_timeout_s end to end.

Two apps on one Serve instance: the open tiny app at "/" (the fuzzer's), and a guarded one at "/guarded"
with an API key, a 4 KiB body limit and a 0.5 s request limit (a 128-token request takes ~1.5 s here)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from served_app import served_app
from tests.cluster.serving.test_http import tiny_config

pytestmark = pytest.mark.slow

APP, GUARDED = "tiny-fuzz", "tiny-guarded"
KEY, WRONG = "sk-guarded-51c0ffee", "sk-wrong-0badc0de"
FUZZ_EXAMPLES = 60  # per route and mode: ~250 cases, about a minute here


def decoder_stats(app: str) -> dict:
    from ray import serve

    from cluster.serving.app import DECODER_DEPLOYMENT

    return serve.get_deployment_handle(DECODER_DEPLOYMENT, app_name=app).stats.remote().result()


def wait_idle(app: str, timeout_s: float = 30.0) -> dict:
    """The app's unit once nothing runs: active requests, KV sequences and open ledgers."""
    deadline = time.time() + timeout_s
    while True:
        stats = decoder_stats(app)
        if not (stats["active_requests"] or stats["target_sequences"] or stats["open_ledgers"]):
            return stats
        if time.time() > deadline:
            return stats
        time.sleep(0.2)


@pytest.fixture(scope="module")
def servers(ray_cluster, tiny_llama_dir):
    from ray import serve

    from cluster.cli import _kill_app_actors
    from cluster.serving.app import build_app

    config = tiny_config(tiny_llama_dir)
    config.update(name=APP, audit={"fraction": 0.0})
    guarded = tiny_config(tiny_llama_dir)
    guarded.update(name=GUARDED, audit={"fraction": 0.0})
    guarded["serving"].update(api_keys=[KEY], request_timeout_s=0.5, max_body_bytes=4096)
    with served_app(config, APP) as url:
        serve.run(build_app({"config": guarded}), name=GUARDED, route_prefix="/guarded")
        try:
            yield url, f"{url}/guarded"
        finally:
            serve.delete(GUARDED)
            _kill_app_actors(GUARDED)


def test_fuzzing_every_route_finds_no_server_error_and_no_undeclared_answer(servers):
    from bench.fuzz import fuzz

    url, _ = servers
    report = fuzz(url, examples=FUZZ_EXAMPLES, settle=lambda: wait_idle(APP))
    summary = report.summary()
    assert report.cases >= 200 and report.server_errors == 0, json.dumps(summary, indent=1)  # a str: shown whole
    assert not report.failures, json.dumps(report.failures[:3], indent=1)
    assert any(key.endswith(" 200") for key in report.statuses if key.startswith("POST"))  # generation ran
    stats = wait_idle(APP)
    assert stats["active_requests"] == stats["target_sequences"] == stats["open_ledgers"] == [], stats


def test_the_sdk_learns_which_field_is_not_honoured(servers):
    """Neutral values (as SDKs and harnesses send them) are served; a field asking for what the server cannot
    do is a 400 naming it, through the OpenAI SDK as through any client (issue 24)."""
    import openai

    url, _ = servers
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    neutral = client.chat.completions.create(**chat, logprobs=False, frequency_penalty=0, n=1, tool_choice="none",
                                             extra_body={"logit_bias": None, "tools": []})
    assert neutral.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**chat, tools=[{"type": "function", "function": {"name": "f"}}])
    assert (info.value.param, info.value.code) == ("tools", "unsupported_parameter")


def test_api_keys_guard_the_api_but_not_health_or_metrics(servers):
    _, url = servers
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": KEY}):
        refused = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["error"]["code"] == "invalid_api_key" and WRONG not in refused.text
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=auth).status_code == 200
    assert httpx.get(f"{url}/healthz").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
    assert httpx.get(f"{url}/v1/specserve/export").status_code == 401
    assert httpx.get(f"{url}/v1/specserve/export", headers=auth).json()["schema"] == "specserve.export/v1"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    too_big = httpx.post(f"{url}/v1/completions", headers=auth,
                         json={"model": "tiny", "prompt": "x" * 5000, "max_tokens": 2})
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"


def test_keys_never_reach_the_logs(servers, ray_cluster):
    """Every log file of the Ray session (Serve's proxy, controller and replicas, the workers) after refused
    and accepted requests: neither the wrong key sent nor the configured one appears."""
    _, url = servers
    httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi"},
               headers={"Authorization": f"Bearer {WRONG}"})
    httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    time.sleep(2)  # log lines are flushed asynchronously
    from ray._private.worker import _global_node

    logs = Path(_global_node.get_session_dir_path()) / "logs"
    files = [p for p in logs.rglob("*") if p.is_file() and p.suffix in (".log", ".out", ".err", "")]
    assert any("serve" in str(p) for p in files)
    leaked = [str(p) for p in files if WRONG.encode() in p.read_bytes() or KEY.encode() in p.read_bytes()]
    assert not leaked, leaked


def test_request_timeout_ends_requests_cleanly_and_frees_them(servers):
    _, url = servers
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "count with me", "max_tokens": 128, "temperature": 0, "speculate": False}
    start = time.monotonic()
    late = httpx.post(f"{url}/v1/completions", json=body, headers={**auth, "x-specserve-arm": "asd"}, timeout=30)
    assert late.status_code == 408 and late.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < 5
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=auth,
                      timeout=30) as response:
        assert response.status_code == 200
        data = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
    assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == "request_timeout"
    # Serve's per-request timeout header cannot lift the limit
    lifted = httpx.post(f"{url}/v1/completions", json=body, headers={**auth, "x-request-timeout-seconds": "0"},
                        timeout=30)
    assert lifted.status_code == 408
    stats = wait_idle(GUARDED)
    assert stats["active_requests"] == stats["target_sequences"] == stats["open_ledgers"] == [], stats


def test_every_metric_the_dashboard_queries_is_exported(servers):
    """k8s/monitoring/grafana-dashboard.json against /metrics after one request per arm."""
    import re

    url, _ = servers
    for arm in ("exact", "asd"):
        response = httpx.post(f"{url}/v1/completions", headers={"x-specserve-arm": arm}, timeout=60,
                              json={"model": "tiny", "prompt": "a b a b a b a b", "max_tokens": 12, "temperature": 0})
        assert response.status_code == 200
    dashboard = json.loads((Path(__file__).parents[3] / "k8s" / "monitoring" / "grafana-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"(?:vllm:|specserve_)[A-Za-z0-9_:]*", target["expr"])}
    assert len(queried) >= 10
    deadline, missing = time.time() + 30, queried
    while missing and time.time() < deadline:  # units ship records to the hub in batches
        text = httpx.get(f"{url}/metrics").text
        missing = {name for name in queried if not re.search(rf"^{re.escape(name)}[{{ ]", text, re.M)}
        time.sleep(0.5)
    assert not missing, sorted(missing)
