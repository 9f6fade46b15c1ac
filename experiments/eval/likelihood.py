"""How likely an output is under the target: Σ −log p_target(token | prompt, earlier output), teacher-forced.

`TargetLikelihood(source)` loads the target (any source `actors.sources` resolves: a Hugging Face directory, a
.gguf file, `embedded:smollm2`) once in float32 and scores (prompt, completion) pairs: the prompt is built as the
in-process backend builds it (the chat template with the generation prompt, or the plain prompt), the completion
text is re-tokenized without special tokens, and the return is (Σ nats, completion tokens). Re-tokenizing text
can split it differently from the tokens the engine emitted; both arms' outputs are scored the same way, so the
difference between arms is what the figure is for. An ASD output that the target would not have produced shows
as a higher NLL per token than the exact arm's greedy output, which is each step's most likely token.
"""

from __future__ import annotations

import threading

import torch

from experiments.eval.suites import EvalPrompt

MAX_SCORED_TOKENS = 4096  # longer (prompt + completion) inputs keep their last tokens


class TargetLikelihood:
    def __init__(self, source: str, threads: int | None = None):
        from transformers import AutoModelForCausalLM

        from actors.sources import load_tokenizer, resolve

        if threads:
            torch.set_num_threads(threads)
        self.source = source
        self.tokenizer = load_tokenizer(source)
        self.model = AutoModelForCausalLM.from_pretrained(resolve(source), dtype=torch.float32).eval()
        self._lock = threading.Lock()

    def prompt_ids(self, prompt: EvalPrompt) -> list[int]:
        if prompt.chat:
            text = self.tokenizer.apply_chat_template([dict(m) for m in prompt.messages], tokenize=False,
                                                      add_generation_prompt=True)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return list(self.tokenizer.encode(prompt.prompt))

    def nll(self, prompt: EvalPrompt, completion: str) -> tuple[float, int]:
        """(Σ −log p of the completion's tokens, their number); (0.0, 0) for an empty completion."""
        out_ids = list(self.tokenizer.encode(completion or "", add_special_tokens=False))
        if not out_ids:
            return 0.0, 0
        ids = (self.prompt_ids(prompt) + out_ids)[-MAX_SCORED_TOKENS:]
        n = min(len(out_ids), len(ids) - 1)
        with self._lock, torch.inference_mode():
            logits = self.model(torch.tensor([ids])).logits[0, -n - 1:-1].float()  # [n, vocab]
            logp = torch.log_softmax(logits, dim=-1)  # [n, vocab]
            picked = logp.gather(1, torch.tensor(ids[-n:]).unsqueeze(1)).squeeze(1)  # [n]
        return float(-picked.sum()), n
