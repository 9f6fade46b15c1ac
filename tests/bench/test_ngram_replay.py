"""The offline prompt-lookup replay (bench.ngram_replay) on outputs whose drafts are known by construction."""

from __future__ import annotations

import pytest

from bench.ngram_replay import replay

PROMPT = list(range(10, 60))


def test_a_verbatim_copy_is_drafted_and_accepted():
    copy = [(PROMPT, PROMPT)]  # the output repeats the prompt: after its first token every draft is right
    fixed = replay(copy, 1, 4, 4, beta=0.0)
    assert fixed["acceptance"] == 1.0
    # 1 plain round, then rounds of 4 accepted + 1: 50 tokens in 1 + ceil(49 / 5) rounds
    assert fixed["speedup"] == pytest.approx(50 / 11)
    assert replay(copy, 1, 4, "adaptive", beta=0.03)["speedup"] > 2.0


def test_new_text_drafts_nothing_and_costs_nothing():
    new = [(PROMPT, list(range(100, 150)))]  # no n-gram of the output occurs before it
    for rule in ("adaptive", 2, 8):
        assert replay(new, 1, 4, rule, beta=0.4) == {"speedup": 1.0, "acceptance": 0.0}


def test_rejected_drafts_cost_verification_and_adaptive_stops_drafting():
    # each "5" is followed by a new token, so the draft after a "5" (what followed the previous one) is always wrong
    wrong = [([5, 7], [t for i in range(20) for t in (5, 100 + i)])]
    fixed = replay(wrong, 1, 1, 1, beta=0.5)
    assert fixed == {"speedup": pytest.approx(40 / (20 + 20 * 1.5)), "acceptance": 0.0}  # 20 wrong drafts of 1
    assert fixed["speedup"] < replay(wrong, 1, 1, "adaptive", beta=0.5)["speedup"] <= 1.0


def test_beta_must_not_be_negative():
    with pytest.raises(ValueError, match="beta"):
        replay([(PROMPT, PROMPT)], 1, 4, 2, beta=-0.1)
