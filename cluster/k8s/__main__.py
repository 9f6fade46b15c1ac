"""python -m cluster.k8s: re-render every shipped manifest in k8s/ from its config in configs/."""

from cluster.k8s.render import render_config_file, shipped_manifests

for config_path, manifest_path in shipped_manifests().items():
    manifest_path.write_text(render_config_file(config_path))
