"""Run a suite through a backend on several arms, one JSONL row per (arm, problem), resumable.

Problem by problem, every arm answering problem i before any arm sees problem i + 1, the arm order rotated by
one each problem; each answer is scored before the next request. A row is appended to `rows.jsonl` (`ROWS_FILE`)
as soon as it exists; a rerun skips every (arm, problem) with a row without an error, so a stopped run resumes.
A failed request is written with an `error` and retried by the next run; `max_consecutive_errors` failures in a
row, or an unreachable service, stop the run. Why this order: docs/experiments.md.

Row keys: suite, problem, arm, score, passed, detail, completion, output_tokens, seconds, tokens_per_s,
finish_reason, served_arm, speculative, error, time, and the output measures of `experiments.eval.measures`
(repetition, copy_rate, truncated, text_sha256; nll and nll_tokens when a likelihood scorer is given), computed
after the request like the score.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from experiments.eval.backends import (
    BackendError,
    BackendUnavailable,
    CompletionRequest,
    EvalBackend,
    with_max_tokens,
)
from experiments.eval.measures import row_measures
from experiments.eval.suites import EvalPrompt, Problem, Suite

logger = logging.getLogger(__name__)

# (prompt, completion) → (Σ nats, completion tokens) under the target: `experiments.eval.likelihood`
LikelihoodScorer = Callable[[EvalPrompt, str], tuple[float, int]]

ROWS_FILE = "rows.jsonl"
RUN_FILE = "run.json"
RUN_SCHEMA = "specserve.eval-run/v1"


@dataclass(frozen=True)
class RunInfo:
    """What a finished (or stopped) run did: rows written now, rows found from earlier runs, errors now."""

    written: int
    resumed: int
    errors: int
    seconds: float


def read_rows(out_dir: Path) -> list[dict]:
    """Every row of `rows.jsonl` in file order; a torn last line (a killed run) is skipped."""
    path = Path(out_dir) / ROWS_FILE
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s line %d is not JSON (a torn write?); skipped", path, number)
    return rows


def read_run_info(out_dir: Path) -> dict | None:
    path = Path(out_dir) / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _prepare_out_dir(out_dir: Path, suite: Suite, arms: Sequence[str], backend: EvalBackend,
                     temperature: float = 0.0) -> dict:
    """Create or extend `run.json`; a directory holding another suite's run, or one at another temperature, is
    refused."""
    out_dir.mkdir(parents=True, exist_ok=True)
    info = read_run_info(out_dir)
    if info is not None and info.get("suite") != suite.name:
        raise ValueError(f"out: {out_dir} holds a run of suite {info.get('suite')!r}, not {suite.name!r}; "
                         f"choose another --out")
    if info is not None and info.get("temperature", 0.0) != temperature:
        raise ValueError(f"temperature: {out_dir} holds a run at temperature {info.get('temperature', 0.0)}, "
                         f"not {temperature}; choose another --out")
    settings = backend.arm_settings()
    if info is None:
        info = {"schema": RUN_SCHEMA, "suite": suite.name, "binary": bool(suite.binary), "arms": [],
                "arm_settings": {}, "backends": [], "started": time.time(), "temperature": temperature}
    info["arms"] = list(dict.fromkeys([*info["arms"], *arms]))
    info["arm_settings"].update({a: settings[a] for a in arms if settings and a in settings})
    if backend.description not in info["backends"]:
        info["backends"].append(backend.description)
    (out_dir / RUN_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _end_torn_line(path: Path) -> None:
    """A run killed mid-write leaves a last line without its newline: end it, so the next row starts afresh."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")


def _fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _progress_line(done: int, total: int, row: dict, elapsed: float, remaining: int) -> str:
    if row.get("error"):
        outcome = f"ERROR {row['error'][:80]}"
    else:
        verdict = "pass" if row["passed"] else "FAIL" if row["passed"] is False else f"{row['score']:.3f}"
        spec = row.get("speculative") or {}
        rate = row.get("tokens_per_s")
        outcome = (f"{verdict:<5}{row['output_tokens']:>5} tok {rate or 0:7.1f} tok/s"
                   f"  acceptance {spec.get('acceptance_rate', float('nan')):.2f}")
    eta = f", ~{_fmt_duration(elapsed / done * remaining)} left" if done and remaining else ""
    return f"[{done}/{total}] {row['arm']:<12} {row['problem']:<18} {outcome}  ({_fmt_duration(elapsed)}{eta})"


def prompt_text(prompt: EvalPrompt) -> str:
    """What the model was given, as text: the messages' contents, or the completion prompt."""
    return "\n".join(m["content"] for m in prompt.messages) if prompt.chat else prompt.prompt


def _measures(prompt: EvalPrompt, row: dict, likelihood: LikelihoodScorer | None) -> dict:
    nll = None
    if likelihood is not None:
        try:
            nll = likelihood(prompt, row["completion"])
        except Exception:  # a scorer's failure costs the figure, never the row
            logger.exception("likelihood of %s on %s failed", row["problem"], row["arm"])
    return row_measures(prompt_text(prompt), row["completion"], row["finish_reason"], nll)


def _answer(suite: Suite, backend: EvalBackend, problem: Problem, arm: str, max_tokens: int | None,
            temperature: float = 0.0, likelihood: LikelihoodScorer | None = None) -> dict:
    """One (arm, problem) row: the request, then its score. BackendError propagates."""
    prompt = with_max_tokens(suite.prompt(problem), max_tokens)
    if temperature:  # one seed per problem, the same on every arm: the arms' draws are paired
        prompt = replace(prompt, temperature=temperature, seed=zlib.crc32(problem.id.encode()))
    completion = backend.complete(CompletionRequest(prompt, arm))
    row: dict[str, Any] = {
        "suite": suite.name, "problem": problem.id, "arm": arm, "completion": completion.text,
        "output_tokens": completion.output_tokens, "seconds": completion.seconds,
        "tokens_per_s": completion.tokens_per_s, "finish_reason": completion.finish_reason,
        "served_arm": completion.served_arm, "speculative": completion.speculative, "error": None,
    }
    row.update(_measures(prompt, row, likelihood))
    try:
        score = suite.score(problem, completion.text)
    except Exception as err:  # a plug-in scorer's bug: keep the answer, retry the row on the next run
        logger.exception("suite %s: scoring %s raised", suite.name, problem.id)
        return {**row, "score": None, "passed": None, "detail": "", "error": f"scorer raised {err!r}"}
    return {**row, "score": score.value, "passed": score.passed, "detail": score.detail}


def run_suite(suite: Suite, backend: EvalBackend, arms: Sequence[str], out_dir: Path | str, *,
              limit: int | None = None, max_tokens: int | None = None, temperature: float = 0.0,
              progress: Callable[[str], None] | None = None, max_consecutive_errors: int = 3,
              likelihood: LikelihoodScorer | None = None) -> RunInfo:
    """Answer the suite's first `limit` problems on every arm, appending rows to `out_dir/rows.jsonl`;
    `likelihood` adds each output's NLL under the target to its row.

    Raises ValueError for bad arguments or an unknown arm, `BackendUnavailable` when the service cannot be
    reached, `BackendError` after `max_consecutive_errors` failed requests in a row (rows so far are kept).
    """
    arms = list(arms)
    if not arms or len(set(arms)) != len(arms):
        raise ValueError(f"arms: give one or more distinct arm names, got {arms}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit: must be >= 1, got {limit}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    if not 0 <= temperature <= 2:
        raise ValueError(f"temperature: must be in [0, 2], got {temperature}")
    out_dir = Path(out_dir)
    problems = list(suite.problems())[:limit]
    if not problems:
        raise ValueError(f"suite {suite.name!r} has no problems")
    backend.check_arms(arms)
    _prepare_out_dir(out_dir, suite, arms, backend, temperature)
    done = {(r["arm"], r["problem"]) for r in read_rows(out_dir) if not r.get("error")}
    todo = [(p, arm) for i, p in enumerate(problems) for arm in arms[i % len(arms):] + arms[: i % len(arms)]
            if (arm, p.id) not in done]
    total = len(problems) * len(arms)
    resumed = total - len(todo)
    say = progress or (lambda line: None)
    say(f"suite {suite.name}: {len(problems)} problems × {len(arms)} arms ({', '.join(arms)}) via "
        f"{backend.description}" + (f"; resuming, {resumed} of {total} rows done" if resumed else ""))
    start = time.perf_counter()
    written = errors = consecutive = 0
    _end_torn_line(out_dir / ROWS_FILE)
    with open(out_dir / ROWS_FILE, "a", encoding="utf-8") as sink:
        for problem, arm in todo:
            try:
                row = _answer(suite, backend, problem, arm, max_tokens, temperature, likelihood)
            except BackendUnavailable:
                raise
            except BackendError as err:
                row = {"suite": suite.name, "problem": problem.id, "arm": arm, "score": None, "passed": None,
                       "error": str(err)}
            row["time"] = time.time()
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            written += 1
            if row.get("error"):
                errors += 1
                consecutive += 1
            else:
                consecutive = 0
            say(_progress_line(resumed + written, total, row, time.perf_counter() - start, len(todo) - written))
            if consecutive >= max_consecutive_errors:
                raise BackendError(f"{consecutive} requests in a row failed (last: {row['error']}); rows so far "
                                   f"are in {out_dir / ROWS_FILE}, rerun to resume")
    return RunInfo(written, resumed, errors, time.perf_counter() - start)
