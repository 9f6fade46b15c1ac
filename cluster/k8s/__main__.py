"""python -m cluster.k8s: re-render every shipped manifest in k8s/ (and its PodMonitor in k8s/monitoring/) from
its config in configs/."""

from cluster.k8s.monitoring import render_podmonitor_file, shipped_podmonitors
from cluster.k8s.render import render_config_file, shipped_manifests

for config_path, manifest_path in shipped_manifests().items():
    manifest_path.write_text(render_config_file(config_path))
for config_path, monitor_path in shipped_podmonitors().items():
    monitor_path.parent.mkdir(parents=True, exist_ok=True)
    monitor_path.write_text(render_podmonitor_file(config_path))
