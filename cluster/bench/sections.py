"""The benchmark's sections. Each measures one thing and returns a JSON-able dict; `run.py` stores each as it
finishes, so an interrupted run resumes where it stopped.

- `single_stream`: per workload at concurrency 1: target-only, the fixed-γ sweep, adaptive γ; identical-token
  check against target-only; α, c, v(γ) and the predicted speedup of every mode (`cluster.bench.speedup`).
- `batched`: the same sweep at concurrency N (γ under load, issue 5).
- `asd`: ASD arms against exact verification: tokens/s, accepted length, regret spent, divergence.
- `hf_peer`: Hugging Face `generate` on the same prompts.
- `http`: the concurrency sweep through the Serve app.
"""

from __future__ import annotations

import logging
import statistics

from actors.coordinator import ArmSpec
from cluster.audit import common_prefix_length
from cluster.bench import speedup
from cluster.bench.harness import ADAPTIVE, TARGET_ONLY, InProcessBench, Mode, RunMeasure, fixed
from cluster.bench.plan import ASDSetting, BenchPlan
from cluster.bench.workloads import Prompt
from policies.asd import ASDConfig

log = logging.getLogger("specserve.bench")


def _sweep(bench: InProcessBench, prompts: list[Prompt], gammas, concurrency: int) -> dict[str, RunMeasure]:
    """target-only, fixed γ (γ = 0 *is* the target-only run: same code path), then adaptive (warmed up)."""
    runs: dict[str, RunMeasure] = {}
    runs["target_only"] = bench.run(prompts, TARGET_ONLY, concurrency, warmup=0)
    log.info("  %s c=%d target_only: %.2f tok/s", prompts[0].workload, concurrency, runs["target_only"].tokens_per_s)
    for gamma in gammas:
        if gamma == 0:
            continue
        runs[f"fixed_{gamma}"] = bench.run(prompts, fixed(gamma), concurrency, warmup=0)
        log.info("  %s c=%d fixed_%d: %.2f tok/s", prompts[0].workload, concurrency, gamma,
                 runs[f"fixed_{gamma}"].tokens_per_s)
    runs["adaptive"] = bench.run(prompts, ADAPTIVE, concurrency, warmup=1)
    log.info("  %s c=%d adaptive: %.2f tok/s", prompts[0].workload, concurrency, runs["adaptive"].tokens_per_s)
    return runs


def _gamma_table(runs: dict[str, RunMeasure], gammas) -> dict:
    """tokens/s per fixed γ (γ = 0 from the target-only run), adaptive, and the best fixed γ after the fact."""
    by_gamma = {g: (runs["target_only"] if g == 0 else runs[f"fixed_{g}"]).tokens_per_s for g in gammas}
    best = max(by_gamma, key=by_gamma.get)
    return {"fixed": {str(g): v for g, v in by_gamma.items()}, "best_fixed_gamma": best,
            "best_fixed_tokens_per_s": by_gamma[best], "adaptive_tokens_per_s": runs["adaptive"].tokens_per_s,
            "target_only_tokens_per_s": runs["target_only"].tokens_per_s}


def single_stream(bench: InProcessBench, prompts: list[Prompt], plan: BenchPlan) -> dict:
    runs = _sweep(bench, prompts, plan.gammas, 1)
    target = runs["target_only"]
    reference = [r.token_ids for r in target.requests]
    fits = {}
    for name, run in runs.items():
        fit = speedup.fit(run.rounds, target.rounds)
        fit["realized"] = run.decode_tokens_per_s / target.decode_tokens_per_s if target.decode_tokens_per_s else None
        fits[name] = fit
    return {
        "workload": prompts[0].workload,
        "prompts": [p.name for p in prompts],
        "prompt_tokens": [len(p.ids) for p in prompts],
        "runs": {name: run.summary() for name, run in runs.items()},
        "gamma_sweep": _gamma_table(runs, plan.gammas),
        "identical": {name: [r.token_ids for r in run.requests] == reference for name, run in runs.items()},
        "fit": fits,
        "adaptive_gammas": _gamma_histogram(runs["adaptive"]),
        "target_only_token_ids": [list(t) for t in reference],
    }


def _gamma_histogram(run: RunMeasure) -> dict[str, int]:
    """How often adaptive γ drafted k tokens per row-round (k < γ when prompt lookup found fewer)."""
    counts: dict[str, int] = {}
    for record in run.rounds:
        for row in record.rows:
            counts[str(row.gamma)] = counts.get(str(row.gamma), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


def batched(bench: InProcessBench, prompts: list[Prompt], plan: BenchPlan) -> dict:
    runs = _sweep(bench, prompts, plan.batched_gammas, plan.batched_concurrency)
    return {"workload": prompts[0].workload, "concurrency": plan.batched_concurrency,
            "runs": {name: run.summary() for name, run in runs.items()},
            "gamma_sweep": _gamma_table(runs, plan.batched_gammas)}


def asd(bench: InProcessBench, prompts: list[Prompt], settings: list[tuple[str, ASDSetting]],
        exact: dict) -> dict:
    """ASD arms (adaptive γ) against the exact arm's adaptive run and target-only tokens in `exact`
    (a `single_stream` section)."""
    reference = [tuple(t) for t in exact["target_only_token_ids"]]
    exact_run = exact["runs"]["adaptive"]
    rows = []
    for label, setting in settings:
        arm = ArmSpec(label, "asd", ASDConfig(g=setting.g, max_relaxed_per_block=setting.max_relaxed_per_block,
                                              budget=setting.budget))
        run = bench.run(prompts, Mode(f"asd_{label}", arm=arm), 1, warmup=1)
        outputs = [r.token_ids for r in run.requests]
        agreement = [common_prefix_length(o, ref) / max(1, len(ref)) for o, ref in zip(outputs, reference)]
        summary = run.summary()
        row = {
            "setting": label, **setting.model_dump(),
            "tokens_per_s": run.tokens_per_s,
            "vs_exact": run.tokens_per_s / exact_run["tokens_per_s"] if exact_run["tokens_per_s"] else None,
            "mean_accepted_length": summary["mean_accepted_length"],
            "exact_mean_accepted_length": exact_run["mean_accepted_length"],
            "regret_spent_mean": summary.get("regret_spent_mean", 0.0),
            "relaxed_tokens": summary.get("relaxed_tokens", 0),
            "exact_match_rate": statistics.fmean(o == ref for o, ref in zip(outputs, reference)),
            "token_agreement": statistics.fmean(agreement),
        }
        log.info("  %s asd %s: %.2f tok/s (%.2fx exact), agreement %.2f", prompts[0].workload, label,
                 run.tokens_per_s, row["vs_exact"] or 0, row["token_agreement"])
        rows.append(row)
    return {"workload": prompts[0].workload, "settings": rows}


def hf_peer(peer, prompts: list[Prompt], modes, reference: list[list[int]]) -> dict:
    rows = {}
    for mode in modes:
        measure = peer.run(prompts, mode)
        row = measure.summary()
        row["identical_to_specserve"] = [list(t) for t in measure.token_ids] == reference
        rows[mode] = row
        log.info("  %s hf %s: %.2f tok/s", prompts[0].workload, mode, measure.tokens_per_s)
    return {"workload": prompts[0].workload, "modes": rows}


def http(config, prompts: list[Prompt], plan: BenchPlan, best_fixed_gamma: int, port: int) -> dict:
    """The concurrency sweep through the Serve app (see cluster.bench.http_bench)."""
    from cluster.bench.http_bench import ServedApp, bench_config, measure

    deployments = []  # (mode, fixed γ of the deployment, speculate)
    if "adaptive" in plan.http_modes or "target_only" in plan.http_modes:
        deployments.append((None, [m for m in ("adaptive", "target_only") if m in plan.http_modes]))
    if "best_fixed" in plan.http_modes:
        deployments.append((best_fixed_gamma, ["best_fixed"]))
    rows = []
    with ServedApp(port=port) as app:
        for gamma, modes in deployments:
            name = "bench-adaptive" if gamma is None else f"bench-fixed{gamma}"
            log.info("  http: deploying %s", name)
            app.deploy(bench_config(config, name=name, fixed_gamma=gamma, port=port))
            for mode in modes:
                for concurrency in plan.http_concurrency:
                    label = f"fixed_{gamma}" if mode == "best_fixed" else mode
                    m = measure(app, prompts, mode=label, concurrency=concurrency, max_tokens=plan.max_tokens,
                                speculate=mode != "target_only", warmup=1 if concurrency == plan.http_concurrency[0] else 0)
                    log.info("  http %s c=%d: %.2f tok/s, p50 %.2fs", label, concurrency, m.tokens_per_s,
                             m.summary()["latency_p50_s"])
                    rows.append({**m.summary(), "policy": mode})
    return {"workload": prompts[0].workload, "best_fixed_gamma": best_fixed_gamma, "rows": rows}
