"""The policy actor forgets the ledger mirrors of a unit whose Ray actor died (its node was lost before it could
report their close), and only those: a live unit's, or an unregistered one's (a driver), stay."""

from __future__ import annotations

from actors.policy import LedgerState, UnitReport
from actors.remote import policy


def _ledger(request_id: str, unit: str) -> LedgerState:
    return LedgerState(request_id, unit, "asd", budget=8.0, spent=1.0, relaxed_tokens=1, blocks=1)


def test_a_dead_unit_s_ledgers_are_forgotten(monkeypatch):
    monkeypatch.setattr(policy, "_dead", lambda actor_id: actor_id == "dead-actor")
    actor = policy.PolicyActor()
    actor.register("lost", "dead-actor")
    actor.register("alive", "live-actor")
    actor.report(UnitReport("lost", ledgers=(_ledger("r1", "lost"), _ledger("r2", "lost"))))
    actor.report(UnitReport("alive", ledgers=(_ledger("r3", "alive"),)))
    actor.report(UnitReport("driver", ledgers=(_ledger("r4", "driver"),)))  # never registered
    assert actor.open_ledgers() == ["r3", "r4"]
    assert actor.unit_actors == {"alive": "live-actor"}
