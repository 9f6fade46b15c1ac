"""Microseconds per call of each verifier, for B ∈ {1, 8, 64}, K ∈ {4, 8}, V = 49152.

    python -m bench.verifiers [--threads 1] [--repeats 50] [--json out.json]

Inputs are random logits with a draft that matches the target argmax on about half its positions (and a
near miss at position 1 for ASD), so every verifier runs its whole path. `*_scores` variants time the
compact path alone (what the policy actor runs on `TargetScores` shipped by the target); `compact_scores` is
the one pass over the vocabulary. Imports only `policies`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from policies.asd import ASDConfig, RegretLedger, verify_asd, verify_asd_scores
from policies.exact import process_logits, verify_greedy, verify_greedy_scores, verify_sampled
from policies.scores import compact_scores

VOCAB = 49152


def time_call(fn: Callable[[], object], repeats: int) -> float:
    """Median microseconds per call over `repeats` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def bench_case(batch: int, k: int, repeats: int, seed: int = 0) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, VOCAB, generator=gen)  # [B, K+1, V]
    draft = logits[:, :k].argmax(-1)  # [B, K]
    miss = torch.rand(batch, k, generator=gen) < 0.5
    draft = torch.where(miss, torch.randint(0, VOCAB, (batch, k), generator=gen), draft)  # [B, K]
    draft[:, 1] = logits[:, 1].topk(2).indices[:, 1]  # a near miss ASD can relax
    scores = compact_scores(draft, logits)
    config = ASDConfig(g=4.0, max_relaxed_per_block=2, budget=1e9)
    ledgers = [RegretLedger(1e12) for _ in range(batch)]  # large enough for every repeat
    target_probs = process_logits(logits, 1.0)  # [B, K+1, V]
    draft_probs = process_logits(logits[:, :k] + 0.5, 1.0)  # [B, K, V]
    generators = [torch.Generator().manual_seed(b) for b in range(batch)]
    calls = {
        "compact_scores": lambda: compact_scores(draft, logits),
        "verify_greedy": lambda: verify_greedy(draft, logits),
        "verify_greedy_scores": lambda: verify_greedy_scores(draft, scores),
        "verify_asd": lambda: verify_asd(draft, logits, ledgers, config),
        "verify_asd_scores": lambda: verify_asd_scores(draft, scores, ledgers, config),
        "verify_sampled": lambda: verify_sampled(draft, draft_probs, target_probs, gen),
        "verify_sampled_onehot": lambda: verify_sampled(draft, None, target_probs, gen),
        "verify_sampled_per_row_gen": lambda: verify_sampled(draft, draft_probs, target_probs, generators),
    }
    slow = {"verify_sampled", "verify_sampled_onehot", "verify_sampled_per_row_gen"}
    return {
        name: time_call(fn, max(5, repeats // 5) if name in slow and batch >= 64 else repeats)
        for name, fn in calls.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for batch in args.batches:
        for k in args.ks:
            for name, micros in bench_case(batch, k, args.repeats).items():
                rows.append({"verifier": name, "B": batch, "K": k, "V": VOCAB, "us_per_call": round(micros, 1)})
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median µs per call")
    print(f"{'verifier':<28}{'B':>4}{'K':>4}{'µs':>12}")
    for row in rows:
        print(f"{row['verifier']:<28}{row['B']:>4}{row['K']:>4}{row['us_per_call']:>12.1f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
