"""Choosing an arm without judging it on the problems it was chosen on.

1. **Split.** The problems (the suite's first `limit`) are ranked by SHA-256 of f"{seed}/{problem id}"; the first
   round(n · held_out_share) form the **held-out** split, the rest the **selection** split. The seed and both
   lists of ids are written in `protocol.json`.
2. **Selection.** Every arm answers the selection split (`OUT/selection/`, an ordinary eval directory). Before
   anything else is looked at, the reference arm's outputs must end by EOS or a stop string in at least
   `min_ended_share` of problems; otherwise the protocol stops (`ProtocolError`) before spending the held-out
   split, and says to rerun with a larger max_tokens in a new directory.
3. **Choice** (`choose_arm`), a rule fixed before the data: an arm is eligible when its score difference to the
   reference is at least −`margin` points and McNemar's test (binary suites) does not find it worse at 0.05;
   among eligible arms the one with the highest tokens/s ratio is chosen; none eligible chooses the reference.
4. **Judgement.** The reference and the chosen arm answer the held-out split once (`OUT/held-out/`); only its
   figures are quoted (`protocol.json` "held_out"). Rerunning resumes; a held-out directory that already holds
   another choice is refused, since a second look would make it a selection split.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.eval.backends import EvalBackend
from experiments.eval.report import build_eval_report, write_outputs
from experiments.eval.runner import LikelihoodScorer, read_rows, read_run_info, run_suite
from experiments.eval.suites import EvalPrompt, Problem, Score, Suite

SCHEMA = "specserve.eval-protocol/v1"
PROTOCOL_FILE = "protocol.json"
SELECTION_DIR, HELD_OUT_DIR = "selection", "held-out"
MIN_ENDED_SHARE = 0.95
DEFAULT_MARGIN = 0.05  # score points (as a fraction) an arm may lose on the selection split and stay eligible
ALPHA = 0.05


class ProtocolError(RuntimeError):
    """The protocol cannot go on without spoiling the held-out split (e.g. too many truncated outputs)."""


@dataclass(frozen=True)
class Split:
    seed: int
    held_out_share: float
    selection: tuple[str, ...]
    held_out: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"seed": self.seed, "held_out_share": self.held_out_share, "selection": list(self.selection),
                "held_out": list(self.held_out)}


def split_problems(ids: Sequence[str], seed: int, held_out_share: float = 0.5) -> Split:
    """Rank by SHA-256 of f"{seed}/{id}": a split that depends on the seed and the ids only (module docstring)."""
    if not 0 < held_out_share < 1:
        raise ValueError(f"held_out_share: must be in (0, 1), got {held_out_share}")
    if len(set(ids)) != len(ids) or len(ids) < 2:
        raise ValueError(f"problems: need two or more distinct ids, got {len(ids)}")
    ranked = sorted(ids, key=lambda i: hashlib.sha256(f"{seed}/{i}".encode()).hexdigest())
    k = min(max(1, round(len(ids) * held_out_share)), len(ids) - 1)
    held = set(ranked[:k])
    return Split(seed, held_out_share, tuple(i for i in ids if i not in held), tuple(i for i in ids if i in held))


class SubsetSuite:
    """`suite` restricted to some of its problems (same name, prompts and scores)."""

    def __init__(self, suite: Suite, ids: Sequence[str]):
        self.name, self.binary, self._suite = suite.name, suite.binary, suite
        wanted = set(ids)
        self._problems = [p for p in suite.problems() if p.id in wanted]

    def problems(self) -> Sequence[Problem]:
        return list(self._problems)

    def prompt(self, problem: Problem) -> EvalPrompt:
        return self._suite.prompt(problem)

    def score(self, problem: Problem, completion: str) -> Score:
        return self._suite.score(problem, completion)


def choose_arm(report: dict, margin: float = DEFAULT_MARGIN) -> tuple[str, dict[str, dict]]:
    """The chosen arm of a selection report and, per arm other than the reference, why it is (not) eligible."""
    verdicts: dict[str, dict] = {}
    for arm, pair in report["paired"].items():
        if not pair:
            verdicts[arm] = {"eligible": False, "why": "no paired answers"}
            continue
        diff, mcnemar = pair["score"]["diff"], pair.get("mcnemar")
        worse = bool(mcnemar and mcnemar["b"] > mcnemar["c"] and mcnemar["p_value"] < ALPHA)
        speed = (pair.get("speed") or {}).get("ratio")
        why = ("score difference below −margin" if diff < -margin else "McNemar finds it worse" if worse
               else "no speed figure" if speed is None else "eligible")
        verdicts[arm] = {"eligible": why == "eligible", "why": why, "score_diff": diff, "speed_ratio": speed}
    eligible = [(v["speed_ratio"], arm) for arm, v in verdicts.items() if v["eligible"]]
    return (max(eligible)[1] if eligible else report["reference"]), verdicts


def _eval(suite: Suite, backend: EvalBackend, arms: Sequence[str], reference: str, out_dir: Path, *,
          max_tokens: int | None, likelihood: LikelihoodScorer | None, resamples: int, seed: int,
          progress: Callable[[str], None] | None) -> dict:
    run_suite(suite, backend, arms, out_dir, max_tokens=max_tokens, likelihood=likelihood, progress=progress)
    report = build_eval_report(read_rows(out_dir), suite=suite.name, binary=bool(suite.binary), arms=arms,
                               reference=reference, arm_settings=backend.arm_settings(), resamples=resamples,
                               seed=seed)
    report["problem_ids"] = [p.id for p in suite.problems()]
    write_outputs(out_dir, report)
    return report


def held_out_figures(report: dict, arm: str) -> dict[str, Any] | None:
    """The figures quoted for the chosen arm: score difference with CI, McNemar, hash divergence, NLL, speed."""
    pair, measures = report["paired"].get(arm), (report.get("measures") or {}).get(arm)
    if not pair:
        return None
    measures = measures or {}
    return {"arm": arm, "n_pairs": pair["n_pairs"], "score": pair["score"], "mcnemar": pair["mcnemar"],
            "speed": pair["speed"], "hash_divergence": measures.get("hash_divergence"),
            "nll": measures.get("nll"), "repetition": measures.get("repetition"),
            "copy_rate": measures.get("copy_rate"), "output_tokens": measures.get("output_tokens"),
            "truncated": {a: report["arms"][a]["measures"]["truncated"] for a in (report["reference"], arm)}}


def run_protocol(suite: Suite, backend: EvalBackend, arms: Sequence[str], out_dir: Path | str, *,
                 reference: str | None = None, limit: int | None = None, split_seed: int = 0,
                 held_out_share: float = 0.5, margin: float = DEFAULT_MARGIN, max_tokens: int | None = None,
                 min_ended_share: float = MIN_ENDED_SHARE, likelihood: LikelihoodScorer | None = None,
                 resamples: int = 2000, seed: int = 0,
                 progress: Callable[[str], None] | None = None) -> dict:
    """Split, select, choose, judge (module docstring); writes and returns `OUT/protocol.json`'s content."""
    arms = list(arms)
    reference = reference or arms[0]
    if reference not in arms or len(arms) < 2:
        raise ValueError(f"arms: the protocol needs the reference {reference!r} and one or more other arms")
    out_dir = Path(out_dir)
    problems = list(suite.problems())[:limit]
    split = split_problems([p.id for p in problems], split_seed, held_out_share)
    say = progress or (lambda line: None)
    say(f"protocol: {len(split.selection)} selection problems, {len(split.held_out)} held out (seed {split_seed})")
    common = dict(max_tokens=max_tokens, likelihood=likelihood, resamples=resamples, seed=seed, progress=progress)
    selection = _eval(SubsetSuite(suite, split.selection), backend, arms, reference, out_dir / SELECTION_DIR,
                      **common)
    ended = selection["arms"][reference]["measures"]["ended_share"]
    result: dict[str, Any] = {
        "schema": SCHEMA, "suite": suite.name, "reference": reference, "arms": arms, "split": split.to_dict(),
        "rule": {"margin": margin, "alpha": ALPHA, "min_ended_share": min_ended_share,
                 "text": "eligible: score diff >= -margin and McNemar not worse at alpha; chosen: fastest eligible"},
        "max_tokens": max_tokens, "reference_ended_share": ended, "selection_dir": str(out_dir / SELECTION_DIR),
    }
    if ended is None or ended < min_ended_share:
        _write(out_dir, {**result, "stopped": "max_tokens"})
        raise ProtocolError(f"only {ended if ended is None else f'{100 * ended:.0f}%'} of {reference}'s selection "
                            f"outputs ended by EOS or a stop string (needs {100 * min_ended_share:.0f}%): rerun "
                            f"with a larger --max-tokens in a new --out, before the held-out split is used")
    chosen, verdicts = choose_arm(selection, margin)
    result.update(chosen=chosen, verdicts=verdicts)
    say(f"protocol: chose {chosen} on the selection split")
    if chosen == reference:
        _write(out_dir, {**result, "held_out": None})
        return {**result, "held_out": None}
    held_dir = out_dir / HELD_OUT_DIR
    earlier = read_run_info(held_dir)
    if earlier and set(earlier.get("arms", [])) - {reference, chosen}:
        raise ProtocolError(f"{held_dir} already judged {earlier['arms']}: the held-out split is judged once; "
                            f"use a new --out (and a new --split-seed) for a new choice")
    held = _eval(SubsetSuite(suite, split.held_out), backend, [reference, chosen], reference, held_dir, **common)
    result.update(held_out_dir=str(held_dir), held_out=held_out_figures(held, chosen))
    _write(out_dir, result)
    return result


def _write(out_dir: Path, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / PROTOCOL_FILE).write_text(json.dumps(result, indent=2) + "\n")


def protocol_markdown(result: dict) -> str:
    """The protocol's summary: the split, each setting's verdict on selection, the held-out figures."""
    split = result["split"]
    lines = [f"Protocol on `{result['suite']}`: split seed {split['seed']}, {len(split['selection'])} selection and "
             f"{len(split['held_out'])} held-out problems; reference `{result['reference']}` ended "
             f"{_pct(result['reference_ended_share'])} of its selection outputs by EOS or a stop string.", ""]
    for arm, v in (result.get("verdicts") or {}).items():
        lines.append(f"- `{arm}`: {v['why']} (Δ score {_pts(v.get('score_diff'))}, speed × "
                     f"{_num(v.get('speed_ratio'))})")
    lines += ["", f"Chosen on selection: `{result.get('chosen', '-')}`."]
    h = result.get("held_out")
    if h:
        lines += ["", f"Held-out ({h['n_pairs']} problems, judged once): Δ score {_pts(h['score']['diff'])} "
                  f"[{_pts(h['score']['ci95'][0])}, {_pts(h['score']['ci95'][1])}], McNemar p "
                  f"{_num((h['mcnemar'] or {}).get('p_value'), 3)}, hash divergence "
                  f"{_pct((h['hash_divergence'] or {}).get('share'))}, Δ NLL/token "
                  f"{_num((h['nll'] or {}).get('diff'), 3)}, speed × {_num((h['speed'] or {}).get('ratio'))}."]
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _pts(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f} pts"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}g}" if digits == 3 else f"{x:.{digits}f}"
