"""α as a function of match length and confidence (`policies.confidence`), and how `GammaPolicy` uses it and
explores γ after fully accepted blocks."""

from __future__ import annotations

import random

import pytest

from policies.confidence import ConfidenceAcceptance
from policies.gamma import GammaPolicy, explore_gamma


def test_steps_split_cumulative_confidence_into_step_probabilities():
    steps = ConfidenceAcceptance.steps(3, [0.8, 0.4, 0.2])
    assert [m for m, _ in steps] == [3, 4, 5]
    assert [p for _, p in steps] == pytest.approx([0.8, 0.5, 0.5])


def test_an_empty_cell_trusts_the_drafter():
    table = ConfidenceAcceptance()
    assert table.step_alpha(1, 0.42) == pytest.approx(0.42)
    assert table.draft_alpha(2, [0.9, 0.45]) == pytest.approx((0.9 + 0.5) / 2)
    assert table.draft_alpha(2, []) is None


def test_learns_the_true_rate_of_a_miscalibrated_cell():
    """One-token matches that claim p = 0.6 but are accepted 20% of the time, and 8-token matches that claim
    0.6 but are accepted 95%: after 2000 drafts each (decay 1, so the estimate is a plain mean shrunk by 4
    pseudo-trials), each cell's estimate is within 0.03 of its true rate (binomial sd ≤ 0.009 at n = 2000)."""
    rng = random.Random(0)
    table = ConfidenceAcceptance(decay=1.0)
    for _ in range(2000):
        table.observe(1, [0.6], int(rng.random() < 0.2))
        table.observe(8, [0.6], int(rng.random() < 0.95))
    assert table.step_alpha(1, 0.6) == pytest.approx(0.2, abs=0.03)
    assert table.step_alpha(8, 0.6) == pytest.approx(0.95, abs=0.03)
    assert table.step_alpha(3, 0.6) == pytest.approx(0.6)  # untouched cell


def test_observes_steps_up_to_the_first_rejection():
    table = ConfidenceAcceptance(decay=1.0)
    table.observe(4, [0.95, 0.5, 0.4, 0.3], accepted=1)  # step 0 accepted, step 1 rejected, 2-3 never tried
    cells = table.summary()
    assert sorted(v for v, _ in cells.values()) == [0.0, 1.0] and sum(n for _, n in cells.values()) == 2


@pytest.mark.parametrize("kwargs, name", [({"weight": 0}, "weight"), ({"decay": 1.5}, "decay")])
def test_bad_settings_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ConfidenceAcceptance(**kwargs)


def test_observe_rejects_accepted_beyond_the_draft():
    with pytest.raises(ValueError, match="accepted"):
        ConfidenceAcceptance().observe(2, [0.9], accepted=2)
    with pytest.raises(ValueError, match="confidence"):
        GammaPolicy().observe("r", "arm", 2, 1, confidence=(0.9,), match_len=3)


def test_explore_doubles_while_it_pays():
    flat = [1.0] * 17  # v ≡ 1: a longer block costs nothing more
    assert [explore_gamma(b, 16, 0.0, flat) for b in (1, 2, 4, 8, 16)] == [1, 4, 8, 16, 16]
    steep = [1.0 + 0.5 * k for k in range(17)]  # a busy batch: every scored token costs half a step
    assert explore_gamma(4, 16, 0.0, steep) == 4
    assert explore_gamma(4, 6, 0.0, flat) == 6  # capped at γ_max
    convex = [1.0 + 0.05 * k * k for k in range(17)]  # at α = 1 and c = 0.1, γ = 3 pays best
    assert explore_gamma(4, 16, 0.1, convex) == 3  # a block past that ceiling comes back to it


def test_fully_accepted_blocks_reach_gamma_max_in_a_few_rounds():
    """A request at γ = 2 whose every block is accepted in full: 2 → 4 → 8 → 16 (CPU-like v: 1 + 0.12·γ)."""
    policy = GammaPolicy(gamma_max=16, prior_alpha=0.5, draft_cost=0.01)
    policy.observe_costs(1, 0.0003, {n: 0.03 * (1 + 0.12 * (n - 1)) for n in (1, 2, 5, 9, 17)})
    gammas = []
    gamma = 2
    for _ in range(4):
        policy.observe("r", "arm", gamma, gamma)
        gamma = policy.choose("r", "arm", 1)
        gammas.append(gamma)
    assert gammas[2:] == [16, 16] and gammas[0] >= 4
    off = GammaPolicy(gamma_max=16, prior_alpha=0.5, draft_cost=0.01, explore=False)
    off.observe_costs(1, 0.0003, {n: 0.03 * (1 + 0.12 * (n - 1)) for n in (1, 2, 5, 9, 17)})
    off.observe("r", "arm", 2, 2)
    assert off.choose("r", "arm", 1) < 16


def test_a_confident_draft_raises_the_request_alpha_at_once():
    """A request whose running count says α ≈ 0.3 but whose last draft was a confident long match gets the
    calibrated α of that draft; a junk draft does not lower a good count."""
    policy = GammaPolicy(gamma_max=16, prior_alpha=0.3, draft_cost=0.01)
    for _ in range(5):
        policy.observe("r", "arm", 4, 1)
    counted = policy.alpha("r", "arm")
    policy.observe("r", "arm", 3, 3, confidence=(0.97, 0.95, 0.93), match_len=20)
    assert policy.alpha("r", "arm") > 0.9 > counted
    twin = GammaPolicy(gamma_max=16, prior_alpha=0.3, draft_cost=0.01)
    for p in (policy, twin):
        p.observe("q", "arm", 4, 4)
    policy.observe("q", "arm", 1, 0, confidence=(0.05,), match_len=1)
    twin.observe("q", "arm", 1, 0)
    assert policy.alpha("q", "arm") >= twin.alpha("q", "arm") - 1e-12  # the count, not the junk draft
    policy.forget("r")
    assert "r" not in policy._requests
