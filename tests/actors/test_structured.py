"""Structured output on the native engine (xgrammar): every finished output parses and validates, greedy
speculation equals target-only decoding under the grammar, drafts the grammar refuses are never verified, a
schema that does not compile is a ValueError naming `structured`, and nothing is left behind."""

import json

import jsonschema
import pytest
import torch

from actors.contracts import DraftBatch
from actors.coordinator import Coordinator, GenerationRequest, SamplingParams
from actors.drafting import ModelDrafter, NgramDrafter
from actors.engines.native import load_model
from actors.engines.native.engine import Engine
from actors.policy import PolicyCore
from actors.requests import StructuredOutput

EOS = 2  # the tiny Llama's
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tiny_llama_pair, smollm2_tokenizer):
    torch.set_num_threads(1)
    target, drafter = tiny_llama_pair
    # a random model would pad JSON with whitespace for ever (the grammar allows any, as vLLM's does): ban it
    blank = {i: -100.0 for i in range(len(smollm2_tokenizer)) if not smollm2_tokenizer.decode([i]).strip()}
    return load_model(target)[0], load_model(drafter)[0], str(target), smollm2_tokenizer, blank


class AnswerDrafter:
    """Drafts the continuation of one valid answer while the output follows it (the drafters of the other
    tests know no grammar, so most of their drafts are cut)."""

    free_drafts = True

    def __init__(self, tokenizer, prompt_len=8):
        self.answer = tokenizer.encode('{"color":"red","ok":true,"n":3}')
        self.prompt_len = prompt_len

    def propose(self, reqs):
        rows = []
        for r in reqs:
            out = list(r.context[self.prompt_len:])
            rows.append(self.answer[len(out) : len(out) + r.gamma] if self.answer[: len(out)] == out else [])
        return DraftBatch.from_rows(rows)

    def release(self, seq_id):
        pass


def unit(tiny, drafter=None, fixed=None):
    return Coordinator.local(Engine(tiny[0], max_slots=64, max_seq_len=256), drafter,
                             PolicyCore(gamma_max=6, fixed_gamma=fixed), eos_token_ids=[EOS], max_batch_size=64,
                             tokenizer_source=tiny[2])


def requests(tiny, n, tag, speculate=True, seed=None, **params):
    """n requests for SCHEMA; sampled ones seeded seed + i."""
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    prompts = [[5, 6, 7, 8, 5, 6, 7 + i % 40, 9] for i in range(n)]
    return [GenerationRequest(f"{tag}{i}", p, SamplingParams(
        max_tokens=48, structured=structured, logit_bias=tiny[4], seed=None if seed is None else seed + i, **params),
        speculate=speculate) for i, p in enumerate(prompts)]


def check_all_valid(tiny, outs):
    for o in outs:
        assert o.finish_reason == "stop", tiny[3].decode(o.token_ids)
        jsonschema.validate(json.loads(tiny[3].decode(o.token_ids)), SCHEMA)


def no_leaks(coord):
    assert coord.active_requests() == [] and coord.target.engine.active_ids() == []
    assert coord.policy.core.open_ledgers() == []


def test_greedy_outputs_validate_and_equal_target_only(tiny):
    reference = unit(tiny).generate_many_sync(requests(tiny, 50, "t", speculate=False))
    check_all_valid(tiny, reference)
    for drafter, fixed in ((NgramDrafter(1, 3), 4), (ModelDrafter(Engine(tiny[1], max_slots=64, max_seq_len=256)), 3),
                           (AnswerDrafter(tiny[3]), 4)):
        coord = unit(tiny, drafter, fixed)
        outs = coord.generate_many_sync(requests(tiny, 50, "s"))
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
        no_leaks(coord)
    assert sum(o.record.accepted_tokens for o in outs) > 0  # the answer drafter's drafts are kept where greedy


@pytest.mark.parametrize("drafter", ["model", "answer"])
def test_sampled_outputs_validate(tiny, drafter):
    coord = unit(tiny, ModelDrafter(Engine(tiny[1], max_slots=64, max_seq_len=256)) if drafter == "model"
                 else AnswerDrafter(tiny[3]), 3)
    outs = coord.generate_many_sync(requests(tiny, 50, "x", temperature=1.0, seed=3))
    check_all_valid(tiny, outs)
    if drafter == "answer":
        assert sum(o.record.accepted_tokens for o in outs) > 0
    assert len({tuple(o.token_ids) for o in outs}) > 1  # sampled: not all the same answer
    no_leaks(coord)


def test_drafts_the_grammar_refuses_are_cut(tiny):
    """Prompt lookup drafts the prompt's ids, which the grammar refuses here: they are cut before the target
    (a verified draft the grammar refuses would fail its request: `actors.grammar.block_masks`)."""
    coord = unit(tiny, NgramDrafter(1, 3), 4)
    proposed, verified = [], []
    propose, step = coord.drafter.propose, coord.target.step

    async def proposing(reqs):
        batch = await propose(reqs)
        proposed.append(int(batch.draft_lens.sum()))
        return batch

    async def stepping(batch):
        verified.append(int(batch.draft_lens.sum()))
        return await step(batch)

    coord.drafter.propose, coord.target.step = proposing, stepping
    check_all_valid(tiny, coord.generate_many_sync(requests(tiny, 4, "c")))
    assert sum(proposed) > sum(verified)
    no_leaks(coord)


def test_json_object_and_bad_schemas(tiny):
    coord = unit(tiny)
    any_object = StructuredOutput("json_object")
    out = coord.generate_sync(GenerationRequest("o", [1, 2, 3], SamplingParams(max_tokens=40, structured=any_object,
                                                                                logit_bias=tiny[4])))
    text = tiny[3].decode(out.token_ids)
    assert text.startswith("{")  # an object, whatever the random model writes inside it
    if out.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    for schema in ('{"type": "nonsense"}', "{not json"):
        with pytest.raises(ValueError, match="structured"):
            coord.generate_sync(GenerationRequest("b", [1, 2, 3], SamplingParams(
                max_tokens=4, structured=StructuredOutput("json_schema", schema))))
    no_leaks(coord)


def test_apply_bitmask_equals_xgrammars():
    import xgrammar as xgr

    from policies.penalties import apply_bitmask

    vocab = 100
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)  # [T, ceil(V / 32)]
    logits = torch.randn(3, vocab, generator=gen)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab)
    torch.testing.assert_close(apply_bitmask(logits, bitmask), want)


def test_asd_relaxes_only_to_what_the_grammar_allows(tiny):
    from actors.coordinator import ArmSpec
    from policies.asd import ASDConfig

    arm = ArmSpec("asd", "asd", ASDConfig(g=10.0, max_relaxed_per_block=4, budget=100.0))
    coord = unit(tiny, AnswerDrafter(tiny[3]), 4)
    reqs = [GenerationRequest(r.request_id, r.prompt_ids, r.params, arm=arm) for r in requests(tiny, 8, "a")]
    outs = coord.generate_many_sync(reqs)
    check_all_valid(tiny, outs)
    assert sum(o.record.relaxed_tokens for o in outs) > 0  # ASD kept drafts the target would not have chosen
    no_leaks(coord)


def test_min_tokens_past_a_finished_grammar_still_stops(tiny):
    """A grammar finished before min_tokens allows only EOS: it is kept (as vLLM does), not a dead row."""
    reference = unit(tiny).generate_many_sync(requests(tiny, 4, "t", speculate=False, min_tokens=40))
    check_all_valid(tiny, reference)
    outs = unit(tiny, AnswerDrafter(tiny[3]), 4).generate_many_sync(requests(tiny, 4, "m", min_tokens=40))
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
