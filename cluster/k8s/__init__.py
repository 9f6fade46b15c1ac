"""Kubernetes: KubeRay RayService manifests rendered from configs (`render`) and validated strictly (`crd`)."""
