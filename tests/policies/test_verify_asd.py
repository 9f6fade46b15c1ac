"""ASD: the gate (both forms), the per-block cap, the persistent budget, suffix reuse, ledger isolation, bad input."""

from __future__ import annotations

import copy

import pytest
import torch

from policies import PAD_TOKEN_ID
from policies.asd import ASDConfig, LedgerEvent, RegretLedger, verify_asd, verify_asd_scores
from policies.exact import verify_greedy
from policies.scores import compact_scores

V = 16
TOP = 10.0


def block(targets: list[int], draft: list[int], regrets: dict[int, float] | None = None) -> torch.Tensor:
    """Logits [1, K+1, V]: argmax targets[i] (logit 10) and the draft token's logit 10 − regrets[i]."""
    logits = torch.zeros(1, len(targets), V)
    for i, y in enumerate(targets):
        logits[0, i, y] = TOP
    for i, r in (regrets or {}).items():
        assert draft[i] != targets[i]
        logits[0, i, draft[i]] = TOP - r
    return logits


def run(targets, draft, regrets, config, ledger):
    return verify_asd(torch.tensor([draft]), block(targets, draft, regrets), [ledger], config)


def test_relaxed_mismatch_and_suffix_reuse():
    """x_1 = 9 is a near miss; x_2, x_3 are target-greedy on the realized prefix, so they are kept too."""
    ledger = RegretLedger(5.0, request_id="r1")
    verdict = run([1, 2, 3, 4, 5], [1, 9, 3, 4], {1: 0.5}, ASDConfig(1.0, 1, 5.0), ledger)
    assert verdict.emitted() == [[1, 9, 3, 4, 5]]
    assert verdict.num_accepted.tolist() == [4] and verdict.num_relaxed.tolist() == [1]
    assert verdict.regret.tolist() == pytest.approx([0.5])
    assert ledger.events == (LedgerEvent(block=0, position=1, draft_token=9, target_token=2, regret=0.5, remaining=3,
                                         block_len=4, gate="remaining"),)
    assert ledger.spent == pytest.approx(0.5) and ledger.remaining == pytest.approx(4.5)
    assert ledger.blocks == 1
    assert ledger.summary() == {
        "request_id": "r1", "budget": 5.0, "spent": pytest.approx(0.5), "remaining": pytest.approx(4.5),
        "relaxed_tokens": 1, "blocks": 1, "exhausted": False,
    }


def test_the_paper_gate_weighs_a_position_by_the_proposal_left():
    """r_i ≤ g · ℓ_i, ℓ_i = K − i: at position 0 of K = 4 a regret up to 4·g passes, at position 2 up to 2·g."""
    config = ASDConfig(g=1.0, max_relaxed_per_block=4, budget=10.0)
    assert config.gate == "remaining"
    assert run([1, 2, 3, 4, 5], [7, 2, 3, 4], {0: 3.9}, config, RegretLedger(10.0)).num_accepted.tolist() == [4]
    ledger = RegretLedger(10.0)
    assert run([1, 2, 3, 4, 5], [1, 2, 7, 4], {2: 2.5}, config, ledger).emitted() == [[1, 2, 3]]
    assert ledger.spent == 0 and ledger.events == ()
    # Exactly on the gate passes: position 2, r = 2 = g · q_2; the event records q_2 and K.
    ledger = RegretLedger(10.0)
    assert run([1, 2, 3, 4, 5], [1, 2, 7, 4], {2: 2.0}, config, ledger).num_accepted.tolist() == [4]
    assert [(e.remaining, e.block_len, e.gate, e.weight) for e in ledger.events] == [(2, 4, "remaining", 2)]


def test_the_fraction_gate_weighs_a_position_by_its_share_of_the_block():
    config = ASDConfig(g=1.0, max_relaxed_per_block=4, budget=10.0, gate="fraction")
    # Position 0 of K=4: v = 1, r / v = 0.8 ≤ 1 passes; 3.9 (the paper's gate would pass it) does not.
    assert run([1, 2, 3, 4, 5], [7, 2, 3, 4], {0: 3.9}, config, RegretLedger(10.0)).num_accepted.tolist() == [0]
    assert run([1, 2, 3, 4, 5], [7, 2, 3, 4], {0: 0.8}, config, RegretLedger(10.0)).num_accepted.tolist() == [4]
    # Position 2 of K=4: v = 0.5, r / v = 1.6 > 1: the gate rejects and the target's token is emitted.
    ledger = RegretLedger(10.0)
    verdict = run([1, 2, 3, 4, 5], [1, 2, 7, 4], {2: 0.8}, config, ledger)
    assert verdict.emitted() == [[1, 2, 3]] and ledger.spent == 0 and ledger.events == ()
    # Exactly on the gate passes: position 2, r = 0.5, r / v = 1.0.
    ledger = RegretLedger(10.0)
    assert run([1, 2, 3, 4, 5], [1, 2, 7, 4], {2: 0.5}, config, ledger).num_accepted.tolist() == [4]
    assert [(e.remaining, e.block_len, e.gate, e.weight) for e in ledger.events] == [(2, 4, "fraction", 0.5)]


def test_cap_binds():
    config = ASDConfig(g=10.0, max_relaxed_per_block=2, budget=10.0)
    ledger = RegretLedger(10.0)
    verdict = run([1, 2, 3, 4, 5], [7, 8, 9, 4], {0: 0.1, 1: 0.1, 2: 0.1}, config, ledger)
    assert verdict.emitted() == [[7, 8, 3]]
    assert verdict.num_relaxed.tolist() == [2] and len(ledger.events) == 2


def test_budget_persists_across_blocks_and_an_exhausted_ledger_accepts_no_tie():
    config = ASDConfig(g=10.0, max_relaxed_per_block=4, budget=1.5)
    ledger = config.new_ledger("r")
    assert run([1, 2, 3], [7, 2], {0: 1.0}, config, ledger).num_accepted.tolist() == [2]
    # 0.5 left: a regret of 1.0 no longer fits, 0.5 does.
    assert run([1, 2, 3], [7, 2], {0: 1.0}, config, ledger).num_accepted.tolist() == [0]
    verdict = run([1, 2, 3], [7, 2], {0: 0.5}, config, ledger)
    assert verdict.num_accepted.tolist() == [2]
    assert ledger.spent == pytest.approx(1.5) and ledger.remaining == 0 and ledger.exhausted
    assert [event.block for event in ledger.events] == [0, 2] and ledger.blocks == 3
    # A zero-regret tie (x ≠ argmax, same logit) is still a mismatch: refused once exhausted.
    assert run([1, 2, 3], [7, 2], {0: 0.0}, config, ledger).num_accepted.tolist() == [0]
    assert len(ledger.events) == 2


def test_block_regret_must_fit_the_remaining_budget():
    """Two mismatches of 0.6 against 1.0 left: the first fits, the second would overspend."""
    ledger = RegretLedger(1.0)
    verdict = run([1, 2, 3, 4], [7, 8, 3], {0: 0.6, 1: 0.6}, ASDConfig(10.0, 3, 1.0), ledger)
    assert verdict.emitted() == [[7, 2]] and ledger.spent == pytest.approx(0.6)


@pytest.mark.parametrize("gate", ["remaining", "fraction"])
@pytest.mark.parametrize("g, m, budget", [(1.0, 2, 0.0), (0.0, 2, 5.0), (1.0, 0, 5.0)])
def test_disabled_settings_equal_greedy_ties_included(g, m, budget, gate):
    config = ASDConfig(g, m, budget, gate)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (32, 6, 8), generator=gen).float()  # [B, K+1, V]: many ties
    draft = torch.where(
        torch.rand(32, 5, generator=gen) < 0.7, logits[:, :5].argmax(-1), torch.randint(0, 8, (32, 5), generator=gen)
    )
    ledgers = [RegretLedger(config.budget) for _ in range(32)]
    asd, greedy = verify_asd(draft, logits, ledgers, config), verify_greedy(draft, logits)
    assert torch.equal(asd.tokens, greedy.tokens) and torch.equal(asd.num_accepted, greedy.num_accepted)
    assert asd.num_relaxed.sum() == 0 and all(ledger.events == () for ledger in ledgers)


def test_ledgers_do_not_leak_between_requests():
    logits = torch.cat([block([1, 2, 3], [7, 2], {0: 0.5}), block([1, 2, 3], [1, 2])])  # [2, 3, V]
    a, b = RegretLedger(1.0, "a"), RegretLedger(1.0, "b")
    verify_asd(torch.tensor([[7, 2], [1, 2]]), logits, [a, b], ASDConfig(10.0, 2, 1.0))
    assert len(a.events) == 1 and a.spent == pytest.approx(0.5)
    assert b.events == () and b.spent == 0 and b.blocks == 1
    # Swapping the rows charges the other ledger: a ledger follows its request, not a row index.
    verify_asd(torch.tensor([[1, 2], [7, 2]]), logits.flip(0), [a, b], ASDConfig(10.0, 2, 1.0))
    assert len(a.events) == 1 and len(b.events) == 1


@pytest.mark.parametrize("gate", ["remaining", "fraction"])
def test_ragged_batch_equals_per_row_calls_and_events_use_row_k(gate):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 5, V, generator=gen)  # [B, K+1, V]
    draft = logits[:, :4].argmax(-1)
    draft[:, 1] = logits[:, 1].topk(2).indices[:, 1]  # a near miss at position 1 of every row
    lens = torch.tensor([4, 2, 0, 3, 1])
    draft[torch.arange(4)[None, :] >= lens[:, None]] = PAD_TOKEN_ID
    config = ASDConfig(g=3.0, max_relaxed_per_block=2, budget=2.0, gate=gate)
    ledgers = [RegretLedger(2.0, str(b)) for b in range(5)]
    alone = copy.deepcopy(ledgers)
    batched = verify_asd(draft, logits, ledgers, config, draft_lens=lens)
    for b, k_b in enumerate(lens.tolist()):
        if k_b == 0:
            assert batched.emitted()[b] == [int(logits[b, 0].argmax())]
            assert ledgers[b].blocks == 0
            continue
        single = verify_asd(draft[b : b + 1, :k_b], logits[b : b + 1, : k_b + 1], [alone[b]], config)
        assert single.emitted()[0] == batched.emitted()[b]
        assert alone[b].events == ledgers[b].events
    for ledger, k_b in zip(ledgers, lens.tolist()):
        for event in ledger.events:
            assert (event.remaining, event.block_len, event.gate) == (k_b - event.position, k_b, gate)


def test_scores_path_is_identical():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 5, V, generator=gen)
    draft = torch.where(torch.rand(8, 4, generator=gen) < 0.6, logits[:, :4].argmax(-1), 3)
    config = ASDConfig(2.0, 2, 3.0)
    one, two = [RegretLedger(3.0) for _ in range(8)], [RegretLedger(3.0) for _ in range(8)]
    full = verify_asd(draft, logits, one, config)
    compact = verify_asd_scores(draft, compact_scores(draft, logits), two, config)
    for name in ("tokens", "num_accepted", "num_relaxed", "regret"):
        assert torch.equal(getattr(full, name), getattr(compact, name))
    assert [ledger.events for ledger in one] == [ledger.events for ledger in two]


def test_failed_calls_charge_nothing():
    logits = block([1, 2, 3], [7, 2], {0: 0.5})
    ledger = RegretLedger(1.0)
    config = ASDConfig(10.0, 2, 1.0)
    with pytest.raises(ValueError, match="ledgers"):
        verify_asd(torch.tensor([[7, 2], [7, 2]]), logits.expand(2, -1, -1), [ledger, ledger], config)
    with pytest.raises(ValueError, match="ledgers"):
        verify_asd(torch.tensor([[7, 2], [7, 2]]), logits.expand(2, -1, -1), [ledger], config)
    bad = logits.expand(2, -1, -1).clone()
    bad[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="target_logits"):
        verify_asd(torch.tensor([[7, 2], [7, 2]]), bad, [ledger, RegretLedger(1.0)], config)
    with pytest.raises(ValueError, match="config"):
        verify_asd(torch.tensor([[7, 2]]), logits, [ledger], {"g": 1.0})
    assert ledger.spent == 0 and ledger.events == () and ledger.blocks == 0


@pytest.mark.parametrize("kwargs", [dict(g=-0.1, max_relaxed_per_block=1, budget=1.0),
                                    dict(g=1.0, max_relaxed_per_block=-1, budget=1.0),
                                    dict(g=1.0, max_relaxed_per_block=1, budget=-1.0),
                                    dict(g=1.0, max_relaxed_per_block=1, budget=float("inf")),
                                    dict(g=1.0, max_relaxed_per_block=1, budget=1.0, gate="remaining-share")])
def test_bad_config_raises_value_error(kwargs):
    bad = (-0.1, -1, -1.0, float("inf"), "remaining-share")
    with pytest.raises(ValueError, match=next(k for k, v in kwargs.items() if v in bad)):
        ASDConfig(**kwargs)


@pytest.mark.parametrize("budget", [-1.0, float("nan"), float("inf"), "1"])
def test_bad_ledger_budget(budget):
    with pytest.raises(ValueError, match="budget"):
        RegretLedger(budget)


def test_positional_config():
    assert ASDConfig(0.5, 2, 3.0) == ASDConfig(g=0.5, max_relaxed_per_block=2, budget=3.0, gate="remaining")
    assert ASDConfig(0.5, 2, 3.0, "fraction") != ASDConfig(0.5, 2, 3.0)


def test_ledger_pickles_and_events_are_frozen():
    import dataclasses
    import pickle

    ledger = RegretLedger(2.0, "r")
    run([1, 2, 3], [7, 2], {0: 0.5}, ASDConfig(10.0, 2, 2.0), ledger)
    clone = pickle.loads(pickle.dumps(ledger))
    assert clone.summary() == ledger.summary() and clone.events == ledger.events
    with pytest.raises(dataclasses.FrozenInstanceError):
        ledger.events[0].regret = 0.0
