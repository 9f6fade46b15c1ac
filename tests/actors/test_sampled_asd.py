"""Sampled requests on ASD arms, in-process: what runs (exact fallback or the relaxed rule), what the record
says, parity with exact sampling at budget 0, the ledger bound, seeded reproducibility and a policy restart."""

import pytest
import torch

from actors.coordinator import ArmSpec, Coordinator, GenerationRequest, SamplingParams
from actors.drafting import ModelDrafter, NgramDrafter
from actors.engines.native import load_model
from actors.engines.native.engine import Engine
from actors.policy import InProcessLink, LocalPolicy, PolicyCore
from actors.stats import RequestRecord
from policies.asd import ASDConfig
from tests.conftest import REPETITIVE_PROMPTS

PROMPTS = REPETITIVE_PROMPTS
EXACT_ARM = ArmSpec("exact")
FALLBACK_ARM = ArmSpec("asd", "asd", ASDConfig(g=2.0, max_relaxed_per_block=2, budget=8.0))


def relaxed(budget: float, g: float = 2.0, m: int = 2, name: str = "relaxed") -> ArmSpec:
    return ArmSpec(name, "asd", ASDConfig(g=g, max_relaxed_per_block=m, budget=budget), sampled="relaxed")


@pytest.fixture(scope="module")
def tiny(tiny_llama_pair):
    torch.set_num_threads(1)
    target, drafter = tiny_llama_pair
    return load_model(target)[0], load_model(drafter)[0]


def unit(model, drafter=None, fixed=None):
    return Coordinator.local(Engine(model, max_slots=16, max_seq_len=256), drafter,
                             PolicyCore(gamma_max=6, fixed_gamma=fixed), max_batch_size=16)


def model_drafter(tiny):
    return ModelDrafter(Engine(tiny[1], max_slots=16, max_seq_len=256))


def sampled(rid, prompt, arm, seed, n=16, temperature=1.0, top_k=None):
    params = SamplingParams(max_tokens=n, temperature=temperature, top_k=top_k, seed=seed)
    return GenerationRequest(rid, prompt, params, arm)


def test_fallback_and_relaxed_records_say_what_ran(tiny):
    """One batch: greedy and sampled rows on the exact arm, an ASD arm whose sampled rule is exact, and a
    relaxed arm. Each record names the verification that ran; only the fallback carries a reason."""
    coord = Coordinator.local(Engine(tiny[0], max_slots=16, max_seq_len=256), NgramDrafter(1, 3),
                              PolicyCore(gamma_max=4))
    greedy = SamplingParams(max_tokens=8)
    hot = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    cases = [("exact-g", greedy, EXACT_ARM), ("exact-s", hot, EXACT_ARM), ("asd-g", greedy, FALLBACK_ARM),
             ("asd-s", hot, FALLBACK_ARM), ("rel-g", greedy, relaxed(8.0)), ("rel-s", hot, relaxed(8.0))]
    outs = coord.generate_many_sync([GenerationRequest(rid, PROMPTS[i % 5], p, arm)
                                     for i, (rid, p, arm) in enumerate(cases)])
    usage = {rid: o.record.speculative_usage() for (rid, _, _), o in zip(cases, outs)}
    assert {rid: u["verification"] for rid, u in usage.items()} == {
        "exact-g": "exact", "exact-s": "exact", "asd-g": "asd", "asd-s": "exact", "rel-g": "asd", "rel-s": "asd"}
    assert {rid for rid, u in usage.items() if "asd_fallback" in u} == {"asd-s"}
    assert usage["asd-s"]["asd_fallback"] == "sampled"
    # the regret keys stay on every request of an ASD arm; a fallback spends nothing
    assert usage["asd-s"]["regret_spent"] == 0.0 and usage["asd-s"]["regret_budget"] == 8.0
    assert usage["rel-s"]["regret_budget"] == 8.0 and "regret_spent" not in usage["exact-s"]
    records = {rid: o.record for (rid, _, _), o in zip(cases, outs)}
    assert records["asd-s"].arm_verification == "asd" and records["asd-s"].sampled
    assert coord.policy.core.open_ledgers() == [] and coord.target.engine.active_ids() == []


def test_record_defaults_keep_old_callers():
    record = RequestRecord("r", "asd", "u", 1, 1, 1, 1, 1, (1,), 0.0, 0.1, 1.0, "stop", verification="asd")
    assert record.arm_verification == "asd" and record.asd_fallback is None
    assert record.speculative_usage()["verification"] == "asd" and "asd_fallback" not in record.speculative_usage()


@pytest.mark.parametrize("drafter_kind", ["ngram", "model"])
@pytest.mark.parametrize("setting", [dict(budget=0.0, g=4.0), dict(budget=8.0, g=0.0), dict(budget=8.0, m=0)])
def test_relaxed_without_allowance_is_exact_sampling_draw_for_draw(tiny, drafter_kind, setting):
    """B = 0, g = 0 or M = 0 fund no position: the relaxed arm emits exactly the tokens of exact speculative
    sampling for the same seeds (the target draws the same uniforms from the same per-request generators).
    With prompt lookup, top_k = 4 makes the sampled text repeat itself, so lookup finds drafts."""
    def run(arm):
        drafter = NgramDrafter(1, 3) if drafter_kind == "ngram" else model_drafter(tiny)
        coord = unit(tiny[0], drafter, fixed=3)
        top_k = 4 if drafter_kind == "ngram" else None
        return coord.generate_many_sync([sampled(f"p{i}", p, arm, seed=i, temperature=0.8, top_k=top_k)
                                         for i, p in enumerate(PROMPTS)])

    exact = run(EXACT_ARM)
    loose = run(relaxed(**setting))
    assert [o.token_ids for o in loose] == [o.token_ids for o in exact]
    assert all(o.record.verification == "asd" and o.record.regret_spent == 0.0 for o in loose)
    assert sum(o.record.draft_tokens for o in exact) > 0  # speculation ran


def test_relaxed_spends_within_the_budget_and_accepts_more(tiny):
    """A model drafter (q ≠ p) on a random tiny target: the relaxed rule keeps more drafts than exact
    sampling, writes its spend to the ledger, and never spends more than B."""
    budget = 0.5
    drafter = model_drafter(tiny)
    reqs = lambda arm: [sampled(f"b{i}-{j}", p, arm, seed=100 * j + i, n=24)  # noqa: E731
                        for j in range(4) for i, p in enumerate(PROMPTS)]
    exact = unit(tiny[0], drafter, fixed=4).generate_many_sync(reqs(EXACT_ARM))
    loose = unit(tiny[0], drafter, fixed=4).generate_many_sync(reqs(relaxed(budget, g=2.0, m=4)))
    spent = [o.record.regret_spent for o in loose]
    assert all(0.0 <= s <= budget + 1e-9 for s in spent), spent
    assert sum(o.record.relaxed_tokens for o in loose) > 0 and max(spent) > 0
    rate = lambda outs: sum(o.record.accepted_tokens for o in outs) / sum(o.record.draft_tokens for o in outs)  # noqa: E731
    assert rate(loose) > rate(exact)


def test_seeded_relaxed_request_reproduces_alone_and_in_a_batch(tiny):
    """top_k = 4 makes the sampled text repeat, so prompt lookup drafts and the relaxed rule spends."""
    arm = relaxed(8.0, g=2.0, m=3)

    def request(rid, prompt, arm, seed):
        return sampled(rid, prompt, arm, seed=seed, n=24, temperature=0.8, top_k=4)

    alone = unit(tiny[0], NgramDrafter(1, 3)).generate_sync(request("s", PROMPTS[0], arm, 11))
    others = [request(f"o{i}", p, arm if i % 2 else EXACT_ARM, i) for i, p in enumerate(PROMPTS[1:])]
    batched = unit(tiny[0], NgramDrafter(1, 3)).generate_many_sync([request("s", PROMPTS[0], arm, 11)] + others)
    assert batched[0].token_ids == alone.token_ids
    assert batched[0].record.regret_spent == pytest.approx(alone.record.regret_spent)
    assert alone.record.draft_tokens > 0 and alone.record.regret_spent > 0  # the relaxed rule decided


class RestartingLink(InProcessLink):
    """An authority that restarts (a fresh `PolicyCore`, every mirror lost) after its 3rd and 6th reports, and
    checks at every report that its mirror of each ledger equals the unit's lease."""

    def __init__(self, core, unit_policy=None):
        super().__init__(core)
        self.unit_policy, self.reports, self.mirrored = unit_policy, 0, set()

    def submit(self, report):
        done = super().submit(report)
        self.reports += 1
        if self.unit_policy is not None:
            for rid, (_, ledger) in self.unit_policy.ledgers.items():
                if rid in self.core.ledgers:
                    self.mirrored.add(rid)
                    assert self.core.ledgers[rid].spent == ledger.spent
        if self.reports in (3, 6):
            self.core = PolicyCore(**self.core.settings)
        return done


def test_an_authority_restart_loses_no_ledger(tiny):
    """The authority's restart loses nothing: units hold their ledgers and send them all to the new one, so
    seeded output and spend equal a run without the restart, and the mirror equals the leases."""
    arm = relaxed(1.5, g=2.0, m=4)

    def run(restart):
        coord = Coordinator.local(Engine(tiny[0], max_slots=16, max_seq_len=256), model_drafter(tiny),
                                  PolicyCore(gamma_max=6, fixed_gamma=4))
        if restart:
            coord.policy.link = RestartingLink(coord.policy.core, coord.policy)
        outs = coord.generate_many_sync([sampled(f"r{i}", p, arm, seed=i, n=24) for i, p in enumerate(PROMPTS)])
        return outs, coord.policy

    plain, _ = run(False)
    restarted, policy = run(True)
    assert policy.link.reports > 6 and policy.link.mirrored
    assert [o.token_ids for o in restarted] == [o.token_ids for o in plain]
    for a, b in zip(restarted, plain):
        assert a.record.regret_spent == pytest.approx(b.record.regret_spent, abs=1e-5)
        assert a.record.regret_spent <= 1.5 + 1e-9
    assert policy.link.core.open_ledgers() == [] and policy.open_ledgers() == []


class RecordingPolicy(LocalPolicy):
    """Records (arm, kind of scores, rows) of every ASD verification."""

    def __init__(self, core):
        super().__init__(core)
        self.calls = []

    def verify_asd(self, asd):
        self.calls.append((asd.arm, type(asd.scores).__name__, len(asd.request_ids)))
        return super().verify_asd(asd)


def test_one_verification_per_arm_and_rule(tiny):
    """Greedy and sampled rows of one relaxed arm verify in two batches a round (TargetScores, SampledScores)."""
    coord = Coordinator.local(Engine(tiny[0], max_slots=16, max_seq_len=256), model_drafter(tiny),
                              PolicyCore(gamma_max=4, fixed_gamma=3))
    coord.policy = RecordingPolicy(coord.policy.core)
    arm = relaxed(2.0)
    reqs = [GenerationRequest("g0", PROMPTS[0], SamplingParams(max_tokens=6), arm),
            GenerationRequest("g1", PROMPTS[1], SamplingParams(max_tokens=6), arm),
            sampled("s0", PROMPTS[2], arm, seed=1, n=6), sampled("s1", PROMPTS[3], arm, seed=2, n=6)]
    coord.generate_many_sync(reqs)
    calls = coord.policy.calls
    assert ("relaxed", "TargetScores", 2) in calls and ("relaxed", "SampledScores", 2) in calls
    assert all(call[0] == "relaxed" and call[2] == 2 for call in calls)
