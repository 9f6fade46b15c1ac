"""The served app on the vLLM engine (configs/local-vllm.yaml, eager and with a small KV cache), end to end: a real
Serve app on the session's Ray cluster, the real `openai` client, both arms, streaming, bad input, and a client
that disconnects mid-stream (vLLM's KV blocks return, read from its block pool). One engine for the module."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import yaml
from openai_checks import check_json_schema, check_logprobs, check_rules
from served_app import assert_timing, decoder_stats, served_app

from tests.vllm_support import require_vllm_or_skip

require_vllm_or_skip()

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

APP = "vllm-http"
ARM = "x-specserve-arm"
MODEL = "smollm2-135m-instruct"


def vllm_config() -> dict:
    config = yaml.safe_load(Path("configs/local-vllm.yaml").read_text())
    config["name"] = APP
    config["target"]["engine_kwargs"] = {"enforce_eager": True, "kv_cache_memory_bytes": 512 << 20}
    config["target"]["max_batch_size"] = 4
    config["target"]["resources"] = {"num_cpus": 0.25}
    config["serving"].update(max_ongoing_requests=4, max_queued_requests=4, max_tokens_limit=256,
                             default_max_tokens=32)
    config["unit"] = {"num_cpus": 0.25, "torch_threads": 1}
    return config


@pytest.fixture(scope="module")
def server(ray_cluster):
    with served_app(vllm_config(), APP) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _decoder_stats() -> dict:
    return decoder_stats(APP)


def _wait_idle(idle_free: int, timeout_s: float = 30.0) -> dict:
    deadline = time.time() + timeout_s
    while True:
        stats = _decoder_stats()
        settled = (not stats["active_requests"] and not stats["open_ledgers"] and not stats["target_sequences"]
                   and stats["kv"]["free_blocks"] == idle_free)
        if settled or time.time() > deadline:
            return stats
        time.sleep(0.2)


def test_both_arms_greedy_with_speculative_usage(client):
    messages = [{"role": "user", "content": "Repeat exactly: red, green, blue, red, green, blue, red, green."}]
    outs = {}
    for arm in ("exact", "asd"):
        start = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=40, temperature=0, extra_headers={ARM: arm})
        assert_timing(raw.parse().usage.model_extra["speculative"], time.perf_counter() - start, engine="vllm")
        assert raw.headers[ARM] == arm
        outs[arm] = raw.parse()
        spec = outs[arm].usage.model_extra["speculative"]
        assert spec["arm"] == arm and spec["verification"] == arm and spec["rounds"] > 0
        assert outs[arm].usage.completion_tokens > 0
    asd = outs["asd"].usage.model_extra["speculative"]
    assert 0.0 <= asd["regret_spent"] <= asd["regret_budget"] == 2.0  # configs/local-vllm.yaml's arm
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                           extra_headers={ARM: "exact"})
    assert again.choices[0].message.content == outs["exact"].choices[0].message.content  # greedy is deterministic


def test_streaming_matches_non_streaming(client):
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                           extra_headers={ARM: "exact"})
    start = time.perf_counter()
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=48, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={ARM: "exact"}))
    wall = time.perf_counter() - start
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.model_extra["speculative"]["arm"] == "exact"
    assert_timing(usage.model_extra["speculative"], wall, engine="vllm")


def test_bad_input_gets_a_4xx_with_an_openai_error_body(server):
    cases = [
        ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"model": "nope", "prompt": "hi"}, 404, "model"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 10_000}, 400, "max_tokens"),
    ]
    for body, status, param in cases:
        response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"] and param in (error.get("param") or error["message"])


def test_a_disconnect_mid_stream_frees_vllms_kv_blocks(server, client):
    idle = _decoder_stats()["kv"]["free_blocks"]  # nothing running: vLLM's idle count (its null block is never free)
    body = {"model": MODEL, "prompt": "Count from one to two hundred: one, two, three,", "max_tokens": 250,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body, headers={ARM: "asd"}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert json.loads(next(line for line in lines if line.startswith("data:"))[5:])["choices"]
            busy = _decoder_stats()
            assert busy["active_requests"] and busy["kv"]["free_blocks"] < idle  # holding blocks mid-stream
    stats = _wait_idle(idle)
    assert stats["active_requests"] == [] and stats["kv"]["free_blocks"] == idle
    assert stats["kv"]["running"] == stats["kv"]["waiting"] == 0
    assert stats["open_ledgers"] == [] and stats["target_sequences"] == []


def test_logprobs_rules_and_json_schema_under_speculation_equal_target_only(client):
    from actors.sources import load_tokenizer

    tokenizer = load_tokenizer("embedded:smollm2")
    check_logprobs(client, MODEL, {ARM: "exact"}, tokenizer, tol=1e-4)
    check_rules(client, MODEL, {ARM: "exact"}, tokenizer)
    check_json_schema(client, MODEL, {ARM: "exact"}, greedy=4, sampled=4)
