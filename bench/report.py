"""results.json → a Markdown report and PNG plots (matplotlib, Agg backend; no display needed).

Plots: `gamma_sweep.png` (tokens/s per fixed γ with adaptive and target-only marked, single stream and under
load), `asd_frontier.png` (speed vs divergence of the ASD settings), `concurrency.png` (HTTP aggregate
tokens/s and latency by concurrency), `peer.png` (specserve vs Hugging Face per workload),
`predicted_vs_realized.png`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from bench.quality import markdown as quality_markdown

log = logging.getLogger(__name__)


def _fmt(x, fmt=".2f") -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return format(x, fmt)
    return str(x)


def _value(v) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    return _fmt(v)


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_fmt(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return out


def markdown(results: dict, plots: list[str]) -> str:
    meta = results["meta"]
    sections = results["sections"]
    lines = [f"# specserve benchmark ({meta['plan']['name']})", "",
             f"- command: `{meta['command']}`",
             f"- machine: {meta['machine']}",
             f"- model: {meta['model']}, drafter: {meta['drafter']}, torch threads {meta['torch_threads']}",
             f"- prompts per workload {meta['plan']['prompts']}, max_tokens {meta['plan']['max_tokens']}, "
             f"repeats {meta['plan']['repeats']} (median), seed {meta['plan']['seed']}",
             f"- started {meta['started']}, took {_fmt(meta.get('elapsed_s'), '.0f')} s"
             + (f" ({len(meta['reused_sections'])} sections reused from an earlier run of the same plan)"
                if meta.get("reused_sections") else ""), "",
             "## Goals", ""]
    lines += _table(["key", "goal", "measured", "met", "why (if missed)"],
                    [[g["key"], g["goal"], _value(g["value"]),
                      "–" if g["met"] is None else ("met" if g["met"] else "**missed**"), g["why"]]
                     for g in results["goals"]])
    single = sections.get("single", {})
    if single:
        gammas = sorted({int(g) for s in single.values() for g in s["gamma_sweep"]["fixed"]})
        lines += ["", "## Single stream: target-only, fixed γ, adaptive (tokens/s, in-process)", ""]
        lines += _table(["workload"] + [f"γ={g}" for g in gammas] + ["adaptive", "best fixed γ", "identical tokens"],
                        [[w] + [s["gamma_sweep"]["fixed"].get(str(g)) for g in gammas]
                         + [s["gamma_sweep"]["adaptive_tokens_per_s"], str(s["gamma_sweep"]["best_fixed_gamma"]),
                            _fmt(all(s["identical"].values()))] for w, s in single.items()])
        lines += ["", "## Measured α, c, v(γ) and predicted vs realized decode speedup (adaptive γ)", ""]
        lines += _table(["workload", "α", "c", "drafts/round", "v(k) by k", "predicted", "realized",
                         "orchestration share"],
                        [[w, f["alpha"], _fmt(f["c"], ".4f"), f.get("mean_drafted"),
                          ", ".join(f"{k}: {x:.2f}" for k, x in f["v"].items() if k != "0") or "–",
                          f["predicted"], f["realized"], _fmt((f.get("round_time_share") or {}).get("orchestration"), ".1%")]
                         for w, f in ((w, s["fit"]["adaptive"]) for w, s in single.items())])
        stalled = {w: sum(f.get("stalled_rounds", 0) for f in s["fit"].values()) for w, s in single.items()}
        rounds = {w: sum(f.get("rounds", 0) or 0 for f in s["fit"].values()) for w, s in single.items()}
        lines += ["", "Stalled rounds (score time > 5 × a plain step: the CPU was taken by other processes), "
                  "all modes: " + ", ".join(f"{w} {stalled[w]}/{rounds[w]}" for w in single)
                  + ". Figures from a run with stalls are noisy; take final figures on a quiet machine."]
    batched = sections.get("batched", {})
    if batched:
        lines += ["", "## Under load: in-process concurrency sweep of γ (aggregate tokens/s)", ""]
        for w, b in batched.items():
            sweep = b["gamma_sweep"]
            lines += [f"- {w}, concurrency {b['concurrency']}: " + ", ".join(
                f"γ={g} {_fmt(v)}" for g, v in sweep["fixed"].items())
                + f"; adaptive {_fmt(sweep['adaptive_tokens_per_s'])} "
                f"({_fmt(sweep['adaptive_tokens_per_s'] / sweep['best_fixed_tokens_per_s'])}× best fixed γ="
                f"{sweep['best_fixed_gamma']}, {_fmt(sweep['adaptive_tokens_per_s'] / sweep['target_only_tokens_per_s'])}× "
                f"no speculation)"]
    asd = sections.get("asd", {})
    if asd:
        lines += ["", "## ASD against exact verification (adaptive γ)", ""]
        lines += _table(["workload", "setting", "tokens/s", "× exact", "accepted len (exact)", "regret/request",
                         "relaxed", "exact match", "token agreement"],
                        [[w, r["setting"], r["tokens_per_s"], r["vs_exact"],
                          f"{_fmt(r['mean_accepted_length'])} ({_fmt(r['exact_mean_accepted_length'])})",
                          r["regret_spent_mean"], str(r["relaxed_tokens"]), r["exact_match_rate"], r["token_agreement"]]
                         for w, a in asd.items() for r in a["settings"]])
        parts = [(w, r["setting"], r["decomposition"]) for w, a in asd.items() for r in a["settings"]
                 if r.get("decomposition")]
        if parts:
            lines += ["", "Tokens per round, decomposed (bench.decompose): exact on its own path, exact greedy "
                      "verification replayed on the ASD arm's rounds, and the ASD arm.", ""]
            lines += _table(["workload", "setting", "exact", "exact on ASD's path", "ASD", "trajectory ×",
                             "relaxation ×", "relaxed/round", "γ mean exact / ASD", "replay agreement"],
                            [[w, s, d["tokens_per_round"]["exact"], d["tokens_per_round"]["exact_on_asd_path"],
                              d["tokens_per_round"]["asd"], d["trajectory_gain"], d["relaxation_gain"],
                              d["relaxed_per_round"],
                              f"{_fmt(d['gamma_mean']['exact'])} / {_fmt(d['gamma_mean']['asd'])}",
                              d["replay_agreement"]] for w, s, d in parts])
    from bench.sampled import markdown as sampled_markdown

    lines += sampled_markdown(sections.get("sampled", {}))
    hf = sections.get("hf", {})
    if hf:
        modes = list(dict.fromkeys(m for h in hf.values() for m in h["modes"]))
        lines += ["", "## The peer: Hugging Face transformers `generate` (tokens/s, same prompts, greedy)", ""]
        lines += _table(["workload", "specserve target-only", "specserve adaptive"] + [f"HF {m}" for m in modes],
                        [[w, single.get(w, {}).get("runs", {}).get("target_only", {}).get("tokens_per_s"),
                          h["specserve_adaptive_tokens_per_s"]]
                         + [h["modes"].get(m, {}).get("tokens_per_s") for m in modes] for w, h in hf.items()])
        lines += ["", "specserve adaptive and the HF modes are interleaved prompt by prompt; specserve "
                  "target-only comes from the single-stream sweep."]
    http = sections.get("http")
    if http:
        lines += ["", f"## Through the HTTP app ({http['workload']}; one unit, non-streaming /v1/completions)", ""]
        lines += _table(["policy", "concurrency", "aggregate tokens/s", "p50 latency s", "p95 latency s"],
                        [[r["mode"], str(r["concurrency"]), r["tokens_per_s"], r["latency_p50_s"], r["latency_p95_s"]]
                         for r in http["rows"]])
        one = http.get("single_stream")
        if one:
            lines += ["", f"Single stream, adaptive γ, interleaved request by request: HTTP "
                      f"{_fmt(one['http_tokens_per_s'])} tok/s vs in-process {_fmt(one['inprocess_tokens_per_s'])} "
                      f"({_fmt(one['ratio'])}×)."]
    if sections.get("quality"):
        lines += quality_markdown(sections["quality"])
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path) -> list[str]:
    """Write the PNG plots into `out`; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = results["sections"]
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    single, batched = sections.get("single", {}), sections.get("batched", {})
    if single:
        panels = [("single stream", single)] + ([("concurrency under load", batched)] if batched else [])
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
        for ax, (title, data) in zip(axes[0], panels):
            for w, s in data.items():
                sweep = s["gamma_sweep"]
                xs = sorted(int(g) for g in sweep["fixed"])
                line, = ax.plot(xs, [sweep["fixed"][str(g)] for g in xs], marker="o", label=f"{w} fixed γ")
                ax.axhline(sweep["adaptive_tokens_per_s"], color=line.get_color(), linestyle="--", linewidth=1,
                           label=f"{w} adaptive")
            ax.set(xlabel="fixed γ (0 = target-only)", ylabel="tokens/s", title=f"γ sweep, {title}")
            ax.legend(fontsize=7)
        save(fig, "gamma_sweep.png")
        fig, ax = plt.subplots(figsize=(5, 4))
        for w, s in single.items():
            pts = [(f["predicted"], f["realized"]) for f in s["fit"].values() if f["predicted"] and f["realized"]]
            if pts:
                ax.scatter(*zip(*pts), label=w)
        lims = [0, max([1.0] + [max(f["predicted"] or 0, f["realized"] or 0) for s in single.values()
                                for f in s["fit"].values()]) * 1.1]
        ax.plot(lims, lims, color="grey", linewidth=1)
        ax.set(xlabel="predicted speedup (measured α, c, v)", ylabel="realized decode speedup",
               title="predicted vs realized, every mode", xlim=lims, ylim=lims)
        ax.legend(fontsize=7)
        save(fig, "predicted_vs_realized.png")
    asd = sections.get("asd", {})
    if asd:
        fig, ax = plt.subplots(figsize=(5, 4))
        for w, a in asd.items():
            rows = sorted(a["settings"], key=lambda r: 1 - r["token_agreement"])
            # exact verification is the frontier's origin: no divergence, 1.0× its own speed
            ax.plot([0.0] + [1 - r["token_agreement"] for r in rows], [1.0] + [r["vs_exact"] for r in rows],
                    marker="o", label=w)
            for r in rows:
                ax.annotate(r["setting"], (1 - r["token_agreement"], r["vs_exact"]), fontsize=6)
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set(xlabel="divergence from exact greedy (1 − token agreement)", ylabel="tokens/s vs exact",
               title="ASD speed / divergence frontier")
        ax.legend(fontsize=7)
        save(fig, "asd_frontier.png")
    hf = sections.get("hf", {})
    if hf and single:
        modes = list(dict.fromkeys(m for h in hf.values() for m in h["modes"]))
        series = [("specserve target-only", lambda w: single[w]["runs"]["target_only"]["tokens_per_s"]),
                  ("specserve adaptive", lambda w: hf[w]["specserve_adaptive_tokens_per_s"])]
        series += [(f"HF {m}", lambda w, m=m: hf[w]["modes"].get(m, {}).get("tokens_per_s") or 0.0) for m in modes]
        workloads = [w for w in hf if w in single]
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(series)
        for i, (label, get) in enumerate(series):
            ax.bar([j + i * width for j in range(len(workloads))], [get(w) for w in workloads], width, label=label)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
        ax.set(ylabel="tokens/s", title="specserve vs Hugging Face generate (single stream)")
        ax.legend(fontsize=7)
        save(fig, "peer.png")
    http = sections.get("http")
    if http:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for mode in dict.fromkeys(r["mode"] for r in http["rows"]):
            rows = [r for r in http["rows"] if r["mode"] == mode]
            xs = [r["concurrency"] for r in rows]
            a1.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=mode)
            a2.plot(xs, [r["latency_p50_s"] for r in rows], marker="o", label=f"{mode} p50")
            a2.plot(xs, [r["latency_p95_s"] for r in rows], marker="x", linestyle=":", label=f"{mode} p95")
        a1.set(xlabel="concurrent requests", ylabel="aggregate tokens/s", title="HTTP throughput")
        a2.set(xlabel="concurrent requests", ylabel="latency s", title="HTTP latency")
        a1.legend(fontsize=7)
        a2.legend(fontsize=7)
        save(fig, "concurrency.png")
    return written


def write_report(results: dict, out: Path) -> Path:
    """Plots and `report.md` into `out`; returns the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        plots = plot(results, out)
    except ImportError:
        log.warning("matplotlib is not installed: the report has no plots (pip install specserve[bench])")
        plots = []
    path = out / "report.md"
    path.write_text(markdown(results, plots))
    return path
