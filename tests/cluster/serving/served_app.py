"""Helpers of the serving tests: a free loopback port, one Serve app per test module, and request parsing as
FastAPI does it."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served_app(config: dict, app_name: str) -> Iterator[str]:
    """Serve `config` on a fresh Serve instance at a free port; yields the base URL. Serve is shut down after,
    so the next module's `serve.start` gets its own port (a running Serve ignores new http_options)."""
    from ray import serve

    from cluster.serving.app import build_app
    from cluster.cli import _kill_app_actors

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"config": config}), name=app_name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        _kill_app_actors(app_name)


@contextlib.contextmanager
def served_declaratively(config: dict, app_name: str) -> Iterator[str]:
    """As `served_app`, but deployed as KubeRay deploys it: `deploy_declaratively`."""
    from ray import serve

    from cluster.cli import _kill_app_actors

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        deploy_declaratively(config, app_name)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        _kill_app_actors(app_name)


def deploy_declaratively(config: dict, app_name: str, timeout_s: float = 240.0) -> float:
    """Deploy the application that `specserve render-k8s` writes into serveConfigV2 for `config` (its arms and
    audit as the ingress's user_config) through Serve's controller, which is what KubeRay's call to the dashboard's
    REST API reaches; wait until it runs again. Returns the wall time the controller took it at."""
    import time

    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from cluster.config import parse_config
    from cluster.k8s.render import serve_config

    applications = serve_config(parse_config(config))["applications"]
    assert [a["name"] for a in applications] == [app_name]
    taken = time.time()
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": applications}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        if app is not None and app.last_deployed_time_s >= taken - 1 and app.status == "RUNNING":
            return taken
        assert app is None or app.status not in ("DEPLOY_FAILED", "UNHEALTHY"), app.message
        time.sleep(0.5)
    raise TimeoutError(f"{app_name} did not run within {timeout_s} s: {serve.status().applications.get(app_name)}")


def decoder_stats(app_name: str) -> dict:
    """The app's decoder unit's leak-check state (`DecoderUnit.stats`)."""
    from ray import serve

    from cluster.serving.app import DECODER_DEPLOYMENT

    return serve.get_deployment_handle(DECODER_DEPLOYMENT, app_name=app_name).stats.remote().result()


def assert_timing(spec: dict, wall_s: float, *, engine: str) -> None:
    """`usage.speculative.timing_s` (actors.timing): every hop, non-negative, within the client's wall time;
    on vLLM the hops its engine keeps inside (queue, prefill, the rounds' parts) are None."""
    from actors.timing import HOPS, ROUND_PARTS

    timing = spec["timing_s"]
    assert list(timing) == list(HOPS), timing
    unmeasured = {"queue", "prefill", *ROUND_PARTS} if engine == "vllm" else set()
    assert {hop for hop, v in timing.items() if v is None} == unmeasured, timing
    assert all(v >= 0 for v in timing.values() if v is not None), timing
    assert sum(v for v in timing.values() if v is not None) <= wall_s, (timing, wall_s)
    assert timing["first_token"] is not None and timing["decode"] is not None
    if engine == "native":
        assert timing["prefill"] > 0 and timing["score"] > 0


def parse_request(model, payload):
    """What FastAPI does with a body: validate it, and map pydantic's errors to the API error."""
    from pydantic import ValidationError

    from cluster.serving.errors import APIError, validation_error

    if not isinstance(payload, dict):
        raise APIError("request body must be a JSON object", code="invalid_request")
    try:
        return model.model_validate(payload)
    except ValidationError as err:
        raise validation_error(err.errors(include_url=False)) from None
