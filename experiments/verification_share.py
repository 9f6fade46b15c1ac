"""Which verification ran on each arm's requests, and the warnings the A/B report puts at its top.

Per arm, over its export rows (`cluster.observability.telemetry.request_row`: `verification` = what ran,
`arm_verification`, `asd_fallback`, `sampled`):
- **own verification share**: the share of requests the arm's own verification ran on;
- **ran the reference's verification**: the share that ran the reference arm's verification instead; above
  `MOST`, for an arm whose own verification differs from the reference's, the report warns (its differences
  would measure noise, not ASD);
- **sampled ASD spend**: the ledger spend of sampled requests the arm verified with the relaxed rule.
Rows of an older export carry only `verification`: there what ran is unknown, and the share is None.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

MOST = 0.5  # an arm that ran its reference's verification on more than this share of its requests is warned


def arm_verification(rows: Sequence[dict]) -> str | list[str] | None:
    """The arm's own verification (a sorted list if rows disagree, None without rows)."""
    values = sorted({r.get("arm_verification") or r.get("verification", "exact") for r in rows})
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def share_that_ran(rows: Sequence[dict], verification: str) -> float | None:
    """Share of `rows` on which `verification` ran; None without rows or when an older export cannot say."""
    if not rows or any("arm_verification" not in r for r in rows):
        return None
    return sum(r.get("verification") == verification for r in rows) / len(rows)


def verification_figures(rows: Sequence[dict]) -> dict[str, Any]:
    """The per-arm block: arm_verification, own_verification_share, asd_fallbacks {reason: n}, sampled_asd."""
    own = arm_verification(rows)
    fallbacks = Counter(r["asd_fallback"] for r in rows if r.get("asd_fallback"))
    return {
        "arm_verification": own,
        "own_verification_share": share_that_ran(rows, own) if isinstance(own, str) else None,
        "asd_fallbacks": dict(sorted(fallbacks.items())),
        "sampled_asd": sampled_spend(rows),
    }


def sampled_spend(rows: Sequence[dict]) -> dict[str, Any] | None:
    """Ledger spend of the sampled requests verified by ASD (relaxed rule): n, regret_spent_mean and _max
    (nats), regret_budget (the largest budget seen), ledger_exhaustions; None when there are none."""
    sampled = [r for r in rows if r.get("sampled") and r.get("verification") == "asd"]
    if not sampled:
        return None
    spent = [float(r.get("regret_spent") or 0.0) for r in sampled]
    budgets = [r["regret_budget"] for r in sampled if r.get("regret_budget") is not None]
    return {
        "n": len(sampled),
        "regret_spent_mean": sum(spent) / len(spent),
        "regret_spent_max": max(spent),
        "regret_budget": max(budgets) if budgets else None,
        "ledger_exhaustions": sum(bool(r.get("ledger_exhausted")) for r in sampled),
    }


def warnings(by_arm: dict[str, Sequence[dict]], reference: str | None) -> list[dict[str, Any]]:
    """One warning per arm that ran its reference arm's verification on most (> MOST) of its requests while
    its own verification differs: {"arm", "reference", "verification", "requests", "ran_reference",
    "share", "message"}."""
    if reference is None or reference not in by_arm:
        return []
    ref_own = arm_verification(by_arm[reference])
    if not isinstance(ref_own, str):
        return []
    out = []
    for name, rows in by_arm.items():
        own = arm_verification(rows)
        share = share_that_ran(rows, ref_own)
        if name == reference or own == ref_own or share is None or share <= MOST:
            continue
        ran = sum(r.get("verification") == ref_own for r in rows)
        fallbacks = Counter(r["asd_fallback"] for r in rows if r.get("asd_fallback"))
        why = ""
        if fallbacks.get("sampled"):
            why = (f" {fallbacks['sampled']} were sampled (temperature > 0, the OpenAI default), which an ASD arm "
                   f"verifies exactly unless it sets asd.sampled: relaxed.")
        out.append({
            "arm": name, "reference": reference, "verification": ref_own, "requests": len(rows),
            "ran_reference": ran, "share": share,
            "message": (f"arm {name!r} ran {ref_own} verification, as its reference arm {reference!r} does, on "
                        f"{ran} of {len(rows)} requests ({100 * share:.0f}%): its differences from {reference!r} "
                        f"measure noise, not {own}.{why} Send temperature 0, set serving.defaults.temperature: 0, "
                        f"or set asd.sampled: relaxed on the arm."),
        })
    return out
