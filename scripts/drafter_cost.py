"""The in-process drafters' cost per engine step, stateless rescan against incremental index, back to back.

    PYTHONPATH=. python scripts/drafter_cost.py [--rows 1 8 32] [--context 2048] [--steps 60] [--gamma 8]

Each row is a window of `--context` SmolLM2 tokens of this repository's own code and docs; between steps each
row appends the next 1-5 tokens of its text (a step's committed tokens), and one `propose` over all rows is
timed per drafter, old and new alternating step by step so load drift hits both. Contexts arrive as the native
coordinator passes them (a Python list) and as the vLLM worker does (a row of vLLM's int32 token buffer: before,
`.tolist()` of the whole row; now a view). Every step checks the new n-gram drafter's drafts equal the old ones.
Prints a markdown table of medians (µs per step).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from actors.contracts import DraftBatch, DraftRequest  # noqa: E402
from actors.drafting import NgramDrafter, SuffixDrafter, ngram_lookup  # noqa: E402
from actors.sources import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["docs/architecture.md", "docs/benchmarks.md", "actors/coordinator.py", "actors/engines/vllm/worker.py",
         "policies", "actors/drafting"]


class RescanNgram:
    """The n-gram drafter before the index: `ngram_lookup` over each row's whole context, every step."""

    def __init__(self, n_min: int = 1, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, requests: list[DraftRequest]) -> DraftBatch:
        return DraftBatch.from_rows([ngram_lookup(np.asarray(r.context, dtype=np.int64), r.gamma, self.n_min,
                                                  self.n_max) for r in requests])

    def release(self, seq_id: str) -> None:
        pass


def corpus() -> list[int]:
    paths = [p for t in TEXTS for p in sorted((ROOT / t).rglob("*") if (ROOT / t).is_dir() else [ROOT / t])
             if p.is_file() and p.suffix in (".md", ".py")]
    return load_tokenizer("embedded:smollm2").encode("\n".join(p.read_text() for p in paths))


def timed(drafter, requests: list[DraftRequest]) -> tuple[float, DraftBatch]:
    start = time.perf_counter()
    out = drafter.propose(requests)
    return (time.perf_counter() - start) * 1e6, out


def measure(tokens: list[int], rows: int, context: int, steps: int, gamma: int, rng: random.Random) -> dict:
    """Median µs per step of each variant at `rows` rows."""
    starts = [rng.randrange(len(tokens) - context - 6 * steps) for _ in range(rows)]
    lens = [context] * rows
    buffer = np.zeros((rows, context + 6 * steps), dtype=np.int32)  # vLLM's token_ids_cpu
    for b, s in enumerate(starts):
        buffer[b] = tokens[s : s + buffer.shape[1]]
    variants = {  # name: (drafter, context as the worker or the coordinator passes it)
        "ngram native, old": (RescanNgram(), "list"), "ngram native, new": (NgramDrafter(), "list"),
        "ngram vLLM, old": (RescanNgram(), "tolist"), "ngram vLLM, new": (NgramDrafter(), "view"),
        "suffix native": (SuffixDrafter(cache_tokens=0), "list"),
        "suffix vLLM, old": (SuffixDrafter(cache_tokens=0), "tolist"),
        "suffix vLLM, new": (SuffixDrafter(cache_tokens=0), "view"),
    }
    lists = [buffer[b, :context].tolist() for b in range(rows)]
    first, costs = {}, {name: [] for name in variants}
    for step in range(steps + 1):
        asks = {"list": lists, "tolist": [buffer[b, : lens[b]].tolist() for b in range(rows)],
                "view": [buffer[b, : lens[b]] for b in range(rows)]}
        drafts = {}
        for name, (drafter, kind) in variants.items():
            if kind == "tolist":  # the conversion was part of the worker's step
                start = time.perf_counter()
                requests = [DraftRequest(f"r{b}", buffer[b, : lens[b]].tolist(), gamma) for b in range(rows)]
                us, drafts[name] = timed(drafter, requests)
                us = (time.perf_counter() - start) * 1e6
            else:
                us, drafts[name] = timed(drafter, [DraftRequest(f"r{b}", c, gamma) for b, c in enumerate(asks[kind])])
            (costs[name].append(us) if step else first.__setitem__(name, us))  # step 0 indexes the prompt
        for new, old in (("ngram native, new", "ngram native, old"), ("ngram vLLM, new", "ngram vLLM, old")):
            assert drafts[new].draft_ids.tolist() == drafts[old].draft_ids.tolist(), (new, step)
        for b in range(rows):
            grow = rng.randint(1, 5)
            lists[b] += buffer[b, lens[b] : lens[b] + grow].tolist()
            lens[b] += grow
    return {name: (first[name], statistics.median(c)) for name, c in costs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--gamma", type=int, default=8)
    args = ap.parse_args(argv)
    tokens, rng = corpus(), random.Random(0)
    results = {rows: measure(tokens, rows, args.context, args.steps, args.gamma, rng) for rows in args.rows}
    names = list(results[args.rows[0]])
    print(f"{datetime.date.today()}, {platform.processor() or platform.machine()}, Python "
          f"{platform.python_version()}; {args.context}-token contexts, γ {args.gamma}, medians of {args.steps} "
          f"steps (1-5 new tokens a row a step); µs per step, all rows (first call, indexing the prompt):\n")
    print("| drafter, context as passed | " + " | ".join(f"{r} row{'s' * (r > 1)}" for r in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for name in names:
        cells = [f"{results[r][name][1]:,.0f} ({results[r][name][0]:,.0f})" for r in args.rows]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
