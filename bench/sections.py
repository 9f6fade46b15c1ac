"""The benchmark's sections. Each measures one thing and returns a JSON-able dict; `run.py` stores each as it
finishes.

- `single_stream`: per workload at concurrency 1: target-only, the fixed-γ sweep, adaptive γ; identical-token
  check against target-only; α, c, v(γ) and the predicted speedup of every mode (`bench.speedup`).
- `batched`: the same sweep at concurrency N (γ under load).
- `asd`: ASD arms against exact verification: tokens/s, accepted length, regret spent, divergence, and where
  the extra tokens per round come from (`bench.decompose`).
- `hf_peer`: Hugging Face `generate` on the same prompts.
- `http`: the concurrency sweep through the Serve app.
"""

from __future__ import annotations

import logging
import statistics

from actors.requests import ArmSpec
from bench import speedup
from bench.decompose import decompose, replay
from bench.harness import ADAPTIVE, TARGET_ONLY, InProcessBench, Mode, RunMeasure, best_of, fixed
from bench.plan import ASDSetting, BenchPlan
from bench.workloads import Prompt
from cluster.serving.audit import common_prefix_length

log = logging.getLogger("specserve.bench")


def _sweep(bench: InProcessBench, prompts: list[Prompt], gammas, concurrency: int) -> dict[str, RunMeasure]:
    """target-only, fixed γ (γ = 0 *is* the target-only run: same code path) and adaptive, interleaved."""
    modes = [TARGET_ONLY] + [fixed(g) for g in gammas if g != 0] + [ADAPTIVE]
    runs = bench.sweep(prompts, modes, concurrency)
    log.info("  %s c=%d: %s", prompts[0].workload, concurrency,
             ", ".join(f"{name} {run.tokens_per_s:.2f}" for name, run in runs.items()) + " tok/s")
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
        reference: list[list[int]]) -> dict:
    """ASD arms (adaptive γ) interleaved with the exact arm (adaptive γ); divergence against `reference`, the
    target-only greedy tokens; each arm's tokens per round decomposed (bench.decompose)."""
    modes = [ADAPTIVE] + [
        Mode(f"asd_{label}", arm=ArmSpec(label, "asd", s.to_asd_config()))
        for label, s in settings]
    runs = bench.sweep(prompts, modes, 1)
    exact = runs["adaptive"]
    exact_summary = exact.summary()
    prompt_ids = {p.name: p.ids for p in prompts}
    exact_replay = replay(bench.engine, exact, prompt_ids)  # once, for every ASD arm's decomposition
    rows = []
    for (label, setting), mode in zip(settings, modes[1:]):
        run = runs[mode.name]
        outputs = [r.token_ids for r in run.requests]
        refs = [tuple(t) for t in reference]
        agreement = [common_prefix_length(o, ref) / max(1, len(ref)) for o, ref in zip(outputs, refs)]
        summary = run.summary()
        row = {
            "setting": label, **setting.model_dump(),
            "tokens_per_s": run.tokens_per_s,
            "exact_tokens_per_s": exact.tokens_per_s,
            "vs_exact": run.tokens_per_s / exact.tokens_per_s if exact.tokens_per_s else None,
            "mean_accepted_length": summary["mean_accepted_length"],
            "exact_mean_accepted_length": exact_summary["mean_accepted_length"],
            "regret_spent_mean": summary.get("regret_spent_mean", 0.0),
            "relaxed_tokens": summary.get("relaxed_tokens", 0),
            "exact_match_rate": statistics.fmean(o == ref for o, ref in zip(outputs, refs)),
            "token_agreement": statistics.fmean(agreement),
            "decomposition": decompose(exact_replay, replay(bench.engine, run, prompt_ids)),
        }
        log.info("  %s asd %s: %.2f tok/s (%.2fx exact), agreement %.2f", prompts[0].workload, label,
                 run.tokens_per_s, row["vs_exact"] or 0, row["token_agreement"])
        rows.append(row)
    return {"workload": prompts[0].workload, "settings": rows}


def hf_peer(bench: InProcessBench, peer, prompts: list[Prompt], modes, reference: list[list[int]]) -> dict:
    """HF modes interleaved prompt by prompt (the order alternating) with specserve's adaptive run (the ratio's
    numerator); each prompt's time is its fastest repeat."""
    ours = bench.runner(ADAPTIVE)
    for prompt in prompts[: bench.warmup]:
        ours.wave([prompt])
        for mode in modes:
            peer.generate(prompt, mode)
    names = ("specserve",) + tuple(modes)
    walls = {m: [] for m in names}  # [repeat][prompt]
    tokens = {m: [] for m in names}  # [prompt], from the last repeat (greedy: the same every repeat)
    outputs = {m: [] for m in modes}
    for r in range(bench.repeats):
        for m in names:
            walls[m].append([])
            tokens[m] = []
        for i, prompt in enumerate(prompts):
            for mode in names if (i + r) % 2 == 0 else names[::-1]:
                if mode == "specserve":
                    (measure,), seconds = ours.wave([prompt])
                    count = measure.output_tokens
                else:
                    out, seconds = peer.generate(prompt, mode)
                    count = len(out)
                    outputs[mode].append(list(out))
                walls[mode][r].append(seconds)
                tokens[mode].append(count)
    rows = {}
    for mode in modes:
        last = outputs[mode][-len(prompts):]
        rows[mode] = {"tokens_per_s": best_of(tokens[mode], walls[mode]),
                      "repeat_tokens_per_s": [sum(tokens[mode]) / sum(w) for w in walls[mode]],
                      "output_tokens": sum(len(t) for t in last), "identical_to_specserve": last == reference}
    lookup = [rows[m]["tokens_per_s"] for m in ("prompt_lookup_3", "prompt_lookup_10") if m in rows]
    specserve = best_of(tokens["specserve"], walls["specserve"])
    log.info("  %s: specserve adaptive %.2f, %s tok/s", prompts[0].workload, specserve,
             ", ".join(f"HF {m} {r['tokens_per_s']:.2f}" for m, r in rows.items()))
    return {"workload": prompts[0].workload, "modes": rows, "specserve_adaptive_tokens_per_s": specserve,
            "vs_best_prompt_lookup": specserve / max(lookup) if lookup else None}


def http(bench: InProcessBench, config, prompts: list[Prompt], plan: BenchPlan, best_fixed_gamma: int,
         port: int) -> dict:
    """The concurrency sweep through the Serve app (see bench.http_bench), and single-stream HTTP vs
    the in-process loop (adaptive γ), interleaved request by request."""
    from bench.http_bench import ServedApp, bench_config, complete_sync, measure_levels

    deployments = []  # (fixed γ of the deployment or None, policies served by it)
    if "adaptive" in plan.http_modes or "target_only" in plan.http_modes:
        deployments.append((None, [m for m in ("adaptive", "target_only") if m in plan.http_modes]))
    if "best_fixed" in plan.http_modes:
        deployments.append((best_fixed_gamma, ["best_fixed"]))
    rows, versus = [], None
    with ServedApp(port=port) as app:
        for gamma, modes in deployments:
            name = "bench-adaptive" if gamma is None else f"bench-fixed{gamma}"
            log.info("  http: deploying %s", name)
            app.deploy(bench_config(config, name=name, fixed_gamma=gamma, port=port))
            if gamma is None and "adaptive" in modes:
                versus = _http_vs_inprocess(bench, app, prompts, plan.max_tokens, complete_sync)
            for mode in modes:
                label = f"fixed_{gamma}" if mode == "best_fixed" else mode
                levels = measure_levels(app, prompts, mode=label, levels=plan.http_concurrency,
                                        max_tokens=plan.max_tokens, repeats=bench.repeats,
                                        speculate=mode != "target_only")
                for concurrency, m in levels.items():
                    log.info("  http %s c=%d: %.2f tok/s, p50 %.2fs", label, concurrency, m.tokens_per_s,
                             m.summary()["latency_p50_s"])
                    rows.append({**m.summary(), "policy": mode})
    return {"workload": prompts[0].workload, "best_fixed_gamma": best_fixed_gamma, "rows": rows,
            "single_stream": versus}


def _http_vs_inprocess(bench: InProcessBench, app, prompts: list[Prompt], max_tokens: int, complete_sync) -> dict:
    """Single stream, adaptive γ: each prompt in-process and over HTTP (both warmed up first, the order
    alternating), `repeats` times; each prompt's time is its fastest repeat."""
    ours = bench.runner(ADAPTIVE)
    for prompt in prompts[: bench.warmup]:
        ours.wave([prompt])
        complete_sync(app, prompt, max_tokens)
    walls = {"local": [], "http": []}  # [repeat][prompt]
    tokens = {"local": [], "http": []}
    for r in range(bench.repeats):
        for path in walls:
            walls[path].append([])
            tokens[path] = []
        for i, prompt in enumerate(prompts):
            for path in ("local", "http") if (i + r) % 2 == 0 else ("http", "local"):
                if path == "local":
                    (measure,), seconds = ours.wave([prompt])
                    count = measure.output_tokens
                else:
                    count, seconds = complete_sync(app, prompt, max_tokens)
                walls[path][r].append(seconds)
                tokens[path].append(count)
    out = {"inprocess_tokens_per_s": best_of(tokens["local"], walls["local"]),
           "http_tokens_per_s": best_of(tokens["http"], walls["http"]),
           "repeat_ratios": [sum(tokens["http"]) / sum(h) / (sum(tokens["local"]) / sum(lo))
                             for h, lo in zip(walls["http"], walls["local"])]}
    out["ratio"] = out["http_tokens_per_s"] / out["inprocess_tokens_per_s"]
    log.info("  http vs in-process, single stream: %.2f vs %.2f tok/s", out["http_tokens_per_s"],
             out["inprocess_tokens_per_s"])
    return out
