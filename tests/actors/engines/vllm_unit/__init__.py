"""The vLLM engine's tests that share one specserve unit (the embedded SmolLM2 in fp32, n-gram drafts, ASD
verifications logged): its settings and the prompts of vLLM's own greedy reference. The unit and the reference
are package fixtures (conftest.py): one engine start for both modules."""

from __future__ import annotations

SOURCE = "embedded:smollm2"
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 512 << 20}
POLICY = dict(gamma_max=8, gamma_min=0, prior_alpha=0.6, draft_cost=0.02, fixed_gamma=None)
MAX_TOKENS = 48


def prompts(tokenizer) -> list[list[int]]:
    """Copy-heavy, code and open chat prompts (chat template applied): drafts hit on some, miss on others."""
    texts = [
        "Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape.",
        "Fix the typo and return the whole function:\ndef add(a, b):\n    retrun a + b\n\n"
        "def sub(a, b):\n    return a - b",
        "Write a Python function that checks whether a number is prime.",
        "What is the capital of France? Answer in one sentence.",
        "Count from one to twenty in words, separated by commas.",
    ]
    out = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out
