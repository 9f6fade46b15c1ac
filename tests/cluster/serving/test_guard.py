"""The ingress's gate without Ray: API keys (config and key file), 401/413 bodies, what stays open, that a key
never reaches the log, and the OpenAPI document's declarations."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI, Request
from starlette.testclient import TestClient

from cluster.config import parse_config
from cluster.serving.guard import API_KEYS_FILE_ENV, GuardPolicy, RequestGuard, configured_keys

KEY = "sk-test-4f1d2c"


def settings(**serving):
    return parse_config({"name": "g", "target": {"source": "x", "served_name": "m"}, "serving": serving}).serving


def client(policy: GuardPolicy | None) -> TestClient:
    app = FastAPI()
    app.add_middleware(RequestGuard)
    if policy is not None:
        app.state.guard = policy

    @app.post("/v1/completions")
    async def completions(request: Request):
        return {"bytes": len(await request.body())}

    for path in ("/healthz", "/metrics", "/v1/specserve/export", "/v1/models"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET"])
    return TestClient(app)


def test_keys_come_from_the_config_and_the_key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# rotated 2025-01\nsk-file-1\n\n  sk-file-2  \n")
    assert configured_keys(["sk-yaml"], {API_KEYS_FILE_ENV: str(path)}) == ["sk-yaml", "sk-file-1", "sk-file-2"]
    assert configured_keys([], {}) == []
    with pytest.raises(ValueError, match=API_KEYS_FILE_ENV):
        configured_keys([], {API_KEYS_FILE_ENV: str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        configured_keys([], {API_KEYS_FILE_ENV: str(tmp_path / "empty")})
    policy = GuardPolicy.from_settings(settings(api_keys=["sk-yaml"]), {API_KEYS_FILE_ENV: str(path)})
    assert policy.auth and len(policy.digests) == 3 and "sk-" not in repr(policy)


def test_bearer_keys_are_checked():
    policy = GuardPolicy.from_settings(settings(api_keys=[KEY, "sk-other"]), {})
    assert policy.accepts(f"Bearer {KEY}".encode()) and policy.accepts(b"bearer sk-other")
    for header in (None, b"", KEY.encode(), f"Basic {KEY}".encode(), f"Bearer {KEY}x".encode(), b"Bearer "):
        assert not policy.accepts(header)
    assert not GuardPolicy().accepts(f"Bearer {KEY}".encode())


def test_missing_or_wrong_key_is_a_401_and_never_logged(caplog):
    http = client(GuardPolicy.from_settings(settings(api_keys=[KEY]), {}))
    caplog.set_level(logging.DEBUG)
    wrong = "sk-wrong-9a8b7c"
    for headers in ({}, {"Authorization": f"Bearer {wrong}"}):
        response = http.post("/v1/completions", json={"prompt": "x"}, headers=headers)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
        assert wrong not in response.text
    assert wrong not in caplog.text and KEY not in caplog.text and "refused" in caplog.text
    ok = http.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200


@pytest.mark.parametrize("metrics, export", [(False, True), (True, False)])
def test_open_and_protected_paths(metrics, export):
    http = client(GuardPolicy.from_settings(settings(api_keys=[KEY], protect_metrics=metrics,
                                                     protect_export=export), {}))
    assert http.get("/healthz").status_code == 200
    assert http.get("/v1/models").status_code == 401
    assert http.get("/metrics").status_code == (401 if metrics else 200)
    assert http.get("/v1/specserve/export").status_code == (401 if export else 200)
    open_service = client(GuardPolicy.from_settings(settings(), {}))
    assert all(open_service.get(p).status_code == 200 for p in ("/v1/models", "/metrics", "/v1/specserve/export"))
    assert client(None).get("/v1/models").status_code == 200  # before the ingress set its policy


def test_bodies_over_the_limit_get_413():
    http = client(GuardPolicy.from_settings(settings(max_body_bytes=2048), {}))
    assert http.post("/v1/completions", content=b"x" * 2048).json() == {"bytes": 2048}
    response = http.post("/v1/completions", content=b"x" * 2049)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it streams in
        for _ in range(10):
            yield b"y" * 1000

    response = http.post("/v1/completions", content=chunks())
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"


def test_openapi_declares_every_answer():
    from cluster.serving import openapi
    from cluster.serving.ingress import app

    app.openapi_schema = None
    doc = openapi.specserve_openapi(app.openapi(), served_name="m", arms=["exact", "asd"], max_tokens_limit=64,
                                    auth=True, protect_metrics=False, protect_export=True)
    paths = doc["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        post = paths[path]["post"]
        assert set(post["responses"]) == {"200", "400", "401", "404", "408", "413", "503"}
        assert set(post["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert post["security"] == [{"bearer": []}]
        assert post["parameters"][0]["schema"]["pattern"] == r"^\s*(?:exact|asd)?\s*$"
    assert "security" not in paths["/healthz"]["get"] and "security" not in paths["/metrics"]["get"]
    assert paths["/v1/specserve/export"]["get"]["security"] == [{"bearer": []}]
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["model"]["enum"] == ["m"]
    assert {"type": "integer", "minimum": 1, "maximum": 64} in completion["max_tokens"]["anyOf"]
    schemas = doc["components"]["schemas"]  # strict, and refused fields only at their neutral values
    chat = schemas["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False and schemas["CompletionRequest"]["additionalProperties"] is False
    assert chat["properties"]["tools"]["anyOf"] == [{"type": "null"}, {"const": []}]  # refused: neutral only
    assert chat["properties"]["logprobs"]["anyOf"] == [{"type": "boolean"}, {"type": "null"}]  # honoured
    assert {"type": "number", "minimum": -2.0, "maximum": 2.0} in completion["frequency_penalty"]["anyOf"]
    assert all("422" not in op["responses"] for item in paths.values() for op in item.values())
    app.openapi_schema = None
