"""The eval's results: per-arm figures, paired differences against the reference arm, and the frontier plot.

Per arm: mean score, output tokens/s as a ratio of sums (Σ output tokens / Σ request seconds) and the mean of
per-request tokens/s, acceptance rate, mean accepted length, regret spent per request. Per arm other than the
reference, over the problems both answered (`stats`): `score` (mean difference, 95% paired-bootstrap interval),
`mcnemar` (discordant counts b, c and the exact p, binary suites) and `speed` (tokens/s ratio with its interval);
and the output measures (`experiments.eval.measures`): per arm `measures` (NLL, repetition, copy rate, length,
outputs cut by max_tokens), per arm other than the reference `report["measures"][arm]` (hash divergence and the
paired differences).

`write_outputs` writes `results.json` (schema `specserve.eval/v1`), `report.md` and `frontier.png`; for other
reports: `quality_section` (the A/B report's), `asd_quality_delta` (the bench's summary entry) and
`read_eval_report` (results.json from a file or an output directory).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.eval.measures import arm_measures, measure_figures, measures_markdown
from experiments.eval.stats import (
    DEFAULT_RESAMPLES,
    mcnemar_exact,
    paired_bootstrap_mean_diff,
    paired_bootstrap_rate_ratio,
)

SCHEMA = "specserve.eval/v1"
RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"
PLOT_FILE = "frontier.png"


def valid_rows(rows: Sequence[dict]) -> dict[tuple[str, str], dict]:
    """(arm, problem) → its latest row without an error (a rerun's row replaces an earlier one)."""
    out: dict[tuple[str, str], dict] = {}
    for row in rows:
        if not row.get("error") and row.get("score") is not None:
            out[(row["arm"], row["problem"])] = row
    return out


def _sum(rows: Sequence[dict], key: str) -> float:
    return float(sum((r.get("speculative") or {}).get(key) or 0 for r in rows))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _verification(rows: Sequence[dict], settings: dict | None) -> str | None:
    if settings and settings.get("verification"):
        return settings["verification"]
    specs = [r["speculative"] for r in rows if r.get("speculative")]
    if not specs:
        return None
    return "asd" if any("regret_budget" in s for s in specs) else "exact"


def arm_figures(rows: Sequence[dict], errors: int, settings: dict | None) -> dict[str, Any]:
    """One arm's block of the report (module docstring)."""
    scores = np.array([r["score"] for r in rows], dtype=float)  # [n]
    rates = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s") is not None]
    tokens = float(sum(r.get("output_tokens") or 0 for r in rows))
    seconds = float(sum(r.get("seconds") or 0 for r in rows))
    passed = [r["passed"] for r in rows if r.get("passed") is not None]
    verification = _verification(rows, settings)
    regret = [(r.get("speculative") or {}).get("regret_spent") for r in rows]
    regret = [x for x in regret if x is not None]
    return {
        "n": len(rows),
        "errors": errors,
        "verification": verification,
        "settings": settings,
        "score": float(scores.mean()) if len(rows) else None,
        "passed": sum(bool(p) for p in passed) if passed else None,
        "tokens_per_s": _ratio(tokens, seconds),
        "tokens_per_s_mean": float(np.mean(rates)) if rates else None,
        "output_tokens_mean": tokens / len(rows) if rows else None,
        "acceptance_rate": _ratio(_sum(rows, "accepted_tokens"), _sum(rows, "draft_tokens")),
        "mean_accepted_length": _ratio(_sum(rows, "accepted_tokens"), _sum(rows, "rounds")),
        "regret_spent_mean": float(np.mean(regret)) if regret else None,
        "relaxed_tokens": int(_sum(rows, "relaxed_tokens")) if verification == "asd" else None,
        "measures": arm_measures(rows),
    }


def paired_figures(ref_rows: Sequence[dict], arm_rows: Sequence[dict], binary: bool, resamples: int,
                   seed: int) -> dict[str, Any]:
    """arm vs reference over the same problems (`ref_rows[i]` and `arm_rows[i]` answer one problem)."""
    score = paired_bootstrap_mean_diff([r["score"] for r in ref_rows], [r["score"] for r in arm_rows],
                                       resamples=resamples, seed=seed)
    speed = paired_bootstrap_rate_ratio(
        [r.get("output_tokens") or 0 for r in ref_rows], [r.get("seconds") or 0 for r in ref_rows],
        [r.get("output_tokens") or 0 for r in arm_rows], [r.get("seconds") or 0 for r in arm_rows],
        resamples=resamples, seed=seed,
    )
    mcnemar = None
    if binary:
        mcnemar = mcnemar_exact([bool(r["passed"]) for r in ref_rows], [bool(r["passed"]) for r in arm_rows])
    return {
        "n_pairs": score.n,
        "score": {"reference": float(np.mean([r["score"] for r in ref_rows])),
                  "arm": float(np.mean([r["score"] for r in arm_rows])),
                  "diff": score.estimate, "ci95": [score.low, score.high]},
        "mcnemar": mcnemar.to_dict() if mcnemar else None,
        "speed": {"ratio": speed.estimate, "ci95": [speed.low, speed.high]} if speed else None,
    }


def build_eval_report(rows: Sequence[dict], *, suite: str, binary: bool, arms: Sequence[str] | None = None,
                      reference: str | None = None, arm_settings: dict[str, dict] | None = None,
                      resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """The report as a JSON-able dict (schema `specserve.eval/v1`); `arms` fixes their order (default: order
    of first appearance), `reference` defaults to the first arm."""
    rows = [r for r in rows if r.get("suite", suite) == suite]
    names = list(dict.fromkeys([*(arms or []), *(r["arm"] for r in rows)]))
    if not names:
        raise ValueError("rows: no results to report")
    reference = reference or names[0]
    if reference not in names:
        raise ValueError(f"reference: arm {reference!r} has no results; arms: {names}")
    valid = valid_rows(rows)
    problems = list(dict.fromkeys(r["problem"] for r in rows))
    settings = arm_settings or {}
    per_arm = {}
    for arm in names:
        answered = [valid[(arm, p)] for p in problems if (arm, p) in valid]
        failed = {r["problem"] for r in rows if r["arm"] == arm and r.get("error")} - {r["problem"] for r in answered}
        per_arm[arm] = arm_figures(answered, len(failed), settings.get(arm))
    paired, measures = {}, {}
    for arm in names:
        if arm == reference:
            continue
        common = [p for p in problems if (arm, p) in valid and (reference, p) in valid]
        ref_rows, arm_rows = [valid[(reference, p)] for p in common], [valid[(arm, p)] for p in common]
        paired[arm] = paired_figures(ref_rows, arm_rows, binary, resamples, seed) if common else None
        measures[arm] = measure_figures(ref_rows, arm_rows, resamples, seed) if common else None
    return {
        "schema": SCHEMA, "suite": suite, "binary": binary, "reference": reference, "arms_order": names,
        "problems": len(problems), "resamples": resamples, "seed": seed, "created": time.time(),
        "arms": per_arm, "paired": paired, "measures": measures,
    }


# ------------------------------------------------------------------------------------------------ rendering


def _f(value: float | None, digits: int = 2, scale: float = 1.0, sign: bool = False) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value * scale:{'+' if sign else ''}.{digits}f}"


def _ci(ci: Sequence[float] | None, digits: int = 1, scale: float = 1.0, sign: bool = True) -> str:
    return f"[{_f(ci[0], digits, scale, sign)}, {_f(ci[1], digits, scale, sign)}]" if ci else "-"


def _p(p: float | None) -> str:
    return "-" if p is None else f"{p:.3g}"


def quality_section(report: dict) -> dict[str, Any]:
    """For the A/B report: one row per arm with its score and speed, and against the reference the score
    difference (points) and tokens/s ratio, each with its 95% CI, and McNemar's p; plus a markdown table."""
    rows = []
    for arm, a in report["arms"].items():
        pair = report["paired"].get(arm)
        rows.append({
            "arm": arm, "verification": a["verification"], "n": a["n"], "score": a["score"],
            "tokens_per_s": a["tokens_per_s"], "acceptance_rate": a["acceptance_rate"],
            "n_pairs": pair["n_pairs"] if pair else None,
            "score_diff": pair["score"]["diff"] if pair else None,
            "score_diff_ci95": pair["score"]["ci95"] if pair else None,
            "mcnemar_p": pair["mcnemar"]["p_value"] if pair and pair["mcnemar"] else None,
            "speed_ratio": pair["speed"]["ratio"] if pair and pair["speed"] else None,
            "speed_ratio_ci95": pair["speed"]["ci95"] if pair and pair["speed"] else None,
            **_measure_columns(a, (report.get("measures") or {}).get(arm)),
        })
    ref = report["reference"]
    lines = [
        (f"Quality on `{report['suite']}` ({report['problems']} problems), paired by problem against `{ref}`; "
         f"95% paired-bootstrap CIs ({report['resamples']} resamples), exact McNemar p."),
        "",
        "| arm | n | score % | Δ score (pts) | 95% CI | McNemar p | tokens/s | speed × | 95% CI | acceptance |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        is_ref = r["arm"] == ref
        lines.append(
            f"| {r['arm']}{' (ref)' if is_ref else ''} | {r['n']} | {_f(r['score'], 1, 100)} | "
            f"{_f(r['score_diff'], 1, 100, True)} | {_ci(r['score_diff_ci95'], 1, 100)} | {_p(r['mcnemar_p'])} | "
            f"{_f(r['tokens_per_s'], 1)} | {'1.00' if is_ref else _f(r['speed_ratio'], 2)} | "
            f"{_ci(r['speed_ratio_ci95'], 2, sign=False)} | {_f(r['acceptance_rate'], 3)} |"
        )
    if any(a.get("measures") for a in report["arms"].values()):
        lines += ["", measures_markdown(report).rstrip("\n")]
    return {"reference": ref, "suite": report["suite"], "rows": rows, "markdown": "\n".join(lines) + "\n"}


def _measure_columns(arm: dict, pair: dict | None) -> dict[str, Any]:
    """The A/B report's output measures of one arm: its means, the hash divergence and paired NLL difference."""
    m, pair = arm.get("measures") or {}, pair or {}
    nll = pair.get("nll") or {}
    divergence = pair.get("hash_divergence") or {}
    return {"truncated": m.get("truncated"), "nll_mean": m.get("nll_mean"), "repetition_mean": m.get("repetition_mean"),
            "copy_rate_mean": m.get("copy_rate_mean"), "output_tokens_mean": m.get("output_tokens_mean"),
            "hash_divergence": divergence.get("share"), "hash_divergence_ci95": divergence.get("ci95"),
            "nll_diff": nll.get("diff"), "nll_diff_ci95": nll.get("ci95")}


def asd_quality_delta(report: dict) -> dict[str, dict]:
    """The bench's `quality` summary entry `asd_quality_delta`: per ASD arm (setting), the score difference to
    the reference (exact) arm with its 95% CI, McNemar's p and the number of pairs."""
    out = {}
    for arm, a in report["arms"].items():
        pair = report["paired"].get(arm)
        if a["verification"] != "asd" or not pair:
            continue
        out[arm] = {
            "suite": report["suite"], "reference": report["reference"],
            "settings": (a.get("settings") or {}).get("asd"),
            "delta": pair["score"]["diff"], "ci95": pair["score"]["ci95"],
            "mcnemar_p": pair["mcnemar"]["p_value"] if pair["mcnemar"] else None, "n": pair["n_pairs"],
            "speed_ratio": pair["speed"]["ratio"] if pair["speed"] else None,
            **{k: v for k, v in _measure_columns(a, (report.get("measures") or {}).get(arm)).items()
               if k in ("hash_divergence", "nll_diff", "nll_diff_ci95", "truncated")},
        }
    return out


def render_markdown(report: dict, plot_file: str | None = PLOT_FILE) -> str:
    """report.md: the per-arm table, the paired comparison, the plot, and how to read them."""
    lines = [f"# specserve eval: {report['suite']}", "",
             f"{report['problems']} problems, reference arm `{report['reference']}`, greedy decoding.", "",
             ("| arm | verification | answered | errors | score % | tokens/s (Σ/Σ) | tokens/s (mean) | acceptance | "
              "accepted length | regret/request |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, a in report["arms"].items():
        lines.append(
            f"| {arm} | {a['verification'] or '-'} | {a['n']} | {a['errors']} | {_f(a['score'], 1, 100)} | "
            f"{_f(a['tokens_per_s'], 1)} | {_f(a['tokens_per_s_mean'], 1)} | {_f(a['acceptance_rate'], 3)} | "
            f"{_f(a['mean_accepted_length'])} | {_f(a['regret_spent_mean'])} |"
        )
    lines += ["", "## Against the reference", "", quality_section(report)["markdown"]]
    if plot_file:
        lines += [f"![speed–quality frontier]({plot_file})", ""]
    lines += [("An interval that excludes 0 (score) or 1 (speed) is a difference the data support. McNemar's "
               "test uses only the problems where the two arms disagree."), ""]
    return "\n".join(lines)


def plot_frontier(report: dict, path: Path | str) -> Path | None:
    """frontier.png (module docstring); None when matplotlib is missing or no arm has both figures."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ref = report["reference"]
    points = [(ref, 1.0, 0.0, None, None)]
    for arm, pair in report["paired"].items():
        if pair and pair["speed"]:
            points.append((arm, pair["speed"]["ratio"], 100 * pair["score"]["diff"], pair["speed"]["ci95"],
                           [100 * x for x in pair["score"]["ci95"]]))
    if len(points) < 2:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    ax.axhline(0, color="grey", lw=0.8)
    ax.axvline(1, color="grey", lw=0.8)
    for name, x, y, xci, yci in points:
        xerr = [[x - xci[0]], [xci[1] - x]] if xci else None
        yerr = [[y - yci[0]], [yci[1] - y]] if yci else None
        ax.errorbar([x], [y], xerr=xerr, yerr=yerr, fmt="o", capsize=3, label=name)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5))
    front = sorted(points, key=lambda p: (-p[1], -p[2]))
    best, frontier = -math.inf, []
    for p in front:  # non-dominated: no other arm is both faster and better
        if p[2] > best:
            frontier.append(p)
            best = p[2]
    frontier.sort(key=lambda p: p[1])
    ax.plot([p[1] for p in frontier], [p[2] for p in frontier], "--", color="black", lw=0.8, label="frontier")
    ax.set_xlabel(f"output tokens/s relative to {ref}")
    ax.set_ylabel(f"score − {ref} (points)")
    ax.set_title(f"{report['suite']}: speed vs quality (95% CIs)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def read_eval_report(path: Path | str) -> dict:
    """An eval's results.json, given the file or the eval's output directory; ValueError if it is not one. A
    protocol's directory (`specserve eval --protocol`) gives its held-out results, the only ones to quote."""
    path = Path(path)
    if path.is_dir() and not (path / RESULTS_FILE).is_file() and (path / "protocol.json").is_file():
        path = path / "held-out"
        if not (path / RESULTS_FILE).is_file():
            raise ValueError(f"eval: the protocol in {path.parent} judged no arm on held-out problems "
                             f"(see its protocol.md); its selection figures are not to be quoted")
    if path.is_dir():
        path = path / RESULTS_FILE
    report = json.loads(path.read_text())
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ValueError(f"eval: {path} is not an eval result (schema {SCHEMA})")
    return report


def write_outputs(out_dir: Path | str, report: dict) -> list[Path]:
    """results.json, report.md and (when it can be drawn) frontier.png in `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = plot_frontier(report, out_dir / PLOT_FILE)
    (out_dir / RESULTS_FILE).write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / REPORT_FILE).write_text(render_markdown(report, PLOT_FILE if plot else None))
    return [out_dir / RESULTS_FILE, out_dir / REPORT_FILE, *([plot] if plot else [])]
