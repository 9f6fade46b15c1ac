"""`specserve`: serve a config, generate once in-process, inspect a running cluster, A/B reports, k8s, benches.

    specserve [-v] serve CONFIG [--host 127.0.0.1] [--port 8000]
    specserve [-v] generate CONFIG --prompt TEXT [--chat] [--max-tokens N] [--arm NAME] [--no-speculation] [--json]
    specserve [-v] status
    specserve [-v] ab report ...       (experiments.ab_report)
    specserve [-v] render-k8s CONFIG [--image IMAGE] [--out PATH]
    specserve [-v] bench ...           (bench.run)
    specserve [-v] eval ...            (experiments.eval.cli)

One argparse parser. An instrument declares its arguments (`configure_parser(parser)`) and this module mounts
them as a subcommand (`_instrument`). Every subcommand's namespace carries `handler(args) -> exit status` and
`argv`, the command line after `specserve`. This is the one product module that imports the instruments
(bench/, experiments/), and no module imports it.

Ray 2.60 turns token authentication on for a local cluster it starts and writes the token to
~/.ray/auth_token; `serve` and `status` work with it as is (set RAY_AUTH_MODE=disabled to opt out, loopback
only). The CLI prints; the library modules it calls only log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import uuid
from typing import Any

logger = logging.getLogger("specserve")


# --------------------------------------------------------------------------------------------- serve


def _start_ray(address: str | None) -> bool:
    """Join the Ray cluster at `address` (or RAY_ADDRESS), else a running local one (`ray start`), else start
    one sized to this machine. `address="local"` always starts a private one. True when this process started
    the cluster (and so must stop it)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    if address != "local":
        try:
            ray.init(address=address, logging_level=logging.WARNING)
            return False
        except ConnectionError:
            if address != "auto":
                raise
    from cluster.serving.app import serve_at_normal_priority

    serve_at_normal_priority()
    ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, logging_level=logging.WARNING)
    return True


def cmd_serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from cluster.config import dump_config, load_config
    from cluster.serving.app import build_app

    config = load_config(args.config)
    host = args.host or config.serving.host
    port = args.port or config.serving.port
    started_ray = _start_ray(args.address)
    if started_ray:
        from cluster.serving.app import fit_units_to_host

        config, note = fit_units_to_host(config, os.cpu_count() or 1)
        if note:
            print(f"specserve: {note}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port, "request_timeout_s": config.serving.request_timeout_s})
        serve.run(build_app({"config": dump_config(config)}), name=config.name, route_prefix="/")
        url = f"http://{host}:{port}/v1"
        print(f"specserve: {config.target.served_name} ({config.name}) is serving at {url}", flush=True)
        print(f"  try: curl {url}/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{config.target.served_name}\", \"prompt\": \"def fib(n):\", \"max_tokens\": 32}}'",
              flush=True)
        print("  Ctrl-C stops it.", flush=True)
        while not stop.wait(1.0):
            pass
        print("specserve: stopping", flush=True)
    finally:
        if started_ray:
            serve.shutdown()
        else:  # a shared cluster: remove only our application
            serve.delete(config.name)
        _kill_app_actors(config.name)
        if started_ray:
            ray.shutdown()
    return 0


def _kill_app_actors(app_name: str) -> None:
    """The detached per-app actors (policy, telemetry hub) outlive Serve; stop them with the app."""
    import ray

    from cluster.serving.decoder import policy_actor_name

    try:
        from cluster.observability.telemetry import kill_hub

        kill_hub(app_name)
    except Exception:
        logger.debug("no telemetry hub to stop", exc_info=True)
    try:
        ray.kill(ray.get_actor(policy_actor_name(app_name), namespace="specserve"))
    except ValueError:
        pass


# --------------------------------------------------------------------------------------------- generate


def generate_once(config, prompt: str, *, chat: bool = False, max_tokens: int | None = None,
                  arm: str | None = None, speculate: bool = True, on_text=None) -> dict[str, Any]:
    """One request decoded in-process (no Ray): the unit is built locally with a local `PolicyCore`.

    Returns `{"text", "token_ids", "finish_reason", "usage": {prompt_tokens, completion_tokens, total_tokens,
    speculative}}`; `on_text(delta)` receives text as it is decoded.
    """
    from actors.requests import SamplingParams
    from actors.sources import load_tokenizer
    from cluster.config import validate_models
    from cluster.serving.ab import ArmRouter
    from cluster.serving.decoder import DecodeJob, Finished, decode_events, local_unit
    from cluster.serving.bodies import usage_body
    from cluster.serving.protocol import resolve_max_tokens

    validate_models(config)
    tokenizer = load_tokenizer(config.target.source)
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        prompt_ids = list(tokenizer.encode(text, add_special_tokens=False))
    else:
        prompt_ids = list(tokenizer.encode(prompt))
    coordinator = local_unit(config, unit="cli")
    max_seq_len = config.target.max_seq_len or coordinator.max_seq_len
    serving = config.serving
    tokens = resolve_max_tokens(max_tokens, prompt_len=len(prompt_ids), default=serving.default_max_tokens,
                                limit=serving.max_tokens_limit, max_seq_len=max_seq_len)
    chosen = ArmRouter(config.arms).assign(None, arm) if arm else config.arms[0]
    job = DecodeJob(f"cli-{uuid.uuid4().hex[:12]}", tuple(prompt_ids), SamplingParams(max_tokens=tokens),
                    chosen.to_arm_spec(), speculate=speculate)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731

    async def run() -> dict[str, Any]:
        parts: list[str] = []
        finished = None
        try:
            async for event in decode_events(coordinator, job, decode, "cli"):
                delta = event.text
                if delta:
                    parts.append(delta)
                    if on_text is not None:
                        on_text(delta)
                if isinstance(event, Finished):
                    finished = event
        finally:
            await coordinator.close()
        return {
            "text": "".join(parts),
            "token_ids": list(finished.token_ids),
            "finish_reason": finished.finish_reason,
            "usage": usage_body(len(prompt_ids), len(finished.token_ids), finished.speculative),
        }

    return asyncio.run(run())


def cmd_generate(args: argparse.Namespace) -> int:
    from cluster.config import load_config

    config = load_config(args.config)
    stream = None if args.json else (lambda delta: print(delta, end="", flush=True))
    result = generate_once(config, args.prompt, chat=args.chat, max_tokens=args.max_tokens, arm=args.arm,
                           speculate=not args.no_speculation, on_text=stream)
    if args.json:
        print(json.dumps({k: result[k] for k in ("text", "token_ids", "usage")}))
    else:
        spec = result["usage"].get("speculative") or {}
        print()
        print(f"[{result['usage']['completion_tokens']} tokens, finish={result['finish_reason']}, "
              f"arm={spec.get('arm')}, acceptance={spec.get('acceptance_rate', 0):.2f}, "
              f"mean accepted={spec.get('mean_accepted_length', 0):.2f}]", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------- status


def cmd_status(args: argparse.Namespace) -> int:
    import ray

    try:
        ray.init(address=args.address or "auto", logging_level=logging.ERROR, log_to_driver=False)
    except ConnectionError:
        print("Ray: not running (start one with `specserve serve CONFIG`)")
        return 1
    from ray import serve

    resources = ray.cluster_resources()
    print(f"Ray: up, {len(ray.nodes())} node(s), CPU {resources.get('CPU', 0):g}, GPU {resources.get('GPU', 0):g}")
    try:
        status = serve.status()
    except Exception as err:  # Serve not started on this cluster
        print(f"Serve: not running ({type(err).__name__})")
        return 0
    if not status.applications:
        print("Serve: running, no applications")
    for name, app in status.applications.items():
        print(f"app {name}: {app.status}")
        for dep_name, dep in app.deployments.items():
            replicas = ", ".join(f"{state}={n}" for state, n in sorted(dep.replica_states.items())) or "none"
            print(f"  {dep_name}: {dep.status} (replicas: {replicas})")
    ray.shutdown()
    return 0


# --------------------------------------------------------------------------------------------- render-k8s


def cmd_render_k8s(args: argparse.Namespace) -> int:
    import yaml

    from cluster.k8s.crd import CRD_ENV, find_crd_dir, load_rayservice_schema, validate_rayservice
    from cluster.k8s.render import render_to_file

    out = render_to_file(args.config, image=args.image, out=args.out)
    crds = find_crd_dir()
    if crds is None:
        print(f"wrote {out} (not validated: no KubeRay CRDs found; set {CRD_ENV} to their folder)")
        return 0
    validate_rayservice(yaml.safe_load(out.read_text()), load_rayservice_schema(crds))
    print(f"wrote {out} (valid against the KubeRay CRD in {crds})")
    return 0


# --------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from bench import run as bench_run
    from experiments import ab_report
    from experiments.eval import cli as eval_cli

    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="deploy a config on Ray Serve and block until Ctrl-C")
    serve.add_argument("config", help="YAML config (e.g. configs/local.yaml)")
    serve.add_argument("--host", default=None, help="bind address (default: serving.host of the config)")
    serve.add_argument("--port", type=int, default=None, help="HTTP port (default: serving.port of the config)")
    serve.add_argument("--address", default=None,
                       help="join this Ray cluster; 'local' starts a private one (default: RAY_ADDRESS, "
                            "else a running local cluster, else a new one)")
    serve.set_defaults(handler=cmd_serve)

    gen = commands.add_parser("generate", help="decode one prompt in-process (no Ray)")
    gen.add_argument("config")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--arm", default=None, help="arm name (default: the first arm)")
    gen.add_argument("--no-speculation", action="store_true", help="decode with the target alone")
    gen.add_argument("--json", action="store_true", help='print one JSON line {"text", "token_ids", "usage"}')
    gen.set_defaults(handler=cmd_generate)

    status = commands.add_parser("status", help="is Ray up; Serve apps, deployments and replicas")
    status.add_argument("--address", default=None, help="Ray address (default: auto)")
    status.set_defaults(handler=cmd_status)

    ab = commands.add_parser("ab", help="A/B experiments: `specserve ab report --help`")
    ab.set_defaults(handler=lambda _: _print_help(ab))  # `specserve ab` alone lists its subcommands
    _instrument(ab.add_subparsers(dest="ab_command"), "report", ab_report, ab_report.run,
                "per-arm figures and differences with bootstrap CIs")

    k8s = commands.add_parser("render-k8s", help="render a KubeRay RayService manifest from a config")
    k8s.add_argument("config")
    k8s.add_argument("--image", default=None)
    k8s.add_argument("--out", default=None)
    k8s.set_defaults(handler=cmd_render_k8s)

    _instrument(commands, "bench", bench_run, bench_run.run_command, "the benchmark suite (docs/benchmarks.md)")
    _instrument(commands, "eval", eval_cli, eval_cli.run,
                "score a task suite per arm (quality vs speed, paired statistics)")
    return parser


def _instrument(commands, name: str, module, handler, help: str) -> argparse.ArgumentParser:
    """Subcommand `name`, whose arguments `module.configure_parser` declares and whose handler is `handler`."""
    parser = commands.add_parser(name, help=help, description=module.__doc__.split("\n\n")[0])
    module.configure_parser(parser)
    parser.set_defaults(handler=handler)
    return parser


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as err:  # bad config or arguments: a message, not a traceback
        print(f"specserve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
