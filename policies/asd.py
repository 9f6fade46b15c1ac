"""Approximate Speculative Decoding (ASD): greedy verification that may keep near-miss draft tokens.

`verify_asd_scores(draft_ids, scores, ledgers, config)` keeps a mismatch x_i ≠ y*_i only when its regret
r_i = z_i(y*_i) − z_i(x_i) passes the gate, the block's cap M and the request's remaining budget, and charges
each relaxed token to its row's `RegretLedger` with a `LedgerEvent`. The gate is the paper's r_i ≤ g · ℓ_i with
ℓ_i = K_b − i (`gate="remaining"`, the default) or r_i ≤ g · ℓ_i / K_b (`gate="fraction"`); the rule and its
terms are docs/architecture.md, "Terms". Budget 0, g = 0 or M = 0 give exactly `verify_greedy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import Field
from pydantic.dataclasses import dataclass

from policies.ledger import LedgerEvent, RegretLedger
from policies.scores import TargetScores, compact_scores
from policies.verdict import Verdict, accepted_prefix, assemble_tokens, check_draft, positions

__all__ = ["ASDConfig", "Gate", "LedgerEvent", "RegretLedger", "verify_asd", "verify_asd_scores"]

Gate = Literal["remaining", "fraction"]
"""How the gate weighs position i of a block of K_b: by ℓ_i = K_b − i (the paper's) or by ℓ_i / K_b."""


@dataclass(frozen=True)
class ASDConfig:
    """One ASD arm's verification setting: `ASDConfig(g, max_relaxed_per_block, budget, gate="remaining")`."""

    g: float = Field(ge=0, description="Gate: a mismatch at position i needs r_i ≤ g · ℓ_i (or g · ℓ_i / K_b with "
                     "gate 'fraction'), ℓ_i = K_b − i. 0 disables relaxation.")
    max_relaxed_per_block: int = Field(ge=0, description="M: most relaxed tokens in one block. 0 disables.")
    budget: float = Field(
        ge=0, allow_inf_nan=False, description="B: regret each request may spend in total (its ledger's budget)."
    )
    gate: Gate = Field("remaining", description="'remaining': r_i ≤ g · (K_b − i), the paper's gate; 'fraction': "
                       "r_i ≤ g · (K_b − i) / K_b, the allowance a share of the block.")

    def new_ledger(self, request_id: str | None = None) -> RegretLedger:
        """A fresh ledger with this arm's budget."""
        return RegretLedger(self.budget, request_id=request_id)


def verify_asd(
    draft_ids: torch.Tensor,  # [B, K] long
    target_logits: torch.Tensor,  # [B, K+1, V] float
    ledgers: Sequence[RegretLedger],  # one per row, distinct
    config: ASDConfig,
    draft_lens: torch.Tensor | None = None,  # [B] long
) -> Verdict:
    """ASD on full logits; equal to `verify_asd_scores(draft_ids, compact_scores(...), ledgers, config)`."""
    return verify_asd_scores(draft_ids, compact_scores(draft_ids, target_logits), ledgers, config, draft_lens)


def verify_asd_scores(
    draft_ids: torch.Tensor,  # [B, K] long
    scores: TargetScores,
    ledgers: Sequence[RegretLedger],  # one per row, distinct
    config: ASDConfig,
    draft_lens: torch.Tensor | None = None,  # [B] long
) -> Verdict:
    """ASD on compact scores; charges each row's ledger. A call that raises charges nothing."""
    lens = check_draft(draft_ids, draft_lens)  # [B]
    scores.check(draft_ids)
    ledgers = _check_ledgers(ledgers, draft_ids.shape[0])
    if not isinstance(config, ASDConfig):
        raise ValueError(f"config must be an ASDConfig, got {type(config).__name__}")

    k = draft_ids.shape[1]
    device = draft_ids.device
    pos = positions(k, device)  # [K]
    valid = pos < lens[:, None]  # [B, K]
    target = scores.argmax_ids[:, :k]  # [B, K]
    mismatch = (draft_ids != target) & valid  # [B, K]
    # float64 so the budget test matches the ledger's Python-float arithmetic.
    regret = (scores.argmax_logits[:, :k].double() - scores.draft_logits.double()).clamp(min=0)  # [B, K]
    cost = torch.where(mismatch, regret, 0.0)  # [B, K]
    spent_incl = cost.cumsum(dim=1)  # [B, K], block regret up to and including i
    if config.g > 0 and config.max_relaxed_per_block > 0:
        remaining = torch.tensor([ledger.remaining for ledger in ledgers], dtype=torch.float64, device=device)  # [B]
        spent_before = torch.cat([torch.zeros(len(ledgers), 1, dtype=torch.float64, device=device),
                                  spent_incl[:, :-1]], dim=1)  # [B, K]
        block_len = lens[:, None].double()  # [B, 1]
        left = block_len - pos  # [B, K], ℓ_i = K_b − i, > 0 where valid
        if config.gate == "remaining":
            gate = regret <= config.g * left  # [B, K], r_i / ℓ_i ≤ g
        else:
            gate = regret * block_len <= config.g * left  # [B, K], r_i / (ℓ_i / K_b) ≤ g
        cap = mismatch.long().cumsum(dim=1) <= config.max_relaxed_per_block  # [B, K]
        funded = (remaining[:, None] - spent_before > 0) & (spent_incl <= remaining[:, None])  # [B, K]
        keep = valid & (~mismatch | (gate & cap & funded))  # [B, K]
    else:
        keep = valid & ~mismatch  # [B, K]
    num_accepted = accepted_prefix(keep)  # [B]
    relaxed = mismatch & (pos < num_accepted[:, None])  # [B, K]
    last_kept = (num_accepted - 1).clamp(min=0)[:, None]  # [B, 1]
    block_regret = torch.where(num_accepted > 0, spent_incl.gather(1, last_kept).squeeze(1), 0.0)  # [B]
    last = scores.argmax_ids.gather(1, num_accepted[:, None]).squeeze(1)  # [B]

    _charge(ledgers, draft_ids, target, regret, relaxed, block_regret, lens, config.gate)
    return Verdict(
        tokens=assemble_tokens(draft_ids, num_accepted, last),
        num_accepted=num_accepted,
        num_relaxed=relaxed.sum(dim=1),
        regret=block_regret.float(),
    )


def _charge(
    ledgers: list[RegretLedger],
    draft_ids: torch.Tensor,  # [B, K]
    target: torch.Tensor,  # [B, K]
    regret: torch.Tensor,  # [B, K] float64
    relaxed: torch.Tensor,  # [B, K] bool
    block_regret: torch.Tensor,  # [B] float64
    lens: torch.Tensor,  # [B]
    gate: Gate,
) -> None:
    """Write one block to every ledger whose row had a block, with an event per relaxed token."""
    events: dict[int, list[LedgerEvent]] = {}
    lens_list = lens.tolist()
    relaxed_at = relaxed.nonzero().tolist()  # [[b, i], ...], row-major: positions in order
    if relaxed_at:
        xs, ys, rs = draft_ids.tolist(), target.tolist(), regret.tolist()
        for b, i in relaxed_at:
            k_b = lens_list[b]
            event = LedgerEvent(ledgers[b].blocks, i, xs[b][i], ys[b][i], rs[b][i], k_b - i, k_b, gate)
            events.setdefault(b, []).append(event)
    for b, (ledger, k_b, spent) in enumerate(zip(ledgers, lens_list, block_regret.tolist())):
        if k_b > 0:
            ledger.charge_block(events.get(b, ()), spent)


def _check_ledgers(ledgers: Sequence[RegretLedger], batch: int) -> list[RegretLedger]:
    ledgers = list(ledgers)
    if len(ledgers) != batch:
        raise ValueError(f"ledgers must hold one RegretLedger per row (B={batch}), got {len(ledgers)}")
    if not all(isinstance(ledger, RegretLedger) for ledger in ledgers):
        raise ValueError("ledgers must all be RegretLedger instances")
    if len({id(ledger) for ledger in ledgers}) != batch:
        raise ValueError("ledgers must be distinct: one request's ledger appears in two rows")
    return ledgers
