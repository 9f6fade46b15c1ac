"""The step's draft plan (`policies.batch_plan`) and `GammaPolicy.plan_step`: optimal against brute force, plain
when the step's fixed cost is not paid back, fixed rows kept, probes let through, bad input named."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from policies.batch_plan import plan_drafts, scored_tokens
from policies.gamma import GammaPolicy, best_gamma

# v(γ) of a CPU vLLM step at batch 8 (docs/benchmarks.md): +13% once any row drafts, then ~2.8% per mean token
STEP_V = [1.0] + [(80 + 16 * (g - 1)) / 71 for g in range(1, 9)]


def rate(alphas, counts, v, batch_size, c, ragged):
    gain = batch_size + sum(sum(a**k for k in range(1, d + 1)) for a, d in zip(alphas, counts))
    drafted, widest = sum(counts), max(counts, default=0)
    if ragged:
        cost = 1.0 if drafted == 0 else float(np.interp(max(1.0, drafted / batch_size), range(len(v)), v))
    else:
        cost = v[widest]
    return gain / (cost + c * widest)


@pytest.mark.parametrize("ragged", [True, False])
def test_the_plan_is_the_best_of_every_plan_within_the_caps(ragged):
    rng = random.Random(7)
    for _ in range(150):
        rows = rng.randint(1, 3)
        caps = [rng.randint(0, 3) for _ in range(rows)]
        alphas = [rng.choice([0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0]) for _ in range(rows)]
        batch_size = rows + rng.randint(0, 3)
        v = [1.0] + sorted(rng.uniform(1.0, 2.5) for _ in range(3))
        c = 0.0 if ragged else rng.choice([0.0, 0.05, 0.2])  # with c > 0 a ragged plan is greedy, not exact
        plan = plan_drafts(alphas, caps, v, batch_size=batch_size, draft_cost=c, ragged=ragged)
        assert all(0 <= d <= cap for d, cap in zip(plan, caps))
        best = max(rate(alphas, d, v, batch_size, c, ragged) for d in itertools.product(*(range(k + 1) for k in caps)))
        assert rate(alphas, plan, v, batch_size, c, ragged) == pytest.approx(best, rel=1e-9)


def test_a_few_short_drafts_do_not_pay_for_the_steps_speculative_path():
    # two of eight rows found a prompt-lookup match: the step's fixed cost outweighs what they may add
    assert plan_drafts([0.3] * 8, [1, 1, 0, 0, 0, 0, 0, 0], STEP_V, batch_size=8) == [0] * 8
    # every row drafting at the same α shares that cost
    assert plan_drafts([0.3] * 8, [1] * 8, STEP_V, batch_size=8) == [1] * 8
    # one row in a verbatim copy pays for the step by itself; the weak rows ride along where they add
    plan = plan_drafts([0.95] + [0.05] * 7, [8] + [2] * 7, STEP_V, batch_size=8)
    assert plan[0] == 8 and sum(plan[1:]) == 0
    # one request alone: the per-row choice, cut to its cap
    for alpha in (0.2, 0.5, 0.8, 0.95):
        assert plan_drafts([alpha], [8], STEP_V, batch_size=1) == [best_gamma(alpha, 0.0, 8, STEP_V)]


def test_fixed_rows_keep_their_caps_and_the_plainest_plan_wins_ties():
    assert plan_drafts([0.0, 0.9], [3, 2], STEP_V, batch_size=4, fixed=[True, False]) == [3, 2]
    assert plan_drafts([0.0, 0.0], [3, 2], [1.0] * 4, batch_size=2) == [0, 0]  # nothing to gain: plain
    assert plan_drafts([1.0], [3], [1.0] * 4, batch_size=1) == [3]
    assert plan_drafts([], [], STEP_V, batch_size=1) == []


def test_the_padded_plan_chooses_the_steps_width():
    v = [1.0, 1.5, 1.6, 1.7, 2.6]  # the width 4 forward is slow: rows capped at 4 draft 3
    assert plan_drafts([0.9, 0.9, 0.2], [4, 4, 1], v, batch_size=3, ragged=False) == [3, 3, 1]
    assert plan_drafts([0.9, 0.9, 0.2], [4, 4, 1], v, batch_size=3, ragged=False, draft_cost=1.0) == [0, 0, 0]


@pytest.mark.parametrize("kwargs, name", [
    (dict(alphas=[0.5], caps=[1, 2]), "alphas, caps and fixed"),
    (dict(alphas=[1.5], caps=[1]), "alphas"),
    (dict(alphas=[0.5], caps=[-1]), "caps"),
    (dict(alphas=[0.5], caps=[9]), "verify_cost"),
    (dict(alphas=[0.5], caps=[1], batch_size=0), "batch_size"),
    (dict(alphas=[0.5], caps=[1], draft_cost=float("nan")), "draft_cost"),
])
def test_bad_input_names_the_argument(kwargs, name):
    args = dict(verify_cost=STEP_V, batch_size=4) | kwargs
    with pytest.raises(ValueError, match=name):
        plan_drafts(args.pop("alphas"), args.pop("caps"), args.pop("verify_cost"), **args)


def test_a_step_is_costed_as_plain_decoding_only_when_no_row_drafted():
    assert scored_tokens([0, 0, 0]) == 1
    assert scored_tokens([]) == 1
    # one short draft in a batch of 8 runs the speculative path: not a plain step (round(1/8) would say 1)
    assert scored_tokens([1, 0, 0, 0, 0, 0, 0, 0]) == 2
    assert scored_tokens([3]) == 4
    assert scored_tokens([4, 2, 0, 2]) == 3


def learned(policy: GammaPolicy, batch_size: int = 8) -> GammaPolicy:
    """`policy` with STEP_V measured at `batch_size` (1 + n tokens per row), as a unit learns it."""
    for n, v in enumerate(STEP_V[:5], start=1):
        policy.observe_costs(batch_size, None, {n: 0.07 * v})
    return policy


def test_plan_step_cuts_a_batch_that_does_not_pay_and_probes_after_the_interval():
    policy = learned(GammaPolicy(gamma_max=4, probe_interval=3))
    rows = [(f"r{i}", "exact", 1 if i < 2 else 0, False) for i in range(8)]
    for i in range(8):
        for _ in range(6):
            policy.observe(f"r{i}", "exact", 2, 0)  # α low for every request
    plans = []
    for _ in range(4):
        plans.append(policy.plan_step(rows, 8, drafted=True))
        for rid, *_ in rows:
            policy.observe(rid, "exact", 0, 0)
    assert plans[:3] == [[0] * 8] * 3
    assert plans[3] == [1, 1] + [0] * 6  # three plain rounds: the rows due a probe (all of them) draft once
    assert policy.plan_step(rows, 8, drafted=True) == [0] * 8  # and the interval starts again


def test_plan_step_keeps_the_caps_when_the_plan_is_off_or_gamma_is_forced():
    rows = [("a", "exact", 1, False), ("b", "exact", 1, False)]
    for policy in (GammaPolicy(batch_plan=False), GammaPolicy.fixed(1), GammaPolicy(gamma_min=1)):
        learned(policy, batch_size=2)
        for _ in range(6):
            policy.observe("a", "exact", 2, 0)
            policy.observe("b", "exact", 2, 0)
        assert policy.plan_step(rows, 8) == [1, 1]


def test_a_row_in_a_fully_accepted_run_keeps_its_explored_gamma():
    policy = learned(GammaPolicy(gamma_max=8, prior_alpha=0.3))
    for _ in range(10):
        policy.observe("copy", "exact", 2, 0)
    policy.observe("copy", "exact", 4, 4)  # a run starts: priced at α ≥ 4/5
    rows = [("copy", "exact", 8, False)] + [(f"r{i}", "exact", 0, False) for i in range(7)]
    assert policy.plan_step(rows, 8, drafted=True)[0] == 8
    alpha = policy.alpha("copy", "exact")  # its running α alone would not pay for the step
    assert plan_drafts([alpha] + [0.0] * 7, [8] + [0] * 7, policy.verify_cost(8), batch_size=8)[0] == 0
