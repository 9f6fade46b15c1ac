"""KubeRay RayService manifests rendered from a specserve config.

`render_rayservice(cfg, ...)` turns a `SpecServeConfig` into a RayService (ray.io/v1) whose `serveConfigV2`
deploys `cluster.serving.app:build_app` with the config inline (its arms and audit as the ingress's
`user_config`), so k8s/ can never drift from configs/: a head pod with no GPUs, one worker group per kind of pod a
unit needs, replicas spanning the Serve autoscaling range plus a surge pod, and the API keys' Secret mounted on
every pod (keys written in the config itself are refused). What a manifest holds and why: docs/kubernetes.md.
`cluster.k8s.crd` validates the result against KubeRay's CRD; `cluster.k8s.monitoring` renders the PodMonitor.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import yaml

from cluster.config import SpecServeConfig, dump_config, load_config, parse_config
from cluster.serving.ab import INGRESS_SETTINGS, ingress_user_config, with_ingress_settings

REPO_ROOT = Path(__file__).resolve().parents[2]
RAY_VERSION = "2.60.0"
SPECSERVE_VERSION = "0.1.0"
DEFAULT_IMAGES = {"cpu": f"specserve:{SPECSERVE_VERSION}-cpu", "gpu": f"specserve:{SPECSERVE_VERSION}-gpu"}
APP_IMPORT_PATH = "cluster.serving.app:build_app"
# cluster.serving.app's deployment names (a test keeps them equal): their rolling restarts surge by one replica, so a
# changed serveConfigV2 (new arm weights) starts each replacement before its old replica stops. Serve rounds
# any positive percentage up to one whole replica; worker groups allow one pod more than max_replicas for it.
SERVE_DEPLOYMENTS = ("OpenAIIngress", "DecoderUnit")
MAX_SURGE_PERCENT = 1
SURGE_PODS = 1
MODELS_DIR = "/models"  # absolute model sources must live here: the models volume is mounted at it
MODELS_CLAIM = "specserve-models"
KEYS_DIR, KEYS_ENTRY = "/etc/specserve/keys", "api-keys"  # the Secret's mount and the entry holding the keys
DEFAULT_ACTOR_MEMORY_GB = 4.0  # host memory assumed for an actor whose resources.memory_gb is unset
POD_OVERHEAD_GB = 2.0  # raylet, object store and Python beside the actors


# --------------------------------------------------------------------------------------------- rendering


def is_gpu(cfg: SpecServeConfig) -> bool:
    """Whether any actor of the deployment runs on CUDA."""
    return cfg.target.device == "cuda" or cfg.drafter.device == "cuda"


def service_name(cfg: SpecServeConfig) -> str:
    """The RayService's name (and its pods' `app.kubernetes.io/instance` label)."""
    return _dns_name(cfg.name if cfg.name.lower().startswith("specserve") else f"specserve-{cfg.name}")


def manifest_filename(cfg: SpecServeConfig, config_path: str | Path) -> str:
    """`rayservice-{cpu|gpu}-{config stem}.yaml`, without repeating a leading `cpu-`/`gpu-` in the stem."""
    kind = "gpu" if is_gpu(cfg) else "cpu"
    stem = Path(config_path).stem
    return f"rayservice-{stem}.yaml" if stem.startswith(f"{kind}-") else f"rayservice-{kind}-{stem}.yaml"


def render_rayservice(cfg: SpecServeConfig, config_path_in_image: str | None, image: str) -> dict[str, Any]:
    """The RayService for `cfg` as a dict; `config_path_in_image` names the source config (an annotation)."""
    _check_model_paths(cfg)
    if cfg.serving.api_keys:
        raise ValueError("serving.api_keys would be written into the manifest in clear: put the keys in a Secret "
                         "and name it in serving.api_keys_secret")
    name = service_name(cfg)
    labels = {"app.kubernetes.io/name": "specserve", "app.kubernetes.io/instance": name}
    annotations = {"specserve/version": SPECSERVE_VERSION}
    if config_path_in_image:
        annotations["specserve/config"] = config_path_in_image
    idle_timeout = max(60, math.ceil(cfg.autoscaling.downscale_delay_s))
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {
            # Changing the Ray cluster spec (image, pods) brings up a new cluster and switches traffic once it
            # serves; changing only serveConfigV2 (arm weights, γ, limits) updates Serve in place.
            "upgradeStrategy": {"type": "NewCluster"},
            "serveConfigV2": _LiteralStr(yaml.safe_dump(serve_config(cfg), sort_keys=False, width=120)),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {
                    "upscalingMode": "Default",
                    "idleTimeoutSeconds": idle_timeout,
                    "resources": _resources(cpu="500m", memory="512Mi"),
                },
                "headGroupSpec": _head_group(cfg, image, labels),
                "workerGroupSpecs": _worker_groups(cfg, image, labels),
            },
        },
    }


def serve_config(cfg: SpecServeConfig) -> dict[str, Any]:
    """The Serve config (serveConfigV2): one application built from the config, which travels inline, except
    the arms and the audit: those are the ingress deployment's `user_config`, so that changing them updates the
    running ingress in place and restarts no unit (the application's arguments, which version every
    deployment, stay the same)."""
    inline = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"host": "0.0.0.0"})})
    args = {key: value for key, value in dump_config(inline).items() if key not in INGRESS_SETTINGS}
    deployments = [{"name": name, "max_surge_percent": MAX_SURGE_PERCENT} for name in SERVE_DEPLOYMENTS]
    deployments[SERVE_DEPLOYMENTS.index("OpenAIIngress")]["user_config"] = ingress_user_config(cfg)
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "0.0.0.0", "port": cfg.serving.port,
                         "request_timeout_s": cfg.serving.request_timeout_s},
        "applications": [
            {
                "name": cfg.name,
                "import_path": APP_IMPORT_PATH,
                "route_prefix": "/",
                "args": {"config": args},
                "deployments": deployments,
            }
        ],
    }


def app_config(app: dict[str, Any]) -> SpecServeConfig:
    """The whole config an application of `serve_config` runs: its arguments with the ingress's user_config."""
    ingress = next(d for d in app["deployments"] if d["name"] == "OpenAIIngress")
    return with_ingress_settings(parse_config(app["args"]["config"]), ingress.get("user_config", {}))


def render_manifest(cfg: SpecServeConfig, config_path_in_image: str | None, image: str) -> str:
    """The RayService as YAML text, with a header saying how it was made."""
    source = config_path_in_image or "CONFIG"
    header = (
        f"# Generated by `specserve render-k8s {source} --image {image}` from {source}.\n"
        "# Do not edit by hand: edit the config and render again (tests compare the two).\n"
    )
    body = yaml.dump(render_rayservice(cfg, config_path_in_image, image), Dumper=_ManifestDumper,
                     sort_keys=False, width=120)
    return header + body


def render_config_file(config_path: str | Path, image: str | None = None) -> str:
    """Load a config file and render its manifest; `image` defaults to the CPU or GPU image tag, with the vLLM
    engine's extra (`-vllm`, the Dockerfile's EXTRAS build) when the config runs on vLLM."""
    cfg = load_config(config_path, check_engines=False)
    vllm = "vllm" in (cfg.target.engine, cfg.drafter.engine)
    image = image or DEFAULT_IMAGES["gpu" if is_gpu(cfg) else "cpu"] + ("-vllm" if vllm else "")
    return render_manifest(cfg, _display_path(config_path), image)


def render_to_file(config_path: str | Path, image: str | None = None, out: str | Path | None = None) -> Path:
    """`specserve render-k8s CONFIG [--image IMAGE] [--out PATH]`: write the manifest and return its path.

    `out` defaults to `k8s/<manifest_filename>` under the current directory.
    """
    text = render_config_file(config_path, image)
    if out is None:
        out = Path("k8s") / manifest_filename(load_config(config_path, check_engines=False), config_path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


def shipped_manifests(root: Path = REPO_ROOT) -> dict[Path, Path]:
    """Each shipped config under `root/configs` mapped to its manifest path under `root/k8s`."""
    return {
        path: root / "k8s" / manifest_filename(load_config(path, check_engines=False), path)
        for path in sorted((root / "configs").glob("*.yaml"))
    }


def _head_group(cfg: SpecServeConfig, image: str, labels: dict[str, str]) -> dict[str, Any]:
    container = {
        "name": "ray-head",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "ports": [
            {"containerPort": 6379, "name": "gcs-server"},
            {"containerPort": 8265, "name": "dashboard"},
            {"containerPort": 10001, "name": "client"},
            {"containerPort": cfg.serving.port, "name": "serve"},
        ],
        # CPUs only: the ingress (tokenizer, routing) may run here, units never need to.
        "resources": _resources(cpu="2", memory="4Gi", request_cpu="1" if is_gpu(cfg) else "500m",
                                request_memory=None if is_gpu(cfg) else "2Gi"),
        **_mounts(cfg),
    }
    return {
        # num-gpus 0: nothing that needs a GPU is ever scheduled on the head.
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "1", "num-gpus": "0"},
        "template": {
            "metadata": {"labels": labels},
            "spec": {"containers": [container], **_volumes(cfg)},
        },
    }


def _worker_groups(cfg: SpecServeConfig, image: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    """One pod per unit in each group: the target TP group (+ coordinator, + a drafter kept with it), and a model
    drafter apart when it runs on a GPU or reserves custom resources the unit's other actors do not. Each group
    advertises the custom resources its actors reserve (`cluster.config.placement`), summed like its CPUs."""
    target, drafter = cfg.target, cfg.drafter
    tp = target.tensor_parallel_size
    unit_custom = _add_custom(*[target.resources.custom] * tp, cfg.unit.custom)
    own = set(drafter.resources.custom) - set(unit_custom)  # resources only the drafter's nodes advertise
    drafter_apart = drafter.kind == "model" and (drafter.device == "cuda" or bool(own))
    cpus = tp * target.resources.num_cpus + cfg.unit.num_cpus
    memory = tp * _memory_gb(target.resources.memory_gb)
    if drafter.kind != "none" and not drafter_apart:
        cpus += drafter.resources.num_cpus
        memory += _memory_gb(drafter.resources.memory_gb) if drafter.kind == "model" else 0.0
        unit_custom = _add_custom(unit_custom, drafter.resources.custom if drafter.kind == "model" else {})
    cpus = max(cpus, cfg.unit.torch_threads or 1)
    groups = [_worker_group("target" if is_gpu(cfg) else "unit", cfg, image, labels, cpus, memory,
                            gpus=math.ceil(tp * target.resources.num_gpus) if target.device == "cuda" else 0,
                            custom=unit_custom)]
    if drafter_apart:
        groups.append(_worker_group("drafter", cfg, image, labels, drafter.resources.num_cpus,
                                    _memory_gb(drafter.resources.memory_gb),
                                    gpus=math.ceil(drafter.resources.num_gpus), custom=drafter.resources.custom))
    return groups


def _add_custom(*amounts: dict[str, float]) -> dict[str, float]:
    total: dict[str, float] = {}
    for amount in amounts:
        for name, value in amount.items():
            total[name] = total.get(name, 0.0) + value
    return total


def _worker_group(group: str, cfg: SpecServeConfig, image: str, labels: dict[str, str], cpus: float,
                  memory_gb: float, gpus: int, custom: dict[str, float]) -> dict[str, Any]:
    scaling = cfg.autoscaling
    low, high = (scaling.min_replicas, scaling.max_replicas) if scaling.enabled else (
        scaling.fixed_replicas, scaling.fixed_replicas)
    cpu = str(max(1, math.ceil(cpus)))
    container = {
        "name": "ray-worker",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        # GPU pods are Guaranteed (requests = limits); CPU pods request one core so kind/minikube can fit them.
        "resources": _resources(cpu=cpu, memory=f"{math.ceil(memory_gb + POD_OVERHEAD_GB)}Gi", gpus=gpus,
                                request_cpu=None if gpus else "1"),
        **_mounts(cfg, shm=gpus > 0),
    }
    spec: dict[str, Any] = {"containers": [container], **_volumes(cfg, shm=gpus > 0)}
    if gpus:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    params = {"num-cpus": cpu}
    if gpus:
        params["num-gpus"] = str(gpus)
    if custom:
        params["resources"] = ray_start_resources(custom)
    return {
        "groupName": group,
        "replicas": scaling.fixed_replicas,
        "minReplicas": low,
        "maxReplicas": high + SURGE_PODS,
        "rayStartParams": params,
        "template": {"metadata": {"labels": {**labels, "specserve/group": group}}, "spec": spec},
    }


def ray_start_resources(custom: dict[str, float]) -> str:
    """`ray start --resources` as KubeRay's rayStartParams takes it: the JSON object, quoted, inner quotes escaped."""
    amounts = {name: int(value) if float(value).is_integer() else value for name, value in sorted(custom.items())}
    return '"' + json.dumps(amounts).replace('"', '\\"') + '"'


def _resources(cpu: str, memory: str, gpus: int = 0, request_cpu: str | None = None,
               request_memory: str | None = None) -> dict[str, Any]:
    """Pod limits, and requests equal to them unless given."""
    limits: dict[str, Any] = {"cpu": cpu, "memory": memory}
    requests: dict[str, Any] = {"cpu": request_cpu or cpu, "memory": request_memory or memory}
    if gpus:
        limits["nvidia.com/gpu"] = gpus
        requests["nvidia.com/gpu"] = gpus
    return {"limits": limits, "requests": requests}


def _memory_gb(memory_gb: float | None) -> float:
    return DEFAULT_ACTOR_MEMORY_GB if memory_gb is None else memory_gb


def _model_sources(cfg: SpecServeConfig) -> list[tuple[str, str]]:
    """(config field, source) of every model loaded from a path (not the embedded model)."""
    pairs = [("target.source", cfg.target.source)]
    if cfg.drafter.kind == "model":
        pairs.append(("drafter.source", cfg.drafter.source))
    return [(field, source) for field, source in pairs if not source.startswith("embedded:")]


def _check_model_paths(cfg: SpecServeConfig) -> None:
    for field, source in _model_sources(cfg):
        if not source.startswith(f"{MODELS_DIR}/"):
            raise ValueError(f"{field} {source!r} must be under {MODELS_DIR}/ to render for Kubernetes "
                             f"(the {MODELS_CLAIM} volume is mounted there)")


def _mounts(cfg: SpecServeConfig, shm: bool = False) -> dict[str, Any]:
    """A container's environment and mounts: the models, /dev/shm on GPU pods, the API keys' Secret."""
    out: dict[str, Any] = {}
    mounts = [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True}] if _model_sources(cfg) else []
    if shm:  # NCCL and the object store need more than the container's default 64 MiB /dev/shm
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if cfg.serving.api_keys_secret:
        from cluster.serving.guard import API_KEYS_FILE_ENV

        out["env"] = [{"name": API_KEYS_FILE_ENV, "value": f"{KEYS_DIR}/{KEYS_ENTRY}"}]
        mounts.append({"name": "api-keys", "mountPath": KEYS_DIR, "readOnly": True})
    return {**out, "volumeMounts": mounts} if mounts else out


def _volumes(cfg: SpecServeConfig, shm: bool = False) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = []
    if _model_sources(cfg):
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": MODELS_CLAIM, "readOnly": True}})
    if shm:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    if cfg.serving.api_keys_secret:  # not optional: without the Secret the pods wait rather than serve unguarded
        volumes.append({"name": "api-keys", "secret": {"secretName": cfg.serving.api_keys_secret,
                                                       "items": [{"key": KEYS_ENTRY, "path": KEYS_ENTRY}]}})
    return {"volumes": volumes} if volumes else {}


def _dns_name(text: str) -> str:
    """A DNS-1123 label: lower case, digits and '-', at most 50 characters (KubeRay appends suffixes)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return name[:50].rstrip("-")


def _display_path(path: str | Path) -> str:
    """The config path as written in a manifest: relative to the repository or the cwd when possible."""
    resolved = Path(path).resolve()
    for base in (REPO_ROOT, Path.cwd()):
        if resolved.is_relative_to(base):
            return resolved.relative_to(base).as_posix()
    return Path(path).as_posix()


class _LiteralStr(str):
    """A string dumped as a YAML literal block (`|`), so serveConfigV2 reads as YAML inside the manifest."""


class _ManifestDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # repeated label maps stay written out, not &id001 anchors
        return True


_ManifestDumper.add_representer(
    _LiteralStr, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|")
)
