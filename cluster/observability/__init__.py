"""Observability: metrics and the export (`telemetry`, the app's hub), a unit's observer (`observer`), traces
(`tracing`)."""
