"""The speedup model (E, S, best γ) and GammaPolicy: estimation, costs, shift tracking, cold start."""

from __future__ import annotations

import pickle
import random

import pytest

from policies.gamma import GammaPolicy, best_gamma, expected_speedup, expected_tokens


def test_leviathan_table_1():
    assert expected_speedup(0.8, 5, 0) == pytest.approx(3.69, abs=0.005)
    assert expected_tokens(0.8, 5) == pytest.approx((1 - 0.8**6) / 0.2)
    assert expected_tokens(1.0, 4) == 5.0 and expected_tokens(0.0, 4) == 1.0
    assert expected_speedup(0.3, 0, 0.5) == 1.0


def test_verify_cost_enters_the_denominator():
    assert expected_speedup(0.8, 2, 0.1, [1.0, 1.2, 1.5]) == pytest.approx(expected_tokens(0.8, 2) / (0.2 + 1.5))


def brute_force(alpha, c, gamma_max, verify_cost):
    speedups = [1.0] + [
        sum(alpha**j for j in range(g + 1)) / (g * c + (1.0 if verify_cost is None else verify_cost[g]))
        for g in range(1, gamma_max + 1)
    ]
    best = max(range(gamma_max + 1), key=lambda g: (speedups[g], -g))  # first argmax
    return best if speedups[best] > 1.0 + 1e-9 else 0  # a tie with plain decoding (α = c) is not a win


@pytest.mark.parametrize("curve", [None, "cpu", "flat"])
def test_best_gamma_equals_brute_force(curve):
    costs = {None: None, "cpu": [1.0 + 0.16 * g for g in range(13)], "flat": [1.0] * 13}[curve]
    for alpha in [i / 20 for i in range(21)]:
        for c in [0.0, 0.01, 0.05, 0.1, 0.2, 0.35, 0.5, 0.8, 1.0]:
            for gamma_max in (0, 1, 4, 8, 12):
                assert best_gamma(alpha, c, gamma_max, costs) == brute_force(alpha, c, gamma_max, costs), (alpha, c)


def test_best_gamma_is_zero_when_alpha_at_most_c():
    for alpha in (0.0, 0.1, 0.3, 0.5):
        assert best_gamma(alpha, 0.5, 8) == 0
        assert best_gamma(alpha, alpha, 8, [1.0 + 0.1 * g for g in range(9)]) == 0


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: expected_tokens(1.5, 2), "alpha"),
        (lambda: expected_tokens(0.5, -1), "gamma"),
        (lambda: expected_speedup(0.5, 2, -0.1), "c"),
        (lambda: best_gamma(0.5, 0.1, 4, [1.0, 1.1]), "verify_cost"),
        (lambda: GammaPolicy(gamma_max=2, gamma_min=3), "gamma_min"),
        (lambda: GammaPolicy(decay=1.0), "decay"),
        (lambda: GammaPolicy().observe("r", "a", 2, 3), "accepted"),
        (lambda: GammaPolicy().observe_costs(0, 0.1), "batch_size"),
        (lambda: GammaPolicy().observe_costs(1, score_s_by_tokens={0: 0.1}), "score_s_by_tokens"),
        (lambda: GammaPolicy().observe_costs(1, draft_step_s=-1.0), "draft_step_s"),
    ],
)
def test_bad_input(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


def simulate_round(rng, alpha, gamma):
    accepted = 0
    while accepted < gamma and rng.random() < alpha:
        accepted += 1
    return accepted


def test_truncated_rounds_give_an_unbiased_alpha():
    """γ = 3 at α = 0.7: accepted/γ would read ≈ 0.62; trials counted as a+1 (or γ when full) give 0.7."""
    rng = random.Random(0)
    policy = GammaPolicy(decay=0.999, arm_decay=0.999)
    for _ in range(4000):
        policy.observe("r", "arm", 3, simulate_round(rng, 0.7, 3))
    assert policy.alpha("r", "arm") == pytest.approx(0.7, abs=0.03)
    assert policy.alpha(None, "arm") == pytest.approx(0.7, abs=0.03)


def test_observation_counts():
    policy = GammaPolicy(prior_weight=1e-9, request_weight=1e-9)
    policy.observe("r", "arm", 4, 4)  # 4 successes, 0 failures
    assert policy.alpha("r", "arm") == pytest.approx(1.0)
    policy = GammaPolicy(prior_weight=1e-9, request_weight=1e-9)
    policy.observe("r", "arm", 4, 1)  # 1 success, 1 failure
    assert policy.alpha("r", "arm") == pytest.approx(0.5)


def test_choice_follows_a_shift_within_20_rounds():
    """α drops 0.9 → 0.2 halfway (c = 0.1, v ≡ 1): best γ goes 8 → 1; the policy follows within 20 rounds."""
    assert best_gamma(0.9, 0.1, 8) == 8 and best_gamma(0.2, 0.1, 8) == 1
    late = []
    for seed in range(5):
        rng = random.Random(seed)
        policy = GammaPolicy(draft_cost=0.1)
        choices = []
        for t in range(100):
            gamma = policy.choose("r", "arm", 1)
            policy.observe("r", "arm", gamma, simulate_round(rng, 0.9 if t < 50 else 0.2, gamma))
            choices.append(gamma)
        assert sum(choices[30:50]) / 20 >= 6.5
        late += choices[70:100]
    assert sum(late) / len(late) <= 2.0


def test_choice_follows_a_rise_after_probing():
    """α rises 0.2 → 0.9 with c = 0.3: γ = 0 while low, then probes find the rise and γ climbs to ≥ 4."""
    assert best_gamma(0.2, 0.3, 8) == 0 and best_gamma(0.9, 0.3, 8) == 5
    rng = random.Random(1)
    policy = GammaPolicy(draft_cost=0.3, probe_interval=8)
    choices = []
    for t in range(120):
        gamma = policy.choose("r", "arm", 1)
        policy.observe("r", "arm", gamma, simulate_round(rng, 0.2 if t < 60 else 0.9, gamma))
        choices.append(gamma)
    assert max(choices[40:60]) <= 1
    assert sum(choices[100:]) / 20 >= 4


def test_never_speculates_when_measured_alpha_at_most_c():
    policy = GammaPolicy(prior_alpha=0.9)
    policy.observe_costs(4, draft_step_s=0.05, score_s_by_tokens={1: 0.1, 5: 0.12})  # c = 0.5
    assert policy.draft_cost(4) == pytest.approx(0.5)
    rng = random.Random(0)
    for _ in range(40):
        policy.observe("r", "arm", 4, simulate_round(rng, 0.45, 4))
    assert policy.alpha("r", "arm") <= 0.5
    assert policy.choose("r", "arm", 4) == 0


def test_new_requests_borrow_the_arm_estimate_and_forget_drops_state():
    policy = GammaPolicy(prior_alpha=0.6)
    assert policy.alpha("new", "arm") == pytest.approx(0.6)
    for _ in range(50):
        policy.observe("old", "arm", 4, 4)
    assert policy.alpha("fresh", "arm") > 0.9
    policy.observe("fresh", "arm", 4, 0)
    assert 0.5 < policy.alpha("fresh", "arm") < policy.alpha(None, "arm")
    policy.forget("fresh")
    assert policy.alpha("fresh", "arm") == policy.alpha(None, "arm")
    assert policy.alpha("x", "other arm") == pytest.approx(0.6)


def test_cold_start_and_learned_costs():
    policy = GammaPolicy(gamma_max=6, draft_cost=0.2)
    assert policy.verify_cost(8) == [1.0] * 7 and policy.draft_cost(8) == 0.2
    # Batch 1: scoring n tokens costs 60 + 10 n ms; batch 16: 150 + 30 n ms.
    policy.observe_costs(1, draft_step_s=0.007, score_s_by_tokens={1: 0.07, 3: 0.09, 5: 0.11})
    policy.observe_costs(16, draft_step_s=0.036, score_s_by_tokens={1: 0.18, 7: 0.36})
    assert policy.verify_cost(1) == pytest.approx([(60 + 10 * n) / 70 for n in range(1, 8)])  # extrapolated
    assert policy.verify_cost(16) == pytest.approx([(150 + 30 * n) / 180 for n in range(1, 8)])
    assert policy.draft_cost(1) == pytest.approx(0.1) and policy.draft_cost(16) == pytest.approx(0.2)
    mid = policy.verify_cost(7)  # 6/15 of the way from batch 1 to batch 16
    assert mid == pytest.approx([0.6 * a + 0.4 * b for a, b in zip(policy.verify_cost(1), policy.verify_cost(16))])
    assert policy.verify_cost(64) == policy.verify_cost(16)
    # Costlier verification at batch 16 makes the policy speculate less there.
    for _ in range(30):
        policy.observe("r", "arm", 4, 3)
    assert policy.choose("r", "arm", 16) <= policy.choose("r", "arm", 1)


def test_one_token_time_is_inferred_when_never_measured():
    """A unit that always speculates never scores 1 token; T(1) comes from the line through T(3) and T(5)."""
    policy = GammaPolicy(gamma_max=4)
    policy.observe_costs(2, draft_step_s=0.014, score_s_by_tokens={3: 0.09})
    assert policy.verify_cost(2) == [1.0] * 5 and policy.draft_cost(2) == 0.1  # one point: the defaults
    policy.observe_costs(2, score_s_by_tokens={5: 0.11})
    assert policy.verify_cost(2) == pytest.approx([(60 + 10 * n) / 70 for n in range(1, 6)])
    assert policy.draft_cost(2) == pytest.approx(0.2)


def test_costs_are_exponentially_weighted():
    policy = GammaPolicy(cost_decay=0.5)
    policy.observe_costs(1, score_s_by_tokens={1: 0.1, 2: 0.1})
    policy.observe_costs(1, score_s_by_tokens={2: 0.3})
    assert policy.verify_cost(1)[1] == pytest.approx(2.0)


def test_a_drafter_that_runs_every_round_is_priced_into_the_plain_round():
    """`draft_floor` (vLLM's own proposers): a plain round pays the drafter's step too, so with a drafter as dear
    as the target (c = 1) drafting still pays, and the cheapest γ per token wins: scoring n tokens costs
    0.9 + 0.1 n s, a drafter step 1 s; at α = 1, γ costs γ + 1 + 0.1 γ s for γ + 1 tokens against 2 s for 1."""
    costs = dict(draft_step_s=1.0, score_s_by_tokens={1: 1.0, 3: 1.2, 9: 1.8})
    plain, floor = GammaPolicy(gamma_max=8, prior_alpha=1.0), GammaPolicy(gamma_max=8, prior_alpha=1.0,
                                                                          draft_floor=True)
    for policy in (plain, floor):
        policy.observe_costs(1, **costs)
    assert plain.draft_cost(1) == pytest.approx(1.0) and plain.choose("r", "arm", 1) == 0  # α ≤ c: never pays
    assert floor.draft_cost(1) == pytest.approx(0.5)  # relative to a plain round of 2 s
    assert floor.verify_cost(1)[:3] == pytest.approx([1.0, 1.1 / 2, 1.2 / 2])
    speedups = {g: expected_speedup(1.0, g, floor.draft_cost(1), floor.verify_cost(1)) for g in range(1, 9)}
    assert speedups[1] == pytest.approx(2 * 2 / 2.1) and max(speedups, key=speedups.get) == 1
    assert floor.choose("r", "arm", 1) == 1
    assert floor.summary()["pricing"] == {1: {"c": floor.draft_cost(1), "v": floor.verify_cost(1)}}
    for _ in range(5):  # fully accepted blocks: exploring a longer one does not pay here
        floor.observe("r", "arm", 1, 1)
    assert floor.choose("r", "arm", 1) == 1
    # a cheap drafter (c = 0.05) and flat scoring: the floor changes little, the longest block pays
    cheap = GammaPolicy(gamma_max=8, prior_alpha=1.0, draft_floor=True)
    cheap.observe_costs(1, draft_step_s=0.05, score_s_by_tokens={1: 1.0, 9: 1.0})
    assert cheap.choose("r", "arm", 1) == 8


def test_a_fully_accepted_run_does_not_hold_a_gamma_its_costs_no_longer_pay_for():
    """A run of fully accepted blocks of 4 (chosen while a drafter looked free), then the drafter's step is
    measured as dear as the target's: γ drops to what pays at α = 1 (γ = 1 here, as in the floor test above),
    instead of staying at the block (before the ceiling, exploration kept it at 4 for as long as the run
    lasted)."""
    policy = GammaPolicy(gamma_max=8, prior_alpha=1.0, draft_floor=True)
    for _ in range(3):
        policy.observe("r", "arm", 4, 4)
    assert policy.choose("r", "arm", 1) == 8  # c not measured yet: the default 0.1 and v ≡ 1
    policy.observe_costs(1, draft_step_s=1.0, score_s_by_tokens={1: 1.0, 3: 1.2, 9: 1.8})
    policy.observe("r", "arm", 4, 4)
    assert policy.choose("r", "arm", 1) == 1


def test_fixed_gamma_and_floor():
    assert GammaPolicy.fixed(3).choose("r", "arm", 8) == 3
    assert GammaPolicy(fixed_gamma=0).choose("r", "arm", 8) == 0
    policy = GammaPolicy(gamma_min=1, draft_cost=0.9)
    assert policy.choose("r", "arm", 1) == 1


def test_probe_after_a_streak_of_plain_rounds():
    policy = GammaPolicy(draft_cost=0.9, probe_interval=4)
    assert policy.choose("r", "arm", 1) == 0
    for _ in range(4):
        policy.observe("r", "arm", 0, 0)
    assert policy.choose("r", "arm", 1) == 1
    policy.observe("r", "arm", 1, 0)
    assert policy.choose("r", "arm", 1) == 0
    assert GammaPolicy(draft_cost=0.9, probe_interval=None).choose("r", "arm", 1) == 0


def test_policy_pickles_with_its_state():
    policy = GammaPolicy()
    policy.observe("r", "arm", 4, 2)
    policy.observe_costs(2, draft_step_s=0.01, score_s_by_tokens={1: 0.1, 5: 0.2})
    clone = pickle.loads(pickle.dumps(policy))
    assert clone.alpha("r", "arm") == policy.alpha("r", "arm")
    assert clone.verify_cost(2) == policy.verify_cost(2) and clone.summary() == policy.summary()
