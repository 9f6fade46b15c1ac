"""k8s/ manifests: rendered from configs/ (no drift), strictly valid against the KubeRay v1.7.0 CRD, and
shaped for GPUs (head without GPUs, TP-sized worker pods) or for a CPU-only trial."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from cluster.config import load_config, parse_config
from cluster.k8s.crd import (
    CRD_ENV,
    find_crd_dir,
    load_rayservice_schema,
    rayservice_errors,
    strict_errors,
    validate_rayservice,
)
from cluster.k8s.render import (
    REPO_ROOT,
    SERVE_DEPLOYMENTS,
    app_config,
    manifest_filename,
    render_config_file,
    render_to_file,
    shipped_manifests,
)

SHIPPED = shipped_manifests()
MANIFESTS = sorted((REPO_ROOT / "k8s").glob("*.yaml"))


@pytest.fixture(scope="module")
def schema():
    crd_dir = find_crd_dir()
    if crd_dir is None:
        pytest.skip(f"KubeRay CRDs not found: set {CRD_ENV} or place ray.io_rayservices.yaml in ../shared/kuberay/")
    return load_rayservice_schema(crd_dir)


def manifest(name: str) -> dict:
    return yaml.safe_load((REPO_ROOT / "k8s" / name).read_text())


def serve_app(doc: dict) -> dict:
    (app,) = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]
    return app


def test_required_manifests_are_shipped():
    names = {p.name for p in MANIFESTS}
    assert {"rayservice-cpu-local.yaml", "rayservice-gpu-llama3-8b-tp2.yaml"} <= names
    assert names == {p.name for p in SHIPPED.values()}, "every k8s/ manifest comes from a configs/ file"


@pytest.mark.parametrize("config_path", list(SHIPPED), ids=lambda p: p.name)
def test_shipped_manifest_matches_its_config(config_path):
    expected = SHIPPED[config_path]
    assert expected.is_file(), f"render it: specserve render-k8s configs/{config_path.name}"
    assert render_config_file(config_path) == expected.read_text(), (
        f"{expected.name} drifted from configs/{config_path.name}: re-render with `python -m cluster.k8s`"
    )


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_strictly_valid(path, schema):
    validate_rayservice(yaml.safe_load(path.read_text()), schema)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_serve_config_parses_into_the_config_schema(path):
    doc = yaml.safe_load(path.read_text())
    app = serve_app(doc)
    assert app["import_path"] == "cluster.serving.app:build_app" and app["route_prefix"] == "/"
    assert not {"arms", "audit"} & set(app["args"]["config"])  # the ingress's user_config holds them
    cfg = app_config(app)
    source = REPO_ROOT / doc["metadata"]["annotations"]["specserve/config"]
    assert cfg == load_config(source, check_engines=False).model_copy(
        update={"serving": load_config(source, check_engines=False).serving.model_copy(update={"host": "0.0.0.0"})}
    )
    ray_schema = pytest.importorskip("ray.serve.schema")
    ray_schema.ServeDeploySchema.model_validate(yaml.safe_load(doc["spec"]["serveConfigV2"]))


def test_gpu_manifest_shape():
    doc = manifest("rayservice-gpu-llama3-8b-tp2.yaml")
    cluster = doc["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert yaml.safe_load(doc["spec"]["serveConfigV2"])["proxy_location"] == "HeadOnly"
    assert cluster["enableInTreeAutoscaling"] is True and "autoscalerOptions" in cluster
    assert doc["spec"]["upgradeStrategy"]["type"] == "NewCluster"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"target", "drafter"}
    gpu_limit = {name: g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
                 for name, g in groups.items()}
    assert gpu_limit == {"target": 2, "drafter": 1}  # one TP = 2 unit per target pod
    # one pod per unit over Serve's 1..4 units, plus one for a rolling restart's surge replica
    assert all((g["minReplicas"], g["maxReplicas"]) == (1, 5) for g in groups.values())


def test_cpu_manifest_shape():
    doc = manifest("rayservice-cpu-local.yaml")
    cluster = doc["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    assert all("nvidia.com/gpu" not in p["template"]["spec"]["containers"][0]["resources"]["limits"] for p in pods)
    (unit,) = cluster["workerGroupSpecs"]
    assert (unit["minReplicas"], unit["maxReplicas"]) == (1, 3)
    assert parse_config(serve_app(doc)["args"]["config"]).target.source == "embedded:smollm2"


def test_misspelled_fields_fail_strict_validation(schema):
    good = manifest("rayservice-gpu-llama3-8b-tp2.yaml")
    validate_rayservice(good, schema)
    cases = {
        "spec.rayClusterConfig.enableInTreeAutoscalling": lambda d: d["spec"]["rayClusterConfig"].update(
            enableInTreeAutoscalling=d["spec"]["rayClusterConfig"].pop("enableInTreeAutoscaling")),
        "spec.rayClusterConfig.workerGroupSpecs[0].maxReplica": lambda d: d["spec"]["rayClusterConfig"][
            "workerGroupSpecs"][0].update(maxReplica=4),
        "spec.rayClusterConfig.headGroupSpec.template.spec.containers[0].imagePullPolicyy": lambda d: d["spec"][
            "rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(imagePullPolicyy="x"),
        "metadata.lables": lambda d: d["metadata"].update(lables={}),
        "spec.serveConfig": lambda d: d["spec"].update(serveConfig="x"),
    }
    for path, mutate in cases.items():
        bad = copy.deepcopy(good)
        mutate(bad)
        with pytest.raises(ValueError, match=re.escape(f"{path}: unknown field")):
            validate_rayservice(bad, schema)


def test_type_errors_fail_validation(schema):
    bad = manifest("rayservice-cpu-local.yaml")
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"] = "1"
    bad["spec"]["rayClusterConfig"]["autoscalerOptions"]["upscalingMode"] = "Eager"
    errors = rayservice_errors(bad, schema)
    assert any("minReplicas: '1' is not of type 'integer'" in e for e in errors)
    assert any("upscalingMode: 'Eager' is not one of" in e for e in errors)


def test_strict_walk_rules():
    schema = {
        "type": "object",
        "properties": {
            "quantity": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "metadata": {"type": "object"},
            "items": {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "string"}}}},
        },
    }
    ok = {"quantity": "4Gi", "labels": {"any": "x"}, "free": {"any": {"thing": 1}}, "metadata": {"name": "n"},
          "items": [{"a": "x"}]}
    assert strict_errors(ok, schema) == []
    assert strict_errors({"quantity": 2}, schema) == []
    assert strict_errors({"quantity": [2]}, schema) == ["quantity: must be an integer or a string"]
    assert strict_errors({"items": [{"a": "x"}, {"b": 1}]}, schema) == ["items[1].b: unknown field 'b'"]
    assert strict_errors({"metadata": {"nmae": "n"}}, schema) == ["metadata.nmae: unknown field 'nmae'"]


def test_render_to_file_and_names(tmp_path):
    out = render_to_file(REPO_ROOT / "configs" / "local.yaml", image="registry.example/specserve:dev",
                         out=tmp_path / "m.yaml")
    text = out.read_text()
    assert "image: registry.example/specserve:dev" in text and "configs/local.yaml" in text
    cfg = load_config(REPO_ROOT / "configs" / "local.yaml")
    assert manifest_filename(cfg, "configs/local.yaml") == "rayservice-cpu-local.yaml"
    assert manifest_filename(cfg, "cpu-small.yaml") == "rayservice-cpu-small.yaml"


def test_model_paths_outside_the_models_volume_are_refused(tmp_path):
    config = tmp_path / "gpu.yaml"
    config.write_text(yaml.safe_dump({
        "name": "x",
        "target": {"source": "/data/llama", "served_name": "l", "device": "cuda", "resources": {"num_gpus": 1}},
    }))
    with pytest.raises(ValueError, match="target.source '/data/llama' must be under /models/"):
        render_config_file(config)


def test_crd_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CRD_ENV, str(tmp_path))
    assert find_crd_dir() != tmp_path  # no CRD file there: falls back (or None)
    (tmp_path / "ray.io_rayservices.yaml").write_text("x: 1\n")
    assert find_crd_dir() == tmp_path
    with pytest.raises(ValueError, match="crd_dir"):
        load_rayservice_schema(Path(tmp_path) / "missing")


def test_surge_deployments_are_the_apps_deployments():
    app = pytest.importorskip("cluster.serving.app")
    assert set(SERVE_DEPLOYMENTS) == {app.DECODER_DEPLOYMENT, app.INGRESS_DEPLOYMENT}
    surge = serve_app(manifest("rayservice-cpu-local.yaml"))["deployments"]
    assert {d["name"]: d["max_surge_percent"] for d in surge} == {name: 1 for name in SERVE_DEPLOYMENTS}
