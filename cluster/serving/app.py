"""The Serve application: `build_app(args)`, import_path-able as `cluster.serving.app:build_app`.

    serve run cluster.serving.app:build_app config=configs/local.yaml
    # KubeRay serveConfigV2: import_path: cluster.serving.app:build_app, args: {config: {...the dumped config...}}

It wires the OpenAI ingress to the decoder deployment, whose every replica is one unit. The config decides the
decoder's concurrency (`serving.max_ongoing_requests` per unit, `serving.max_queued_requests` waiting per
caller before a 503) and its replicas (`autoscaling`). Nothing is created at build time: each replica builds
its unit, and the policy actor and telemetry hub are made on first use by whichever replica comes first.

Placement on a multi-node cluster: the ingress, the policy actor and the telemetry hub on the head
(`actors.remote.placement`); a unit's replica and target shards where `unit.custom` and
`target.resources.custom` are advertised, a model drafter where `drafter.resources.custom` is; Serve spreads
the replicas over the nodes that fit them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from cluster.config import SpecServeConfig, dump_config, load_config, parse_config, validate_models
from cluster.config.engines import cpu_threads_per_unit
from cluster.serving.decoder import DecoderUnit
from cluster.serving.ingress import OpenAIIngress

DECODER_DEPLOYMENT = "DecoderUnit"
INGRESS_DEPLOYMENT = "OpenAIIngress"
HEALTH_CHECK_PERIOD_S = 2.0  # how often Serve asks a decoder replica whether its unit can serve


def serve_at_normal_priority() -> None:
    """Call before starting a local Ray cluster: its workers (the server's replicas and engines) run at niceness
    0, not Ray's 15, unless `RAY_worker_niceness` is set (docs/architecture.md, "Process priority")."""
    os.environ.setdefault("RAY_worker_niceness", "0")


def fit_units_to_host(config: SpecServeConfig, cores: int) -> tuple[SpecServeConfig, str | None]:
    """For a cluster on one host (`specserve serve` without a cluster to join): at most max(1, cores // the threads
    a CPU unit computes with, `cpu_threads_per_unit`) units, so that none shares cores (why: docs/reliability.md,
    "Autoscaling under a traffic ramp"). Returns the config with its replica counts capped, and a line saying so
    (None when nothing changed); GPU configs are returned as they are."""
    if config.target.device != "cpu":
        return config, None
    threads = cpu_threads_per_unit(config.target.engine, config.unit.torch_threads,
                                   config.target.tensor_parallel_size)
    fit = 1 if threads is None else max(1, cores // threads)
    scaling = config.autoscaling
    most = scaling.max_replicas if scaling.enabled else scaling.fixed_replicas
    if most <= fit:
        return config, None
    capped = scaling.model_copy(update={
        "max_replicas": min(scaling.max_replicas, fit), "min_replicas": min(scaling.min_replicas, fit),
        "initial_replicas": None if scaling.initial_replicas is None else min(scaling.initial_replicas, fit)})
    note = (f"at most {fit} unit(s) on this host: it has {cores} cores and a CPU unit computes with "
            f"{threads or 'all'} of them; units that share cores run slower than one (docs/reliability.md), so "
            "join a cluster with more nodes to scale out")
    return config.model_copy(update={"autoscaling": capped}), note


def resolve_config(value: Any) -> SpecServeConfig:
    """`args["config"]`: a YAML path, an inline mapping (serveConfigV2), or a `SpecServeConfig`."""
    if isinstance(value, SpecServeConfig):
        return value
    if isinstance(value, dict):
        return parse_config(value, source="args.config")
    if isinstance(value, (str, Path)):
        return load_config(value)
    raise ValueError(f"config: expected a path, a mapping or a SpecServeConfig, got {type(value).__name__}")


def decoder_options(config: SpecServeConfig) -> dict[str, Any]:
    """Serve deployment options of the decoder (one replica = one unit)."""
    scaling = config.autoscaling
    options: dict[str, Any] = dict(
        name=DECODER_DEPLOYMENT,
        max_ongoing_requests=config.serving.max_ongoing_requests,
        max_queued_requests=config.serving.max_queued_requests,
        graceful_shutdown_timeout_s=scaling.graceful_shutdown_timeout_s,
        ray_actor_options=replica_resources(config),
        # Loading a model (and, on first use, converting the embedded GGUF) takes a while.
        health_check_timeout_s=120,
        # A dead replica is found by its failed health check: more often than Serve's 10 s, so its traffic waits
        # less for the replacement (the check only asks the unit whether its engine is up).
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    )
    options.update(replica_placement(config))
    if scaling.enabled:
        options["autoscaling_config"] = scaling.to_serve()
    else:
        options["num_replicas"] = scaling.fixed_replicas
    return options


def replica_resources(config: SpecServeConfig) -> dict[str, float]:
    """Ray resources of one decoder replica (`actors.unit.replica_resources`)."""
    from actors.unit import replica_resources as unit_resources
    from cluster.serving.decoder import unit_setup

    return unit_resources(unit_setup(config)["target"], config.unit.num_cpus, config.unit.custom)


def replica_placement(config: SpecServeConfig) -> dict[str, Any]:
    """The decoder replica's placement group options, if its unit needs one (`actors.unit.replica_placement`)."""
    from actors.unit import replica_placement as unit_placement
    from cluster.serving.decoder import unit_setup

    return unit_placement(unit_setup(config)["target"], config.unit.num_cpus, config.unit.custom)


def ingress_options(config: SpecServeConfig) -> dict[str, Any]:
    """The ingress only parses, tokenizes and relays: no reserved CPU, and room for every request the units
    can hold or queue, so overload surfaces as the decoder's 503 rather than as a wait at the proxy. It runs on
    the head, beside the proxy (`proxy_location: HeadOnly`), so losing a worker node never takes a stream's
    relay with it: the stream ends as a clean 503 from its unit instead. Its `user_config` holds the arms and
    the audit, which an in-place update changes without restarting a unit."""
    from actors.remote.placement import on_head
    from cluster.serving.ab import ingress_user_config

    capacity = (
        config.serving.max_ongoing_requests + config.serving.max_queued_requests
    ) * config.autoscaling.max_replicas
    return dict(
        name=INGRESS_DEPLOYMENT,
        max_ongoing_requests=2 * capacity + 16,
        ray_actor_options={"num_cpus": 0, "resources": on_head()},
        user_config=ingress_user_config(config),
    )


def build_app(args: dict[str, Any]) -> Application:
    """The specserve Serve application. `args["config"]` is a config path or the dumped config."""
    if "config" not in args:
        raise ValueError("args: 'config' (a YAML path or an inline config mapping) is required")
    config = resolve_config(args["config"])
    validate_models(config)  # vocabularies, TP vs heads, context: from the models' config files only
    dumped = dump_config(config)
    decoder = serve.deployment(DecoderUnit).options(**decoder_options(config))
    ingress = serve.deployment(OpenAIIngress).options(**ingress_options(config))
    return ingress.bind(decoder.bind(dumped), dumped)
