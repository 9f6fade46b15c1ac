"""The peer: Hugging Face transformers `generate` on the same model, prompts and machine, greedy.

Modes (`HF_MODES`): `plain`, `prompt_lookup_3` and `prompt_lookup_10` (`prompt_lookup_num_tokens`), and
`assistant` (`assistant_model`: the target itself, the only model at hand with the same vocabulary, so it
measures assisted generation's overhead at α ≈ 1). The model is the converted cache directory of the source
(`actors.sources.resolve`), loaded by transformers itself, so HF runs its own modelling code, not ours.
`generate` returns one call's new tokens and seconds, prefill included (like specserve's e2e figure).
"""

from __future__ import annotations

import logging
import time

import torch

from bench.workloads import Prompt

log = logging.getLogger(__name__)

HF_MODES = ("plain", "prompt_lookup_3", "prompt_lookup_10", "assistant")


class HFPeer:
    """transformers `generate` over a Hugging Face directory; the assistant copy is loaded on first use."""

    def __init__(self, directory, *, max_tokens: int, eos_token_ids):
        from transformers import AutoModelForCausalLM

        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        self.directory = directory
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        self.max_tokens = max_tokens
        self.eos = list(eos_token_ids)
        self._assistant = None

    def _assistant_model(self):
        if self._assistant is None:
            from transformers import AutoModelForCausalLM

            self._assistant = AutoModelForCausalLM.from_pretrained(self.directory, dtype=torch.float32).eval()
        return self._assistant

    def _kwargs(self, mode: str) -> dict:
        if mode == "plain":
            return {}
        if mode.startswith("prompt_lookup_"):
            return {"prompt_lookup_num_tokens": int(mode.rsplit("_", 1)[1])}
        if mode == "assistant":
            return {"assistant_model": self._assistant_model()}
        raise ValueError(f"mode: unknown {mode!r} (known: {', '.join(HF_MODES)})")

    @torch.inference_mode()
    def generate(self, prompt: Prompt, mode: str) -> tuple[tuple[int, ...], float]:
        """(new token ids, seconds) of one greedy `generate` call."""
        ids = torch.tensor([prompt.ids], dtype=torch.long)  # [1, T]
        start = time.perf_counter()
        out = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_tokens, do_sample=False,
            eos_token_id=self.eos, pad_token_id=self.eos[0], **self._kwargs(mode),
        )  # [1, T + new]
        seconds = time.perf_counter() - start
        new = out[0, ids.shape[1]:].tolist()
        if new and new[-1] in self.eos:  # specserve does not count the EOS token it stops on
            new = new[:-1]
        return tuple(new), seconds
