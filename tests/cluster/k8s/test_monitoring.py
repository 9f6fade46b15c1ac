"""k8s/monitoring: a PodMonitor per shipped RayService (no drift, the fields of monitoring.coreos.com/v1 we use,
aimed at the head pod's serve port), the API keys' Secret mounted on every pod, and the Grafana dashboard."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml

from cluster.config import load_config
from cluster.k8s.crd import strict_errors
from cluster.k8s.monitoring import render_podmonitor, render_podmonitor_file, shipped_podmonitors
from cluster.k8s.render import REPO_ROOT, render_rayservice, shipped_manifests
from cluster.observability.metrics import METRICS
from cluster.serving.guard import API_KEYS_FILE_ENV

MONITORS = shipped_podmonitors()
DASHBOARD = REPO_ROOT / "k8s" / "monitoring" / "grafana-dashboard.json"
_STRING = {"type": "string"}
_SECRET_KEY = {"type": "object", "required": ["key"], "properties": {"name": _STRING, "key": _STRING}}
# The part of the Prometheus Operator's PodMonitor CRD (monitoring.coreos.com/v1) that we render.
PODMONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["selector", "podMetricsEndpoints"], "properties": {
            "selector": {"type": "object", "properties": {
                "matchLabels": {"type": "object", "additionalProperties": _STRING}}},
            "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
                "port": _STRING, "path": {"type": "string", "pattern": "^/"},
                "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)(y|w|d|h|m|s|ms))+)$"},
                "authorization": {"type": "object", "properties": {"type": _STRING, "credentials": _SECRET_KEY}},
            }}},
        }},
    },
}


def test_every_config_has_its_podmonitor_and_nothing_else_is_there():
    assert set(MONITORS) == set(shipped_manifests())
    shipped = {p for p in (REPO_ROOT / "k8s" / "monitoring").iterdir()}
    assert shipped == set(MONITORS.values()) | {DASHBOARD}


@pytest.mark.parametrize("config_path", list(MONITORS), ids=lambda p: p.name)
def test_podmonitor_matches_its_config_and_scrapes_the_head(config_path):
    path = MONITORS[config_path]
    assert render_podmonitor_file(config_path) == path.read_text(), "re-render with `python -m cluster.k8s`"
    monitor = yaml.safe_load(path.read_text())
    jsonschema.validate(monitor, PODMONITOR)
    assert strict_errors(monitor, PODMONITOR) == []
    service = yaml.safe_load(shipped_manifests()[config_path].read_text())
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    selector = dict(monitor["spec"]["selector"]["matchLabels"])
    assert selector.pop("ray.io/node-type") == "head"  # KubeRay's label on the head pod
    assert selector.items() <= head["metadata"]["labels"].items()
    ports = {p["name"] for p in head["spec"]["containers"][0]["ports"]}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports


def test_protected_metrics_send_a_key_from_the_secret():
    cfg = load_config(REPO_ROOT / "configs" / "local.yaml")
    serving = cfg.serving.model_copy(update={"protect_metrics": True})
    (endpoint,) = render_podmonitor(cfg.model_copy(update={"serving": serving}))["spec"]["podMetricsEndpoints"]
    assert endpoint["authorization"] == {"type": "Bearer",
                                         "credentials": {"name": "specserve-api-keys", "key": "metrics-key"}}
    jsonschema.validate({"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "x"},
                         "spec": {"selector": {}, "podMetricsEndpoints": [endpoint]}}, PODMONITOR)
    no_secret = serving.model_copy(update={"api_keys_secret": None})
    with pytest.raises(ValueError, match="api_keys_secret"):
        render_podmonitor(cfg.model_copy(update={"serving": no_secret}))


@pytest.mark.parametrize("config_path", list(MONITORS), ids=lambda p: p.name)
def test_every_pod_reads_the_keys_from_the_secret(config_path):
    cfg = load_config(config_path, check_engines=False)
    service = yaml.safe_load(shipped_manifests()[config_path].read_text())
    cluster = service["spec"]["rayClusterConfig"]
    for pod in [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]:
        spec = pod["template"]["spec"]
        (container,) = spec["containers"]
        (env,) = [e for e in container["env"] if e["name"] == API_KEYS_FILE_ENV]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "api-keys"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "api-keys"]
        assert env["value"].startswith(mount["mountPath"] + "/") and mount["readOnly"]
        assert volume["secret"]["secretName"] == cfg.serving.api_keys_secret
        assert not volume["secret"].get("optional")  # no Secret: the pod waits instead of serving unguarded


def test_keys_in_the_config_are_never_rendered():
    cfg = load_config(REPO_ROOT / "configs" / "local.yaml")
    inline = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"api_keys": ["sk-secret"]})})
    with pytest.raises(ValueError, match="api_keys"):
        render_rayservice(inline, None, "img")


def test_dashboard_panels_query_known_metrics():
    """Offline half of the dashboard check (the live half, against /metrics, is in tests/cluster/serving)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exported = {s.name for s in METRICS}
    names = set()
    for panel in dashboard["panels"]:
        assert panel["title"] and panel["targets"] and panel["datasource"]["type"] == "prometheus"
        for target in panel["targets"]:
            names |= set(re.findall(r"(?:vllm:|specserve_)[A-Za-z0-9_:]*", target["expr"]))
    bases = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in names}
    assert bases <= exported, bases - exported
    wanted = {"vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens", "specserve_gamma",
              "specserve_regret_spent", "specserve_ledger_exhaustions", "vllm:time_to_first_token_seconds",
              "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
              "specserve_degraded_requests", "specserve_round_phase_seconds"}
    assert wanted <= bases, wanted - bases
