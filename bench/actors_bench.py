"""Single-stream tokens/s of one unit, in-process and through Ray actors, and where a round's time goes.

    python -m bench.actors_bench [CONFIG] [--workload edit] [--prompts 3] [--max-tokens 64] [--json PATH]

Per path (`inprocess`: `build_unit(on_ray=False)`; `ray`: `build_unit(on_ray=True)`) it decodes the same prompts
target-only and speculatively and reports tokens/s and the share of round time in draft, score (split into the
model forward and the rest), verify and orchestration (everything else in a round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time

from actors.requests import GenerationRequest, SamplingParams
from bench.harness import RoundCollector
from bench.workloads import Prompt, load_workload

log = logging.getLogger("specserve.bench")

TORCH_THREADS = 2


def round_shares(rounds) -> dict:
    """Share of summed round time per phase, and the mean round in milliseconds."""
    total = sum(r.total_s for r in rounds)
    if not rounds or total <= 0:
        return {}
    return {
        "rounds": len(rounds), "mean_round_ms": 1000 * total / len(rounds),
        "draft": sum(r.draft_s for r in rounds) / total, "score": sum(r.score_s for r in rounds) / total,
        "verify": sum(r.verify_s for r in rounds) / total,
        "orchestration": sum(r.orchestration_s for r in rounds) / total,
    }


def decode(coordinator, collector: RoundCollector, prompts: list[Prompt], max_tokens: int, speculate: bool,
           tag: str) -> dict:
    """Run prompts one at a time (after one untimed warm-up request); tokens/s = Σ tokens / Σ seconds."""

    def one(i: int, prompt: Prompt):
        request = GenerationRequest(f"{tag}-{i}", list(prompt.ids), SamplingParams(max_tokens), speculate=speculate)
        start = time.perf_counter()
        result = coordinator.generate_sync(request)
        return len(result.token_ids), time.perf_counter() - start

    one(-1, prompts[0])
    collector.rounds.clear()
    outs = [one(i, p) for i, p in enumerate(prompts)]
    rounds = [r for r in collector.rounds if r.batch_size == 1]
    forward = [r.forward_s for r in collector.rounds]  # one per round (prefill steps are not rounds)
    out = {"tokens_per_s": sum(n for n, _ in outs) / sum(s for _, s in outs), "tokens": sum(n for n, _ in outs),
           **round_shares(rounds)}
    if rounds and forward:
        # score time beyond the model forward: actor call, transfer, post-processing (per round, ms)
        out["score_overhead_ms"] = 1000 * (sum(r.score_s for r in collector.rounds) - sum(forward)) / len(forward)
        out["forward_ms"] = 1000 * statistics.fmean(forward)
    return out


def measure_path(config, prompts: list[Prompt], max_tokens: int, on_ray: bool) -> dict:
    from actors.policy import LocalPolicy, PolicyCore
    from actors.unit import build_unit
    from cluster.serving.decoder import policy_kwargs, unit_setup

    collector = RoundCollector()
    path = "ray" if on_ray else "inprocess"
    policy_name = f"actors-bench-policy-{time.monotonic_ns()}"
    if on_ray:
        from actors.remote.policy import RemotePolicy

        policy = RemotePolicy(policy_name, **policy_kwargs(config))
    else:
        policy = LocalPolicy(PolicyCore(**policy_kwargs(config)))
    coordinator = build_unit(unit=f"bench-{path}", policy=policy, observer=collector, on_ray=on_ray,
                             **{**unit_setup(config), "torch_threads": TORCH_THREADS})
    try:
        out = {mode: decode(coordinator, collector, prompts, max_tokens, mode == "speculative", f"{path}-{mode}")
               for mode in ("target_only", "speculative")}
    finally:
        asyncio.run(coordinator.close())
        if on_ray:
            import ray

            ray.kill(policy.handle)
    out["speedup"] = out["speculative"]["tokens_per_s"] / out["target_only"]["tokens_per_s"]
    return out


def run(config_path: str, workload: str, prompts: int, max_tokens: int, ray_path: bool = True) -> dict:
    import torch

    from actors.sources import load_tokenizer
    from cluster.config import load_config

    torch.set_num_threads(TORCH_THREADS)
    config = load_config(config_path)
    batch = load_workload(workload, load_tokenizer(config.target.source), prompts)
    results = {"workload": workload, "prompts": prompts, "max_tokens": max_tokens,
               "inprocess": measure_path(config, batch, max_tokens, on_ray=False)}
    if ray_path:
        import ray

        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            results["ray"] = measure_path(config, batch, max_tokens, on_ray=True)
        finally:
            ray.shutdown()
        results["ray_vs_inprocess"] = {
            mode: results["ray"][mode]["tokens_per_s"] / results["inprocess"][mode]["tokens_per_s"]
            for mode in ("target_only", "speculative")}
    return results


def format_table(results: dict) -> str:
    lines = [f"{'path':10} {'mode':12} {'tok/s':>7} {'round ms':>9} {'draft':>6} {'score':>6} {'verify':>7} {'orch':>6} "
             f"{'forward ms':>10} {'score-forward ms':>16}"]
    for path in ("inprocess", "ray"):
        for mode in ("target_only", "speculative"):
            r = results.get(path, {}).get(mode)
            if r:
                lines.append(f"{path:10} {mode:12} {r['tokens_per_s']:7.2f} {r.get('mean_round_ms', 0):9.1f} "
                             f"{r.get('draft', 0):6.1%} {r.get('score', 0):6.1%} {r.get('verify', 0):7.1%} "
                             f"{r.get('orchestration', 0):6.1%} {r.get('forward_ms', 0):10.1f} "
                             f"{r.get('score_overhead_ms', 0):16.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.actors_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="configs/local.yaml")
    parser.add_argument("--workload", default="edit")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-ray", action="store_true", help="in-process path only")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    results = run(args.config, args.workload, args.prompts, args.max_tokens, ray_path=not args.no_ray)
    print(format_table(results))
    if "ray_vs_inprocess" in results:
        print("ray / in-process tokens/s: " + ", ".join(f"{k} {v:.2f}" for k, v in results["ray_vs_inprocess"].items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
