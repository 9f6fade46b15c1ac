"""Task quality per arm: the bench's `quality` section and the (g, M, B) grid that chooses the default ASD arm.

Both run `specserve eval`'s protocol (`experiments.eval.protocol`) in-process: every arm answers a selection
split of the suite's problems, one ASD arm is chosen there by a fixed rule, and the exact reference and the
chosen arm answer the held-out split once; only the held-out comparison (score, McNemar, hash divergence, NLL
under the target, speed) is quoted. Why task quality and this protocol: docs/experiments.md.

- `quality_section(config, ...)`: the bench section (the config's arms plus the plan's extra ASD settings);
  `summary_entry(section)` is the summary key `asd_quality_delta`, `markdown(section)` the report's part.
- `grid_config(config, settings)`: the config with its exact reference arm and one ASD arm per setting,
  named by the setting's label (`g2_M2_B8`).
- `python -m bench.quality CONFIG --suite S --limit N --out DIR [--settings g2_M2_B8,...] [--split-seed S]
  [--torch-threads 1]`: the grid run (resumable: rerun the same command).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.plan import ASDSetting

log = logging.getLogger(__name__)

# One factor at a time around the earlier default (g 2, M 2, B 8): the (g, M, B) cube of 3 × 2 × 3 settings
# does not fit the CPU time of one run on a shared 2-core machine, and the default's neighbours on each axis
# say which knob moves speed and quality.
DEFAULT_GRID = tuple(ASDSetting(g=g, max_relaxed_per_block=m, budget=b) for g, m, b in (
    (1, 2, 8), (2, 2, 8), (4, 2, 8), (2, 1, 8), (2, 2, 2), (2, 2, 32)))
_LABEL = re.compile(r"^g([0-9.]+)_M([0-9]+)_B([0-9.]+)(?:_(remaining|fraction))?$")


def parse_setting(label: str) -> ASDSetting:
    """`g2_M2_B8` → ASDSetting(g=2, max_relaxed_per_block=2, budget=8); a `_fraction` suffix sets the gate form;
    ValueError naming the label."""
    match = _LABEL.match(label.strip())
    if not match:
        raise ValueError(f"settings: {label!r} is not a label like g2_M2_B8 or g2_M2_B8_fraction")
    return ASDSetting(g=float(match[1]), max_relaxed_per_block=int(match[2]), budget=float(match[3]),
                      gate=match[4] or "remaining")


def _same(arm, setting: ASDSetting) -> bool:
    return arm.asd is not None and (arm.asd.g, arm.asd.max_relaxed_per_block, arm.asd.budget, arm.asd.gate) == (
        setting.g, setting.max_relaxed_per_block, setting.budget, setting.gate)


def reference_arm(config) -> str:
    """The arm the others are compared with: the audit's reference when it is an arm, else the first exact."""
    names = [a.name for a in config.arms]
    if config.audit.reference_arm in names:
        return config.audit.reference_arm
    exact = [a.name for a in config.arms if a.verification == "exact"]
    if not exact:
        raise ValueError("arms: the quality comparison needs an exact arm as its reference")
    return exact[0]


def grid_config(config, settings: Sequence[ASDSetting], keep_arms: bool = False):
    """`config` whose arms are its reference (exact) arm, then (with `keep_arms`) its other arms, then one ASD
    arm per setting not already among them, named by the setting's label."""
    from cluster.config import ArmConfig, SpecServeConfig

    reference = reference_arm(config)
    arms = [a for a in config.arms if a.name == reference or keep_arms]
    arms.sort(key=lambda a: a.name != reference)
    for s in settings:
        if not any(_same(a, s) for a in arms):
            arms.append(ArmConfig.model_validate({"name": s.label, "verification": "asd", "asd": {
                "g": s.g, "max_relaxed_per_block": s.max_relaxed_per_block, "budget": s.budget, "gate": s.gate}}))
    data = config.model_dump()
    data["arms"] = [a.model_dump() for a in arms]
    return SpecServeConfig.model_validate(data)


def run_eval(config, suite_name: str, out_dir: Path, *, limit: int | None = None, max_tokens: int | None = None,
             resamples: int = 2000, split_seed: int = 0, nll: bool = True,
             progress: Callable[[str], None] | None = None) -> tuple[dict, dict]:
    """The protocol on every arm of `config` in-process, reference first; rows resume from `out_dir`. Returns
    (protocol result, the report quoted: the held-out one, or the selection one when no ASD arm was chosen)."""
    from experiments.eval.backends import InProcessBackend
    from experiments.eval.protocol import protocol_markdown, run_protocol
    from experiments.eval.report import read_eval_report
    from experiments.eval.suites import load_suite

    suite = load_suite(suite_name)
    arms = [a.name for a in config.arms]
    likelihood = None
    if nll:
        from experiments.eval.likelihood import TargetLikelihood

        likelihood = TargetLikelihood(config.target.source).nll
    backend = InProcessBackend(config)
    try:
        result = run_protocol(suite, backend, arms, out_dir, reference=reference_arm(config), limit=limit,
                              split_seed=split_seed, max_tokens=max_tokens, likelihood=likelihood,
                              resamples=resamples, progress=progress)
    finally:
        backend.close()
    (Path(out_dir) / "protocol.md").write_text(protocol_markdown(result))
    return result, read_eval_report(result.get("held_out_dir") or result["selection_dir"])


# ------------------------------------------------------------------------------------------------ the bench


def quality_section(config, *, suite: str, problems: int, max_tokens: int | None,
                    settings: Sequence[ASDSetting], out_dir: Path, resume: bool,
                    progress: Callable[[str], None] | None = None) -> dict:
    """The bench's `quality` section: the config's arms and `settings` on the suite's first `problems`.
    Without `resume`, rows of an earlier run in `out_dir` are discarded (the eval runner would resume them)."""
    if not resume and out_dir.exists():
        shutil.rmtree(out_dir)
    from experiments.eval.protocol import PROTOCOL_FILE, ProtocolError
    from experiments.eval.report import read_eval_report

    grid = grid_config(config, settings, keep_arms=True)
    stopped = None
    try:
        protocol, report = run_eval(grid, suite, out_dir, limit=problems, max_tokens=max_tokens, progress=progress)
    except ProtocolError as err:  # the held-out split stays unjudged; the section says why
        stopped = str(err)
        protocol = json.loads((out_dir / PROTOCOL_FILE).read_text())
        report = read_eval_report(protocol["selection_dir"])
    return {"suite": report["suite"], "problems": problems, "max_tokens": max_tokens, "eval_dir": str(out_dir),
            "protocol": protocol, "report": report, "stopped": stopped}


def summary_entry(section: dict) -> dict:
    """`asd_quality_delta`: for the arm chosen on the selection split, its held-out {delta, ci95, mcnemar_p, n,
    speed_ratio, settings, suite, reference}; {} when no arm was judged on held-out problems (selection figures
    are never quoted)."""
    from experiments.eval.report import asd_quality_delta

    protocol = section.get("protocol")
    if protocol is not None and not protocol.get("held_out"):
        return {}
    return asd_quality_delta(section["report"])


def markdown(section: dict) -> list[str]:
    """The report's lines for the section: the protocol's summary, then the quoted (held-out) comparison."""
    from experiments.eval.protocol import protocol_markdown
    from experiments.eval.report import quality_section as table

    report = section["report"]
    title = f"## Task quality per arm (`specserve eval`, {report['suite']}, first {section['problems']} problems)"
    note = ("Greedy answers scored by the suite's tests; Δ is the arm's pass rate minus the reference's in points. "
            f"Rows, reports and frontier plots (selection/, held-out/): `{section['eval_dir']}`.")
    head = [protocol_markdown(section["protocol"]).rstrip("\n"), ""] if section.get("protocol") else []
    if section.get("stopped"):
        head += [f"**Not judged on held-out problems:** {section['stopped']}. The table is the selection split's.", ""]
    return ["", title, "", *head, table(report)["markdown"].rstrip("\n"), "", note]


# ------------------------------------------------------------------------------------------------ the grid


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.quality CONFIG --suite S [--limit N] [--out DIR] [--settings LABELS]`."""
    parser = argparse.ArgumentParser(prog="python -m bench.quality",
                                     description="Task quality of a (g, M, B) grid of ASD arms against exact.")
    parser.add_argument("config", help="deployment config; its exact reference arm is kept, its ASD arms replaced")
    parser.add_argument("--suite", default="humaneval", help="eval suite (default %(default)s)")
    parser.add_argument("--limit", type=int, help="the suite's first N problems")
    parser.add_argument("--max-tokens", type=int, help="override the suite's max_tokens")
    parser.add_argument("--settings", help="comma-separated labels like g2_M2_B8 (default: the built-in grid: "
                                           + ", ".join(s.label for s in DEFAULT_GRID) + ")")
    parser.add_argument("--out", type=Path, help="output directory (default specserve-eval/grid-SUITE)")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the selection/held-out split")
    parser.add_argument("--no-nll", action="store_true", help="skip scoring each output's NLL under the target")
    parser.add_argument("--torch-threads", type=int, help="override the config's unit.torch_threads (on a busy "
                                                          "CPU, 1: threads waiting on preempted threads inflate "
                                                          "every multi-token forward)")
    args = parser.parse_args(argv)
    import torch

    from cluster.config import load_config
    from experiments.eval.protocol import ProtocolError, protocol_markdown
    from experiments.eval.report import quality_section as table

    torch.set_num_threads(1)  # the unit sets its own (config.unit.torch_threads); keep import-time pools small
    try:
        settings = [parse_setting(s) for s in args.settings.split(",")] if args.settings else list(DEFAULT_GRID)
        config = load_config(args.config)
        if args.torch_threads is not None:
            data = config.model_dump()
            data["unit"]["torch_threads"] = args.torch_threads
            config = type(config).model_validate(data)
        config = grid_config(config, settings)
        out = args.out or Path("specserve-eval") / f"grid-{args.suite.replace(':', '_')}"
        protocol, report = run_eval(config, args.suite, out, limit=args.limit, max_tokens=args.max_tokens,
                                    resamples=args.resamples, split_seed=args.split_seed, nll=not args.no_nll,
                                    progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, FileNotFoundError) as err:
        print(f"bench.quality: {err}", file=sys.stderr)
        return 2
    except ProtocolError as err:
        print(f"bench.quality: protocol stopped: {err}", file=sys.stderr)
        return 1
    sys.stdout.write(protocol_markdown(protocol) + "\n" + table(report)["markdown"])
    print(f"wrote {out}/protocol.json, protocol.md, selection/, held-out/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
