"""verify_asd_scores equals a plain-Python reference written from the paper's definition, and never overspends.

The reference walks each row's block one position at a time: a match is kept; a mismatch is kept iff its regret
passes the gate (the paper's r_i ≤ g · (K_b − i), or the "fraction" form r_i ≤ g · (K_b − i) / K_b), the block's
relaxed count stays ≤ M and the request's cumulative regret stays ≤ B (with budget left before it); the block stops
at the first rejection and emits the target's argmax there (or the bonus after a fully kept block). Logits are
multiples of 0.5 (exact in float32, many ties) and gates and budgets are dyadic, so the reference uses exact
Fractions and agrees bit for bit with the vectorised float arithmetic.
"""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import PAD_TOKEN_ID
from policies.asd import ASDConfig, RegretLedger, verify_asd_scores
from policies.exact import verify_greedy
from policies.scores import compact_scores

GATES = ("remaining", "fraction")


def reference_row(draft, logits, k_b, remaining, config):
    """One row's block, position by position. Returns (emitted tokens, [(position, x, y, regret, ℓ_i)])."""
    argmax = [max(range(len(row)), key=lambda v, row=row: (row[v], -v)) for row in logits]  # first index on ties
    g, m = Fraction(config.g), config.max_relaxed_per_block
    kept, spent, events = 0, Fraction(0), []
    for i in range(k_b):
        x, y = draft[i], argmax[i]
        if x == y:
            kept += 1
            continue
        regret = Fraction(logits[i][y]) - Fraction(logits[i][x])
        q = k_b - i  # the proposal length left at position i
        allowed = g * q if config.gate == "remaining" else g * Fraction(q, k_b)
        passes = (
            g > 0  # g = 0 disables relaxation, zero-regret ties included
            and regret <= allowed
            and len(events) + 1 <= m
            and remaining - spent > 0
            and spent + regret <= remaining
        )
        if not passes:
            break
        kept += 1
        spent += regret
        events.append((i, x, y, regret, q))
    return draft[:kept] + [argmax[kept]], events


def check_against_reference(config, blocks):
    """Run `blocks` [(logits [B][K+1][V], draft [B][K], lens [B])] through one set of ledgers and the reference."""
    batch = len(blocks[0][1])
    ledgers = [RegretLedger(config.budget, str(b)) for b in range(batch)]
    expected_remaining = [Fraction(config.budget)] * batch
    expected_events = [[] for _ in range(batch)]
    for block_index, (logits, draft, lens) in enumerate(blocks):
        k = len(draft[0])
        padded = torch.tensor([row[:k_b] + [PAD_TOKEN_ID] * (k - k_b) for row, k_b in zip(draft, lens)])
        scores = compact_scores(padded, torch.tensor(logits))
        verdict = verify_asd_scores(padded, scores, ledgers, config, torch.tensor(lens))
        for b in range(batch):
            tokens, events = reference_row(draft[b], logits[b], lens[b], expected_remaining[b], config)
            assert verdict.emitted()[b] == tokens
            assert verdict.num_accepted[b].item() == len(tokens) - 1
            assert verdict.num_relaxed[b].item() == len(events)
            block_regret = sum((e[3] for e in events), Fraction(0))
            assert verdict.regret[b].item() == float(block_regret)
            expected_remaining[b] -= block_regret
            blocks_before = sum(1 for _, _, ls in blocks[:block_index] if ls[b] > 0)
            expected_events[b] += [(blocks_before, *e[:4], e[4], lens[b], config.gate) for e in events]
            ledger = ledgers[b]
            assert ledger.spent <= ledger.budget and ledger.remaining >= 0
            assert Fraction(ledger.remaining) == expected_remaining[b]
            assert ledger.blocks == sum(1 for _, _, ls in blocks[: block_index + 1] if ls[b] > 0)
            got = [(e.block, e.position, e.draft_token, e.target_token, Fraction(e.regret), e.remaining,
                    e.block_len, e.gate) for e in ledger.events]
            assert got == expected_events[b]


def random_blocks(rng: random.Random, batch: int, k: int, vocab: int, rounds: int):
    """Half-integer logits; each draft token is the argmax half the time (long accepted prefixes), else random."""
    blocks = []
    for _ in range(rounds):
        logits = [[[rng.randint(0, 8) / 2 for _ in range(vocab)] for _ in range(k + 1)] for _ in range(batch)]
        draft = [[max(range(vocab), key=lambda v, pos=pos: (pos[v], -v)) if rng.random() < 0.5
                  else rng.randrange(vocab) for pos in row[:k]] for row in logits]
        lens = [rng.randint(0, k) for _ in range(batch)]
        blocks.append((logits, draft, lens))
    return blocks


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("seed", range(6))
def test_seeded_cases_match_the_reference(gate, seed):
    rng = random.Random(seed)
    for _ in range(40):
        config = ASDConfig(g=rng.choice([0.0, 0.25, 0.5, 1.0, 2.0, 8.0]), max_relaxed_per_block=rng.randint(0, 3),
                           budget=rng.choice([0.0, 0.5, 1.0, 2.5, 10.0]), gate=gate)
        check_against_reference(config, random_blocks(rng, rng.randint(1, 4), rng.randint(1, 6), rng.randint(2, 5),
                                                      rng.randint(1, 4)))


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("g, m, budget", [(2.0, 2, 0.0), (0.0, 2, 8.0), (2.0, 0, 8.0)])
def test_disabled_settings_equal_greedy_on_the_same_cases(gate, g, m, budget):
    rng = random.Random(7)
    config = ASDConfig(g, m, budget, gate)
    for _ in range(30):
        batch, k = rng.randint(1, 4), rng.randint(1, 6)
        for logits, draft, lens in random_blocks(rng, batch, k, rng.randint(2, 5), 2):
            padded = torch.tensor([row[:k_b] + [PAD_TOKEN_ID] * (k - k_b) for row, k_b in zip(draft, lens)])
            lens_t, logits_t = torch.tensor(lens), torch.tensor(logits)
            ledgers = [RegretLedger(budget) for _ in range(batch)]
            asd = verify_asd_scores(padded, compact_scores(padded, logits_t), ledgers, config, lens_t)
            greedy = verify_greedy(padded, logits_t, lens_t)
            assert torch.equal(asd.tokens, greedy.tokens) and torch.equal(asd.num_accepted, greedy.num_accepted)
            assert asd.num_relaxed.sum() == 0 and all(ledger.events == () for ledger in ledgers)


@st.composite
def rounds(draw):
    batch = draw(st.integers(1, 4))
    k = draw(st.integers(1, 5))
    vocab = draw(st.integers(2, 5))
    config = ASDConfig(
        g=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 8.0])),
        max_relaxed_per_block=draw(st.integers(0, 3)),
        budget=draw(st.sampled_from([0.0, 0.5, 1.0, 2.5, 10.0])),
        gate=draw(st.sampled_from(GATES)),
    )
    blocks = []
    for _ in range(draw(st.integers(1, 3))):
        logits = draw(st.lists(
            st.lists(st.lists(st.integers(0, 8), min_size=vocab, max_size=vocab), min_size=k + 1, max_size=k + 1),
            min_size=batch, max_size=batch,
        ))
        draft = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=k, max_size=k), min_size=batch,
                              max_size=batch))
        lens = draw(st.lists(st.integers(0, k), min_size=batch, max_size=batch))
        blocks.append(([[[v / 2 for v in pos] for pos in row] for row in logits], draft, lens))
    return config, blocks


@settings(max_examples=300, deadline=None)
@given(rounds())
def test_asd_matches_reference_and_never_overspends(case):
    check_against_reference(*case)
