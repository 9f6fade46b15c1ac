"""Compact target scores: what greedy and ASD verification need from the target's logits.

`TargetScores` carries three numbers per position of the teacher-forced target logits, the argmax token y*_i,
its logit z_i(y*_i) and the draft token's logit z_i(x_i), so a block crosses actor boundaries as a few hundred
bytes instead of full-vocabulary rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from policies.verdict import PAD_TOKEN_ID, check_devices, check_vocab_range

_NUMPY_ARGMAX_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class TargetScores:
    """Per-position summary of teacher-forced target logits for a block of K draft tokens.

    Row i scores the token after the first i draft tokens, so position K (the last) is the bonus position.
    """

    argmax_ids: torch.Tensor  # [B, K+1] long, y*_i = argmax_v z_i(v)
    argmax_logits: torch.Tensor  # [B, K+1] float, z_i(y*_i)
    draft_logits: torch.Tensor  # [B, K] float, z_i(x_i); -inf where x_i is PAD_TOKEN_ID

    def check(self, draft_ids: torch.Tensor) -> None:
        """Raise ValueError unless the shapes match `draft_ids` [B, K] and the logits are usable."""
        batch, k = draft_ids.shape
        for name, tensor, shape in (
            ("argmax_ids", self.argmax_ids, (batch, k + 1)),
            ("argmax_logits", self.argmax_logits, (batch, k + 1)),
            ("draft_logits", self.draft_logits, (batch, k)),
        ):
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"scores.{name} must have shape {shape} to match draft_ids, got {got}")
        check_devices(draft_ids=draft_ids, **{"scores.argmax_ids": self.argmax_ids,
                                             "scores.argmax_logits": self.argmax_logits,
                                             "scores.draft_logits": self.draft_logits})
        if self.argmax_ids.dtype != torch.long:
            raise ValueError(f"scores.argmax_ids must be torch.long, got {self.argmax_ids.dtype}")
        # The row maximum is NaN or ±inf whenever the row holds NaN or +inf (or only -inf).
        if not bool(torch.isfinite(self.argmax_logits).all()):
            raise ValueError("target_logits holds NaN or inf values (scores.argmax_logits is not finite)")
        # A draft token's logit never exceeds its row's maximum; NaN fails the comparison, -inf (masked) passes.
        if not bool((self.draft_logits <= self.argmax_logits[:, :k]).all()):
            raise ValueError("scores.draft_logits must be ≤ scores.argmax_logits and not NaN")


def compact_scores(draft_ids: torch.Tensor, target_logits: torch.Tensor, validate: bool = True) -> TargetScores:
    """Reduce teacher-forced logits [B, K+1, V] to `TargetScores` with one pass of max over the vocabulary.

    `draft_ids` [B, K] long, padded with PAD_TOKEN_ID; `target_logits` [B, K+1, V] float; both on one device,
    where the scores are returned. Raises ValueError on mismatched shapes or devices and on ids ≥ V.
    `validate=False` skips the checks that read values (each one a host sync on a GPU): for a caller that
    checked the draft ids on the host already (NaN / +inf logits are caught later by `TargetScores.check`).
    """
    if not isinstance(draft_ids, torch.Tensor) or draft_ids.dim() != 2 or draft_ids.dtype != torch.long:
        raise ValueError("draft_ids must be a 2-D torch.long tensor [B, K]")
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 3:
        raise ValueError("target_logits must be a 3-D tensor [B, K+1, V]")
    batch, k = draft_ids.shape
    if target_logits.shape[:2] != (batch, k + 1):
        raise ValueError(
            f"target_logits must have shape [B={batch}, K+1={k + 1}, V], got {tuple(target_logits.shape)}"
        )
    if not target_logits.is_floating_point():
        raise ValueError(f"target_logits must be floating point, got {target_logits.dtype}")
    check_devices(target_logits=target_logits, draft_ids=draft_ids)
    vocab = target_logits.shape[2]
    if vocab == 0:
        raise ValueError("target_logits has an empty vocabulary (V = 0)")
    if validate:
        check_vocab_range(draft_ids, vocab)
    argmax_ids = vocab_argmax(target_logits)  # [B, K+1]
    argmax_logits = target_logits.gather(-1, argmax_ids[..., None]).squeeze(-1)  # [B, K+1]
    is_pad = draft_ids == PAD_TOKEN_ID  # [B, K]
    draft_logits = target_logits[:, :k].gather(-1, draft_ids.clamp(min=0)[..., None]).squeeze(-1)  # [B, K]
    draft_logits = draft_logits.masked_fill(is_pad, float("-inf"))  # [B, K]
    return TargetScores(argmax_ids=argmax_ids, argmax_logits=argmax_logits, draft_logits=draft_logits)


def vocab_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim (first index on ties, NaN counts as the maximum), as a long tensor.

    On CPU this is numpy's argmax, one vectorised pass and much faster than torch.max(dim) at a full
    vocabulary (this pass is the whole cost of greedy verification). Elsewhere (GPU, bfloat16) torch.argmax.
    """
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_ARGMAX_DTYPES:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1)).long()
    return logits.argmax(dim=-1)
