"""The served app end to end: a real Serve app on a local Ray cluster, a tiny random Llama, the real `openai`
client (sync and streaming) and raw HTTP for bad input. One Ray + Serve session for the whole module."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from openai_checks import check_json_schema, check_logprobs, check_rules
from served_app import assert_timing, decoder_stats, served_app

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

MODEL = "tiny"
APP = "tiny-http"
ARM = "x-specserve-arm"


def tiny_config(model_dir) -> dict:
    """A config for the tiny random Llama: small limits so queues, context and backpressure are testable."""
    return {
        "name": APP,
        "target": {
            "source": str(model_dir),
            "served_name": MODEL,
            "max_seq_len": 256,
            "max_batch_size": 8,
            "resources": {"num_cpus": 0.25},
            "placement_strategy": "PACK",
        },
        "drafter": {"kind": "ngram", "resources": {"num_cpus": 0}},
        "arms": [
            {"name": "exact", "verification": "exact", "weight": 1},
            {"name": "asd", "verification": "asd", "asd": {"g": 2.0, "max_relaxed_per_block": 2, "budget": 8.0},
             "weight": 1},
        ],
        "serving": {"max_ongoing_requests": 4, "max_queued_requests": 4, "max_tokens_limit": 128,
                    "default_max_tokens": 16, "stream_interval_ms": 20},  # this module's streams are batched
        "unit": {"num_cpus": 0.25, "torch_threads": 1},
        "autoscaling": {"enabled": False, "min_replicas": 1, "max_replicas": 1},
        "audit": {"fraction": 1.0, "reference_arm": "exact", "max_pending": 4},
    }


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_llama_dir):
    with served_app(tiny_config(tiny_llama_dir), APP) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def _decoder_stats() -> dict:
    return decoder_stats(APP)


def _wait_idle(timeout_s: float = 20.0) -> dict:
    deadline = time.time() + timeout_s
    while True:
        stats = _decoder_stats()
        if (not stats["active_requests"] and not stats["open_ledgers"]) or time.time() > deadline:
            return stats
        time.sleep(0.2)


def test_health_and_models(server, client):
    assert httpx.get(f"{server}/healthz").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_with_speculative_usage(client):
    start = time.perf_counter()
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="one two three one two three one two", max_tokens=12, temperature=0,
        extra_headers={ARM: "exact"},
    )
    wall = time.perf_counter() - start
    assert raw.headers[ARM] == "exact"
    completion = raw.parse()
    choice = completion.choices[0]
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.text, str)
    usage = completion.usage
    assert 0 < usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.model_extra["speculative"]
    for key in ("arm", "rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length",
                "gamma_min", "gamma_mean", "gamma_max"):
        assert key in spec
    assert spec["arm"] == "exact" and "regret_spent" not in spec
    assert_timing(spec, wall, engine="native")
    again = client.completions.create(model=MODEL, prompt="one two three one two three one two", max_tokens=12,
                                      temperature=0, extra_headers={ARM: "exact"})
    assert again.choices[0].text == choice.text  # greedy is deterministic


def test_asd_arm_reports_regret(client):
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="a b c a b c a b", max_tokens=10, temperature=0, extra_headers={ARM: "asd"}
    )
    assert raw.headers[ARM] == "asd"
    spec = raw.parse().usage.model_extra["speculative"]
    assert spec["arm"] == "asd"
    assert {"regret_spent", "regret_budget", "relaxed_tokens"} <= set(spec)
    assert spec["regret_spent"] <= spec["regret_budget"] == 8.0


def test_chat_streaming_matches_non_streaming(client):
    messages = [{"role": "user", "content": "Say something."}]
    start = time.perf_counter()
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                           extra_headers={ARM: "exact"})
    assert_timing(whole.usage.model_extra["speculative"], time.perf_counter() - start, engine="native")
    start = time.perf_counter()
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={ARM: "exact"},
    ))
    wall = time.perf_counter() - start
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.model_extra["speculative"]["arm"] == "exact"
    assert_timing(usage.model_extra["speculative"], wall, engine="native")


def test_completion_streaming_and_sampling(client):
    stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, temperature=0.8, top_p=0.9,
                                       seed=7, stream=True, extra_body={"top_k": 20})
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.usage is None for c in chunks)  # no usage chunk unless include_usage


def test_stop_string_truncates(client):
    prompt = "the cat sat on the mat and the cat sat"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_headers={ARM: "exact"}).choices[0].text
    stop = next((full[i : i + 3] for i in range(4, len(full) - 3) if full[i : i + 3].strip()), None)
    if stop is None:
        pytest.skip(f"greedy output too short for a stop string: {full!r}")
    for stream in (False, True):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                             stop=[stop], stream=stream, extra_headers={ARM: "exact"})
        if stream:
            chunks = list(response)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = response.choices[0].text, response.choices[0].finish_reason
        assert text == full[: full.index(stop)] and reason == "stop"
    assert _wait_idle()["active_requests"] == []



def test_stop_token_ids_end_the_output_before_them(client, smollm2_tokenizer):
    prompt = "the cat sat on the mat and the cat sat"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_headers={ARM: "exact"}).choices[0].text
    ids = smollm2_tokenizer.encode(first, add_special_tokens=False)
    if len(ids) != 1 or smollm2_tokenizer.decode(ids) != first:
        pytest.skip(f"the first greedy token's text {first!r} does not map back to one id")
    for stream in (False, True):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                             stream=stream, extra_body={"stop_token_ids": ids, "ignore_eos": True},
                                             extra_headers={ARM: "exact"})
        if stream:
            chunks = list(response)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = response.choices[0].text, response.choices[0].finish_reason
        assert (text, reason) == ("", "stop")
    assert _wait_idle()["active_requests"] == []

BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [5] * 300}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": [5] * 200, "max_tokens": 100}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 129}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"], "n": 65}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 5}, 400, "n"),  # more than a unit runs at once (4)
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b", "c", "d", "e"]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "repetition_penalty": 1e-300}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"49152": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "min_tokens": 9, "max_tokens": 8}, 400, "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": 5}}}},
     400, "response_format.json_schema.schema"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop_token_ids": [49152]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", ["not", "an", "object"], 400, None),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 3}]}, 400,
     "messages.0.content"),
]


@pytest.mark.parametrize("path, payload, status, param", BAD_REQUESTS)
def test_bad_input_is_a_4xx_with_an_openai_error(server, path, payload, status, param):
    if isinstance(payload, bytes):
        response = httpx.post(f"{server}{path}", content=payload, headers={"content-type": "application/json"})
    else:
        response = httpx.post(f"{server}{path}", json=payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_unknown_arm_and_route(server):
    response = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                          headers={ARM: "nope"})
    assert response.status_code == 400 and response.json()["error"]["param"] == ARM
    response = httpx.get(f"{server}/v1/nothing-here")
    assert response.status_code == 404 and "error" in response.json()


def test_disconnect_mid_stream_frees_the_sequence(server):
    body = {"model": MODEL, "prompt": "count: 1 2 3 4", "max_tokens": 120, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body, headers={ARM: "asd"}) as response:
            assert response.status_code == 200 and response.headers[ARM] == "asd"
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert json.loads(first[5:])["choices"]
            stats = _decoder_stats()
            assert stats["active_requests"]  # still decoding when the client goes away
    stats = _wait_idle()
    assert stats["active_requests"] == [] and stats["open_ledgers"] == []


def test_concurrent_requests_share_a_unit_and_overflow_gets_503(server):
    async def one(http, max_tokens):
        return await http.post(f"{server}/v1/completions", json={
            "model": MODEL, "prompt": "x y z", "max_tokens": max_tokens, "temperature": 0,
        }, headers={ARM: "exact"})

    async def burst(n, max_tokens):
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(one(http, max_tokens) for _ in range(n)))

    ok = asyncio.run(burst(4, 16))  # fits max_ongoing_requests: batched together
    assert [r.status_code for r in ok] == [200] * 4
    responses = asyncio.run(burst(24, 120))  # 4 ongoing + 4 queued per unit: the rest is refused
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 503} and codes.count(200) >= 4 and 503 in codes, codes
    refused = next(r for r in responses if r.status_code == 503)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "server_overloaded"
    assert _wait_idle()["active_requests"] == []


def test_metrics_export_and_audit(server, client):
    client.completions.create(model=MODEL, prompt="audit me audit me", max_tokens=8, temperature=0,
                              extra_headers={ARM: "asd"})
    deadline, export = time.time() + 30, {}
    while time.time() < deadline:
        export = httpx.get(f"{server}/v1/specserve/export").json()
        if export.get("audits") and export.get("requests"):
            break
        time.sleep(0.5)
    assert export["requests"] and export["audits"], export.keys()
    audit = export["audits"][-1]
    assert audit["arm"] == "asd" and audit["reference_arm"] == "exact"
    metrics = httpx.get(f"{server}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "vllm:spec_decode_num_draft_tokens_total" in metrics.text
    assert 'arm="asd"' in metrics.text


def test_status_command_lists_the_app(server, ray_cluster):
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "status"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Ray: up" in out.stdout and f"app {APP}" in out.stdout and "DecoderUnit" in out.stdout


def test_default_local_config_serves_smollm2(server):
    """configs/local.yaml as shipped (embedded SmolLM2-135M, n-gram drafter, exact + asd), as a second app."""
    from ray import serve

    from cluster.serving.app import build_app
    from cluster.cli import _kill_app_actors
    from cluster.config import load_config

    config = load_config("configs/local.yaml")
    serve.run(build_app({"config": "configs/local.yaml"}), name=config.name, route_prefix="/local")
    try:
        local = openai.OpenAI(base_url=f"{server}/local/v1", api_key="unused", max_retries=0, timeout=120)
        chat = local.chat.completions.create(
            model=config.target.served_name, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16, temperature=0, extra_headers={ARM: "exact"},
        )
        assert "Paris" in chat.choices[0].message.content
        spec = chat.usage.model_extra["speculative"]
        assert spec["arm"] == "exact" and spec["rounds"] > 0
    finally:
        serve.delete(config.name)
        _kill_app_actors(config.name)


def test_n_choices_and_prompt_lists_with_echo(client):
    """n choices per prompt, numbered prompt-major; greedy choices equal the one-choice answer; a seeded choice j
    equals a one-choice request with seed + j; usage counts each prompt once and every choice's tokens."""
    one = client.completions.create(model=MODEL, prompt="one two three", max_tokens=6, temperature=0,
                                    extra_headers={ARM: "exact"})
    many = client.completions.create(model=MODEL, prompt=["one two three", "four five"], n=2, max_tokens=6,
                                     temperature=0, extra_headers={ARM: "exact"})
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == one.choices[0].text
    second = client.completions.create(model=MODEL, prompt="four five", max_tokens=6, temperature=0,
                                       extra_headers={ARM: "exact"})
    assert many.choices[2].text == many.choices[3].text == second.choices[0].text
    assert many.usage.prompt_tokens == one.usage.prompt_tokens + second.usage.prompt_tokens
    assert many.usage.completion_tokens == 2 * (one.usage.completion_tokens + second.usage.completion_tokens)
    spec = many.usage.model_extra["speculative"]
    assert len(spec["choices"]) == 4 and spec["rounds"] == sum(c["rounds"] for c in spec["choices"])

    seeded = client.completions.create(model=MODEL, prompt="hello", n=2, max_tokens=8, temperature=1.0, seed=11)
    for j in range(2):
        alone = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, temperature=1.0, seed=11 + j)
        assert seeded.choices[j].text == alone.choices[0].text

    echoed = client.completions.create(model=MODEL, prompt="one two three", max_tokens=6, temperature=0, echo=True,
                                       extra_headers={ARM: "exact"})
    assert echoed.choices[0].text == "one two three" + one.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="one two three", max_tokens=6, temperature=0,
                                            echo=True, stream=True, extra_headers={ARM: "exact"}))
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_streamed_choices_interleave_and_each_ends_once(client):
    messages = [{"role": "user", "content": "Count."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=10, temperature=0,
                                           extra_headers={ARM: "exact"})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_headers={ARM: "exact"}))
    for index in range(3):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[index].message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [whole.choices[index].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert _wait_idle()["active_requests"] == []


def test_logprobs_rules_and_json_schema_under_speculation_equal_target_only(client, smollm2_tokenizer):
    check_logprobs(client, MODEL, {ARM: "exact"}, smollm2_tokenizer, tol=1e-4)
    check_rules(client, MODEL, {ARM: "exact"}, smollm2_tokenizer)
    check_json_schema(client, MODEL, {ARM: "exact"}, greedy=3, sampled=4)
    assert _wait_idle()["active_requests"] == []
