"""Property test: verify_asd equals a plain-Python reference loop, and a ledger never exceeds its budget.

Logits are multiples of 0.5 (exact in float32, many ties) and budgets and gates are dyadic, so the
reference can use exact Fractions and still agree bit for bit with the vectorised float arithmetic.
"""

from __future__ import annotations

from fractions import Fraction

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import PAD_TOKEN_ID
from policies.asd import ASDConfig, RegretLedger, verify_asd


def reference_row(draft, logits, k_b, remaining, g, m):
    """The ASD rule, one position at a time. Returns (emitted tokens, [(position, x, y, regret, value)])."""
    argmax = [max(range(len(row)), key=lambda v, row=row: (row[v], -v)) for row in logits]  # first index on ties
    kept, spent, events = 0, Fraction(0), []
    for i in range(k_b):
        x, y = draft[i], argmax[i]
        if x == y:
            kept += 1
            continue
        regret = Fraction(logits[i][y]) - Fraction(logits[i][x])
        value = Fraction(k_b - i, k_b)
        passes = (
            g > 0
            and regret / value <= g
            and len(events) + 1 <= m
            and remaining - spent > 0
            and spent + regret <= remaining
        )
        if not passes:
            break
        kept += 1
        spent += regret
        events.append((i, x, y, regret, value))
    return draft[:kept] + [argmax[kept]], events


@st.composite
def rounds(draw):
    batch = draw(st.integers(1, 4))
    k = draw(st.integers(1, 5))
    vocab = draw(st.integers(2, 5))
    config = ASDConfig(
        g=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 8.0])),
        max_relaxed_per_block=draw(st.integers(0, 3)),
        budget=draw(st.sampled_from([0.0, 0.5, 1.0, 2.5, 10.0])),
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
    return batch, config, blocks


@settings(max_examples=300, deadline=None)
@given(rounds())
def test_asd_matches_reference_and_never_overspends(case):
    batch, config, blocks = case
    ledgers = [RegretLedger(config.budget, str(b)) for b in range(batch)]
    expected_remaining = [Fraction(config.budget)] * batch
    expected_events = [[] for _ in range(batch)]
    for block_index, (logits, draft, lens) in enumerate(blocks):
        k = len(draft[0])
        padded = [row[:k_b] + [PAD_TOKEN_ID] * (k - k_b) for row, k_b in zip(draft, lens)]
        verdict = verify_asd(torch.tensor(padded), torch.tensor(logits), ledgers, config, torch.tensor(lens))
        for b in range(batch):
            tokens, events = reference_row(draft[b], logits[b], lens[b], expected_remaining[b], config.g,
                                           config.max_relaxed_per_block)
            assert verdict.emitted()[b] == tokens
            assert verdict.num_relaxed[b].item() == len(events)
            expected_remaining[b] -= sum((e[3] for e in events), Fraction(0))
            blocks_before = sum(1 for _, _, ls in blocks[:block_index] if ls[b] > 0)
            expected_events[b] += [(blocks_before, *e[:4], float(e[4])) for e in events]
            ledger = ledgers[b]
            assert ledger.spent <= ledger.budget and ledger.remaining >= 0
            assert Fraction(ledger.remaining) == expected_remaining[b]
            got = [(e.block, e.position, e.draft_token, e.target_token, Fraction(e.regret), e.value)
                   for e in ledger.events]
            assert got == expected_events[b]
