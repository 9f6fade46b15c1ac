"""Where an ASD arm's extra tokens per round come from: the relaxed tokens themselves, or the changed text that
follows them (the trajectory). Terms and reading: docs/benchmarks.md, "Where ASD's speedup comes from".

Tokens per round τ = 1 + kept drafts per round, over a run's rounds:
- `exact`: the exact arm on its own output;
- `exact_on_asd_path`: exact greedy verification replayed on the ASD arm's own rounds (same context, same drafts):
  the leading drafts equal to the target's greedy token there;
- `asd`: the ASD arm.

`trajectory_gain` = τ(exact on ASD's path) / τ(exact) and `relaxation_gain` = τ(asd) / τ(exact on ASD's path);
their product is τ(asd) / τ(exact).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from actors.stats import RowRecord

REPLAY_ID = "bench-decompose"


def greedy_along(engine, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> list[int]:
    """The target's greedy token at each output position given the prompt and the output before it, from one
    teacher-forced forward on `engine` (a native `Engine`); its sequence is released after."""
    if not output_ids:
        return []
    try:
        logits = engine.forward([REPLAY_ID], [list(prompt_ids) + list(output_ids[:-1])],
                                num_logits=[len(output_ids)])
    finally:
        engine.release(REPLAY_ID)
    return logits[0].argmax(-1).tolist()


def exact_kept(rows: Sequence[RowRecord], output_ids: Sequence[int], greedy: Sequence[int]) -> list[int]:
    """Per round of one request (in order): how many of the drafts it kept exact greedy verification would have
    kept too, the leading ones equal to the target's greedy token. The first output token is the prefill's;
    a round emits its kept drafts and one token of the target's."""
    position, kept = 1, []
    for row in rows:
        n = 0
        while n < row.accepted and position + n < len(output_ids) and output_ids[position + n] == greedy[position + n]:
            n += 1
        kept.append(n)
        position += row.accepted + 1
    return kept


def replay(engine, run, prompt_ids: dict[str, Sequence[int]]) -> dict[str, int]:
    """A single-stream `RunMeasure`'s rounds (its median repeat) replayed on `engine`: rounds, drafted, kept,
    kept by exact greedy verification, and relaxed. Rows map to prompts by the harness's request ids
    (`<prompt name>#<n>`)."""
    rows: dict[str, list[RowRecord]] = defaultdict(list)
    for record in run.rounds:
        for row in record.rows:
            rows[row.request_id].append(row)
    outputs = {r.prompt: r.token_ids for r in run.requests}
    totals = dict(rounds=0, drafted=0, kept=0, exact_kept=0, relaxed=0)
    for request_id, request_rows in rows.items():
        name = request_id.rsplit("#", 1)[0]
        output = outputs[name]
        greedy = greedy_along(engine, prompt_ids[name], output)
        totals["rounds"] += len(request_rows)
        totals["drafted"] += sum(r.gamma for r in request_rows)
        totals["kept"] += sum(r.accepted for r in request_rows)
        totals["exact_kept"] += sum(exact_kept(request_rows, output, greedy))
        totals["relaxed"] += sum(r.relaxed for r in request_rows)
    return totals


def decompose(exact: dict[str, int], asd: dict[str, int]) -> dict:
    """The decomposition (module docstring) of an ASD run against the exact run of the same prompts, from their
    `replay` totals; {} when either has no rounds. `replay_agreement`: the exact run's kept drafts that its
    replay finds greedy (1.0 up to float near-ties), the check that the replay sees what the engine saw."""
    if not exact["rounds"] or not asd["rounds"]:
        return {}

    def per_round(kept: int, rounds: int) -> float:
        return 1 + kept / rounds

    tau = {"exact": per_round(exact["kept"], exact["rounds"]),
           "exact_on_asd_path": per_round(asd["exact_kept"], asd["rounds"]),
           "asd": per_round(asd["kept"], asd["rounds"])}
    return {
        "tokens_per_round": tau,
        "gamma_mean": {"exact": exact["drafted"] / exact["rounds"], "asd": asd["drafted"] / asd["rounds"]},
        "trajectory_gain": tau["exact_on_asd_path"] / tau["exact"],
        "relaxation_gain": tau["asd"] / tau["exact_on_asd_path"],
        "relaxed_per_round": asd["relaxed"] / asd["rounds"],
        "kept_past_relaxation_per_round": (asd["kept"] - asd["exact_kept"]) / asd["rounds"],
        "replay_agreement": exact["exact_kept"] / exact["kept"] if exact["kept"] else 1.0,
    }
