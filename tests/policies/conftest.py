"""Helpers for the policies tests: hand-built teacher-forced logits."""

from __future__ import annotations

import pytest
import torch


def logits_for(argmax_ids: list[list[int]], vocab: int = 16, seed: int = 0) -> torch.Tensor:
    """Logits [B, K+1, V] whose argmax at each position is the given id (margin ≥ 1 over the rest)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(argmax_ids)  # [B, K+1]
    logits = torch.rand(*ids.shape, vocab, generator=gen)  # [B, K+1, V] in [0, 1)
    return logits.scatter_(-1, ids[..., None], 2.0)


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def make_logits():
    """`make_logits(argmax_ids, vocab=16, seed=0)` -> logits [B, K+1, V] with those argmax ids."""
    return logits_for
