"""The step's draft plan (`gamma.batch_plan`) on against off on the native engine, in process, interleaved.

    PYTHONPATH=. python scripts/plan_ab.py [CONFIG] [--streams 1] [--workloads code,chat] [--prompts 4]
                                           [--max-tokens 96]

One unit (`build_unit(on_ray=False)`, the CONFIG's drafter and γ settings) decodes the same greedy prompts six
times per workload, the plan toggled on the unit's policy between runs in the order off, on, on, off, off, on,
so drift on a shared machine hits both alike. At `--streams 1` the prompts go one after another, else together
in one batch. Prints one line per run: output tok/s, rounds, the rows' mean γ, the share of rows that drafted,
acceptance, tokens per round and the mean score (forward) time per round.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

ORDER = (False, True, True, False, False, True)


def run(coordinator, collector, policy, prompts, *, plan: bool, streams: int, max_tokens: int, tag: str) -> dict:
    from actors.requests import GenerationRequest, SamplingParams

    policy.gamma.batch_plan = plan
    collector.rounds.clear()
    requests = [GenerationRequest(f"{tag}-{i}", list(p.ids), SamplingParams(max_tokens), speculate=True)
                for i, p in enumerate(prompts)]
    start = time.perf_counter()
    results = ([coordinator.generate_sync(r) for r in requests] if streams == 1
               else coordinator.generate_many_sync(requests))
    wall = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    rows = [row for r in collector.rounds for row in r.rows]
    gammas = [row.gamma for row in rows]
    return {"tok_s": tokens / wall, "rounds": len(collector.rounds), "mean_gamma": statistics.fmean(gammas),
            "drafted": sum(1 for g in gammas if g) / len(gammas),
            "acceptance": sum(row.accepted for row in rows) / max(1, sum(gammas)),
            "tokens_per_round": tokens / len(collector.rounds),
            "score_ms": 1000 * statistics.fmean(r.score_s for r in collector.rounds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="configs/local.yaml")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--workloads", default="code,chat")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    import torch

    from actors.policy import LocalPolicy, PolicyCore
    from actors.sources import load_tokenizer
    from actors.unit import build_unit
    from bench.harness import RoundCollector
    from bench.workloads import load_workload
    from cluster.config import load_config
    from cluster.serving.decoder import policy_kwargs, unit_setup

    torch.set_num_threads(2)
    config = load_config(args.config)
    tokenizer = load_tokenizer(config.target.source)
    collector = RoundCollector()
    policy = LocalPolicy(PolicyCore(**policy_kwargs(config)))
    coordinator = build_unit(unit="plan-ab", policy=policy, observer=collector, on_ray=False,
                             **{**unit_setup(config), "torch_threads": 2})
    try:
        for workload in args.workloads.split(","):
            prompts = load_workload(workload, tokenizer, max(args.streams, args.prompts))
            run(coordinator, collector, policy, prompts[:1], plan=False, streams=1, max_tokens=args.max_tokens,
                tag=f"{workload}-warm")
            for k, plan in enumerate(ORDER):
                out = run(coordinator, collector, policy, prompts, plan=plan, streams=args.streams,
                          max_tokens=args.max_tokens, tag=f"{workload}-{k}")
                print(workload, f"streams={args.streams}", "plan=on " if plan else "plan=off",
                      " ".join(f"{key}={value:.3f}" for key, value in out.items()), flush=True)
    finally:
        asyncio.run(coordinator.close())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
