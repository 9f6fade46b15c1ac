"""The OpenAI wire format without Ray: request validation, error bodies, max_tokens, stop strings."""

import pytest

from pydantic import ValidationError

from cluster.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chunk_body,
    completion_body,
    resolve_max_tokens,
    usage_body,
    validation_error,
)
from cluster.serving.text import TextAssembler


def parse_request(model, payload):
    """What FastAPI does with a body: validate it, and map pydantic's errors to the API error."""
    if not isinstance(payload, dict):
        raise APIError("request body must be a JSON object", code="invalid_request")
    try:
        return model.model_validate(payload)
    except ValidationError as err:
        raise validation_error(err.errors(include_url=False)) from None


def _completion(**fields):
    return parse_request(CompletionRequest, {"model": "m", "prompt": "hi", **fields})


def _error(**fields) -> APIError:
    with pytest.raises(APIError) as info:
        _completion(**fields)
    assert info.value.status == 400
    body = info.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error"
    return info.value


def test_defaults_and_extensions():
    request = _completion(top_k=5, seed=3, user="u", stream=True, stream_options={"include_usage": True})
    assert request.temperature == 1.0 and request.top_p == 1.0 and request.top_k_or_none == 5
    assert request.include_usage and request.stop_strings == () and request.speculate
    assert _completion(top_k=-1).top_k_or_none is None
    assert _completion(prompt=["one"]).prompt == "one"
    assert _completion(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert _completion(stop="\n").stop_strings == ("\n",)
    assert _completion(logit_bias=None, frequency_penalty=0).model == "m"  # unused SDK fields are ignored


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 2}, "n"),
        ({"max_tokens": "lots"}, "max_tokens"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": ""}, "model"),
        ({"echo": True}, "echo"),
        ({"top_k": -5}, "top_k"),
    ],
)
def test_bad_fields_name_their_param(fields, param):
    assert _error(**fields).param == param


def test_missing_and_non_object():
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, {"prompt": "hi"})
    assert info.value.param == "model" and info.value.code == "missing_required_parameter"
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, ["not", "an", "object"])
    assert info.value.status == 400


def test_chat_request():
    request = parse_request(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
            ],
            "max_completion_tokens": 7,
        },
    )
    assert request.requested_max_tokens == 7
    assert request.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
    ]
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, {"model": "m", "messages": []})
    assert info.value.param == "messages"
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "wizard", "content": "x"}]})
    assert info.value.param == "messages.0.role"
    empty = parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": ""}]})
    with pytest.raises(APIError):
        empty.template_messages()


def test_resolve_max_tokens():
    limits = dict(default=16, limit=64, max_seq_len=100)
    assert resolve_max_tokens(None, prompt_len=10, **limits) == 16
    assert resolve_max_tokens(None, prompt_len=90, **limits) == 10  # default shortened to the room left
    assert resolve_max_tokens(64, prompt_len=36, **limits) == 64
    for requested, prompt_len, param, code in [
        (0, 10, "max_tokens", "invalid_value"),
        (-3, 10, "max_tokens", "invalid_value"),
        (65, 10, "max_tokens", "invalid_value"),
        (64, 37, "max_tokens", "context_length_exceeded"),
        (None, 100, "prompt", "context_length_exceeded"),
        (None, 0, "prompt", "empty_prompt"),
    ]:
        with pytest.raises(APIError) as info:
            resolve_max_tokens(requested, prompt_len=prompt_len, **limits)
        assert (info.value.param, info.value.code) == (param, code)


class _ByteTokenizer:
    """Token i is byte i of UTF-8 text: multi-byte characters arrive split across tokens."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode())

    @staticmethod
    def decode(ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")


def _assemble(text: str, stop=(), step=1) -> tuple[list[str], TextAssembler]:
    tok = _ByteTokenizer()
    ids = tok.encode(text)
    assembler = TextAssembler(tok.decode, tok.encode("prompt: "), stop)
    deltas = [assembler.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    if not assembler.stopped:
        deltas.append(assembler.flush())
    return deltas, assembler


@pytest.mark.parametrize("step", [1, 2, 5])
def test_incremental_detokenization_never_splits_characters(step):
    text = "naïve café → 日本語 ok"
    deltas, assembler = _assemble(text, step=step)
    assert "".join(deltas) == text == assembler.text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("step", [1, 3])
def test_stop_strings_truncate_and_hold_back(step):
    deltas, assembler = _assemble("hello wor", stop=("world",), step=step)
    assert not assembler.stopped and "".join(deltas) == "hello wor"
    deltas, assembler = _assemble("hello world and more", stop=("world", "zzz"), step=step)
    assert assembler.stopped and "".join(deltas) == "hello " == assembler.text
    # nothing that could begin a stop string is sent before it is ruled out
    sent = ""
    assembler = TextAssembler(_ByteTokenizer.decode, [], ("END",))
    for ch in "abcE":
        sent += assembler.push(_ByteTokenizer.encode(ch))
    assert sent == "abc"
    assert assembler.push(_ByteTokenizer.encode("N")) == ""
    assert assembler.push(_ByteTokenizer.encode("x")) == "ENx"  # ruled out: sent
    assert assembler.push(_ByteTokenizer.encode("EN")) == ""
    assert assembler.push(_ByteTokenizer.encode("D")) == "" and assembler.stopped
    assert assembler.text == "abcENx"
    assert assembler.push(_ByteTokenizer.encode("more")) == ""


def test_response_bodies():
    usage = usage_body(3, 4, {"arm": "exact"})
    assert usage == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "speculative": {"arm": "exact"}}
    body = completion_body("cmpl-1", "m", "hi", "stop", usage, chat=True, created=1)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "hi"
    body = completion_body("cmpl-1", "m", "hi", "length", usage, chat=False, created=1)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "hi"
    first = chunk_body("c", "m", 1, chat=True, role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = chunk_body("c", "m", 1, chat=True, no_choices=True, usage=usage)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 7
