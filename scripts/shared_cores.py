"""Native units that share a host's cores: output tok/s of each of `--procs` processes decoding at once.

    PYTHONPATH=. python scripts/shared_cores.py [CONFIG] [--procs 2] [--threads 2] [--seconds 40]

Each process builds one unit of CONFIG in process (`build_unit(on_ray=False)`, `torch.set_num_threads(--threads)`)
and decodes waves of 8 greedy chat streams of 48 tokens for `--seconds`; all start together. Prints one line per
process. The environment passes through, so `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` can be tried the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time


def worker(config_path: str, threads: int, seconds: float) -> None:
    import torch

    torch.set_num_threads(threads)
    from actors.policy import LocalPolicy, PolicyCore
    from actors.requests import GenerationRequest, SamplingParams
    from actors.sources import load_tokenizer
    from actors.unit import build_unit
    from bench.workloads import load_workload
    from cluster.config import load_config
    from cluster.serving.decoder import policy_kwargs, unit_setup

    config = load_config(config_path)
    prompts = load_workload("chat", load_tokenizer(config.target.source), 8)
    unit = build_unit(unit="shared", policy=LocalPolicy(PolicyCore(**policy_kwargs(config))), on_ray=False,
                      **{**unit_setup(config), "torch_threads": threads})
    unit.generate_many_sync([GenerationRequest("warm", list(prompts[0].ids), SamplingParams(8))])
    start, tokens, wave = time.perf_counter(), 0, 0
    while time.perf_counter() - start < seconds:
        results = unit.generate_many_sync([GenerationRequest(f"w{wave}-{i}", list(p.ids), SamplingParams(48))
                                           for i, p in enumerate(prompts)])
        tokens += sum(len(r.token_ids) for r in results)
        wave += 1
    print(f"threads={threads} tok/s={tokens / (time.perf_counter() - start):.1f}", flush=True)
    asyncio.run(unit.close())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="configs/local.yaml")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.config, args.threads, args.seconds)
        return 0
    command = [sys.executable, __file__, args.config, "--threads", str(args.threads), "--seconds",
               str(args.seconds), "--worker"]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(args.procs)]
    for i, proc in enumerate(procs):
        out, _ = proc.communicate()
        print(f"process {i}: {out.strip() or f'failed (exit {proc.returncode})'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
