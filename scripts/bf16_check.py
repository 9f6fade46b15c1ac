"""float32 vs bfloat16 on this CPU, side by side in one run, on SmolLM2-135M (`embedded:smollm2`).

    PYTHONPATH=. python scripts/bf16_check.py [--threads 1] [--steps 32] [--tokens 64] > bf16_check.md

Prints a markdown report:
- decode: tokens/s of decode steps (one new token per row, argmax fed back through the host) at batch 1 and 8
  for fp32, bf16 (the Engine's default: packed and batch-invariant where the CPU has native bf16) and bf16
  plain (`packed=False`, the path before the packed one), interleaved repeat by repeat so load drift hits
  all alike.
- identity: 5 prompts x `--tokens` greedy tokens (ignore_eos). Speculative (n-gram drafter, adaptive γ;
  alone and the 5 batched) against target-only alone of the same variant, and bf16 target-only against fp32
  target-only: identical sequences, mean common prefix, first divergences; and per position, the share of
  fp32's greedy tokens that bf16 also ranks first when both read fp32's sequence (teacher-forced).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from actors.coordinator import Coordinator, GenerationRequest, SamplingParams  # noqa: E402
from actors.drafting import NgramDrafter  # noqa: E402
from actors.engines.native import Engine, load_model  # noqa: E402
from actors.engines.native.packed import cpu_has_native_bf16  # noqa: E402
from actors.policy import PolicyCore  # noqa: E402

SOURCE = "embedded:smollm2"
VARIANTS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "bf16 plain": ("bfloat16", False)}  # dtype, packed
BATCHES = (1, 8)
PROMPTS = [  # code editing, completion, a summary, open chat
    "Add type hints and a docstring to this function:\n\ndef merge(a, b):\n    out = []\n    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "Rename the variable `tmp` to `total` in this code:\n\ndef score(items):\n    tmp = 0\n    for it in items:\n"
    "        tmp += it.weight * it.value\n    return tmp / max(1, len(items))\n",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Summarize in two sentences: The city council met on Tuesday to discuss the new bike lanes. Residents "
    "praised the safety improvements but shop owners worried about losing parking. The council voted 5-2 "
    "to continue the project and review parking in six months.",
    "Tell me a short story about a robot who learns to paint.",
]


def encode(tokenizer, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(chat, add_special_tokens=False)["input_ids"]


def engine(variant: str, models: dict, max_slots: int) -> Engine:
    return Engine(models[variant], max_slots=max_slots, max_seq_len=1024, packed=VARIANTS[variant][1])


def decode_seconds(engine: Engine, prompts: list[list[int]], batch: int, steps: int) -> float:
    """Seconds for `steps` decode steps of `batch` rows after their prefill (a fresh engine, argmax fed back)."""
    ids = [f"s{b}" for b in range(batch)]
    rows = [prompts[b % len(prompts)] for b in range(batch)]
    feed = engine.forward_last(ids, rows).argmax(-1)[:, None].tolist()  # [B, 1]
    start = time.perf_counter()
    for _ in range(steps):
        feed = engine.forward_last(ids, feed).argmax(-1)[:, None].tolist()
    return time.perf_counter() - start


def generate(engine: Engine, prompts: list[list[int]], tokens: int, speculate: bool, together: bool) -> list[list[int]]:
    coord = Coordinator.local(engine, NgramDrafter(), PolicyCore())
    requests = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=tokens, ignore_eos=True),
                                  speculate=speculate) for i, p in enumerate(prompts)]
    if together:
        return [r.token_ids for r in coord.generate_many_sync(requests)]
    return [coord.generate_sync(r).token_ids for r in requests]


def agreement(got: list[list[int]], want: list[list[int]]) -> str:
    """'identical/total | mean common prefix | first divergences' of two sets of sequences."""
    prefixes = []
    for a, b in zip(got, want):
        prefixes.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    same = sum(a == b for a, b in zip(got, want))
    mean = statistics.mean(p / max(1, len(b)) for p, b in zip(prefixes, want))
    firsts = ", ".join(str(p) for p, a, b in zip(prefixes, got, want) if a != b) or "-"
    return f"{same}/{len(want)} | {mean:.1%} | {firsts}"


def teacher_forced_agreement(engine: Engine, prompts: list[list[int]], outputs: list[list[int]]) -> tuple[int, int]:
    """(positions where the engine's argmax equals the given next token, positions) over the continuations."""
    same = total = 0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        top = engine.forward([f"t{i}"], [prompt + out[:-1]], [len(out)])[0].argmax(-1)  # [N]
        same += int((top == torch.tensor(out)).sum())
        total += len(out)
    return same, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt in the identity check")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = {}
    for variant, (dtype, _) in VARIANTS.items():
        models[variant], tokenizer = load_model(SOURCE, dtype)
    prompts = [encode(tokenizer, p) for p in PROMPTS]
    print(f"# float32 vs bfloat16 on {SOURCE}, {datetime.date.today()}\n")
    print(f"{platform.processor() or platform.machine()}, native bf16: {cpu_has_native_bf16()}, torch "
          f"{torch.__version__}, {args.threads} thread(s); prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens.\n")

    times = {(v, b): [] for v in VARIANTS for b in BATCHES}
    for _ in range(args.repeats):
        for b in BATCHES:
            for v in VARIANTS:
                times[v, b].append(decode_seconds(engine(v, models, b), prompts, b, args.steps))
    print(f"## Decode ({args.steps} steps, median of {args.repeats}; bf16 packed: {models['bf16'].packed})\n")
    print("| batch | " + " | ".join(f"{v} tok/s" for v in VARIANTS) + " | bf16 / fp32 |\n|---|---|---|---|---|")
    for b in BATCHES:
        rate = {v: b * args.steps / statistics.median(times[v, b]) for v in VARIANTS}
        print(f"| {b} | " + " | ".join(f"{r:.1f}" for r in rate.values()) + f" | {rate['bf16'] / rate['fp32']:.2f}x |")

    print(f"\n## Greedy identity ({len(prompts)} prompts x {args.tokens} tokens, n-gram drafter)\n")
    print("| comparison | identical | mean common prefix | first divergences |\n|---|---|---|---|")
    n = len(prompts)
    references = {}
    for v in VARIANTS:
        references[v] = generate(engine(v, models, n), prompts, args.tokens, speculate=False, together=False)
        for speculate, together, label in ((True, False, "speculative, alone"), (True, True, f"speculative, {n} batched"),
                                           (False, True, f"target-only, {n} batched")):
            outs = generate(engine(v, models, n), prompts, args.tokens, speculate, together)
            print(f"| {v} {label} vs {v} target-only | {agreement(outs, references[v])} |")
    print(f"| bf16 target-only vs fp32 target-only | {agreement(references['bf16'], references['fp32'])} |")
    same, total = teacher_forced_agreement(engine("bf16", models, n), prompts, references["fp32"])
    print(f"\nTeacher-forced on fp32's greedy tokens, bf16 ranks the same token first at {same}/{total} positions "
          f"({same / total:.2%}).")


if __name__ == "__main__":
    main()
