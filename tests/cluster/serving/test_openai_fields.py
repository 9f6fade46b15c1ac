"""Issue 24's request fields and response shapes without Ray: logprobs, penalties and bias, n, prompt lists, echo
and response_format parse to the engine's `SamplingParams` or a 400 naming the field; logprobs render in OpenAI's
shapes; usage merges over choices."""

import json

import pytest
from served_app import parse_request

from actors.requests import StructuredOutput, TokenLogprob
from cluster.serving.bodies import TokenText, chat_logprobs, completion_logprobs, merge_speculative
from cluster.serving.choices import choice_seed
from cluster.serving.errors import APIError
from cluster.serving.protocol import INT64_MAX, INT64_MIN, ChatCompletionRequest, CompletionRequest

VOCAB = 100


def _chat(**fields):
    return parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def _completion(**fields):
    return parse_request(CompletionRequest, {"model": "m", "prompt": "hi", **fields})


def _api_error(call) -> APIError:
    with pytest.raises(APIError) as info:
        call()
    assert info.value.status == 400
    return info.value


def test_penalties_and_bias_reach_the_sampling_params():
    rules = _completion(frequency_penalty=0.5, presence_penalty=-1, logit_bias={"7": -100, "9": 2.5},
                        repetition_penalty=1.3, min_tokens=4).logit_rules(VOCAB, max_tokens=8)
    assert rules == {"frequency_penalty": 0.5, "presence_penalty": -1.0, "repetition_penalty": 1.3,
                     "logit_bias": {7: -100.0, 9: 2.5}, "min_tokens": 4}
    assert _completion().logit_rules(VOCAB, 8) == {"frequency_penalty": 0.0, "presence_penalty": 0.0,
                                                   "repetition_penalty": 1.0, "logit_bias": None, "min_tokens": 0}


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),  # not a token id of this vocabulary
    ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens
])
def test_rules_checked_against_the_model_name_their_field(fields, param):
    assert _api_error(lambda: _completion(**fields).logit_rules(VOCAB, max_tokens=8)).param == param


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"٣": 1}}, "logit_bias"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": False}}},
     "response_format.json_schema.strict"),
])
def test_bad_values_name_their_field(fields, param):
    assert _api_error(lambda: _chat(**fields)).param == param


def test_logprobs_fields():
    assert _chat().top_logprobs_n is None and _chat(logprobs=False, top_logprobs=0).top_logprobs_n is None
    assert _chat(logprobs=True).top_logprobs_n == 0 and _chat(logprobs=True, top_logprobs=5).top_logprobs_n == 5
    assert _api_error(lambda: _chat(top_logprobs=3).check_choices()).param == "top_logprobs"
    assert _completion(logprobs=0).top_logprobs_n == 0 and _completion(logprobs=20).top_logprobs_n == 20
    assert _completion().top_logprobs_n is None


def test_choices_prompts_and_echo():
    assert len(_completion(prompt=["a", "b"], n=64).prompts) == 2
    assert _api_error(lambda: _completion(prompt=["a", "b"], n=65).check_choices()).param == "n"
    assert _api_error(lambda: _completion(echo=True, logprobs=0).check_choices()).param == "echo"
    _completion(echo=True).check_choices()
    assert [choice_seed(7, j) for j in range(3)] == [7, 8, 9] and choice_seed(None, 2) is None
    assert choice_seed(INT64_MAX, 1) == INT64_MIN  # wrapped, as int64 arithmetic would


def test_response_format():
    assert _chat().structured() is None and _chat(response_format={"type": "text"}).structured() is None
    assert _chat(response_format={"type": "json_object"}).structured() == StructuredOutput("json_object")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    structured = _chat(response_format=fmt).structured()
    assert structured.kind == "json_schema" and json.loads(structured.schema) == schema
    bad = {"type": "json_schema", "json_schema": {"name": "thing", "schema": {"type": "bogus"}}}
    assert _api_error(lambda: _chat(response_format=bad).structured()).param == "response_format.json_schema.schema"
    missing = {"type": "json_schema"}
    assert _api_error(lambda: _chat(response_format=missing).structured()).param == "response_format.json_schema"


def test_logprobs_render_in_each_routes_shape(smollm2_tokenizer):
    text = TokenText(smollm2_tokenizer)
    ids = smollm2_tokenizer.encode(" héllo")
    entries = [TokenLogprob(t, -0.5 * (k + 1), ((t, -0.5 * (k + 1)), (0, -3.0))) for k, t in enumerate(ids)]
    chat = chat_logprobs(entries, text)
    assert chat["refusal"] is None and len(chat["content"]) == len(ids)
    assert bytes(b for e in chat["content"] for b in e["bytes"]).decode() == " héllo"  # split characters rejoin
    assert [e["logprob"] for e in chat["content"]] == [e.logprob for e in entries]
    assert [len(e["top_logprobs"]) for e in chat["content"]] == [2] * len(ids)
    legacy = completion_logprobs(entries, text, offset=3)
    assert legacy["token_logprobs"] == [e.logprob for e in entries] and legacy["text_offset"][0] == 3
    assert all(legacy["tokens"][k] in legacy["top_logprobs"][k] for k in range(len(ids)))  # the chosen one too
    assert legacy["text_offset"] == [3 + sum(len(t) for t in legacy["tokens"][:k]) for k in range(len(ids))]


def test_usage_over_choices():
    one = {"arm": "exact", "rounds": 2, "draft_tokens": 8, "accepted_tokens": 4, "acceptance_rate": 0.5,
           "mean_accepted_length": 2.0, "gamma_min": 4, "gamma_mean": 4.0, "gamma_max": 4, "degraded": False,
           "verification": "exact", "timing_s": {"tokenize": 0.1, "queue": None}}
    two = {**one, "rounds": 6, "draft_tokens": 12, "accepted_tokens": 12, "gamma_min": 2, "gamma_mean": 2.0,
           "timing_s": {"tokenize": 0.3, "queue": None}}
    assert merge_speculative([one]) is one and merge_speculative([None]) is None
    merged = merge_speculative([one, two])
    assert (merged["rounds"], merged["draft_tokens"], merged["accepted_tokens"]) == (8, 20, 16)
    assert merged["acceptance_rate"] == 0.8 and merged["mean_accepted_length"] == 2.0
    assert (merged["gamma_min"], merged["gamma_max"], merged["gamma_mean"]) == (2, 4, 2.5)
    assert merged["timing_s"] == {"tokenize": 0.3, "queue": None} and merged["choices"] == [one, two]


def test_a_units_refusal_names_the_requests_field():
    from cluster.serving.choices import refusal

    error = refusal("structured: the schema cannot be compiled (unsupported keyword)")
    assert (error.status, error.param) == (400, "response_format")
    assert error.message.startswith("response_format: the schema")
    assert refusal("logit_bias: token ids must be < 100").param == "logit_bias"
    assert refusal("something went wrong").param is None


def test_merged_streams_and_read_ahead():
    import asyncio

    from cluster.serving.choices import merged, read_ahead
    from cluster.serving.decoder import Finished

    async def events(*items, fail=None):
        for item in items:
            await asyncio.sleep(0)
            yield item
        if fail is not None:
            raise fail

    async def run():
        got = [pair async for pair in merged([events("a", "b"), events("c")])]
        assert sorted(got) == [(0, "a"), (0, "b"), (1, "c")] and [e for i, e in got if i == 0] == ["a", "b"]
        try:
            _ = [pair async for pair in merged([events("a", fail=RuntimeError("gone")), events("c", "d")])]
        except RuntimeError as err:
            assert str(err) == "gone"
        else:
            raise AssertionError("the failing stream's error must end the merge")
        again = await read_ahead([events("x", "y")])
        assert [e async for e in again[0]] == ["x", "y"]
        refused = Finished("error", (), "", None, None, "u", error="structured: no", refused=True)
        try:
            await read_ahead([events("x"), events(refused)])
        except APIError as err:
            assert err.param == "response_format"
        else:
            raise AssertionError("a refused job must be a 400 before the response starts")

    asyncio.run(run())
