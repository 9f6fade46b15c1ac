"""Structured output on the native engine: a request's grammar as a mask of the tokens it allows, at every
verified position.

`Grammars` compiles a `StructuredOutput` (xgrammar: JSON Schema, or any JSON object) against the target's
tokenizer, once per distinct grammar, and gives each structured request its own matcher, which stands at the
request's committed output. Per round, `valid_drafts` walks the matcher through the row's drafts and keeps them
up to the first token the grammar refuses; `block_masks` fills the allowed-token bitmask at every position of
the kept block (position i after drafts 0..i-1), and rolls the matcher back; the target masks its logits with
them (`policies.penalties.apply_bitmask`) before it verifies, so exact verification is exact under the grammar
and ASD cannot relax to a token the grammar refuses (its logit is -inf). Emitted tokens advance the matcher
(`advance`). Why xgrammar: docs/architecture.md, "Structured output on the native engine".
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence

import torch

from actors.requests import StructuredOutput

WORD_BITS = 32  # tokens per int32 word of a bitmask
ANY_OBJECT = '{"type": "object"}'  # json_object: any JSON object (vLLM's reading of it too)
# Compact JSON, no free whitespace (vLLM's disable_any_whitespace, which the vLLM engine sets too): a grammar that
# allows any whitespace lets a model pad its JSON with blanks until max_tokens, and small models do.
COMPACT = (",", ":")


class Grammars:
    """The grammar compiler of one unit: the target's tokenizer (`source`, loaded on first use) over its model
    vocabulary, EOS as the stop token a finished grammar allows."""

    def __init__(self, source: str, vocab_size: int, eos: Collection[int]):
        self.source, self.vocab_size, self.eos = source, vocab_size, sorted(eos)
        self._compiler = None

    def matcher(self, structured: StructuredOutput):
        """A fresh matcher for a request's grammar; ValueError naming `structured` if it does not compile."""
        import xgrammar as xgr

        compiler = self._compiler or self._build()
        try:
            schema = ANY_OBJECT if structured.kind == "json_object" else structured.schema
            json.loads(schema)
            compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=COMPACT)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"structured: the grammar does not compile: {exc}") from None
        return xgr.GrammarMatcher(compiled)

    def _build(self):
        import xgrammar as xgr

        from actors.sources import load_tokenizer

        info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(self.source), vocab_size=self.vocab_size,
                                                  stop_token_ids=self.eos or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


def valid_drafts(matcher, drafts: Sequence[int]) -> int:
    """How many of `drafts` the grammar accepts in a row from the matcher's state (which it keeps)."""
    kept = 0
    for token in drafts:
        if not matcher.accept_token(token):
            break
        kept += 1
    if kept:
        matcher.rollback(kept)
    return kept


def block_masks(matcher, drafts: Sequence[int], vocab_size: int) -> torch.Tensor:
    """The allowed-token bitmask [k+1, ceil(V / 32)] int32 at each position of a block whose drafts the grammar
    accepts (`valid_drafts`): position i after drafts 0..i-1. The matcher ends where it started."""
    masks = torch.full((len(drafts) + 1, -(-vocab_size // WORD_BITS)), -1, dtype=torch.int32)
    for i, token in enumerate(drafts):
        matcher.fill_next_token_bitmask(masks, i)
        if not matcher.accept_token(token):
            raise ValueError(f"drafts: token {token} at position {i} is not allowed by the grammar")
    matcher.fill_next_token_bitmask(masks, len(drafts))
    if drafts:
        matcher.rollback(len(drafts))
    return masks


def advance(matcher, tokens: Sequence[int], request_id: str) -> None:
    """Move the matcher past a request's emitted tokens; they were drawn under its masks, so it accepts them."""
    for token in tokens:
        if not matcher.accept_token(token):
            raise RuntimeError(f"request {request_id!r}: emitted token {token} breaks its grammar")
