"""Drafters: n-gram prompt lookup semantics and the model drafter's cache bookkeeping."""

import numpy as np
import pytest
import torch

from actors.contracts import DraftRequest
from actors.drafting import ModelDrafter, NgramDrafter, check_vocab, ngram_lookup
from actors.sampling import SamplingSpec
from actors.engines.native.engine import Engine
from actors.engines.native import load_model
from policies import PAD_TOKEN_ID


def test_ngram_prefers_longest_match_and_most_recent_full_occurrence():
    ctx = np.array([1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3])
    # suffix (1, 2, 3) occurs at 0 → proposes what followed it
    assert ngram_lookup(ctx, 3, 1, 3) == [9, 2, 3]
    # only n = 2 allowed: (2, 3) occurs at 1 and 4; the most recent (4) is followed by 7, 8
    assert ngram_lookup(ctx, 2, 2, 2) == [7, 8]
    # inside a loop the most recent occurrence has one token after it; the earliest gives all k
    assert ngram_lookup(np.array([6] * 8), 4, 1, 3) == [6, 6, 6, 6]


def test_ngram_no_match_and_short_continuation():
    assert ngram_lookup(np.array([1, 2, 3, 4]), 3, 1, 3) == []
    # match near the end: fewer than k tokens follow
    assert ngram_lookup(np.array([5, 6, 5]), 4, 1, 2) == [6, 5]


def test_ngram_drafter_batch_pads_ragged_rows():
    d = NgramDrafter(1, 3)
    batch = d.propose([DraftRequest("a", [1, 2, 1], 3), DraftRequest("b", [4, 5, 6], 2), DraftRequest("c", [7, 7], 0)])
    assert batch.draft_lens.tolist() == [2, 0, 0]
    assert batch.draft_ids.tolist() == [[2, 1], [PAD_TOKEN_ID] * 2, [PAD_TOKEN_ID] * 2]
    assert batch.draft_probs is None


def test_ngram_drafter_rejects_bad_bounds():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramDrafter(0, 3)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        NgramDrafter(3, 2)


def test_vocab_mismatch_names_both_models():
    with pytest.raises(ValueError, match="drafter 'small'.*target 'big'"):
        check_vocab("big", 49152, "small", 32000)


def test_model_drafter_greedy_equals_plain_decoding_and_resyncs(tiny_llama_dir):
    torch.manual_seed(0)
    model, _ = load_model(tiny_llama_dir)
    drafter = ModelDrafter(Engine(model, max_slots=4, max_seq_len=256))
    reference = Engine(model, max_slots=4, max_seq_len=256)
    context = [5, 17, 300, 42, 9]
    # plain greedy decoding of 4 tokens
    expected, feed = [], context
    for _ in range(4):
        tok = int(reference.forward(["r"], [feed])[0, len(feed) - 1].argmax())
        expected.append(tok)
        feed = [tok]
    batch = drafter.propose([DraftRequest("s", context, 4)])
    assert batch.draft_ids[0].tolist() == expected
    # next round: 2 drafts accepted, then a different recovered token; the cache is cropped and re-fed
    new_context = context + expected[:2] + [123]
    again = drafter.propose([DraftRequest("s", new_context, 3)])
    fresh = ModelDrafter(Engine(model, max_slots=4, max_seq_len=256)).propose([DraftRequest("t", new_context, 3)])
    assert again.draft_ids.tolist() == fresh.draft_ids.tolist()
    drafter.release("s")
    assert drafter.active_ids() == [] and drafter.engine.active_ids() == []


def test_model_drafter_sampled_returns_q_rows(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    drafter = ModelDrafter(Engine(model, max_slots=4, max_seq_len=256))
    spec = SamplingSpec(temperature=1.0, seed=3)
    batch = drafter.propose([DraftRequest("s", [1, 2, 3], 3, spec), DraftRequest("g", [4, 5], 2)])
    assert batch.draft_probs.shape == (2, 3, model.args.vocab_size)
    assert torch.allclose(batch.draft_probs[0].sum(-1), torch.ones(3), atol=1e-4)
    # the greedy row's q is one-hot at its draft token
    assert batch.draft_probs[1, 0, batch.draft_ids[1, 0]] == 1.0
    # seeded drafts reproduce
    again = ModelDrafter(Engine(model, max_slots=4, max_seq_len=256)).propose([DraftRequest("s", [1, 2, 3], 3, spec)])
    assert again.draft_ids[0].tolist() == batch.draft_ids[0].tolist()
