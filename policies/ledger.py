"""Regret ledgers: the per-request record of what approximate verification spent against its budget.

ASD may accept a draft token x_i that is not the target's argmax y*_i. Its **regret** is
r_i = z_i(y*_i) − z_i(x_i) ≥ 0 on raw target logits. A request's ledger holds a **budget** B of regret; every
relaxed token writes one `LedgerEvent` and spends its regret. `remaining` is the authoritative state and never
goes below 0, so `spent = budget − remaining` never exceeds the budget, even with floating-point rounding.

A ledger belongs to one request and is mutated only by `policies.asd.verify_asd*` (through `charge_block`),
one call at a time: the policy actor that owns ledgers serialises calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LedgerEvent:
    """One relaxed (accepted mismatching) draft token."""

    block: int  # index of the block within the request, 0 for its first verified block
    position: int  # i, 0-based position within the block
    draft_token: int  # x_i, the accepted draft token
    target_token: int  # y*_i, the target's argmax it replaced
    regret: float  # r_i = z_i(y*_i) − z_i(x_i)
    remaining: int  # ℓ_i = K_b − i, the proposal length left at position i, i included (the ASD paper's q_i)
    block_len: int  # K_b, the block's draft length
    gate: str  # the gate form that admitted it: "remaining" (r_i ≤ g · ℓ_i) or "fraction" (r_i ≤ g · ℓ_i / K_b)

    @property
    def weight(self) -> float:
        """What g multiplies in this event's gate: ℓ_i, or ℓ_i / K_b for the "fraction" form."""
        return self.remaining if self.gate == "remaining" else self.remaining / self.block_len


class RegretLedger:
    """Regret spent against a budget by one request, with one event per relaxed token."""

    def __init__(self, budget: float, request_id: str | None = None) -> None:
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget):
            raise ValueError(f"budget must be a finite number, got {budget!r}")
        if budget < 0:
            raise ValueError(f"budget must be ≥ 0, got {budget}")
        self.budget = float(budget)
        self.request_id = request_id
        self._remaining = float(budget)
        self._events: list[LedgerEvent] = []
        self._blocks = 0

    @classmethod
    def restored(cls, budget: float, spent: float = 0.0, request_id: str | None = None) -> RegretLedger:
        """A ledger that has already spent `spent` of `budget` (reopened after the policy actor restarted;
        the events before the restart are not kept, their regret is)."""
        ledger = cls(budget, request_id=request_id)
        if isinstance(spent, bool) or not isinstance(spent, (int, float)) or not 0 <= spent <= budget:
            raise ValueError(f"spent must be a number in [0, budget={budget}], got {spent!r}")
        ledger._remaining = max(ledger.budget - float(spent), 0.0)
        return ledger

    @property
    def remaining(self) -> float:
        """Budget left, ≥ 0."""
        return self._remaining

    @property
    def spent(self) -> float:
        """Regret charged so far, ≤ budget."""
        return self.budget - self._remaining

    @property
    def events(self) -> tuple[LedgerEvent, ...]:
        """One event per relaxed token, in order."""
        return tuple(self._events)

    @property
    def blocks(self) -> int:
        """Blocks (rounds with K_b ≥ 1) verified against this ledger so far."""
        return self._blocks

    @property
    def exhausted(self) -> bool:
        """True once nothing is left to spend: no further mismatch can be accepted."""
        return self._remaining <= 0

    def charge_block(self, events: Sequence[LedgerEvent], block_regret: float) -> None:
        """Record one verified block: its relaxed-token events and their summed regret.

        The caller (ASD) has already checked `block_regret ≤ remaining`; the clamp only absorbs rounding.
        """
        if block_regret < 0 or block_regret > self._remaining:
            raise ValueError(f"block_regret {block_regret} is outside [0, remaining={self._remaining}]")
        self._remaining = max(self._remaining - block_regret, 0.0)
        self._events.extend(events)
        self._blocks += 1

    def summary(self) -> dict:
        """Plain-dict view for telemetry and `usage.speculative`."""
        return {
            "request_id": self.request_id,
            "budget": self.budget,
            "spent": self.spent,
            "remaining": self.remaining,
            "relaxed_tokens": len(self._events),
            "blocks": self._blocks,
            "exhausted": self.exhausted,
        }

    def __repr__(self) -> str:
        return (
            f"RegretLedger(budget={self.budget}, spent={self.spent}, relaxed_tokens={len(self._events)}, "
            f"request_id={self.request_id!r})"
        )
