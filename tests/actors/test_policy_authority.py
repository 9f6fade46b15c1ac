"""The policy authority in-process: units decide locally, report in the background, and share what they learn.

- a unit started after another has learned starts from the learned α, not the prior;
- the authority's mirror of a live ASD ledger equals the unit's lease after every round;
- an authority that does not answer stalls no round, and gets every ledger once it answers.
"""

import concurrent.futures

import pytest
import torch

from actors.coordinator import ArmSpec, Coordinator, GenerationRequest, SamplingParams
from actors.drafting import NgramDrafter
from actors.engines.native import load_model
from actors.engines.native.engine import Engine
from actors.policy import InProcessLink, PolicyCore, UnitPolicy
from actors.stats import NullObserver
from policies.asd import ASDConfig

from tests.conftest import REPETITIVE_PROMPTS

SETTINGS = dict(gamma_max=6, prior_alpha=0.3, draft_cost=0.02)
ASD = ArmSpec("asd", "asd", ASDConfig(g=4.0, max_relaxed_per_block=2, budget=2.0))


@pytest.fixture(scope="module")
def tiny(tiny_llama_pair):
    torch.set_num_threads(1)
    return load_model(tiny_llama_pair[0])[0]


def unit(model, core: PolicyCore, name: str, observer=None) -> Coordinator:
    return Coordinator.local(Engine(model, max_slots=8, max_seq_len=256), NgramDrafter(1, 3), core, unit=name,
                             observer=observer, eos_token_ids=[])


def greedy(rid, prompt, arm=ArmSpec("exact"), n=24):
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=n), arm)


def test_a_new_unit_starts_from_what_the_app_learned(tiny):
    """Unit A learns a high α (the tiny random model repeats itself, so n-gram drafts hit); unit B, started
    after, plans its first round from that α (γ above the prior's), while a unit on a fresh authority plans
    from the prior."""
    shared = PolicyCore(**SETTINGS)
    first = unit(tiny, shared, "a")
    first.generate_many_sync([greedy(f"a{i}", p, n=48) for i, p in enumerate(REPETITIVE_PROMPTS)])
    learned = shared.gamma.alpha(None, "exact")
    assert learned > SETTINGS["prior_alpha"] + 0.3, learned
    second = UnitPolicy(InProcessLink(shared), unit="b", **SETTINGS)
    fresh = UnitPolicy(InProcessLink(PolicyCore(**SETTINGS)), unit="c", **SETTINGS)
    assert second.gamma.alpha(None, "exact") == pytest.approx(learned)
    assert second.choose("new", "exact", 1) > fresh.choose("new", "exact", 1)
    # and a whole unit's first request shows it in its record
    late = unit(tiny, shared, "d").generate_sync(greedy("late", REPETITIVE_PROMPTS[0]))
    prior = unit(tiny, PolicyCore(**SETTINGS), "e").generate_sync(greedy("prior", REPETITIVE_PROMPTS[0]))
    assert late.record.gammas[0] > prior.record.gammas[0]


class MirrorCheck(NullObserver):
    """After every round, the authority's mirror of each open ASD ledger equals the unit's lease."""

    def __init__(self):
        self.unit, self.checked = None, 0

    def on_round(self, record):
        policy = self.unit.policy
        for rid, (_, lease) in policy.ledgers.items():
            if rid in policy._dirty:  # charged in this round: its report leaves at the round's end
                continue
            assert policy.core.ledger(rid).spent == lease.spent
            self.checked += 1


def test_the_authoritys_ledger_equals_the_units_after_every_round(tiny):
    core, check = PolicyCore(**SETTINGS), MirrorCheck()
    check.unit = unit(tiny, core, "m", observer=check)
    outs = check.unit.generate_many_sync([greedy(f"m{i}", p, ASD) for i, p in enumerate(REPETITIVE_PROMPTS)])
    assert check.checked > 0 and any(o.record.regret_spent for o in outs)
    for o in outs:  # the closed ledger as it ended is the record's spend
        assert core.ledger(o.record.request_id).spent == o.record.regret_spent <= 2.0
    assert core.open_ledgers() == []


class SilentLink(InProcessLink):
    """An authority that takes reports but answers none until `answer()`."""

    def __init__(self, core):
        super().__init__(core)
        self.held: list[tuple[concurrent.futures.Future, object]] = []

    def submit(self, report):
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.held.append((future, report))
        return future

    def answer(self):
        for future, report in self.held:
            future.set_result(self.core.report(report))
        self.held = []


def test_an_authority_that_does_not_answer_stalls_no_round(tiny, monkeypatch):
    monkeypatch.setattr("actors.policy.SYNC_TIMEOUT_S", 0.5)  # the waits off the step path give up sooner
    core = PolicyCore(**SETTINGS)
    coord = unit(tiny, core, "s")
    coord.policy = UnitPolicy(SilentLink(core), unit="s", **SETTINGS)
    outs = coord.generate_many_sync([greedy(f"s{i}", p, ASD) for i, p in enumerate(REPETITIVE_PROMPTS)])
    assert all(len(o.token_ids) == 24 for o in outs)
    assert len(coord.policy.link.held) == 1  # one report in flight; the rest waited for it
    coord.policy.link.answer()
    coord.policy.flush(wait=True)
    coord.policy.link.answer()
    assert core.open_ledgers() == [] and all(core.ledger(o.record.request_id) is not None for o in outs)
