"""OpenAI's response bodies: whole completions, streamed chunks, usage, and logprobs in each route's shape.

Terms:
- **choice**: one generated output; a request has `n` per prompt, numbered prompt-major (choice
  `p * n + j` is prompt p's j-th), as OpenAI numbers them.
- **logprobs**: `actors.requests.TokenLogprob`s, one per output token, rendered as chat's
  `{"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal": null}` or the completions route's
  `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`. A token's text is the token decoded alone;
  its `bytes` are the token's own bytes (byte-level BPE tokens may hold part of a UTF-8 character).

Nothing here imports Ray or torch.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache
from typing import Any, Sequence

from actors.requests import TokenLogprob


def usage_body(prompt_tokens: int, completion_tokens: int, speculative: dict | None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if speculative is not None:
        usage["speculative"] = speculative
    return usage


SUMMED = ("rounds", "draft_tokens", "accepted_tokens", "relaxed_tokens", "regret_spent")


def merge_speculative(per_choice: Sequence[dict | None]) -> dict | None:
    """One request's `usage.speculative` from its choices': the counts summed, the rates recomputed, γ over all
    rounds, each hop of `timing_s` the slowest choice's (they run concurrently), and `choices` holding each
    choice's own object. One choice keeps its object as it is."""
    known = [s for s in per_choice if s is not None]
    if len(per_choice) == 1 or not known:
        return known[0] if len(per_choice) == 1 and known else None
    out = dict(known[0])
    for key in SUMMED:
        if key in out:
            out[key] = sum(s.get(key) or 0 for s in known)
    rounds = out["rounds"]
    out["acceptance_rate"] = out["accepted_tokens"] / out["draft_tokens"] if out["draft_tokens"] else 0.0
    out["mean_accepted_length"] = out["accepted_tokens"] / rounds if rounds else 0.0
    out["gamma_min"] = min(s["gamma_min"] for s in known)
    out["gamma_max"] = max(s["gamma_max"] for s in known)
    out["gamma_mean"] = (sum(s["gamma_mean"] * s["rounds"] for s in known) / rounds if rounds
                         else sum(s["gamma_mean"] for s in known) / len(known))
    out["degraded"] = any(s.get("degraded") for s in known)
    hops = known[0].get("timing_s") or {}
    out["timing_s"] = {hop: max((v for s in known if (v := (s.get("timing_s") or {}).get(hop)) is not None),
                                default=None) for hop in hops}
    out["choices"] = list(per_choice)
    return out


# ---------------------------------------------------------------------------------------------------------
# Logprobs


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character each byte is spelled with, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    """A token id's text and bytes for logprobs, from a Hugging Face tokenizer (cached per id)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tokenizer.decode([token_id])
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            decoder = _byte_decoder()
            if isinstance(piece, str) and piece and all(c in decoder for c in piece):
                raw = [decoder[c] for c in piece]  # byte-level BPE: the token's exact bytes
            else:
                raw = list(text.encode("utf-8"))
            if len(self._cache) < 1 << 17:
                self._cache[token_id] = hit = (text, raw)
            else:
                hit = (text, raw)
        return hit


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """Chat's `choices[].logprobs` for `entries` (a whole output, or one chunk's tokens)."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    content = [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText, offset: int = 0) -> dict[str, Any]:
    """The completions route's `choices[].logprobs`; `offset` is the first token's character offset in the
    choice's text (the text already sent, and an echoed prompt). `top_logprobs` maps the top tokens' texts to
    their logprobs and always holds the chosen token, as OpenAI's does; tokens whose texts collide keep the
    higher logprob."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in entries:
        text, _ = token_text(e.token_id)
        tokens.append(text)
        token_logprobs.append(e.logprob)
        ranked: dict[str, float] = {}
        for token_id, logprob in (*e.top, (e.token_id, e.logprob)):
            key = token_text(token_id)[0]
            ranked[key] = max(ranked.get(key, logprob), logprob)
        top.append(ranked)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


# ---------------------------------------------------------------------------------------------------------
# Bodies


def choice_body(index: int, text: str, finish_reason: str | None, *, chat: bool,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a whole (non-streamed) answer."""
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_body(request_id: str, model: str, choices: list[dict[str, Any]], usage: dict | None, *,
                    chat: bool, created: int | None = None) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion; `choices` from `choice_body`."""
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def chunk_body(
    request_id: str, model: str, created: int, *, chat: bool, index: int = 0, text: str | None = None,
    role: bool = False, finish_reason: str | None = None, usage: dict | None = None, no_choices: bool = False,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk of choice `index`. `role` opens a chat choice; `no_choices` is the final usage-only
    chunk."""
    if no_choices:
        choices: list[dict] = []
    elif chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text:
            delta["content"] = text
        choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    else:
        choices = [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}]
    body = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def models_body(served_name: str, owned_by: str = "specserve", created: int | None = None) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": served_name, "object": "model", "created": created or 0, "owned_by": owned_by}],
    }


def sse(body: dict[str, Any]) -> str:
    """One server-sent event carrying `body`."""
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
