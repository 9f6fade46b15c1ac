"""The verdict of one verification call, and the block helpers every verifier shares.

Row b of a `Verdict` emits `tokens[b, : num_accepted[b] + 1]`: its accepted draft tokens, then one recovered
or bonus token. Ragged blocks are padded with `PAD_TOKEN_ID` beyond `draft_lens[b]` (terms: docs/architecture.md,
"Terms"). Every verifier works on the one device of its inputs (`check_devices`) and returns its tensors there;
nothing here moves data between devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_TOKEN_ID = -1
"""Fills `draft_ids` beyond a row's own block length and `Verdict.tokens` beyond a row's emitted tokens."""


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one block per row. Row b emits `tokens[b, : num_accepted[b] + 1]`."""

    tokens: torch.Tensor  # [B, K+1] long, PAD_TOKEN_ID after the emitted tokens
    num_accepted: torch.Tensor  # [B] long, draft tokens kept (relaxed ones included)
    num_relaxed: torch.Tensor | None = None  # [B] long, accepted mismatches (ASD only)
    regret: torch.Tensor | None = None  # [B] float, regret charged to the row's ledger this call (ASD only)

    def emitted(self) -> list[list[int]]:
        """The emitted token ids of each row, as Python lists."""
        counts = (self.num_accepted + 1).tolist()
        return [row[:n] for row, n in zip(self.tokens.tolist(), counts)]


def check_draft(draft_ids: torch.Tensor, draft_lens: torch.Tensor | None) -> torch.Tensor:
    """Validate a padded draft block and return the row lengths `draft_lens` [B] (long).

    `draft_ids` [B, K] long with K ≥ 1. Without `draft_lens` every row has K tokens. With it, ids beyond
    a row's length must be `PAD_TOKEN_ID`, ids within it must be ≥ 0 (the upper bound, the vocabulary size,
    is checked where it is known).
    """
    if not isinstance(draft_ids, torch.Tensor) or draft_ids.dim() != 2:
        raise ValueError(f"draft_ids must be a 2-D tensor [B, K], got {_describe(draft_ids)}")
    if draft_ids.dtype != torch.long:
        raise ValueError(f"draft_ids must be torch.long, got {draft_ids.dtype}")
    batch, k = draft_ids.shape
    if k == 0:
        raise ValueError("draft_ids has K = 0 positions; plain decoding is draft_lens = 0 with K ≥ 1")
    if batch == 0:
        raise ValueError("draft_ids has an empty batch (B = 0)")
    if draft_lens is None:
        if bool((draft_ids < 0).any()):
            raise ValueError("draft_ids holds negative token ids; pass draft_lens for padded (ragged) blocks")
        return torch.full((batch,), k, dtype=torch.long, device=draft_ids.device)
    if not isinstance(draft_lens, torch.Tensor) or draft_lens.shape != (batch,):
        raise ValueError(f"draft_lens must be a tensor of shape [{batch}], got {_describe(draft_lens)}")
    if draft_lens.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"draft_lens must be an integer tensor, got {draft_lens.dtype}")
    check_devices(draft_ids=draft_ids, draft_lens=draft_lens)
    draft_lens = draft_lens.long()
    if bool(((draft_lens < 0) | (draft_lens > k)).any()):
        raise ValueError(f"draft_lens must lie in [0, K={k}], got {draft_lens.tolist()}")
    valid = positions(k, draft_ids.device) < draft_lens[:, None]  # [B, K]
    if bool((valid & (draft_ids < 0)).any()):
        raise ValueError("draft_ids holds negative token ids within draft_lens")
    if bool((~valid & (draft_ids != PAD_TOKEN_ID)).any()):
        raise ValueError(f"draft_ids must be PAD_TOKEN_ID ({PAD_TOKEN_ID}) beyond draft_lens")
    return draft_lens


def check_vocab_range(draft_ids: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError when a draft id is ≥ `vocab_size`."""
    if bool((draft_ids >= vocab_size).any()):
        raise ValueError(f"draft_ids holds token ids ≥ the vocabulary size {vocab_size}")


def check_devices(**tensors: torch.Tensor | None) -> torch.device | None:
    """The one device of the given tensors (None entries skipped); ValueError naming the first one elsewhere.

    Verifiers never move data: a caller that mixes devices (draft ids built on the host, logits on a GPU)
    gets this error instead of torch's, and moves its tensors once per round on purpose.
    """
    named = [(name, t) for name, t in tensors.items() if isinstance(t, torch.Tensor)]
    if not named:
        return None
    device = named[0][1].device
    for name, t in named[1:]:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {named[0][0]} is on {device}; move them to one device")
    return device


def positions(k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Position indices 0..k-1 as a [k] long tensor on `device` (default the CPU)."""
    return torch.arange(k, dtype=torch.long, device=device)


def assemble_tokens(draft_ids: torch.Tensor, num_accepted: torch.Tensor, last_token: torch.Tensor) -> torch.Tensor:
    """Emitted tokens [B, K+1]: the first num_accepted[b] draft ids, then last_token[b], then padding."""
    batch, k = draft_ids.shape
    pad = torch.full((batch, 1), PAD_TOKEN_ID, dtype=torch.long, device=draft_ids.device)
    tokens = torch.cat([draft_ids, pad], dim=1)  # [B, K+1]
    tokens = torch.where(positions(k + 1, draft_ids.device) < num_accepted[:, None], tokens, PAD_TOKEN_ID)
    return tokens.scatter_(1, num_accepted[:, None], last_token[:, None])  # [B, K+1]


def accepted_prefix(keep: torch.Tensor) -> torch.Tensor:
    """Length [B] of the longest all-True prefix of `keep` [B, K] (bool)."""
    return keep.to(torch.int32).cumprod(dim=1).sum(dim=1).long()  # [B]


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__
