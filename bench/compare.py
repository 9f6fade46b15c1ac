"""`python -m bench.compare A/results.json B/results.json [...]`: the summary ratios of runs side by side.

For every summary key (and workload) it prints each run's value and the spread, (max − min) / mean, and says
which exceed `--tolerance` (default ±5%, i.e. a spread of 10%). Two `--quick` runs made back to back on a quiet
machine should agree within it; the figures say how far a run can be trusted on the machine at hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows(summaries: list[dict]) -> list[tuple[str, list[float | None]]]:
    """(key[/workload], one value per run) for every key any run has, in the first run's order."""
    keys: list[str] = []
    for summary in summaries:
        for key, value in summary.items():
            names = [f"{key}/{w}" for w in value] if isinstance(value, dict) else [key]
            keys += [n for n in names if n not in keys]
    out = []
    for name in keys:
        key, _, workload = name.partition("/")
        values = []
        for summary in summaries:
            value = summary.get(key)
            value = value.get(workload) if isinstance(value, dict) else value
            if isinstance(value, dict):  # asd_quality_delta/ARM: {"delta", "ci95", ...}: its delta
                value = value.get("delta")
            values.append(value if isinstance(value, (int, float)) else None)
        out.append((name, values))
    return out


def spread(values: list[float | None]) -> float | None:
    """(max − min) / mean over the runs that measured it; None with fewer than two."""
    present = [v for v in values if v is not None]
    if len(present) < 2:
        return None
    mean = sum(present) / len(present)
    return (max(present) - min(present)) / mean if mean else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results.json files (or folders holding one)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="agreement wanted: ±this share (0.05)")
    args = parser.parse_args(argv)
    if len(args.results) < 2:
        parser.error("give at least two results")
    paths = [Path(p) / "results.json" if Path(p).is_dir() else Path(p) for p in args.results]
    summaries = [json.loads(p.read_text())["summary"] for p in paths]
    width = max(len(name) for name, _ in rows(summaries))
    print(f"{'key':{width}s} " + " ".join(f"{'run ' + str(i + 1):>8s}" for i in range(len(paths))) + "   spread")
    outside = 0
    for name, values in rows(summaries):
        s = spread(values)
        flag = "" if s is None or s <= 2 * args.tolerance else "  > ±{:.0%}".format(args.tolerance)
        outside += bool(flag)
        cells = " ".join(f"{v:8.3f}" if v is not None else f"{'-':>8s}" for v in values)
        print(f"{name:{width}s} {cells}   {'' if s is None else format(s, '6.1%')}{flag}")
    print(f"{outside} ratio(s) outside ±{args.tolerance:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
