"""The OpenAI wire format without Ray: request validation, error bodies, max_tokens, stop strings."""

from collections import Counter

import pytest

from cluster.serving.bodies import choice_body, chunk_body, completion_body, usage_body
from cluster.serving.errors import APIError
from cluster.serving.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    StreamOptions,
    resolve_max_tokens,
)
from cluster.serving.text import TextAssembler
from served_app import parse_request


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
    assert _completion(prompt=["one"]).prompts == ["one"]
    assert _completion(prompt=[1, 2, 3]).prompts == [[1, 2, 3]]
    assert _completion(prompt=["a", "b"]).prompts == ["a", "b"]
    assert _completion(stop="\n").stop_strings == ("\n",)
    assert _completion(logit_bias=None, frequency_penalty=0).model == "m"  # neutral values, as SDKs send them
    assert _completion(prompt=[[4, 5]]).prompts == [[4, 5]]
    assert _completion(prompt=[[4, 5], [6]], n=3).prompts == [[4, 5], [6]]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": "lots"}, "max_tokens"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": ""}, "model"),
        ({"top_k": -5}, "top_k"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": ["a"] * 129}, "prompt"),
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
    body = completion_body("cmpl-1", "m", [choice_body(0, "hi", "stop", chat=True)], usage, chat=True, created=1)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "hi"
    body = completion_body("cmpl-1", "m", [choice_body(0, "hi", "length", chat=False)], usage, chat=False,
                           created=1)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "hi"
    first = chunk_body("c", "m", 1, chat=True, role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = chunk_body("c", "m", 1, chat=True, no_choices=True, usage=usage)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 7


# ---------------------------------------------------------------------------------------------------------
# Nothing silently ignored: every OpenAI field is honoured, refused unless neutral, or ignored for a reason


def _chat(**fields):
    return parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def _sdk_fields(typed_dict) -> set[str]:
    return {name for cls in typed_dict.__mro__ for name in getattr(cls, "__annotations__", {})}


def test_every_field_of_the_sdk_schema_is_declared():
    """A field the installed openai SDK can send is a declared field (honoured, refused or ignored), never
    an unknown one: a newer SDK's new field fails here until it is decided."""
    chat = pytest.importorskip("openai.types.chat")
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chats

    assert _sdk_fields(chats.CompletionCreateParamsBase) <= set(ChatCompletionRequest.model_fields)
    assert _sdk_fields(completions.CompletionCreateParamsBase) <= set(CompletionRequest.model_fields)
    assert _sdk_fields(chat.ChatCompletionStreamOptionsParam) <= set(StreamOptions.model_fields)
    assert _sdk_fields(chat.ChatCompletionContentPartTextParam) <= set(ContentPart.model_fields)
    for role in ("System", "Developer", "User", "Assistant", "Tool"):
        assert _sdk_fields(getattr(chat, f"ChatCompletion{role}MessageParam")) <= set(ChatMessage.model_fields)


CHAT_REFUSED = [  # (field, a value that asks for something)
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]), ("moderation", {"model": "omni"}), ("reasoning_effort", "high"),
    ("verbosity", "low"), ("web_search_options", {}), ("store", True),
]
COMPLETION_REFUSED = [("best_of", 3), ("suffix", " end")]
CHAT_NEUTRAL = {
    "logprobs": False, "top_logprobs": 0, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
    "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "functions": [],
    "function_call": "none", "modalities": ["text"], "reasoning_effort": "none", "verbosity": "medium",
    "store": False, "n": 1, "repetition_penalty": 1.0, "min_tokens": 0,
    "audio": None, "moderation": None, "web_search_options": None,
}
COMPLETION_NEUTRAL = {"logprobs": None, "best_of": 1, "suffix": "", "echo": False, "n": 1, "frequency_penalty": 0,
                      "presence_penalty": 0, "logit_bias": None, "min_tokens": 0}
IGNORED_VALUES = {  # chat
    "metadata": {"team": "search"}, "prompt_cache_key": "k", "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h", "safety_identifier": "hash", "service_tier": "priority",
    "prediction": {"type": "content", "content": "x"}, "parallel_tool_calls": False,
    "stream_options": {"include_usage": True, "include_obfuscation": True},
}


def _refusal(parse, field, value) -> dict:
    with pytest.raises(APIError) as info:
        parse(**{field: value})
    assert info.value.status == 400
    return info.value.body()["error"]


@pytest.mark.parametrize("field, value", CHAT_REFUSED)
def test_chat_refuses_what_it_cannot_honour_naming_the_field(field, value):
    error = _refusal(_chat, field, value)
    assert (error["param"], error["code"], error["type"]) == (field, "unsupported_parameter", "invalid_request_error")
    assert error["message"].startswith(f"{field}: ")


@pytest.mark.parametrize("field, value", COMPLETION_REFUSED)
def test_completions_refuse_what_they_cannot_honour_naming_the_field(field, value):
    error = _refusal(_completion, field, value)
    assert (error["param"], error["code"]) == (field, "unsupported_parameter")


def test_neutral_values_and_null_are_accepted():
    assert _chat(**CHAT_NEUTRAL).logprobs is False
    assert _completion(**COMPLETION_NEUTRAL).best_of == 1
    assert _chat(**{field: None for field, _ in CHAT_REFUSED}).model == "m"
    assert _completion(**{field: None for field, _ in COMPLETION_REFUSED}).model == "m"
    assert _completion(frequency_penalty=0.0, logprobs=None).frequency_penalty == 0  # 0.0 is 0, as in JSON
    assert _refusal(_chat, "logprobs", 0)["param"] == "logprobs"  # ... but 0 is not false
    assert _refusal(_chat, "frequency_penalty", False)["param"] == "frequency_penalty"


def test_null_means_the_default():
    request = _completion(temperature=None, top_p=None, n=None, stream=None, echo=None)
    assert request.sampling() == _completion().sampling() and not request.stream and request.n == 1
    assert request.model_fields_set == {"model", "prompt"}  # so the operator's defaults apply


def test_ignored_fields_are_accepted_and_listed_in_the_readme():
    request = _chat(**IGNORED_VALUES)
    assert request.include_usage and request.metadata == {"team": "search"}
    from pathlib import Path

    from cluster.serving.fields import IGNORED

    readme = (Path(__file__).parents[3] / "README.md").read_text()
    for name in IGNORED:
        assert f"{name.rsplit('.', 1)[-1]}`" in readme, name


def test_unknown_fields_are_refused_naming_them():
    for parse, fields, param in [
        (_completion, {"temprature": 0.5}, "temprature"),
        (_chat, {"extra_body": {"top_k": 2}}, "extra_body"),
        (_chat, {"messages": [{"role": "user", "content": "hi", "mood": "ok"}]}, "messages.0.mood"),
        (_chat, {"stream_options": {"include_usage": True, "chunk_size": 2}}, "stream_options.chunk_size"),
    ]:
        with pytest.raises(APIError) as info:
            parse(**fields)
        assert (info.value.param, info.value.code) == (param, "unknown_parameter"), info.value.body()


def test_message_fields():
    request = _chat(messages=[
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "hi", "prompt_cache_breakpoint": {}}]},
        {"role": "assistant", "content": "hello", "tool_calls": [], "refusal": None, "audio": None},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ])
    assert request.template_messages() == [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "hello"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    for field, value in [("tool_calls", [{"id": "c", "type": "function"}]), ("refusal", "no"),
                         ("function_call", {"name": "f", "arguments": "{}"})]:
        error = _refusal(_chat, "messages", [{"role": "assistant", "content": "x", field: value}])
        assert (error["param"], error["code"]) == (f"messages.0.{field}", "unsupported_parameter")


def test_every_body_accepted_is_one_the_openapi_document_declares():
    """Schemathesis's schema-valid and schema-invalid bodies from the served document, without a server: each
    body the request models (and the ingress's checks of model and max_tokens) accept validates against the
    document, so fuzzing finds no invalid body answered 200."""
    schemathesis = pytest.importorskip("schemathesis")
    import hypothesis
    import jsonschema
    from fastapi import FastAPI

    from cluster.serving.openapi import specserve_openapi

    app = FastAPI()

    @app.post("/v1/completions")
    def completions(body: CompletionRequest) -> None: ...

    @app.post("/v1/chat/completions")
    def chat_completions(body: ChatCompletionRequest) -> None: ...

    document = specserve_openapi(app.openapi(), served_name="m", arms=["exact"], max_tokens_limit=64, auth=False,
                                 protect_metrics=False, protect_export=False)
    undeclared, accepted = [], Counter()
    for result in schemathesis.openapi.from_dict(document).get_all_operations():
        operation = result.ok()
        model = CompletionRequest if operation.path == "/v1/completions" else ChatCompletionRequest
        declared = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{model.__name__}",
                                                    "components": document["components"]})
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @hypothesis.settings(max_examples=40, deadline=None, derandomize=True, database=None,
                                 suppress_health_check=list(hypothesis.HealthCheck))
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                try:
                    request = parse_request(model, case.body)
                    resolve_max_tokens(request.requested_max_tokens, prompt_len=1, default=16, limit=64,
                                       max_seq_len=2**40)
                except APIError:
                    return
                accepted[operation.path, mode.value] += 1
                if request.model == "m" and not declared.is_valid(case.body):
                    undeclared.append(case.body)

            run()
    assert not undeclared, undeclared[:3]
    # not vacuous: most positive bodies are refused by checks the schema cannot state (6 of 25 accepted, once)
    assert min(accepted[path, "positive"] for path in ("/v1/completions", "/v1/chat/completions")) >= 8, accepted


def test_stop_token_ids_and_ignore_eos_are_honoured():
    request = _chat(stop_token_ids=[2, 7], ignore_eos=True)
    assert request.stop_rules(vocab_size=49152) == {"stop_token_ids": (2, 7), "ignore_eos": True}
    assert _chat().stop_rules(vocab_size=49152) == {"stop_token_ids": (), "ignore_eos": False}
    for ids in ([49152], [-1]):
        with pytest.raises(APIError) as info:
            _chat(stop_token_ids=ids).stop_rules(vocab_size=49152)
        assert info.value.status == 400 and info.value.param == "stop_token_ids"


@pytest.mark.parametrize("field, value", [("top_k", True), ("seed", False), ("max_tokens", True), ("temperature", True),
                                          ("stream", 1), ("speculate", 0), ("stop_token_ids", [True]),
                                          ("stream_options", {"include_usage": 1})])
def test_json_types_are_not_coerced(field, value):
    """A boolean is not an integer and an integer not a boolean, as the OpenAPI document declares them."""
    with pytest.raises(APIError) as info:
        _completion(**{field: value})
    assert info.value.status == 400 and info.value.param.split(".")[0] == field
