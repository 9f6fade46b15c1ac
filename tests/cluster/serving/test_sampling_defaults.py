"""`serving.defaults`: fields a request leaves out take the operator's default, sent fields never do, and with
nothing set the OpenAI defaults stay."""

import pytest

from cluster.config.schema import SamplingDefaults
from cluster.serving.protocol import ChatCompletionRequest, CompletionRequest

OPENAI = {"temperature": 1.0, "top_p": 1.0, "top_k": None}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def test_nothing_set_keeps_the_openai_defaults():
    assert chat().sampling() == OPENAI
    assert chat().sampling(SamplingDefaults()) == OPENAI


def test_left_out_fields_take_the_operator_defaults():
    defaults = SamplingDefaults(temperature=0.0, top_p=0.9, top_k=40)
    assert chat().sampling(defaults) == {"temperature": 0.0, "top_p": 0.9, "top_k": 40}
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": 4})
    assert completion.sampling(SamplingDefaults(temperature=0.0)) == {**OPENAI, "temperature": 0.0}


@pytest.mark.parametrize("fields, expected", [
    ({"temperature": 1.0}, {"temperature": 1.0, "top_p": 0.9, "top_k": 40}),  # sent = kept, even OpenAI's value
    ({"temperature": 0.7, "top_p": 1.0}, {"temperature": 0.7, "top_p": 1.0, "top_k": 40}),
    ({"top_k": 0}, {"temperature": 0.0, "top_p": 0.9, "top_k": None}),  # 0 = off, sent explicitly
    ({"top_k": None}, {"temperature": 0.0, "top_p": 0.9, "top_k": None}),
])
def test_sent_fields_keep_their_own_values(fields, expected):
    assert chat(**fields).sampling(SamplingDefaults(temperature=0.0, top_p=0.9, top_k=40)) == expected
