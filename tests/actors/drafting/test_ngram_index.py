"""The incremental n-gram drafter answers exactly as the stateless `ngram_lookup`, and holds nothing for
released sequences."""

import random

import numpy as np
import pytest

from actors.contracts import DraftRequest
from actors.drafting import NgramDrafter, ngram_lookup
from actors.drafting.ngram import CHECKED_TAIL

BOUNDS = [(1, 4), (2, 3), (3, 3), (1, 1)]


def _check(drafter: NgramDrafter, contexts: dict[str, list[int]], rng: random.Random) -> None:
    ks = {sid: rng.randint(0, 9) for sid in contexts}
    batch = drafter.propose([DraftRequest(sid, ctx, ks[sid]) for sid, ctx in contexts.items()])
    for b, (sid, ctx) in enumerate(contexts.items()):
        want = ngram_lookup(np.asarray(ctx, dtype=np.int64), ks[sid], drafter.n_min, drafter.n_max) if ks[sid] else []
        assert batch.draft_ids[b, : batch.draft_lens[b]].tolist() == want, (sid, ctx, ks[sid])


@pytest.mark.parametrize("n_min,n_max", BOUNDS)
def test_growing_contexts_match_the_reference(n_min, n_max):
    """Rows grown by 1-5 tokens a step, on a small vocabulary so matches (and loops) are common."""
    rng = random.Random(1000 * n_min + n_max)
    for _ in range(20):
        drafter = NgramDrafter(n_min, n_max)
        vocab = rng.choice([2, 3, 5, 8])
        contexts = {f"r{j}": [rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for j in range(4)}
        for _ in range(40):
            _check(drafter, contexts, rng)
            for ctx in contexts.values():
                ctx += [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]


@pytest.mark.parametrize("n_min,n_max", BOUNDS)
def test_shrunk_or_rewritten_contexts_are_indexed_again(n_min, n_max):
    """A context rolled back, rolled back and rewritten, replaced by another under the same id, or passed as
    a numpy view: the drafter still answers as the reference."""
    rng = random.Random(7 + n_min * 10 + n_max)
    for _ in range(30):
        drafter = NgramDrafter(n_min, n_max)
        vocab = rng.choice([2, 3, 5])
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(5, 30))]
        for _ in range(30):
            _check(drafter, {"s": ctx}, rng)
            change = rng.random()
            if len(ctx) < 2:
                ctx += [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            elif change < 0.25:  # roll back
                del ctx[len(ctx) - rng.randint(1, min(len(ctx) - 1, CHECKED_TAIL)):]
            elif change < 0.5:  # roll back and rewrite as long or longer
                cut = rng.randint(1, min(len(ctx) - 1, CHECKED_TAIL))
                ctx[len(ctx) - cut:] = [rng.randrange(vocab) for _ in range(cut + rng.randint(0, 4))]
            elif change < 0.6:  # another context under the same id
                ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
            else:
                ctx += [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            if rng.random() < 0.3:
                _check(drafter, {"s": np.asarray(ctx, dtype=np.int64)}, rng)


def test_a_long_loop_and_a_long_context():
    drafter = NgramDrafter(1, 4)
    rng = random.Random(3)
    loop = [5] * 300
    text = [rng.randrange(50) for _ in range(2000)]
    for step in range(30):
        _check(drafter, {"loop": loop, "text": text}, rng)
        loop += [5] * rng.randint(1, 5)
        text += text[100 + step : 100 + step + rng.randint(1, 5)]  # copies make long matches


def test_release_frees_the_row_and_nothing_else():
    drafter = NgramDrafter(1, 3)
    drafter.propose([DraftRequest("a", [1, 2, 1], 2), DraftRequest("b", [3, 4, 3], 2), DraftRequest("c", [7], 0)])
    assert sorted(drafter.active_ids()) == ["a", "b"]  # a row asked for no draft is not indexed
    drafter.release("a")
    drafter.release("unknown")
    assert drafter.active_ids() == ["b"]
    drafter.release("b")
    assert drafter.active_ids() == [] and drafter._indexes == {}
    # a released id starts over: nothing of the old context answers
    assert drafter.propose([DraftRequest("a", [9, 8], 2)]).draft_lens.tolist() == [0]


def test_finished_rows_leave_no_state_across_many_requests():
    drafter = NgramDrafter(1, 4)
    rng = random.Random(11)
    live: dict[str, list[int]] = {}
    for step in range(200):
        if rng.random() < 0.3:
            live[f"req{step}"] = [rng.randrange(6) for _ in range(rng.randint(1, 20))]
        for sid in [s for s in live if rng.random() < 0.1]:
            drafter.release(sid)
            del live[sid]
        if live:
            _check(drafter, live, rng)
            for ctx in live.values():
                ctx.append(rng.randrange(6))
        assert set(drafter.active_ids()) <= set(live)  # a row asked for no draft yet is not indexed
    for sid in list(live):
        drafter.release(sid)
    assert drafter.active_ids() == []
