"""Measures of an output besides its score, and their per-arm figures against the reference arm.

Per row (written by the runner beside the score, `row_measures`):
- `repetition`: 1 − distinct / total over the output's word 3-grams (0 when it has fewer than three words):
  the share of 3-grams that repeat an earlier one, high for degenerate loops;
- `copy_rate`: the share of the output's word 3-grams that occur in the prompt (0 with fewer than three words);
- `nll`, `nll_tokens`: the target's mean negative log-likelihood per output token (nats), the output
  teacher-forced after the prompt (`experiments.eval.likelihood`), when a scorer is given;
- `truncated`: the output was cut by max_tokens (finish_reason "length").

Per arm against the reference (`measure_figures`), over the problems both answered: `hash_divergence`, the share
whose output text differs from the reference's (the ASD paper's figure: SHA-256 of the text), and for NLL,
repetition, copy rate and output tokens the arm's mean and the paired mean difference with its 95% bootstrap
interval (the problem is the unit, as for the score). Words are lower-cased `\\w+` runs.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.eval.stats import paired_bootstrap_mean_diff

_WORD = re.compile(r"\w+")
N = 3
PAIRED = ("nll", "repetition", "copy_rate", "output_tokens")


def _ngrams(text: str, n: int = N) -> list[tuple[str, ...]]:
    words = _WORD.findall((text or "").lower())
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def repetition_rate(text: str) -> float:
    grams = _ngrams(text)
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def copy_rate(prompt_text: str, text: str) -> float:
    grams = _ngrams(text)
    if not grams:
        return 0.0
    source = set(_ngrams(prompt_text))
    return sum(g in source for g in grams) / len(grams)


def text_hash(text: str) -> str:
    return hashlib.sha256((text or "").encode("utf-8")).hexdigest()


def row_measures(prompt_text: str, completion: str, finish_reason: str | None,
                 nll: tuple[float, int] | None = None) -> dict[str, Any]:
    """The measures the runner writes into a row (module docstring); `nll` is (Σ nats, tokens) or None."""
    out: dict[str, Any] = {
        "repetition": repetition_rate(completion), "copy_rate": copy_rate(prompt_text, completion),
        "truncated": finish_reason == "length", "text_sha256": text_hash(completion),
    }
    if nll is not None:
        total, tokens = nll
        out["nll"] = total / tokens if tokens else None
        out["nll_tokens"] = tokens
    return out


def _value(row: dict, key: str) -> float | None:
    if key in ("repetition", "copy_rate") and key not in row:
        completion = row.get("completion")
        if completion is None:
            return None
        return repetition_rate(completion) if key == "repetition" else None
    value = row.get(key)
    return None if value is None else float(value)


def arm_measures(rows: Sequence[dict]) -> dict[str, Any]:
    """One arm's own figures: means of the row measures, and how many outputs max_tokens cut."""
    out: dict[str, Any] = {}
    for key in PAIRED:
        values = [v for v in (_value(r, key) for r in rows) if v is not None]
        out[f"{key}_mean"] = float(np.mean(values)) if values else None
    known = [r for r in rows if r.get("finish_reason") is not None]
    out["truncated"] = sum(r.get("finish_reason") == "length" for r in known)
    out["ended_share"] = 1 - out["truncated"] / len(known) if known else None
    return out


def measure_figures(ref_rows: Sequence[dict], arm_rows: Sequence[dict], resamples: int,
                    seed: int) -> dict[str, Any]:
    """arm vs reference over the same problems (`ref_rows[i]` and `arm_rows[i]` answer one problem)."""
    differs = [float(text_hash(a.get("completion") or "") != text_hash(r.get("completion") or ""))
               for r, a in zip(ref_rows, arm_rows)]
    divergence = paired_bootstrap_mean_diff([0.0] * len(differs), differs, resamples=resamples, seed=seed)
    out: dict[str, Any] = {"hash_divergence": {"share": divergence.estimate, "ci95": [divergence.low,
                                                                                      divergence.high],
                                                "n": divergence.n}}
    for key in PAIRED:
        pairs = [(_value(r, key), _value(a, key)) for r, a in zip(ref_rows, arm_rows)]
        pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
        if not pairs:
            out[key] = None
            continue
        diff = paired_bootstrap_mean_diff([x for x, _ in pairs], [y for _, y in pairs], resamples=resamples,
                                          seed=seed)
        out[key] = {"reference": float(np.mean([x for x, _ in pairs])), "arm": float(np.mean([y for _, y in pairs])),
                    "diff": diff.estimate, "ci95": [diff.low, diff.high], "n": diff.n}
    return out


def _f(value: float | None, digits: int = 2, sign: bool = False) -> str:
    return "-" if value is None else f"{value:{'+' if sign else ''}.{digits}f}"


def _diff(block: dict | None, digits: int = 2) -> str:
    if not block:
        return "-"
    low, high = block["ci95"]
    return f"{_f(block['diff'], digits, True)} [{_f(low, digits, True)}, {_f(high, digits, True)}]"


def measures_markdown(report: dict) -> str:
    """The measures table: per arm its own means, and against the reference the paired differences."""
    ref = report["reference"]
    lines = [
        (f"Output measures against `{ref}`: hash divergence (share of outputs whose text differs), the target's "
         "NLL per output token (nats, teacher-forced), repetition and copy-from-prompt rates (word 3-grams), "
         "output tokens; Δ = arm − reference with its 95% paired-bootstrap CI; truncated = cut by max_tokens."),
        "",
        "| arm | truncated | hash divergence | NLL/token | Δ NLL | repetition | Δ repetition | copy rate | "
        "Δ copy | tokens | Δ tokens |",
        "|---|---:|---:|---:|---|---:|---|---:|---|---:|---|",
    ]
    for arm, a in report["arms"].items():
        m = a.get("measures") or {}
        pair = (report.get("measures") or {}).get(arm) or {}
        div = pair.get("hash_divergence")
        div_text = (f"{100 * div['share']:.0f}% [{100 * div['ci95'][0]:.0f}, {100 * div['ci95'][1]:.0f}]"
                    if div else "-")
        lines.append(
            f"| {arm}{' (ref)' if arm == ref else ''} | {m.get('truncated', '-')}/{a['n']} | {div_text} | "
            f"{_f(m.get('nll_mean'), 3)} | {_diff(pair.get('nll'), 3)} | {_f(m.get('repetition_mean'), 3)} | "
            f"{_diff(pair.get('repetition'), 3)} | {_f(m.get('copy_rate_mean'), 3)} | "
            f"{_diff(pair.get('copy_rate'), 3)} | {_f(m.get('output_tokens_mean'), 1)} | "
            f"{_diff(pair.get('output_tokens'), 1)} |")
    return "\n".join(lines) + "\n"
