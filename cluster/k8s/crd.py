"""Strict validation of a RayService manifest against KubeRay's CRD.

`validate_rayservice(manifest, schema)` checks a manifest against the CRD's OpenAPI schema with jsonschema, plus
the **strict** check `kubectl apply --validate=strict` makes: a field the schema does not declare is an error
(the API server would silently prune it), except below `x-kubernetes-preserve-unknown-fields: true`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from cluster.config.load import dotted_path
from cluster.k8s.render import REPO_ROOT

CRD_ENV = "SPECSERVE_KUBERAY_CRDS"
RAYSERVICE_CRD = "ray.io_rayservices.yaml"
# Kubernetes ObjectMeta fields a manifest may set (metadata is validated by the API server, not the CRD).
OBJECT_META_FIELDS = frozenset(
    {"name", "namespace", "generateName", "labels", "annotations", "finalizers", "ownerReferences"}
)


def find_crd_dir() -> Path | None:
    """The KubeRay CRD folder: $SPECSERVE_KUBERAY_CRDS, else ../shared/kuberay beside the repository or cwd."""
    candidates = [Path(os.environ[CRD_ENV])] if os.environ.get(CRD_ENV) else []
    candidates += [REPO_ROOT.parent / "shared" / "kuberay", Path.cwd().parent / "shared" / "kuberay"]
    for candidate in candidates:
        if (candidate / RAYSERVICE_CRD).is_file():
            return candidate
    return None


def load_rayservice_schema(crd_dir: str | Path, version: str = "v1") -> dict[str, Any]:
    """The OpenAPI v3 schema of a RayService from KubeRay's CRD file in `crd_dir`."""
    path = Path(crd_dir) / RAYSERVICE_CRD
    if not path.is_file():
        raise ValueError(f"crd_dir {str(crd_dir)!r} has no {RAYSERVICE_CRD}")
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 1 MB of YAML
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise ValueError(f"version {version!r} is not in {path}")


def rayservice_errors(manifest: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Every problem with `manifest` against `schema`: jsonschema errors plus unknown fields, as `path: message`."""
    import jsonschema

    errors = [f"{_json_path(e.absolute_path)}: {e.message}"
              for e in jsonschema.Draft4Validator(schema).iter_errors(manifest)]
    if manifest.get("apiVersion") != "ray.io/v1" or manifest.get("kind") != "RayService":
        errors.append("apiVersion/kind: expected ray.io/v1 RayService")
    errors += strict_errors(manifest, schema)
    return sorted(set(errors))


def validate_rayservice(manifest: dict[str, Any], schema: dict[str, Any]) -> None:
    """Raise ValueError listing every problem (see `rayservice_errors`); return None when the manifest is valid."""
    errors = rayservice_errors(manifest, schema)
    if errors:
        raise ValueError("manifest: invalid RayService\n  " + "\n  ".join(errors))


def strict_errors(value: Any, schema: dict[str, Any], path: tuple = ()) -> list[str]:
    """Fields of `value` that `schema` does not declare, as `kubectl apply --validate=strict` reports them.

    Maps (`additionalProperties`) are walked with their value schema; a node marked
    `x-kubernetes-preserve-unknown-fields` accepts anything below it; `metadata` objects are Kubernetes
    ObjectMeta; an `x-kubernetes-int-or-string` node must hold an integer or a string.
    """
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if schema.get("x-kubernetes-int-or-string"):
        ok = isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
        return [] if ok else [f"{_json_path(path)}: must be an integer or a string"]
    errors: list[str] = []
    if isinstance(value, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if properties is not None and key in properties:
                errors += strict_errors(item, properties[key], path + (key,))
            elif isinstance(extra, dict):
                errors += strict_errors(item, extra, path + (key,))
            elif extra is True:
                continue
            elif properties is None and path and path[-1] == "metadata" and key in OBJECT_META_FIELDS:
                continue
            else:
                errors.append(f"{_json_path(path + (key,))}: unknown field {key!r}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += strict_errors(item, schema["items"], path + (i,))
    return errors


def _json_path(path) -> str:
    return dotted_path(tuple(path)) or "<root>"
