"""The suffix drafter's matching core against brute-force scans, on hand cases, for bounded memory, and for draft
quality against prompt lookup on a copy-edit stream."""

from __future__ import annotations

import gc
import random
import tracemalloc
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.drafting.suffix_index import SEPARATOR, SuffixIndex
from actors.drafting.suffix_propose import (CACHE_PRIOR, DEFAULT_PRIOR, SOURCE_CACHE, SOURCE_REQUEST,
                                            ConfidencePrior, Draft, SuffixCache, propose)

from actors.drafting.ngram import ngram_lookup


# ---------------------------------------------------------------- brute-force references (scan every position)


def brute_counts(stream: list[int], pattern: list[int]) -> tuple[Counter, dict[int, int]]:
    """Continuations of every occurrence of `pattern` in `stream` (ends e with a non-separator stream[e+1]):
    counts per token, and per token the latest position it was seen at."""
    counts, latest = Counter(), {}
    m = len(pattern)
    for e in range(m - 1, len(stream) - 1):
        if stream[e - m + 1 : e + 1] == pattern and stream[e + 1] != SEPARATOR:
            counts[stream[e + 1]] += 1
            latest[stream[e + 1]] = e + 1
    return counts, latest


def brute_match(stream: list[int], max_depth: int, pattern: list[int] | None = None) -> tuple[int, dict]:
    """(L, counts): the longest suffix (≤ max_depth) of `pattern`, by default of the stream itself, with an
    occurrence that has a continuation; the stream's own final occurrence has none, so it never counts."""
    pattern = stream if pattern is None else pattern
    for length in range(min(max_depth, len(pattern)), 0, -1):
        counts, _ = brute_counts(stream, pattern[len(pattern) - length :])
        if counts:
            return length, dict(counts)
    return 0, {}


def brute_walk(stream, max_depth, pattern, max_tokens, min_confidence, prior=DEFAULT_PRIOR):
    """The documented draft rule by scanning: most frequent continuation (ties: latest), pattern ≤ max_depth."""
    length, _ = brute_match(stream, max_depth, pattern)
    context, tokens, confidence, running = list(pattern), [], [], 1.0
    while length and len(tokens) < max_tokens:
        counts, latest = brute_counts(stream, context[len(context) - length :])
        if not counts:
            break
        best = max(counts, key=lambda t: (counts[t], latest[t]))
        running *= prior.step(counts[best], sum(counts.values()), length)
        if running < min_confidence:
            break
        tokens.append(best)
        confidence.append(running)
        context.append(best)
        length = min(length + 1, max_depth)
    return tokens, confidence


def cache_stream(cache: SuffixCache) -> list[int]:
    """Everything the cache holds, oldest first (each sequence ends with SEPARATOR)."""
    return [t for segment in cache._segments for t in segment.tail(len(segment))]


streams = st.integers(1, 4).flatmap(lambda vocab: st.lists(st.integers(0, vocab - 1), min_size=1, max_size=48))


# ---------------------------------------------------------------- equivalence with the scans


@settings(max_examples=150, deadline=None)
@given(stream=streams, max_depth=st.integers(1, 6))
def test_match_equals_scan_after_every_append(stream, max_depth):
    index = SuffixIndex(max_depth)
    for i, token in enumerate(stream):
        index.extend([token])
        match = index.match()
        assert (match.length, match.counts) == brute_match(stream[: i + 1], max_depth)


@settings(max_examples=150, deadline=None)
@given(stream=streams, pattern=st.lists(st.integers(0, 4), max_size=12), max_depth=st.integers(1, 6))
def test_pattern_match_equals_scan(stream, pattern, max_depth):
    index = SuffixIndex(max_depth)
    index.extend(stream)
    match = index.match(pattern)
    assert (match.length, match.counts) == brute_match(stream, max_depth, pattern)


@settings(max_examples=150, deadline=None)
@given(stream=streams, max_depth=st.integers(1, 6), max_tokens=st.integers(1, 12),
       min_confidence=st.sampled_from([0.0, 0.2, 0.5]))
def test_request_draft_equals_scan(stream, max_depth, max_tokens, min_confidence):
    index = SuffixIndex(max_depth)
    index.extend(stream)
    draft = propose(index, None, max_tokens, min_confidence)
    tokens, confidence = brute_walk(stream, max_depth, stream, max_tokens, min_confidence)
    assert list(draft.tokens) == tokens
    assert draft.confidence == pytest.approx(confidence, rel=1e-12)
    assert draft.source == (SOURCE_REQUEST if tokens else None)
    assert draft.match_len == (index.match().length if tokens else 0)


@settings(max_examples=100, deadline=None)
@given(sequences=st.lists(st.lists(st.integers(0, 3), max_size=14), min_size=1, max_size=10),
       pattern=st.lists(st.integers(0, 3), min_size=1, max_size=10), max_tokens=st.integers(8, 40),
       segments=st.integers(1, 3), max_depth=st.integers(1, 5))
def test_cache_match_and_draft_equal_scan_of_what_it_holds(sequences, pattern, max_tokens, segments, max_depth):
    cache = SuffixCache(max_tokens, max_depth=max_depth, segments=segments)
    for sequence in sequences:
        cache.add(sequence)
    held = cache_stream(cache)
    match = cache.match(pattern)
    assert (match.length, match.counts) == brute_match(held, max_depth, pattern)
    draft = propose(None, cache, 8, 0.0, context_tail=pattern)
    assert list(draft.tokens) == brute_walk(held, max_depth, pattern, 8, 0.0)[0]


# ---------------------------------------------------------------- hand cases


def test_the_current_suffix_is_not_its_own_occurrence():
    index = SuffixIndex()
    index.extend([1, 2, 3, 4])
    assert index.match().length == 0
    assert propose(index, None, 8) == Draft.empty()
    index.extend([1, 2])  # [1, 2] occurred before, followed by 3; the final [1, 2] has no continuation yet
    match = index.match()
    assert (match.length, match.counts) == (2, {3: 1})


def test_verbatim_copy_of_a_prompt_segment_is_proposed_in_full_with_high_confidence():
    rng = random.Random(0)
    segment = list(range(100, 140))  # 40 tokens that occur nowhere else
    prompt = [rng.randrange(20) for _ in range(200)] + segment + [rng.randrange(20) for _ in range(100)]
    index = SuffixIndex()
    index.extend(prompt + segment[:12])  # the output has started copying the segment
    draft = propose(index, None, max_tokens=16, min_confidence=0.05)
    assert draft.tokens == tuple(segment[12:28])
    assert (draft.match_len, draft.source) == (12, SOURCE_REQUEST)
    # one occurrence at pattern length m ≥ 12: each step ≥ (1 + 2·12/14) / 3 ≈ 0.90
    assert draft.confidence[0] > 0.9
    assert draft.confidence[-1] > 0.3
    assert draft.expected_accepted > 8


def test_the_more_frequent_continuation_wins_and_the_confidence_reflects_the_split():
    index = SuffixIndex()
    #             A  B  C  y     A  B  C  z     A  B  C  y     A  B  C
    index.extend([7, 1, 2, 3, 50, 8, 1, 2, 3, 60, 9, 1, 2, 3, 50, 4, 1, 2, 3])
    match = index.match()
    assert (match.length, match.counts) == (3, {50: 2, 60: 1})
    draft = propose(index, None, max_tokens=1, min_confidence=0.0)
    assert draft.tokens == (50,)
    assert draft.confidence[0] == pytest.approx(DEFAULT_PRIOR.step(2, 3, 3))
    unanimous = SuffixIndex()
    unanimous.extend([7, 1, 2, 3, 50, 8, 1, 2, 3, 50, 9, 1, 2, 3, 50, 4, 1, 2, 3])
    assert propose(unanimous, None, 1, 0.0).confidence[0] > draft.confidence[0]


def test_ties_go_to_the_most_recent_occurrence():
    index = SuffixIndex()
    index.extend([1, 2, 30, 9, 1, 2, 40, 9, 1, 2])
    assert propose(index, None, 1, 0.0).tokens == (40,)


def test_no_match_proposes_nothing():
    index = SuffixIndex()
    index.extend(range(50))
    cache = SuffixCache(1000)
    cache.add(range(100, 200))
    assert propose(index, cache, 8) == Draft.empty()
    assert propose(SuffixIndex(), None, 8) == Draft.empty()


def test_confidence_is_non_increasing_and_stops_at_min_confidence():
    rng = random.Random(1)
    index = SuffixIndex(8)
    index.extend([rng.randrange(3) for _ in range(400)])
    for min_confidence in (0.0, 0.05, 0.3):
        draft = propose(index, None, 16, min_confidence)
        assert draft.tokens
        assert all(1.0 >= a >= b > 0.0 for a, b in zip(draft.confidence, draft.confidence[1:]))
        assert min(draft.confidence) >= min_confidence
    unbounded = propose(index, None, 16, 0.0)
    stopped = propose(index, None, 16, 0.3)
    cut = len(stopped.tokens)
    assert unbounded.tokens[:cut] == stopped.tokens
    assert cut == 16 or unbounded.confidence[cut] < 0.3


def test_short_single_matches_are_less_confident_than_long_ones():
    prior = ConfidencePrior()
    assert prior.step(1, 1, 1) < prior.step(1, 1, 4) < prior.step(1, 1, 32) < 1.0
    assert prior.step(3, 3, 4) > prior.step(1, 1, 4)  # more unanimous occurrences, more confidence


def test_the_cache_drafts_when_the_request_has_no_match_and_never_across_sequences():
    cache = SuffixCache(1000)
    cache.add([1, 2, 3, 4, 5, 6, 7, 8])
    cache.add([9, 9, 9])
    index = SuffixIndex()
    index.extend([20, 21, 1, 2, 3])
    draft = propose(index, cache, 8, 0.0)
    assert (draft.tokens, draft.match_len, draft.source) == ((4, 5, 6, 7, 8), 3, SOURCE_CACHE)
    assert draft.confidence[0] == pytest.approx(CACHE_PRIOR.step(1, 1, 3))  # other requests' matches: own prior
    assert propose(None, cache, 8, 0.0, context_tail=[7, 8]).tokens == ()  # 8 ends its sequence: no 9 follows


def test_the_request_wins_over_the_cache_when_it_expects_more():
    cache = SuffixCache(1000)
    cache.add([1, 2, 3, 90, 91])
    index = SuffixIndex()
    index.extend([5, 6, 1, 2, 3, 4, 5, 6, 7, 8, 0, 5, 6, 1, 2, 3])  # here [5 6 1 2 3] is followed by 4
    draft = propose(index, cache, 4, 0.0)
    assert (draft.tokens, draft.source, draft.match_len) == ((4, 5, 6, 7), SOURCE_REQUEST, 5)


def test_bad_arguments_name_themselves():
    index = SuffixIndex()
    with pytest.raises(ValueError, match="max_depth"):
        SuffixIndex(0)
    with pytest.raises(ValueError, match="tokens"):
        index.extend([3, -1])
    with pytest.raises(ValueError, match="max_tokens"):
        propose(index, None, -1)
    with pytest.raises(ValueError, match="min_confidence"):
        propose(index, None, 4, 1.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixCache(3, segments=4)
    with pytest.raises(ValueError, match="segments"):
        SuffixCache(100, segments=0)
    with pytest.raises(ValueError, match="weight"):
        ConfidencePrior(weight=-1.0)
    assert propose(index, None, 0) == Draft.empty()


# ---------------------------------------------------------------- bounded memory


def test_the_cache_never_holds_more_than_max_tokens_and_evicts_the_oldest():
    rng = random.Random(2)
    cache = SuffixCache(max_tokens=2000, segments=4)
    first = list(range(1000, 1040))
    cache.add(first)
    for i in range(3000):
        sequence = [rng.randrange(200) for _ in range(rng.randrange(1, 300))]
        cache.add(sequence)
        assert cache.num_tokens <= 2000
        newest = cache._segments[-1]
        assert newest.tail(len(sequence) + 1)[-len(sequence) - 1 : -1] == sequence[: cache.segment_tokens - 1]
    assert cache.num_tokens >= 2000 * 3 // 4 - 300  # full up to the segment being filled
    assert cache.match(first[:10]).length == 0  # long evicted


def _traced_bytes() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def test_request_indexes_are_freed_with_the_request():
    rng = random.Random(3)

    def serve_one():
        index = SuffixIndex()
        index.extend([rng.randrange(50) for _ in range(100)])  # prompt
        for _ in range(10):  # rounds: propose, then commit what the target would emit
            draft = propose(index, None, 8)
            index.extend(list(draft.tokens[:2]) + [rng.randrange(50)])
        return len(index)

    tracemalloc.start()
    try:
        serve_one()  # warm up interpreter caches
        before = _traced_bytes()
        index = SuffixIndex()
        index.extend([rng.randrange(50) for _ in range(400)])
        one_index = _traced_bytes() - before
        del index
        before = _traced_bytes()
        for _ in range(500):
            serve_one()
        grown = _traced_bytes() - before
    finally:
        tracemalloc.stop()
    # One live index of 400 tokens holds ~47 kB (measured), and keeping every request's index grows this loop by
    # ~9 MB (measured); without a leak it grows by ~0.1 kB. 64 kB allows interpreter noise yet fails on any leak
    # of ≥ 128 bytes per request.
    assert one_index > 10_000
    assert grown < 64_000, f"memory grew by {grown} bytes over 500 requests"


def test_index_memory_per_token_stays_small():
    rng = random.Random(4)
    tracemalloc.start()
    try:
        before = _traced_bytes()
        index = SuffixIndex()
        index.extend([rng.randrange(2000) for _ in range(4000)])
        held = _traced_bytes() - before
    finally:
        tracemalloc.stop()
    # ~2 states per token × 6 int32 columns plus a dict per branching state: measured ~130 kB per 1k tokens on
    # real code and prose; 400 kB per 1k flags a regression toward a dict per state (the plain automaton: 430 kB).
    assert held / 4 < 400_000, f"{held / 4:.0f} bytes per 1k tokens"


# ---------------------------------------------------------------- draft quality against prompt lookup


def copy_edit_stream(seed: int = 0) -> tuple[list[int], list[int]]:
    """(prompt, output): a prompt holding ~60 lines of synthetic code; the output rewrites it with small edits
    (a renamed identifier in ~15% of lines, an inserted comment line in ~10%). Code-like: a few frequent tokens
    (newline, indent, punctuation, keywords 0-15) between identifiers (100-299), so short n-grams recur often."""
    rng = random.Random(seed)
    newline, indent = 0, 1
    templates = [[2, "i", 3, "i", 4, 5], [6, "i", 7, "i", 8, "i"], [9, "i", 3, "i", 10, "i", 4],
                 [11, "i", 12, "i", 5], ["i", 7, "i", 3, "i", 4]]
    code = []
    for _ in range(60):
        line = [newline] + [indent] * rng.randrange(1, 4)
        line += [rng.randrange(100, 300) if t == "i" else t for t in rng.choice(templates)]
        code.append(line)
    output = []
    for line in code:
        line = list(line)
        if rng.random() < 0.15:
            spots = [i for i, t in enumerate(line) if t >= 100]
            line[rng.choice(spots)] = rng.randrange(300, 400)
        if rng.random() < 0.10:
            output += [newline, indent, 13] + [rng.randrange(400, 500) for _ in range(rng.randrange(3, 8))]
        output += line
    instruction = list(range(500, 520))
    return instruction + [t for line in code for t in line] + [14, 15], output


def replay(prompt, output, draft_fn, gamma):
    """Greedy verification against the true output: keep the longest matching prefix, then one target token."""
    context, t = list(prompt), 0
    proposals = proposed = accepted = rounds = 0
    while t < len(output):
        draft = draft_fn(context, gamma)
        k = 0
        while k < len(draft) and t + k < len(output) and draft[k] == output[t + k]:
            k += 1
        emitted = output[t : t + k + 1]
        context += emitted
        t += len(emitted)
        rounds += 1
        proposals += bool(draft)
        proposed += len(draft)
        accepted += k
    return {"accept_rate": accepted / max(proposed, 1), "accepted_per_proposal": accepted / max(proposals, 1),
            "tokens_per_round": len(output) / rounds, "proposed": proposed}


def suffix_drafter(min_confidence: float):
    """The suffix proposer with an index kept across rounds (each round appends only what was committed)."""
    index = SuffixIndex()

    def draft(context, gamma):
        index.extend(context[len(index) :])
        return list(propose(index, None, gamma, min_confidence).tokens)

    return draft


@pytest.mark.parametrize("gamma", [8, 16])
def test_suffix_drafts_accept_more_than_prompt_lookup_on_copy_edit(gamma):
    lookup = ngram_lookup
    prompt, output = copy_edit_stream()

    def ngram_draft(context, g):
        return lookup(np.asarray(context, dtype=np.int64), g, 1, 4)

    ngram = replay(prompt, output, ngram_draft, gamma)
    suffix = replay(prompt, output, suffix_drafter(0.1), gamma)
    # Measured on this stream (γ = 8 / 16), prompt lookup vs suffix: accepted fraction of proposed tokens
    # 0.46 / 0.32 vs 0.67 / 0.55; accepted per proposal 3.65 / 5.07 vs 4.91 / 6.83; tokens per round
    # 3.68 / 4.44 vs 4.32 / 5.17 (seeds 1, 2 alike). Asserted loosely: at least as good on every figure.
    assert suffix["accepted_per_proposal"] >= ngram["accepted_per_proposal"]
    assert suffix["tokens_per_round"] >= ngram["tokens_per_round"]
    assert suffix["accept_rate"] > ngram["accept_rate"]
