"""Issue 24's request fields over HTTP with the OpenAI SDK, shared by the native and the vLLM app's test modules:
logprobs, penalties and bias, and response_format, each under speculation equal to target-only decoding."""

from __future__ import annotations

import json

import jsonschema

CHAT = [{"role": "user", "content": "List three colors, then repeat the list."}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}


def _chat(client, model: str, headers: dict, speculate: bool = True, **fields):
    extra = {"speculate": speculate, **fields.pop("extra_body", {})}
    return client.chat.completions.create(model=model, messages=fields.pop("messages", CHAT), temperature=0,
                                          extra_headers=headers, extra_body=extra, **fields)


def _entries(content) -> list[tuple[str, float]]:
    return [(e.token, e.logprob) for e in content]


def check_logprobs(client, model: str, headers: dict, tokenizer, *, tol: float) -> None:
    """Chat logprobs: one per output token, their bytes spell the text, the greedy token is the top one, and
    speculation, streaming and target-only give the same; the completions route's shape."""
    spec = _chat(client, model, headers, max_tokens=12, logprobs=True, top_logprobs=3)
    alone = _chat(client, model, headers, speculate=False, max_tokens=12, logprobs=True, top_logprobs=3)
    content = spec.choices[0].logprobs.content
    assert spec.choices[0].message.content == alone.choices[0].message.content
    assert len(content) == spec.usage.completion_tokens
    special = set(tokenizer.all_special_tokens)  # in the logprobs, not in the text (skipped when decoding)
    assert bytes(b for e in content if e.token not in special for b in e.bytes).decode() == \
        spec.choices[0].message.content
    for e, a in zip(content, alone.choices[0].logprobs.content):
        assert e.token == a.token and abs(e.logprob - a.logprob) <= tol
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy: the raw argmax
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=12,
                                                 logprobs=True, top_logprobs=3, stream=True, extra_headers=headers))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [t for t, _ in _entries(streamed)] == [t for t, _ in _entries(content)]
    assert max(abs(a - b) for (_, a), (_, b) in zip(_entries(streamed), _entries(content))) <= tol
    legacy = client.completions.create(model=model, prompt="one two three four", max_tokens=6, temperature=0,
                                       logprobs=2, extra_headers=headers).choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == len(legacy.text_offset)
    assert all(len(top) >= 2 for top in legacy.top_logprobs) and legacy.text_offset[0] == 0


def _token_id(tokenizer, token_bytes: list[int]) -> int:
    """The id of a byte-level BPE token from its bytes (the logprobs' `bytes`)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelled = bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids("".join(spelled[b] for b in token_bytes))


def check_rules(client, model: str, headers: dict, tokenizer) -> None:
    """Penalties and min_tokens leave speculation equal to target-only; logit_bias -100 bans the greedy token
    (the next one by the raw logits comes instead) and +100 forces one."""
    for rules in ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, {"extra_body": {"repetition_penalty": 1.6}},
                  {"extra_body": {"min_tokens": 10}}):
        extra = rules.pop("extra_body", {})
        texts = [client.chat.completions.create(
            model=model, messages=CHAT, temperature=0, max_tokens=16, extra_headers=headers,
            extra_body={"speculate": speculate, **extra}, **rules).choices[0].message.content
            for speculate in (True, False)]
        assert texts[0] == texts[1], rules
    first = _chat(client, model, headers, max_tokens=4, logprobs=True, top_logprobs=2).choices[0].logprobs.content[0]
    banned = _token_id(tokenizer, first.bytes)
    runner_up = first.top_logprobs[1]
    for speculate in (True, False):
        out = _chat(client, model, headers, speculate, max_tokens=4, logprobs=True, logit_bias={str(banned): -100})
        assert out.choices[0].logprobs.content[0].token == runner_up.token
    forced = _token_id(tokenizer, list(" yes".encode()))
    out = _chat(client, model, headers, max_tokens=5, logit_bias={str(forced): 100},
                extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == tokenizer.decode([forced] * 5)


def check_json_schema(client, model: str, headers: dict, *, greedy: int, sampled: int) -> None:
    """`greedy` chat prompts and `sampled` seeded choices (n) with a JSON schema: every output parses and
    validates (the grammar is compact JSON, so even a random model cannot pad it with blanks); greedy output
    under speculation equals target-only with the same grammar."""
    for k in range(greedy):
        messages = [{"role": "user", "content": f"Question {k}: is {k} an even number? Answer in JSON."}]
        outs = [_chat(client, model, headers, speculate, messages=messages, max_tokens=48,
                      response_format=RESPONSE_FORMAT).choices[0] for speculate in (True, False)]
        assert outs[0].message.content == outs[1].message.content
        assert outs[0].finish_reason == "stop", outs[0]
        jsonschema.validate(json.loads(outs[0].message.content), SCHEMA)
    many = client.chat.completions.create(model=model, messages=CHAT, temperature=1.0, seed=5, n=sampled,
                                          max_tokens=48, response_format=RESPONSE_FORMAT, extra_headers=headers)
    assert len(many.choices) == sampled
    for choice in many.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
