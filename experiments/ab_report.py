"""`specserve ab report`: per-arm figures of an A/B experiment and each arm's difference from the reference.

Input is the telemetry hub's export (schema `specserve.export/v1`), fetched from a running service at
`GET {url}/v1/specserve/export` or read from a saved JSON file; `--eval` adds a `specserve eval` result's task
quality per arm (`experiments.eval.report.quality_section`). Per arm, over requests that finished normally:
speed (`COMPARED`), acceptance, regret, which verification ran (`experiments.verification_share`) and the audit
(`cluster.serving.audit.summarize`); per arm other than the reference, `arm − reference` of each statistic in
`COMPARED` with a 95% percentile-bootstrap interval (`--resamples`, seeded by `--seed`). Methods:
docs/experiments.md.

`build_report(export)` is the pure computation (a JSON-able dict; `--json` prints it). `configure_parser(parser)`
declares the arguments (`cluster.cli` mounts them as `specserve ab report`), `run(args)` runs them, and
`main(argv)` parses the arguments after `ab report`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from cluster.serving.audit import AuditRecord, summarize
from experiments.verification_share import verification_figures, warnings

EXPORT_PATH = "/v1/specserve/export"
DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_RESAMPLES = 2000
COMPLETED = ("stop", "length")
_MAX_CELLS = 4_000_000  # bootstrap index cells held at once (resamples × requests)

# statistic name → (kind, columns): "mean"/"p50" of one column, or "ratio" of two columns' sums.
COMPARED: dict[str, tuple[str, tuple[str, ...]]] = {
    "tokens_per_s_mean": ("mean", ("tokens_per_s",)),
    "tokens_per_s_p50": ("p50", ("tokens_per_s",)),
    "ttft_s_mean": ("mean", ("ttft_s",)),
    "tpot_s_mean": ("mean", ("tpot_s",)),
    "acceptance_rate": ("ratio", ("accepted_tokens", "draft_tokens")),
    "mean_accepted_length": ("ratio", ("accepted_tokens", "rounds")),
    "regret_spent_mean": ("mean", ("regret_spent",)),
    "ledger_exhaustion_rate": ("mean", ("ledger_exhausted",)),
}


# ------------------------------------------------------------------------------------------ computation


def _column(rows: Sequence[dict], key: str) -> np.ndarray:
    """Float column; None becomes NaN (missing), except regret (an exact arm spends 0) and booleans."""
    default = 0.0 if key in ("regret_spent", "ledger_exhausted") else math.nan
    return np.array([default if r.get(key) is None else float(r[key]) for r in rows], dtype=float)


def _summary(values: np.ndarray) -> dict[str, float | None]:
    values = values[~np.isnan(values)]
    if not len(values):
        return {"mean": None, "p50": None, "p95": None}
    return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p95": float(np.percentile(values, 95))}


def _ratio(num: np.ndarray, den: np.ndarray) -> float | None:
    total = den.sum()
    return float(num.sum() / total) if total > 0 else None


def _statistic(kind: str, columns: Sequence[np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """stat(idx [R, n]) -> [R]: the statistic on each resample of row indices (NaN when undefined)."""
    if kind == "ratio":
        num, den = columns

        def ratio(idx: np.ndarray) -> np.ndarray:
            d = den[idx].sum(axis=1)  # [R]
            with np.errstate(invalid="ignore", divide="ignore"):
                return np.where(d > 0, num[idx].sum(axis=1) / d, np.nan)

        return ratio
    (x,) = columns
    reduce = np.nanmean if kind == "mean" else np.nanmedian

    def center(idx: np.ndarray) -> np.ndarray:
        values = x[idx]  # [R, n]
        out = np.full(len(idx), np.nan)
        defined = ~np.isnan(values).all(axis=1)
        if defined.any():
            out[defined] = reduce(values[defined], axis=1)
        return out

    return center


def _bootstrap(stat: Callable[[np.ndarray], np.ndarray], n: int, resamples: int,
               rng: np.random.Generator) -> np.ndarray:
    """[resamples] values of `stat` on index resamples of n rows, drawn in chunks to bound memory."""
    chunk = max(1, _MAX_CELLS // max(n, 1))
    parts = []
    for start in range(0, resamples, chunk):
        idx = rng.integers(0, n, size=(min(chunk, resamples - start), n))  # [R_chunk, n]
        parts.append(stat(idx))
    return np.concatenate(parts)


def _point(kind: str, columns: Sequence[np.ndarray]) -> float | None:
    if kind == "ratio":
        return _ratio(*columns)
    x = columns[0][~np.isnan(columns[0])]
    if not len(x):
        return None
    return float(x.mean() if kind == "mean" else np.median(x))


def _clean(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def arm_figures(rows: Sequence[dict], audits: Sequence[AuditRecord]) -> dict[str, Any]:
    """The per-arm block of the report (see the module docstring)."""
    done = [r for r in rows if r.get("finish_reason") in COMPLETED]
    verifications = sorted({r.get("verification", "exact") for r in rows})
    regret = _column(done, "regret_spent")
    return {
        "requests": len(rows),
        "completed": len(done),
        "aborted": sum(r.get("finish_reason") == "abort" for r in rows),
        "errors": sum(r.get("finish_reason") == "error" for r in rows),
        "verification": verifications[0] if len(verifications) == 1 else verifications,
        "tokens_per_s": _summary(_column(done, "tokens_per_s")),
        "ttft_s": _summary(_column(done, "ttft_s")),
        "tpot_s": _summary(_column(done, "tpot_s")),
        "acceptance_rate": _ratio(_column(done, "accepted_tokens"), _column(done, "draft_tokens")),
        "mean_accepted_length": _ratio(_column(done, "accepted_tokens"), _column(done, "rounds")),
        "regret_spent": {"total": float(regret.sum()), "mean": float(regret.mean()) if len(done) else None},
        "ledger_exhaustions": sum(bool(r.get("ledger_exhausted")) for r in rows),
        "degraded": sum(bool(r.get("degraded")) for r in rows),
        "audit": summarize(audits) if audits else None,
        **verification_figures(rows),
    }


def compare_arms(ref_rows: Sequence[dict], arm_rows: Sequence[dict], resamples: int,
                 rng: np.random.Generator) -> dict[str, dict]:
    """arm − reference for each statistic in `COMPARED`, with a 95% percentile-bootstrap interval."""
    ref_done = [r for r in ref_rows if r.get("finish_reason") in COMPLETED]
    arm_done = [r for r in arm_rows if r.get("finish_reason") in COMPLETED]
    out = {}
    for name, (kind, keys) in COMPARED.items():
        ref_cols = [_column(ref_done, k) for k in keys]
        arm_cols = [_column(arm_done, k) for k in keys]
        ref_value, arm_value = _point(kind, ref_cols), _point(kind, arm_cols)
        entry = {"reference": ref_value, "arm": arm_value, "diff": None, "ci95": None, "relative": None}
        if ref_value is not None and arm_value is not None:
            entry["diff"] = arm_value - ref_value
            entry["relative"] = _clean(entry["diff"] / ref_value) if ref_value else None
            diffs = (_bootstrap(_statistic(kind, arm_cols), len(arm_done), resamples, rng)
                     - _bootstrap(_statistic(kind, ref_cols), len(ref_done), resamples, rng))
            diffs = diffs[~np.isnan(diffs)]
            if len(diffs):
                lo, hi = np.percentile(diffs, [2.5, 97.5])
                entry["ci95"] = [float(lo), float(hi)]
        out[name] = entry
    return out


def build_report(export: dict, reference: str | None = None, resamples: int = DEFAULT_RESAMPLES,
                 seed: int = 0) -> dict[str, Any]:
    """The whole report as a JSON-able dict:

    {"schema": "specserve.report/v1", "service", "reference", "resamples", "seed",
     "dropped": export's dropped counts,
     "changes": [{"at_s", "arms_before", "arms_after", "weights_before", "weights_after", "requests_before",
                  "requests_after"}] (each upgrade that changed the arms or their weights; requests counted by when
                they finished; weights None where the export does not have them),
     "warnings": [verification_share.warnings(...) entries: {"arm", "message", "share", ...}],
     "arms": {name: arm_figures(...)}  (config order),
     "differences": {name: {statistic: {"reference", "arm", "diff", "ci95": [lo, hi] | None, "relative"}}}}
    """
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    requests = export.get("requests", [])
    audits = [AuditRecord.from_dict(a) for a in export.get("audits", [])]
    names = list(dict.fromkeys([*export.get("arms", []), *(r["arm"] for r in requests)]))
    by_arm = {name: [r for r in requests if r["arm"] == name] for name in names}
    names = [n for n in names if by_arm[n] or any(a.arm == n for a in audits)]
    if reference is None:
        reference = names[0] if names else None
    elif reference not in names:
        raise ValueError(f"reference arm {reference!r} has no requests in the export; arms: {names}")
    rng = np.random.default_rng(seed)
    return {
        "schema": "specserve.report/v1",
        "service": export.get("service"),
        "reference": reference,
        "resamples": resamples,
        "seed": seed,
        "dropped": export.get("dropped", {}),
        "changes": changes(export.get("deployments", []), requests),
        "warnings": warnings(by_arm, reference),
        "arms": {n: arm_figures(by_arm[n], [a for a in audits if a.arm == n]) for n in names},
        "differences": {
            n: compare_arms(by_arm[reference], by_arm[n], resamples, rng) for n in names if n != reference
        },
    }


def changes(deployments: Sequence[dict], requests: Sequence[dict]) -> list[dict[str, Any]]:
    """Each change of the configured arms or their weights after the first deployment, with the requests that
    finished before and after it (a row's arm is the one it ran with, whichever version assigned it)."""
    out = []
    for before, after in zip(deployments, deployments[1:]):
        at = after["at_s"]
        out.append({"at_s": at, "arms_before": before["arms"], "arms_after": after["arms"],
                    "weights_before": before.get("weights"), "weights_after": after.get("weights"),
                    "requests_before": sum(1 for r in requests if r["finished_s"] < at),
                    "requests_after": sum(1 for r in requests if r["finished_s"] >= at)})
    return out


# ------------------------------------------------------------------------------------------ rendering


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value * scale:{'+' if sign else ''}.{digits}f}"


def _triple(summary: dict, scale: float = 1.0, digits: int = 1) -> str:
    return "/".join(_fmt(summary[k], scale, digits) for k in ("mean", "p50", "p95"))


def _arms_text(change: dict, side: str) -> str:
    """'exact, asd' or, with weights, 'exact ×1, asd ×3'."""
    weights = change.get(f"weights_{side}") or {}
    return ", ".join(f"{name} ×{weights[name]:g}" if name in weights else name for name in change[f"arms_{side}"])


def render_text(report: dict) -> str:
    """The human-readable report."""
    if not report["arms"]:
        return "specserve A/B report: the export holds no requests yet\n"
    lines = [f"WARNING: {w['message']}" for w in report.get("warnings", [])]
    lines += [
        *([""] if lines else []),
        f"specserve A/B report: service {report['service']}, reference arm {report['reference']}",
        "tokens/s, TTFT and TPOT as mean/p50/p95 per request; TTFT and TPOT in ms; own = share of requests "
        "the arm's own verification ran on",
        "",
        f"{'arm':<16}{'requests':>9}{'tokens/s':>22}{'TTFT ms':>24}{'TPOT ms':>22}{'accept':>8}{'acc len':>8}"
        f"{'regret/req':>11}{'exhausted':>10}{'degraded':>9}{'own %':>7}",
    ]
    for name, a in report["arms"].items():
        lines.append(
            f"{name:<16}{a['requests']:>9}{_triple(a['tokens_per_s']):>22}{_triple(a['ttft_s'], 1e3):>24}"
            f"{_triple(a['tpot_s'], 1e3):>22}{_fmt(a['acceptance_rate'], digits=3):>8}"
            f"{_fmt(a['mean_accepted_length']):>8}{_fmt(a['regret_spent']['mean']):>11}"
            f"{a['ledger_exhaustions']:>10}{a['degraded']:>9}{_fmt(a.get('own_verification_share'), 100, 0):>7}"
        )
    for name, diffs in report["differences"].items():
        lines += ["", f"{name} − {report['reference']} (95% bootstrap CI, {report['resamples']} resamples, "
                      f"seed {report['seed']})"]
        for stat, d in diffs.items():
            ci = d["ci95"]
            ci_text = f"[{_fmt(ci[0], digits=4, sign=True)}, {_fmt(ci[1], digits=4, sign=True)}]" if ci else "-"
            rel = f"({_fmt(d['relative'], 100, 1, sign=True)}%)" if d["relative"] is not None else ""
            lines.append(f"  {stat:<24}{_fmt(d['diff'], digits=4, sign=True):>12}  {ci_text:<28}{rel}")
    for name, a in report["arms"].items():
        sampled = a.get("sampled_asd")
        if sampled:
            lines += ["", f"sampled requests of {name} verified by ASD (asd.sampled: relaxed): {sampled['n']}, "
                          f"ledger spend {_fmt(sampled['regret_spent_mean'])} nats mean, "
                          f"{_fmt(sampled['regret_spent_max'])} max, of budget {_fmt(sampled['regret_budget'])} "
                          "(an output is at most e^spend times as likely as under the target). The audit "
                          "replays greedy requests only: their quality is measured by `specserve eval`."]
        audit = a["audit"]
        if not audit:
            continue
        lines += [
            "",
            f"audit of {name}: {audit['n']} requests, exact match {_fmt(audit['exact_match_rate'], 100, 1)}%, "
            f"prefix agreement {_fmt(audit['mean_prefix_agreement'], 100, 1)}%, "
            f"edit distance {_fmt(audit['mean_edit_distance'], digits=1)} tokens, "
            f"Spearman(regret, divergence) {_fmt(audit['regret_divergence_spearman'], digits=2)}",
        ]
        for b in audit["by_regret"]:
            lines.append(
                f"  regret {_fmt(b['regret_lo'])}..{_fmt(b['regret_hi'])}: n={b['n']}, "
                f"exact {_fmt(b['exact_match_rate'], 100, 1)}%, prefix {_fmt(b['mean_prefix_agreement'], 100, 1)}%"
            )
    for change in report.get("changes", []):
        when = datetime.fromtimestamp(change["at_s"], timezone.utc).isoformat(timespec="seconds")
        lines += ["", f"arms changed at {when}: {_arms_text(change, 'before')} -> {_arms_text(change, 'after')} "
                      f"({change['requests_before']} requests finished before, {change['requests_after']} after)"]
    dropped = report.get("dropped") or {}
    if any(dropped.values()):
        lines += ["", f"note: the export's ring buffers dropped {dropped} older rows"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ CLI


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the report's arguments to `parser`."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--url", help=f"running service; the export is read from URL{EXPORT_PATH} "
                                      f"(default {DEFAULT_URL}, unless only --eval is given)")
    source.add_argument("--file", type=Path, help="read a saved export (JSON) instead of the service")
    parser.add_argument("--eval", type=Path, help="a `specserve eval` result (its output directory or results.json): "
                                                  "show task quality per arm beside the speed figures")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (default %(default)s)")
    parser.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES,
                        help="bootstrap resamples (default %(default)s)")
    parser.add_argument("--reference", help="reference arm (default: the first arm of the export)")
    parser.add_argument("--timeout", type=float, default=30.0, help="HTTP timeout in seconds")
    return parser


def load_export(url: str | None = None, file: Path | None = None, timeout: float = 30.0) -> dict:
    """The export from a file, or from `GET {url}/v1/specserve/export`."""
    if file is not None:
        return json.loads(Path(file).read_text())
    response = httpx.get(url.rstrip("/") + EXPORT_PATH, timeout=timeout)
    response.raise_for_status()
    return response.json()


def render_quality(quality: dict) -> str:
    """The quality section as text (its markdown table reads as is in a terminal)."""
    return f"\ntask quality (specserve eval), reference arm {quality['reference']}\n{quality['markdown']}"


def _quality(path: Path | None) -> dict | None:
    """The quality section of an eval result, or None without `--eval`; ValueError/OSError when unreadable."""
    if path is None:
        return None
    from experiments.eval.report import quality_section, read_eval_report

    return quality_section(read_eval_report(path))


def run(args: argparse.Namespace) -> int:
    """Run the report for parsed arguments; 0 on success, 2 when the export or the eval can't be read or used."""
    try:
        quality = _quality(getattr(args, "eval", None))
    except (OSError, ValueError, KeyError, TypeError) as err:
        sys.stderr.write(f"specserve ab report: could not read the eval result: {err}\n")
        return 2
    if quality is not None and args.url is None and args.file is None:
        sys.stdout.write(json.dumps({"quality": quality}, indent=2) + "\n" if args.json else render_quality(quality))
        return 0
    try:
        export = load_export(args.url or DEFAULT_URL, args.file, args.timeout)
    except (OSError, ValueError, httpx.HTTPError) as err:
        sys.stderr.write(f"specserve ab report: could not read the export: {err}\n")
        return 2
    try:
        report = build_report(export, reference=args.reference, resamples=args.resamples, seed=args.seed)
    except (ValueError, KeyError, TypeError) as err:
        sys.stderr.write(f"specserve ab report: unusable export: {err}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps({**report, **({"quality": quality} if quality else {})}, indent=2) + "\n")
    else:
        sys.stdout.write(render_text(report) + (render_quality(quality) if quality else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`specserve ab report [--url URL | --file EXPORT.json] [--eval DIR] [--json] [--seed N] [--resamples N]
    [--reference ARM]`; argv are the arguments after `ab report`."""
    parser = argparse.ArgumentParser(prog="specserve ab report", description=__doc__.split("\n\n")[0])
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
