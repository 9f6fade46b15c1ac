"""Penalties, logit_bias, min_tokens and logprobs on the native engine, with and without speculation: greedy
identity to target-only decoding under each rule, raw logprobs equal with and without speculation (and to the
target's own log_softmax), the sampled law of the penalised target, bad input, and nothing left behind."""

import pytest
import torch

from actors.coordinator import ArmSpec, Coordinator, GenerationRequest, SamplingParams
from actors.drafting import ModelDrafter, NgramDrafter
from actors.engines.native import load_model
from actors.engines.native.engine import Engine
from actors.policy import PolicyCore
from actors.requests import StructuredOutput
from policies.asd import ASDConfig
from policies.penalties import Penalties, penalise_block

from tests.conftest import REPETITIVE_PROMPTS, save_tiny_llama

PROMPTS = REPETITIVE_PROMPTS
EOS = 2  # the tiny Llama's


@pytest.fixture(scope="module")
def tiny(tiny_llama_pair):
    torch.set_num_threads(1)
    target, drafter = tiny_llama_pair
    return load_model(target)[0], load_model(drafter)[0]


def unit(model, drafter=None, fixed=None, **kw):
    return Coordinator.local(Engine(model, max_slots=16, max_seq_len=256), drafter,
                             PolicyCore(gamma_max=6, fixed_gamma=fixed), eos_token_ids=[EOS], **kw)


def run(coord, params, speculate=True, arm=None, tag="r"):
    extra = {} if arm is None else {"arm": arm}
    reqs = [GenerationRequest(f"{tag}{i}", p, params, speculate=speculate, **extra) for i, p in enumerate(PROMPTS)]
    outs = coord.generate_many_sync(reqs)
    assert coord.active_requests() == [] and coord.target.engine.active_ids() == []
    assert coord.policy.core.open_ledgers() == []
    return outs


@pytest.fixture(scope="module")
def plain(tiny):
    """Target-only greedy outputs without rules (to show each rule changes something)."""
    return [o.token_ids for o in run(unit(tiny[0]), SamplingParams(max_tokens=24), speculate=False, tag="p")]


def rule_cases(plain):
    common = max(set(sum(plain, [])), key=sum(plain, []).count)  # the token the target emits most
    return {
        "frequency": dict(frequency_penalty=1.5),
        "presence": dict(presence_penalty=2.0),
        "repetition": dict(repetition_penalty=1.8),
        "logit_bias": dict(logit_bias={common: -100.0, 777: 4.0}),
        "min_tokens": dict(logit_bias={EOS: 60.0}, min_tokens=7),  # EOS would come first, but not before 7
        "all": dict(frequency_penalty=0.8, presence_penalty=0.5, repetition_penalty=1.3,
                    logit_bias={common: -100.0}, min_tokens=3),
    }


@pytest.mark.parametrize("case", ["frequency", "presence", "repetition", "logit_bias", "min_tokens", "all"])
def test_greedy_speculation_equals_target_only_under_each_rule(tiny, plain, case):
    params = SamplingParams(max_tokens=24, **rule_cases(plain)[case])
    reference = [o.token_ids for o in run(unit(tiny[0]), params, speculate=False, tag="t")]
    assert reference != plain  # the rule changed the output
    for drafter, fixed in ((NgramDrafter(1, 3), None), (NgramDrafter(1, 3), 4),
                           (ModelDrafter(Engine(tiny[1], max_slots=16, max_seq_len=256)), 3)):
        outs = run(unit(tiny[0], drafter, fixed=fixed), params)
        assert [o.token_ids for o in outs] == reference, (case, fixed)
        assert sum(o.record.draft_tokens for o in outs) > 0  # speculation happened
    if case == "min_tokens":
        assert all(len(t) == 7 for t in reference)  # EOS, boosted, is the first token allowed after 7
    if case in ("logit_bias", "all"):
        banned = next(iter(params.logit_bias))
        assert all(banned not in t for t in reference)


def test_asd_with_zero_budget_is_exact_under_rules(tiny, plain):
    params = SamplingParams(max_tokens=24, **rule_cases(plain)["all"])
    reference = [o.token_ids for o in run(unit(tiny[0]), params, speculate=False, tag="t")]
    arm = ArmSpec("asd0", "asd", ASDConfig(g=5.0, max_relaxed_per_block=3, budget=0.0))
    outs = run(unit(tiny[0], NgramDrafter(1, 3), fixed=4), params, arm=arm)
    assert [o.token_ids for o in outs] == reference


def test_banned_drafts_are_cut_before_verification(tiny, plain):
    """Prompt lookup would draft the banned token (the prompts repeat it); no row ever verifies it."""
    seen = []

    class Spy(NgramDrafter):
        pass

    coord = unit(tiny[0], Spy(1, 3), fixed=4)
    step = coord.target.step

    async def spying(batch):
        seen.append(batch)
        return await step(batch)

    coord.target.step = spying
    banned = PROMPTS[0][-1]  # 6: the lookup continues the repeated pattern 5 6 7 8 with it
    params = SamplingParams(max_tokens=12, logit_bias={banned: -100.0})
    run(coord, params)
    lens = [b.draft_lens for b in seen]
    assert all(banned not in b.draft_ids[r, : int(b.draft_lens[r])].tolist()
               for b in seen for r in range(len(b.seq_ids) - b.prompt_rows))
    assert sum(int(x.sum()) for x in lens) > 0


@pytest.mark.parametrize("top", [0, 5])
def test_logprobs_equal_with_and_without_speculation(tiny, plain, top):
    for rules in ({}, rule_cases(plain)["all"]):
        params = SamplingParams(max_tokens=16, logprobs=top, **rules)
        reference = run(unit(tiny[0]), params, speculate=False, tag="t")
        outs = run(unit(tiny[0], NgramDrafter(1, 3), fixed=4), params)
        assert sum(o.record.accepted_tokens if not rules else o.record.draft_tokens for o in outs) > 0
        for got, want in zip(outs, reference):
            assert got.token_ids == want.token_ids
            assert [lp.token_id for lp in got.logprobs] == got.token_ids
            assert all(len(lp.top) == top for lp in got.logprobs)
            for a, b in zip(got.logprobs, want.logprobs):
                assert abs(a.logprob - b.logprob) <= 1e-4
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
                assert all(abs(x - y) <= 1e-4 for (_, x), (_, y) in zip(a.top, b.top))
                if top:
                    assert a.top[0][1] >= a.logprob - 1e-6
                    assert all(x >= y for (_, x), (_, y) in zip(a.top, a.top[1:]))


def test_logprobs_are_the_raw_target_distribution(tiny, plain):
    """Each token's logprob is log_softmax of the target's unpenalised logits at its position."""
    params = SamplingParams(max_tokens=10, logprobs=3, **rule_cases(plain)["frequency"])
    prompt = PROMPTS[0]
    out = unit(tiny[0], NgramDrafter(1, 3), fixed=3).generate_sync(GenerationRequest("x", prompt, params))
    engine = Engine(tiny[0], max_slots=1, max_seq_len=256)
    n = len(out.token_ids)
    logits = engine.forward(["x"], [prompt + out.token_ids[:-1]], [n])[0]  # [n, V]
    raw = torch.log_softmax(logits.float(), -1)
    for j, lp in enumerate(out.logprobs):
        assert abs(lp.logprob - float(raw[j, lp.token_id])) <= 1e-4
        assert [t for t, _ in lp.top] == raw[j].topk(3).indices.tolist()


def test_sampled_rows_with_rules_and_logprobs(tiny, plain):
    """Sampled rows (exact, and relaxed ASD) with a model drafter: a logprob for every token, reproducible."""
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5, logprobs=2, **rule_cases(plain)["all"])
    relaxed = ArmSpec("relaxed", "asd", ASDConfig(g=1.0, max_relaxed_per_block=2, budget=2.0), sampled="relaxed")
    for arm in (None, relaxed):
        drafter = ModelDrafter(Engine(tiny[1], max_slots=16, max_seq_len=256))
        first = run(unit(tiny[0], drafter, fixed=3), params, arm=arm)
        again = run(unit(tiny[0], ModelDrafter(Engine(tiny[1], max_slots=16, max_seq_len=256)), fixed=3),
                    params, arm=arm)
        assert [o.token_ids for o in first] == [o.token_ids for o in again]
        for o in first:
            assert [lp.token_id for lp in o.logprobs] == o.token_ids and all(len(lp.top) == 2 for lp in o.logprobs)
        banned = next(iter(params.logit_bias))
        assert all(banned not in o.token_ids for o in first)


@pytest.mark.slow
def test_sampled_speculation_follows_the_penalised_target(tmp_path_factory, smollm2_tokenizer):
    """Joint law of the first two tokens under speculative sampling with a model drafter (q ≠ p), with a
    frequency penalty and a logit_bias, equals the penalised target's p(t1)·p(t2 | t1), where p(t2 | t1) is
    penalised with t1 in the output (the second token is verified against a draft: max_tokens 3 leaves room for
    one). Vocabulary 8, 4000 seeded requests, chi-square over cells with expected ≥
    5. The statistic is deterministic at these fixed seeds; the bound p > 1e-4 leaves a wide margin (as in
    test_coordinator's unpenalised twin), while ignoring the penalty at the second position, or the bias,
    moves the law by far more than that: the last assertion checks that the unpenalised law fails it."""
    from scipy import stats as scipy_stats
    vocab = 8
    tgt = save_tiny_llama(tmp_path_factory.mktemp("p8t"), smollm2_tokenizer, seed=3, vocab_size=vocab,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
    drf = save_tiny_llama(tmp_path_factory.mktemp("p8d"), smollm2_tokenizer, seed=4, vocab_size=vocab,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
    target, drafter = load_model(tgt)[0], load_model(drf)[0]
    prompt, temperature = [1, 2, 3, 4], 2.0
    rules = Penalties.of(frequency=2.0, logit_bias={5: 1.5, 6: -1.0})

    def law(rules):
        def probs(context, output):
            z = Engine(target, max_slots=1, max_seq_len=32).forward(["x"], [context])[0, -1:]  # [1, V]
            z = penalise_block(z, rules, torch.tensor(prompt), torch.tensor(output, dtype=torch.long),
                               torch.zeros(0, dtype=torch.long))[0]
            return torch.softmax(z / temperature, -1)

        p1 = probs(prompt, [])
        return torch.stack([p1[t] * probs(prompt + [t], [t]) for t in range(vocab)])  # [V, V]

    n = 4000
    coord = Coordinator.local(Engine(target, max_slots=64, max_seq_len=32),
                              ModelDrafter(Engine(drafter, max_slots=64, max_seq_len=32)),
                              PolicyCore(gamma_max=3, fixed_gamma=3), max_batch_size=64)
    params = [SamplingParams(max_tokens=3, temperature=temperature, seed=i, frequency_penalty=2.0,
                             logit_bias={5: 1.5, 6: -1.0}) for i in range(n)]
    outs = coord.generate_many_sync([GenerationRequest(f"d{i}", prompt, p) for i, p in enumerate(params)])
    counts = torch.zeros(vocab, vocab)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1

    def p_value(p12):
        expected, observed = (p12 * n).flatten(), counts.flatten()
        big = expected >= 5
        chi2 = float((((observed - expected) ** 2) / expected)[big].sum())
        return scipy_stats.chi2.sf(chi2, int(big.sum()) - 1)

    assert p_value(law(rules)) > 1e-4
    assert p_value(law(Penalties())) < 1e-6  # the test can tell the penalised law from the raw one
    assert sum(o.record.accepted_tokens for o in outs) > 0


def test_bad_values_raise_value_errors_naming_the_field(tiny):
    coord = unit(tiny[0], NgramDrafter(1, 3))
    for params, field in ((SamplingParams(max_tokens=4, logit_bias={49152: 1.0}), "logit_bias"),
                          (SamplingParams(max_tokens=4, stop_token_ids=(10**6,)), "stop_token_ids"),
                          (SamplingParams(max_tokens=4, structured=StructuredOutput("json_object")), "structured")):
        with pytest.raises(ValueError, match=field):
            coord.generate_sync(GenerationRequest("bad", [1, 2, 3], params))
    for kwargs, field in ((dict(logprobs=21), "logprobs"), (dict(frequency_penalty=3.0), "frequency_penalty"),
                          (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_tokens=-1), "min_tokens"),
                          (dict(logit_bias={1: 101.0}), "logit_bias")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(max_tokens=4, **kwargs)
    assert coord.active_requests() == [] and coord.target.engine.active_ids() == []


def test_a_model_drafter_drafts_under_the_requests_bias(tiny):
    """The drafter adds the request's logit_bias to its own logits: a +100 token is what it drafts."""
    from actors.contracts import DraftRequest

    drafter = ModelDrafter(Engine(tiny[1], max_slots=4, max_seq_len=256))
    batch = drafter.propose([DraftRequest("a", PROMPTS[0], 3, rules=Penalties.of(logit_bias={777: 100.0})),
                             DraftRequest("b", PROMPTS[1], 2)])
    assert batch.draft_ids[0].tolist() == [777, 777, 777] and 777 not in batch.draft_ids[1].tolist()


def test_asd_rows_carry_a_logprob_for_every_token_they_keep(tiny, plain):
    """Relaxed tokens are draft tokens: their logprobs come from the same raw rows (and rules still apply)."""
    arm = ArmSpec("asd", "asd", ASDConfig(g=5.0, max_relaxed_per_block=3, budget=50.0))
    params = SamplingParams(max_tokens=16, logprobs=1, frequency_penalty=0.5)
    outs = run(unit(tiny[0], NgramDrafter(1, 3), fixed=4), params, arm=arm)
    assert sum(o.record.relaxed_tokens for o in outs) > 0
    for o in outs:
        assert [lp.token_id for lp in o.logprobs] == o.token_ids


@pytest.mark.parametrize("rule", ["frequency", "presence", "repetition", "all"])
def test_the_target_drafting_for_itself_under_the_rules_has_its_drafts_accepted(tiny, plain, rule):
    """A model drafter applies the request's rules as the target does, each drafted position seeing the drafts
    before it: the target drafting for itself proposes the penalised target's own tokens, so its drafts are
    accepted (all but a near-tie the one-token and the block forward order differently), and the output is
    target-only's."""
    params = SamplingParams(max_tokens=24, **rule_cases(plain)[rule])
    want = [o.token_ids for o in run(unit(tiny[0]), params, speculate=False, tag="t")]
    outs = run(unit(tiny[0], ModelDrafter(Engine(tiny[0], max_slots=16, max_seq_len=256)), fixed=4), params)
    assert [o.token_ids for o in outs] == want
    drafted = sum(o.record.draft_tokens for o in outs)
    accepted = sum(o.record.accepted_tokens for o in outs)
    assert drafted >= 40 and accepted >= 0.95 * drafted, (accepted, drafted)
