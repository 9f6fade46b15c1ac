"""Prompt lookup replayed offline: which drafting rule would pay, independent of the machine's noise.

`greedy_outputs` decodes the bench's workloads greedily with the target alone (transformers). `replay` then
walks each output round by round as the exact arm would: the drafter (`NgramIndex` with a prompt_lookup_min and
max) drafts up to γ tokens from the context so far, the accepted prefix is the part equal to the output, the
round emits it plus one token. γ comes from a fixed rule or from the real adaptive `GammaPolicy`, fed a
synthetic cost model: scoring n + 1 tokens costs v(n) = 1 + beta·n target steps (beta small at batch 1 on a
memory-bound forward, large where verification is compute-bound). The figure is output tokens per unit of
target cost: plain decoding is 1. Greedy outputs make exact verification deterministic, so the replay is what
serving would do, less every cost outside the model.

`python -m bench.ngram_replay [--prompts N] [--max-tokens N] [--beta B ...]` prints one table per beta.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from actors.drafting.ngram import NgramIndex
from policies.gamma import GammaPolicy

SETTINGS = ((1, 4), (2, 4), (3, 5), (5, 5))  # (prompt_lookup_min, prompt_lookup_max); (5, 5) is vLLM's default
RULES = ("adaptive", 2, 4, 8)  # the adaptive policy, or a fixed γ


def greedy_outputs(source: str, workloads: Sequence[str], prompts: int, max_tokens: int) -> dict[str, list]:
    """{workload: [(prompt ids, greedy output ids), ...]}, the target alone (`bench.hf_peer.HFPeer`, plain)."""
    from actors.sources import load_tokenizer, model_info, resolve
    from bench.hf_peer import HFPeer
    from bench.workloads import load_workload

    tokenizer = load_tokenizer(source)
    peer = HFPeer(resolve(source), max_tokens=max_tokens, eos_token_ids=model_info(source)["eos_token_ids"])
    return {workload: [(list(prompt.ids), list(peer.generate(prompt, "plain")[0]))
                       for prompt in load_workload(workload, tokenizer, prompts)]
            for workload in workloads}


def replay(pairs: Sequence[tuple[list[int], list[int]]], n_min: int, n_max: int, rule: str | int,
           beta: float, gamma_max: int = 8) -> dict[str, float]:
    """Tokens per unit of target cost (`speedup`) and the acceptance of the drafts, over `pairs` in order (an
    adaptive policy learns its arm's α across them, as a unit does)."""
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    policy = GammaPolicy(gamma_max=gamma_max, prior_alpha=0.5, draft_cost=0.02)
    for n in range(1, gamma_max + 2):  # the synthetic costs, as a unit would have measured them
        policy.observe_costs(1, 1e-6, {n: (1 + beta * (n - 1)) * 0.01})
    tokens = cost = drafted = accepted = 0.0
    for i, (prompt, output) in enumerate(pairs):
        index, t = NgramIndex(n_min, n_max), 0
        index.extend(list(prompt))
        while t < len(output):
            gamma = policy.choose(str(i), "arm", 1) if rule == "adaptive" else int(rule)
            draft = index.lookup(gamma)[:gamma] if gamma else []
            kept = 0
            while kept < len(draft) and t + kept < len(output) and draft[kept] == output[t + kept]:
                kept += 1
            if rule == "adaptive":
                policy.observe(str(i), "arm", len(draft), kept)
            emitted = min(kept + 1, len(output) - t)
            index.extend(output[t : t + emitted])
            t += emitted
            cost += 1 + beta * len(draft)
            drafted, accepted = drafted + len(draft), accepted + kept
        tokens += len(output)
        policy.forget(str(i))
    return {"speedup": tokens / cost if cost else 1.0, "acceptance": accepted / drafted if drafted else 0.0}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ngram_replay", description=__doc__.split("\n")[0])
    parser.add_argument("--source", default="embedded:smollm2")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--beta", type=float, nargs="+", default=[0.03, 0.15, 0.4])
    args = parser.parse_args(argv)
    outputs = greedy_outputs(args.source, ("code", "edit", "summarization", "chat"), args.prompts, args.max_tokens)
    for beta in args.beta:
        print(f"\nbeta = {beta}: tokens per target step (acceptance)")
        print("| workload | " + " | ".join(f"{lo}-{hi} {rule}" for lo, hi in SETTINGS for rule in RULES) + " |")
        for workload, pairs in outputs.items():
            cells = [replay(pairs, lo, hi, rule, beta) for lo, hi in SETTINGS for rule in RULES]
            print(f"| {workload} | " + " | ".join(f"{c['speedup']:.2f} ({c['acceptance']:.0%})" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
